"""What produced a run's numbers: the fedjax_dg source, the data and the machine.

A number in a results table is only worth quoting if it can be traced back to
the code that computed it (docs/results.md quotes none without a committed CSV
and a commit). Every run therefore records, once, in one shape:

  source       {"commit", "dirty", "diff", "version"}: the git commit of the
               fedjax_dg checkout that ran, whether its tree had uncommitted
               changes (`git status --porcelain` non-empty) and a digest of
               them (`diff`: two dirty trees at one commit are the same code
               only if it is equal); "unknown (installed package <version>)"
               where the package is not in a git checkout (a wheel, a
               site-packages copy).
  data         {"dataset", "images", "fingerprint"} (data.json).
  environment  python, jax, jaxlib, flax, optax, numpy versions; backend,
               device kind and count, process count; the CPU model.

The repository is found from this package's own files, never from the
working directory: `fedjax-dg run` started in another checkout still records
the code it imported. The source is read once per process (`source`): the
code a process runs is the code it imported when it started.

A resumed run compares the source and environment it started with
(source.json, environment.json in the run directory) with its own
(`resume_warnings`). A different commit or dirty state is recorded loudly (a
results.json warning), not refused: `--resume` refuses only another config
or other data (those change what is computed by design); another commit
usually fixes a bug or a message and leaves the numbers alone, and refusing
would strand a days-long run for a typo fix. Each run in results.json keeps
the commit it ran at, so runs.csv says which runs came from which code.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform
import subprocess
import sys

import jax

from fedjax_dg.report.origin import source_text

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSIONS = ("jax", "jaxlib", "flax", "optax", "numpy")


def _git(folder: str, *args: str) -> str | None:
  """stdout of `git -C folder args`, or None (no git, not a repository, a
  git error or a 10 s timeout)."""
  try:
    out = subprocess.run(["git", "-C", folder, *args], capture_output=True,
                         text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout if out.returncode == 0 else None


def _version(package: str) -> str | None:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return None


def package_version() -> str:
  """fedjax_dg's version: the installed distribution's, else the package's
  `__version__` (already imported: this module is inside it)."""
  return (_version("fedjax_dg")
          or getattr(sys.modules[__name__.split(".")[0]], "__version__", "?"))


def git_source(package_dir: str, version: str | None = None) -> dict:
  """{"commit", "dirty", "diff", "version"} of the git checkout holding
  `package_dir` (a folder of tracked files): HEAD, whether `git status
  --porcelain` lists anything, and a 16-hex digest of that listing and of
  `git diff HEAD` ("" when clean). Outside a checkout, or where the folder's
  files are not tracked (a site-packages copy inside some repository):
  commit "unknown (installed package <version>)", dirty and diff None."""
  version = version or package_version()
  unknown = dict(commit=f"unknown (installed package {version})", dirty=None,
                 diff=None, version=version)
  if not os.path.isdir(package_dir):
    return unknown
  tracked = _git(package_dir, "ls-files", "--", ".")
  commit = _git(package_dir, "rev-parse", "HEAD")
  if not tracked or not commit:
    return unknown
  top = (_git(package_dir, "rev-parse", "--show-toplevel") or "").strip()
  status = _git(top or package_dir, "status", "--porcelain")
  if status is None:
    return unknown
  diff = _git(top or package_dir, "diff", "HEAD", "--binary") or ""
  digest = (hashlib.sha1((status + "\0" + diff).encode()).hexdigest()[:16]
            if status else "")
  return dict(commit=commit.strip(), dirty=bool(status), diff=digest,
              version=version)


@functools.lru_cache(maxsize=None)
def source() -> dict:
  """`git_source` of this fedjax_dg package, read once per process."""
  return git_source(PACKAGE_DIR)


def cpu_model() -> str:
  """The CPU's model string: /proc/cpuinfo's "model name" on Linux, else
  what `platform` knows ("" if nothing)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.lower().startswith(("model name", "hardware")):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine() or ""


def environment() -> dict:
  """What a run's numbers depend on beyond its config, data and code: the
  float summation order changes with the JAX version, the backend and the
  devices the cohort is sharded over (HyperGenFL's by up to ~1e-2,
  docs/faithfulness.md; the others' by ~1e-5). Written to
  `environment.json` where a run begins and into results.json."""
  env = dict(python=platform.python_version())
  env.update({p: _version(p) for p in VERSIONS})
  env["jax"] = jax.__version__
  devices = jax.devices()
  env.update(backend=jax.default_backend(),
             device_kind=devices[0].device_kind if devices else None,
             devices=jax.device_count(), processes=jax.process_count(),
             cpu=cpu_model(), platform=sys.platform)
  return env


def data_of(dataset) -> dict:
  """{"dataset", "images", "fingerprint"} of a DomainDataset: the data part of
  `record` (data.json; a resume refuses other data)."""
  return dict(dataset=dataset.name, images=int(len(dataset.images)),
              fingerprint=dataset.fingerprint())


def record(data: dict) -> dict:
  """{"source", "data", "environment"}: what results.json records of the
  code, data and machine that produced it (module docstring)."""
  return dict(source=source(), data=dict(data), environment=environment())


def environment_changes(before: dict, now: dict) -> str:
  """'' or a warning that a resumed run continues in another environment:
  its numbers from here on are not bit for bit those of an uninterrupted
  run. Only what both recorded is compared (a run begun by an older
  fedjax_dg recorded fewer keys)."""
  changed = [f"{k} {before[k]!r} -> {now[k]!r}" for k in now
             if k in before and before[k] != now[k]]
  if not changed:
    return ""
  return (f"resumed in another environment ({'; '.join(changed)}): the rounds "
          "from here on are not bit for bit those of an uninterrupted run "
          "(float summation order; HyperGenFL's by up to ~1e-2, "
          "docs/faithfulness.md). Resume where the run began for identical "
          "numbers")


def source_changes(before: dict | None, now: dict) -> str:
  """'' or a warning that a resumed run continues with other code than it
  began with (another commit, or another set of uncommitted changes)."""
  if not before or (before.get("commit"), before.get("dirty"),
                    before.get("diff")) == (now.get("commit"), now.get("dirty"),
                                            now.get("diff")):
    return ""
  return (f"resumed with other fedjax_dg code than the run began with "
          f"({source_text(before)} -> {source_text(now)}): the runs "
          "finished before and after this point may differ by what changed; "
          "each run's `commit` in results.json (and runs.csv) says which code "
          "computed it")


def resume_warnings(before_source: dict | None, before_env: dict | None,
                    now: dict) -> list[str]:
  """The warnings of a resumed run (`source_changes`, `environment_changes`)
  given what it began with and `now` (a `record`)."""
  out = [source_changes(before_source, now["source"]),
         environment_changes(before_env or {}, now["environment"])]
  return [w for w in out if w]
