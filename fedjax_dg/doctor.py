"""`fedjax-dg doctor`: is this machine ready? Backend and devices, the library
versions, the data directory in effect, the datasets prepared there, whether
the offline benchmark is prepared and where its raw Fashion-MNIST files are;
one line of what to do for each problem. Exit code 0 when everything required
is there (Python, JAX and its devices, the packages), else 1.

Datasets are optional: a user who runs only a folder of their own needs
neither the offline benchmark (only `make demo`, `fedjax-dg demo` and
`make test` use it) nor the raw Fashion-MNIST files; they are listed as
`optional` with what to do, and do not fail the check.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import os

OK, MISSING, NOTE = "ok", "MISSING", "note"
OPTIONAL = "optional"  # missing, but needed only by some commands: exit 0
# The dataset `make demo` / `make test` prepare and the demo runs on.
OFFLINE_DATASET = "rotated_fashion_mnist"
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorboardX")
INSTALL_FIX = ("pip install -r requirements.lock && pip install --no-deps -e . "
               "(or `make setup`)")


@dataclasses.dataclass(frozen=True)
class Check:
  name: str
  status: str     # OK, MISSING (required: exit code 1), OPTIONAL (missing,
                  # needed only by some commands) or NOTE (informational)
  value: str
  fix: str = ""   # what to do, for MISSING, OPTIONAL and NOTE


def package_checks(version=importlib.metadata.version) -> list[Check]:
  out = []
  for name in PACKAGES:
    try:
      out.append(Check(name, OK, version(name)))
    except importlib.metadata.PackageNotFoundError:
      out.append(Check(name, MISSING, "not installed", INSTALL_FIX))
  return out


def device_summary(devices) -> str:
  """'NVIDIA H100 80GB HBM3 x 1' (counts per device kind)."""
  kinds = collections.Counter(d.device_kind for d in devices)
  return ", ".join(f"{k} x {n}" for k, n in kinds.items())


def device_checks() -> list[Check]:
  try:  # imported here: a broken jax install is what this check reports
    import jax
    from fedjax_dg import engine
    engine.use_cpu_devices()  # the CPU devices a run gets: one per core
    backend, devices = jax.default_backend(), jax.devices()
  except Exception as e:  # a broken install or accelerator runtime: say which
    return [Check("backend", MISSING, f"{type(e).__name__}: {e}"[:120],
                  "reinstall jax for this machine: pip install -e '.[cuda12]' "
                  "(NVIDIA GPU), '.[tpu]' (TPU) or the plain install (CPU)")]
  fix = ("" if backend != "cpu" else "CPU only; on an NVIDIA GPU: pip install "
         "-e '.[cuda12]', on a TPU: pip install -e '.[tpu]'")
  return [Check("backend", NOTE if fix else OK, backend, fix),
          Check("devices", OK, device_summary(devices))]


def data_checks(data_dir: str | None = None,
                raw_dir: str | None = None) -> list[Check]:
  """The data directory in effect, the offline benchmark and its raw files
  (`raw_dir`: default `$FEDJAX_DG_FASHION_MNIST_DIR` or the Debian package's)."""
  # Imported here, as jax in `device_checks`: the doctor runs (and says what
  # is missing) where the data modules' dependencies do not import.
  from fedjax_dg.data import locations, lookup, registry
  from fedjax_dg.data.builders import fashion_mnist_base as fmb
  origin = "given" if data_dir else locations.data_dir_origin()
  data_dir = os.path.expanduser(data_dir or locations.data_dir_default())
  raw_dir = raw_dir or fmb.source_dir_default()
  prepared = bool(lookup.is_prepared(OFFLINE_DATASET, data_dir))
  has_raw = fmb.has_idx_files(raw_dir)
  out = [Check("data dir", OK, f"{data_dir} ({origin})")]
  own = sorted(n for n in registry.available(data_dir)
               if lookup.is_prepared(n, data_dir))
  out.append(Check("prepared", OK if own else NOTE,
                   ", ".join(own) if own else "no dataset yet",
                   "" if own else "a folder of yours: fedjax-dg prepare folder "
                   "--manual-dir DIR --name NAME; `fedjax-dg datasets` lists "
                   "every dataset"))
  if prepared:
    out.append(Check(OFFLINE_DATASET, OK, "prepared"))
  else:
    out.append(Check(
        OFFLINE_DATASET, OPTIONAL, f"not prepared in {data_dir}",
        "used only by the demo (make demo, fedjax-dg demo) and make test: "
        f"make data, or: fedjax-dg prepare {OFFLINE_DATASET} (writes into "
        f"{data_dir}; set ${locations.ENV_DATA_DIR} to prepare elsewhere)"))
  raw_fix = (f"sudo apt-get install dataset-fashion-mnist, or export "
             f"{fmb.ENV_SOURCE_DIR}=<a folder with the four IDX files>")
  if has_raw:
    out.append(Check("fashion-mnist raw", OK, f"{raw_dir} (4 IDX files)"))
  elif prepared:  # prepared data outlive their source
    out.append(Check("fashion-mnist raw", NOTE, f"no IDX files in {raw_dir}",
                     "needed only to prepare again: " + raw_fix))
  else:
    out.append(Check("fashion-mnist raw", OPTIONAL,
                     f"no IDX files in {raw_dir}",
                     f"needed only to prepare {OFFLINE_DATASET} (and the other "
                     "Fashion-MNIST datasets): " + raw_fix))
  return out


def checks(data_dir: str | None = None, raw_dir: str | None = None) -> list[Check]:
  import platform
  return ([Check("python", OK, platform.python_version())] + device_checks()
          + package_checks() + data_checks(data_dir, raw_dir))


def table(rows: list[Check]) -> str:
  """The checks as a short table, each problem followed by what to do."""
  width = max(len(r.name) for r in rows)
  lines = []
  for r in rows:
    lines.append(f"{r.name:<{width}}  {r.status:<8}  {r.value}")
    if r.fix:
      lines.append(f"{'':<{width}}  {'':<8}  -> {r.fix}")
  missing = sum(r.status == MISSING for r in rows)
  optional = [r.name for r in rows if r.status == OPTIONAL]
  lines.append("all required checks passed" if not missing else
               f"{missing} required check(s) failed: see the -> lines")
  if optional:
    lines.append(f"optional, not needed for your own data: {', '.join(optional)}"
                 " missing (see the -> lines for what uses them)")
  return "\n".join(lines)


def exit_code(rows: list[Check]) -> int:
  return int(any(r.status == MISSING for r in rows))


def main() -> int:
  rows = checks()
  print(table(rows))
  return exit_code(rows)
