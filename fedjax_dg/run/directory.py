"""Run and sweep directories: making a fresh one, and the files in them.

A run directory holds config.json and data.json (written when it starts:
what `--resume` must match), environment.json and source.json (the machine
and the fedjax_dg commit it began with: `provenance`), results.json (after every
finished run), features/ (`train.features_max`), checkpoints/, metrics.jsonl
and tb/ (`report.metrics_log`); a sweep directory holds sweep.json (its
manifest) and one run directory per cell.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import shutil

import numpy as np

from fedjax_dg import distributed
from fedjax_dg.errors import ConfigError, DataError, DiskFull, is_disk_full
from fedjax_dg.run import config as config_lib
from fedjax_dg.run.config import ConfigDict

MANIFEST = "sweep.json"
ENVIRONMENT = "environment.json"  # where the run began: `provenance`
SOURCE = "source.json"

# What to do about a damaged file of a run directory (`read_json`).
REDO_RESULTS = ("Restore it from a copy, or delete it: `--resume` then trains "
                "the directory's finished runs again (unfinished ones continue "
                "from their checkpoints)")
REDO_START = ("Restore it from a copy; without it the directory cannot be "
              "resumed (start a new run or sweep)")


def read_json(path: str, fix: str = REDO_START):
  """The JSON in `path`; a file that does not parse (cut short, overwritten)
  is a DataError naming it, what is wrong and `fix`: what to do. fedjax_dg
  writes its JSON files whole (results.json and sweep.json: a temporary file
  renamed into place), so a damaged one was cut or changed outside it."""
  try:
    with open(path) as f:
      return json.load(f)
  except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
    size = os.path.getsize(path)
    raise DataError(f"{path} is damaged: not valid JSON ({e}; {size} bytes), "
                    f"e.g. cut short by a full disk or an interrupted copy. "
                    f"{fix}") from None


def check_output_dir(root: str, field: str = "output_dir") -> None:
  """`root` (the config's `field`) can hold a new run directory: its nearest
  existing folder is a folder and writable; else a ConfigError naming the
  field and the path. Checked before any data is read."""
  path = os.path.abspath(root or ".")
  probe = path
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  fix = (f"set {field} to a writable folder" + (
      " (--set output_dir=...)" if field == "output_dir" else ""))
  if not os.path.isdir(probe):
    raise ConfigError(f"{field}={root!r}: {probe!r} is a file, not a folder, "
                      f"so no run directory can be made there: {fix}")
  if not os.access(probe, os.W_OK | os.X_OK):
    raise ConfigError(f"{field}={root!r}: {probe!r} is not writable (read-only "
                      f"or another user's): {fix}")


def make_run_dir(root: str, name: str, field: str = "output_dir") -> str:
  """A new directory `<root>/<name>-<timestamp>[-k]`; never reuses an existing
  one. A folder that cannot be made is a ConfigError naming `field` (the
  setting that chose `root`) and the path."""
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  base = os.path.join(root, f"{name}-{stamp}")
  path, k = base, 1
  while True:
    try:
      os.makedirs(path)
      return path
    except FileExistsError:
      if not os.path.isdir(path):
        check_output_dir(root, field)
      k += 1
      path = f"{base}-{k}"
    except OSError as e:
      if is_disk_full(e):
        raise DiskFull(f"cannot create the run directory {path!r}: the disk "
                       f"is full; free space or set {field} to another disk"
                       ) from None
      check_output_dir(root, field)  # names a file or read-only folder
      raise ConfigError(f"{field}={root!r}: cannot create the run directory "
                        f"{path!r} ({type(e).__name__}: {e}): set {field} to a "
                        "writable folder") from None


def check_resume(cfg: ConfigDict, run_dir: str, data: dict) -> None:
  """A run directory is continued only with its own settings and data: the
  stored config.json and data.json must equal the requested ones (a
  ConfigError names the differing keys). Nothing is written before this."""
  path = os.path.join(run_dir, "config.json")
  if not os.path.exists(path):
    raise ConfigError(f"--resume {run_dir}: holds no config.json, so it is not "
                      "a run directory of fedjax-dg run")
  stored = read_json(path)
  changed = config_lib.drift(stored, json.loads(cfg.to_json()))
  if changed:
    raise ConfigError(
        f"{run_dir} was run with other settings ({'; '.join(changed)}): "
        f"continue it with its own (`fedjax-dg run --resume {run_dir}` alone "
        "reads its config.json), or start a new run for the new settings")
  path = os.path.join(run_dir, "data.json")
  if os.path.exists(path):
    before = read_json(path)
    if before != data:
      raise ConfigError(
          f"{run_dir} was run on other data ({before} -> {data}): the dataset "
          "changed since (another prepare, data_dir or manual_dir); start a "
          "new run")


def write_start(run_dir: str, cfg: ConfigDict, record: dict) -> None:
  """The run directory's config.json and data.json, and where the run began
  (files absent) environment.json and source.json: `record` is
  `provenance.record`'s."""
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "config.json"), "w") as f:
    f.write(cfg.to_json(indent=2))
  with open(os.path.join(run_dir, "data.json"), "w") as f:
    json.dump(record["data"], f)
  for name, key in ((ENVIRONMENT, "environment"), (SOURCE, "source")):
    path = os.path.join(run_dir, name)
    if not os.path.exists(path):  # where the run began
      with open(path, "w") as f:
        json.dump(record[key], f)


def read_started(run_dir: str) -> tuple[dict | None, dict | None]:
  """(source.json, environment.json) of a run directory: the code and the
  machine its run began with; None for a file it does not hold (a run begun
  by an older fedjax_dg has no source.json)."""
  out = []
  for name in (SOURCE, ENVIRONMENT):
    path = os.path.join(run_dir, name)
    if os.path.exists(path):
      out.append(read_json(path))
    else:
      out.append(None)
  return out[0], out[1]


def holds_work(run_dir: str) -> bool:
  """Whether a run directory holds something computed: its results.json or
  a checkpoint file."""
  if os.path.exists(os.path.join(run_dir, "results.json")):
    return True
  return any(files for _, _, files in os.walk(os.path.join(run_dir,
                                                           "checkpoints")))


def remove_if_empty(run_dir: str, echo) -> None:
  """Removes a run directory made by a run that failed before leaving
  anything to continue or read: no results.json, no checkpoint file. Its
  config.json, data.json, environment.json, source.json and empty logs go
  with it."""
  if holds_work(run_dir):
    return
  shutil.rmtree(run_dir, ignore_errors=True)
  echo(f"removed {run_dir}: the run failed before anything was computed")


def features_path(run_dir: str, name: str, target) -> str:
  return os.path.join(run_dir, "features", f"{name}--{target}.npz")


def save_features(run_dir: str, name: str, target, features: dict) -> None:
  """A run's target-domain features (`train.features_max`), for `plots.tsne`."""
  path = features_path(run_dir, name, target)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  np.savez(path, **features)


def strict_json(value):
  """`value` with every NaN / inf float as None (null): strict JSON, which
  `json.dump` would otherwise write as bare NaN tokens."""
  if isinstance(value, float):
    return value if math.isfinite(value) else None
  if isinstance(value, dict):
    return {k: strict_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [strict_json(v) for v in value]
  return value


def write_results(run_dir: str, results: dict) -> None:
  tmp = os.path.join(run_dir, "results.json.tmp")
  with open(tmp, "w") as f:
    json.dump(strict_json(results), f, allow_nan=False)
  os.replace(tmp, os.path.join(run_dir, "results.json"))


def read_manifest(sweep_dir: str) -> dict:
  path = os.path.join(sweep_dir, MANIFEST)
  if not os.path.isdir(sweep_dir):
    raise DataError(f"{sweep_dir}: no such folder (a sweep directory is the "
                    "--out, or the sweep-<name>-<time> folder under output_dir, "
                    "that fedjax-dg sweep printed)")
  if not os.path.isfile(path):
    raise DataError(f"{sweep_dir} has no {MANIFEST}: not a sweep directory")
  return read_json(path, "Restore it from a copy; without it the sweep cannot "
                   "be resumed, but each cell's run directory still reports "
                   f"on its own (fedjax-dg report {sweep_dir}/<cell>)")


def write_manifest(sweep_dir: str, manifest: dict) -> None:
  if not distributed.is_main():  # several processes: process 0 writes
    return
  tmp = os.path.join(sweep_dir, MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump(manifest, f, indent=1)
  os.replace(tmp, os.path.join(sweep_dir, MANIFEST))


def cell_complete(cell_dir: str) -> bool:
  path = os.path.join(cell_dir, "results.json")
  if not os.path.isfile(path):
    return False
  res = read_json(path, REDO_RESULTS)
  done = {(r["algorithm"], r["target"]) for r in res["runs"]}
  return all((a, t) in done for a in res["algorithms"] for t in res["targets"])
