"""A sweep folder's state on disk: its cells' statuses in sweep.json
(`mark`), the locks a whole sweep or a part holds (`hold`), a part joining
the manifest another part made (`check_parts`, `join`), no cell left
"running" by a failed sweep (`no_stuck_cells`), and a failed cell's
tracebacks (`write_tracebacks`). `run.sweep` plans and trains the cells.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import traceback

from fedjax_dg import distributed
from fedjax_dg.errors import ConfigError, DiskFull
from fedjax_dg.run import config as config_lib
from fedjax_dg.run import directory, lock, reports

# The short lock around a partitioned sweep's manifest writes.
MANIFEST_LOCK = "sweep.json.lock"


def hold(sweep_dir: str, part) -> None:
  """This process's locks of the folder: the sweep lock, exclusive for a
  whole sweep; shared, plus the part's own exclusive one, for a part."""
  if part is None:
    lock.hold(sweep_dir)
  else:
    lock.hold(sweep_dir, shared=True)
    lock.hold(sweep_dir, lock.part_lock(*part))


def check_parts(sweep_dir: str, manifest: dict, part) -> None:
  """A part of a partitioned sweep is one of the N it was made with."""
  parts = manifest.get("parts")
  if part is not None and parts not in (None, part[1]):
    raise ConfigError(f"--part {part[0]}/{part[1]}: {sweep_dir} was split "
                      f"into {parts} parts; give --part I/{parts}")


def join(sweep_dir: str, fresh: dict, p) -> dict:
  """The manifest of a partitioned sweep another part made, checked to be
  this part's: the same cells and settings."""
  stored = directory.read_manifest(sweep_dir)
  if [c["name"] for c in stored["cells"]] != [c.name for c in p.cells]:
    raise ConfigError(f"{sweep_dir} holds another sweep (other cells) than "
                      "this part's: give every part the same --config, "
                      "--set, --grid and --seeds")
  drift = config_lib.drift(stored["base_config"], fresh["base_config"])
  if drift:
    raise ConfigError(f"{sweep_dir} holds a sweep with other settings than "
                      f"this part's: {'; '.join(drift)}")
  return stored


@contextlib.contextmanager
def no_stuck_cells(sweep_dir: str, manifest: dict, *, fresh: bool, echo,
                    mine: range | None = None):
  """A sweep that fails (not stopped, not a full disk: those resume) leaves
  no cell "running": each is marked failed with the error; a new sweep
  (`fresh`) that computed nothing is removed again (its sweep.json and cell
  folders), so the same --out starts afresh once the cause is fixed."""
  try:
    yield
  except Exception as e:
    if isinstance(e, DiskFull) or not distributed.is_main():
      raise
    stuck = [c for k, c in enumerate(manifest["cells"])
             if c["status"] == "running" and (mine is None or k in mine)]
    for entry in stuck:  # this process's cells only (a part's)
      mark(sweep_dir, manifest, entry, "failed",
            error=f"{type(e).__name__}: {e}")
    cells = [os.path.join(sweep_dir, c["name"]) for c in manifest["cells"]]
    if fresh and not any(directory.holds_work(c) for c in cells):
      for c in cells:
        shutil.rmtree(c, ignore_errors=True)
      shutil.rmtree(os.path.join(sweep_dir, reports.REPORT_DIR),
                    ignore_errors=True)
      os.remove(os.path.join(sweep_dir, directory.MANIFEST))
      echo(f"[sweep] {sweep_dir}: the sweep failed before any run was "
           "computed; its sweep.json and cell folders are removed, so the "
           "same --out starts afresh")
    raise


# A failed cell's tracebacks of what was not a config or data error (a bug:
# the message alone does not say where it happened).
ERROR_FILE = "error.txt"


def write_tracebacks(run_dir: str, errors: list) -> str | None:
  """Writes `run_dir`/error.txt with the traceback of every error of
  `errors` ((message, exception) pairs) that is no `ConfigError`; returns
  its path, or None when there is none."""
  bugs = [(m, e) for m, e in errors
          if e is not None and not isinstance(e, ConfigError)]
  if not bugs:
    return None
  path = os.path.join(run_dir, ERROR_FILE)
  with open(path, "w") as f:
    for message, e in bugs:
      f.write(f"{message}\n\n")
      f.write("".join(traceback.format_exception(e)) + "\n")
  return path


def mark(sweep_dir: str, manifest: dict, entry: dict, status: str,
          **fields) -> None:
  """A cell's status (and `fields`) in the manifest, written."""
  now = datetime.datetime.now().isoformat(timespec="seconds")
  if status == "running":
    entry.update(status=status, started=now)
    entry.pop("error", None)
  elif status == "done":
    entry.update(status=status, finished=now, **fields)
  else:
    entry.update(status=status, **fields)
  if manifest.get("parts") and distributed.is_main():
    # Other parts write their cells into the same file: read it again,
    # replace this cell's entry only.
    with lock.exclusive(os.path.join(sweep_dir, MANIFEST_LOCK)):
      on_disk = directory.read_manifest(sweep_dir)
      on_disk["cells"] = [entry if c["name"] == entry["name"] else c
                          for c in on_disk["cells"]]
      directory.write_manifest(sweep_dir, on_disk)
    return
  directory.write_manifest(sweep_dir, manifest)
