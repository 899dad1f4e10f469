"""`fedjax-dg sweep` and `fedjax-dg report`: grids of experiments and their tables.

A sweep is the cartesian product of grid values x seeds over one experiment
config. Each product element (a *cell*) is one `experiment.run` (which itself loops
over the config's algorithms and held-out target domains) in its own
subdirectory, named from its settings (`data.d=2__seed=1`). `sweep.json` in the
sweep directory lists the config, the overrides, the grid, the seeds and every
cell with its status (pending / running / done / failed), so `--resume DIR` skips
finished cells and continues an interrupted one (experiment.run resumes a run
directory from its results.json and checkpoints).

Every cell is built and validated (config keys and types, algorithm / dataset /
model names, partitions and engine settings on the real data) before anything is
computed or any directory is created; an error names the grid values.

An experiment file may define `SWEEP = dict(grid={"data.d": (1, 2, 3)},
seeds=(0, 1, 2))`: the grid and seeds used when the command line gives none
(`--grid KEY=...` replaces that key's values, `--seeds` the seeds).

`fedjax-dg report DIR` reads every cell and writes the paper-shaped tables of
`fedjax_dg/report/tables.py` as markdown and CSV, a long CSV of every run and the
averaged learning curves (see docs/protocol.md). `fedjax-dg report DIR DIR...`
(run or sweep directories of one dataset and the same targets) puts them side
by side instead: one comparison table per metric, columns per directory.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import importlib.util
import itertools
import json
import os
import re
import time

from fedjax_dg.run import config as config_lib
from fedjax_dg import distributed
from fedjax_dg.report import plots
from fedjax_dg.run import presets
from fedjax_dg.report import tables
from fedjax_dg.errors import ConfigError, DataError, DiskFull, Stopped

MANIFEST = "sweep.json"
REPORT_DIR = "report"


@dataclasses.dataclass
class Cell:
  name: str                  # subdirectory of the sweep directory
  settings: dict[str, str]   # grid key -> value, and "seed"
  overrides: list[str]       # the `key=value` strings applied after --set


@dataclasses.dataclass
class Plan:
  config_path: str
  sets: list[str]
  grid: list[tuple[str, list[str]]]
  seeds: list[int]
  base: config_lib.ConfigDict       # the config after --set
  cells: list[Cell]
  configs: list[config_lib.ConfigDict]


# ------------------------------------------------------------ grid and cells


def split_values(raw: str) -> list[str]:
  """`v1,v2` -> [v1, v2]; with a `|` anywhere, `|` separates instead, so values
  of tuple fields can hold commas: `algorithms=hfedf,fedavg|hfedf`."""
  sep = "|" if "|" in raw else ","
  return [v.strip() for v in raw.split(sep)]


def parse_grid(specs: list[str]) -> list[tuple[str, list[str]]]:
  """`--grid key=v1,v2` strings -> [(key, [values])], in command-line order."""
  grid: dict[str, list[str]] = {}
  for spec in specs or ():
    if "=" not in spec:
      raise config_lib.ConfigError(f"--grid expects key=v1,v2,..., got {spec!r}")
    key, raw = (s.strip() for s in spec.split("=", 1))
    values = split_values(raw)
    if not key or any(v == "" for v in values):
      raise config_lib.ConfigError(f"--grid {spec!r}: empty key or value")
    if key in grid:
      raise config_lib.ConfigError(f"--grid {key} given twice")
    if len(set(values)) != len(values):
      raise config_lib.ConfigError(f"--grid {key}: repeated value in {values}")
    grid[key] = values
  return list(grid.items())


def parse_seeds(text: str | None) -> list[int] | None:
  if text is None or text == "":
    return None
  try:
    seeds = [int(s) for s in text.split(",")]
  except ValueError:
    raise config_lib.ConfigError(
        f"--seeds expects comma-separated integers, got {text!r}") from None
  if len(set(seeds)) != len(seeds):
    raise config_lib.ConfigError(f"--seeds {text!r} repeats a seed")
  return seeds


def _raw(value) -> str:
  """A config value as the string `apply_overrides` parses back to it."""
  if isinstance(value, str):
    return value
  if isinstance(value, (tuple, list)):
    return ",".join(str(v) for v in value)
  return repr(value)


def sweep_defaults(config_path: str) -> dict:
  """The experiment file's `SWEEP` dict (grid and seeds), or {}."""
  spec = importlib.util.spec_from_file_location("_fedjax_dg_sweep_defaults",
                                                config_path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  sweep = dict(getattr(module, "SWEEP", {}) or {})
  unknown = set(sweep) - {"grid", "seeds"}
  if unknown:
    raise config_lib.ConfigError(f"{config_path}: SWEEP has unknown keys "
                                 f"{sorted(unknown)}; allowed: grid, seeds")
  return dict(grid=[(k, [_raw(v) for v in vs])
                    for k, vs in dict(sweep.get("grid", {})).items()],
              seeds=[int(s) for s in sweep.get("seeds", ())] or None)


def _safe(value: str) -> str:
  return re.sub(r"[^A-Za-z0-9._+-]", "+", value) or "_"


def cell_name(settings: dict[str, str]) -> str:
  return "__".join(f"{k}={_safe(v)}" for k, v in settings.items())


def describe(cell: Cell) -> str:
  return ", ".join(f"{k}={v}" for k, v in cell.settings.items())


def plan(config_path: str, sets=(), grid=(), seeds=None, *,
         use_defaults: bool = True) -> Plan:
  """Every cell's config; errors name the bad key or `key=value`.

  Checks only config keys and types (no data, no algorithm registry): see `check`.
  """
  config_path = os.path.abspath(config_path)
  base = config_lib.apply_overrides(config_lib.load(config_path), list(sets))
  defaults = sweep_defaults(config_path) if use_defaults else {}
  merged = dict(defaults.get("grid", ()))
  for key, values in grid:
    merged[key] = list(values)       # the command line replaces a default key
  if seeds is None:
    seeds = defaults.get("seeds")
  seeds = list(seeds) if seeds else [int(base.seed)]
  if "seed" in merged:
    raise config_lib.ConfigError("--grid seed=...: give seeds with --seeds 0,1,2")
  for key, values in merged.items():
    for v in values:
      try:
        config_lib.apply_overrides(copy.deepcopy(base), [f"{key}={v}"])
      except config_lib.ConfigError as e:
        raise config_lib.ConfigError(f"--grid {key}={v}: {e}") from None
  keys = list(merged)
  cells, configs, names = [], [], set()
  # Seeds outermost: a partly finished sweep already holds whole seeds.
  for seed in seeds:
    for combo in itertools.product(*(merged[k] for k in keys)):
      settings = dict(zip(keys, combo))
      settings["seed"] = str(seed)
      overrides = [f"{k}={v}" for k, v in settings.items()]
      name, k = cell_name(settings), 1
      while name in names:
        k += 1
        name = f"{cell_name(settings)}-{k}"
      names.add(name)
      cfg = config_lib.apply_overrides(copy.deepcopy(base), overrides)
      try:
        presets.resolve_scenario(cfg.copy_and_resolve_references())
      except ConfigError as e:
        raise ConfigError(f"sweep cell {cell_name(settings)}: {e}") from None
      cells.append(Cell(name, settings, overrides))
      configs.append(cfg)
  return Plan(config_path, list(sets), list(merged.items()), seeds, base, cells,
              configs)


def check(p: Plan, *, data: bool = True) -> list[int]:
  """Validates every cell before any compute, as `experiment.run` would: names,
  engine settings and (with `data`) every federation on the real dataset.

  Returns each cell's number of held-out targets (for the ETA).
  """
  from fedjax_dg.run import experiment
  for cell, cfg in zip(p.cells, p.configs):
    try:
      experiment.validate(cfg)
    except ConfigError as e:
      raise ConfigError(f"sweep cell {describe(cell)}: {e}") from None
  if not data:
    return [1] * len(p.cells)
  datasets, checked, num_targets = {}, {}, []
  for cell, cfg in zip(p.cells, p.configs):
    try:
      cfg = experiment.resolve(cfg)
    except ConfigError as e:
      raise ConfigError(f"sweep cell {describe(cell)}: {e}") from None
    d = cfg.data
    load_key = (d.name, d.image_size, d.data_dir, d.manual_dir, d.max_per_domain,
                cfg.seed if d.max_per_domain else None)
    if load_key not in datasets:
      datasets[load_key] = experiment.load_dataset(cfg)
    dataset = datasets[load_key]
    fed_key = (load_key, d.to_json(), cfg.seed, cfg.train.to_json())
    try:
      targets = experiment.target_domains(cfg, dataset.domain_names)
      if fed_key not in checked:
        ecfg = experiment.engine_config(cfg)
        for target in targets:
          ecfg.validate(experiment.federate(cfg, dataset, target).num_clients)
        checked[fed_key] = True
    except ConfigError as e:
      raise ConfigError(f"sweep cell {describe(cell)}: {e}") from None
    num_targets.append(len(targets))
  return num_targets


def _work(cfg, num_targets: int) -> float:
  """Relative cost of a cell (for the ETA): rounds x epochs x runs."""
  t = cfg.train
  per_round = 1 if t.local_steps else max(t.epochs, 1)
  return float(t.rounds * per_round * len(cfg.algorithms) * max(num_targets, 1))


# ------------------------------------------------------------------ manifest


def read_manifest(sweep_dir: str) -> dict:
  path = os.path.join(sweep_dir, MANIFEST)
  if not os.path.isfile(path):
    raise DataError(f"{sweep_dir} has no {MANIFEST}: not a sweep directory")
  with open(path) as f:
    return json.load(f)


def write_manifest(sweep_dir: str, manifest: dict) -> None:
  if not distributed.is_main():  # several processes: process 0 writes
    return
  tmp = os.path.join(sweep_dir, MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump(manifest, f, indent=1)
  os.replace(tmp, os.path.join(sweep_dir, MANIFEST))


def _config_json(cfg) -> dict:
  return json.loads(cfg.to_json())


def _complete(cell_dir: str) -> bool:
  path = os.path.join(cell_dir, "results.json")
  if not os.path.isfile(path):
    return False
  with open(path) as f:
    res = json.load(f)
  done = {(r["algorithm"], r["target"]) for r in res["runs"]}
  return all((a, t) in done for a in res["algorithms"] for t in res["targets"])


def _hms(seconds: float) -> str:
  s = int(round(seconds))
  if s >= 3600:
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
  if s >= 60:
    return f"{s // 60}m{s % 60:02d}s"
  return f"{s}s"


# ----------------------------------------------------------------------- run


def run_sweep(config_path: str | None = None, sets=(), grid=(), seeds=None, *,
              out: str | None = None, resume: str | None = None,
              dry_run: bool = False, report: bool = True,
              echo=print) -> tuple[str | None, int]:
  """Runs (or resumes) a sweep; returns (sweep directory, number of failed cells)."""
  from fedjax_dg.run import experiment
  echo = distributed.main_only(echo)
  if resume:
    manifest = read_manifest(resume)
    p = plan(manifest["config"], manifest["sets"],
             [(k, v) for k, v in manifest["grid"]], manifest["seeds"],
             use_defaults=False)
    if [c.name for c in p.cells] != [c["name"] for c in manifest["cells"]]:
      raise ConfigError(f"{resume}: the cells of {MANIFEST} do not match its grid")
    drift = config_lib.drift(manifest["base_config"], _config_json(p.base))
    if drift:
      raise ConfigError(f"{manifest['config']} changed since the sweep started "
                       f"(resuming would mix settings): {'; '.join(drift)}")
    sweep_dir = resume
  else:
    if not config_path:
      raise ConfigError("sweep needs --config experiments/<file>.py (or --resume DIR)")
    p = plan(config_path, sets, grid, seeds)
    if out and os.path.exists(os.path.join(out, MANIFEST)):
      raise ConfigError(f"{out} already holds a sweep: continue it with --resume {out}")
    if out and os.path.isdir(out) and os.listdir(out):
      raise ConfigError(f"--out {out} exists and is not empty")
    if out:
      experiment.check_output_dir(out, "--out")
    else:
      experiment.check_output_dir(p.base.output_dir)
  num_targets = check(p)
  work = [_work(cfg, n) for cfg, n in zip(p.configs, num_targets)]
  runs = sum(len(cfg.algorithms) * n for cfg, n in zip(p.configs, num_targets))
  echo(f"[sweep] {len(p.cells)} cells ({len(p.seeds)} seeds x "
       f"{len(p.cells) // len(p.seeds)} grid points), {runs} runs "
       f"(algorithm x target), {sum(work):.0f} run-rounds x local epochs; "
       "all validated")
  if dry_run:
    for k, c in enumerate(p.cells, 1):
      echo(f"  cell {k}/{len(p.cells)} {c.name}: {' '.join(c.overrides)}")
    return None, 0

  if not resume:  # process 0 names it (several processes)
    sweep_dir = distributed.same_everywhere(out or (
        experiment.make_run_dir(p.base.output_dir, f"sweep-{p.base.name}")
        if distributed.is_main() else ""))
    if distributed.is_main():
      try:
        os.makedirs(sweep_dir, exist_ok=True)
      except OSError as e:
        raise ConfigError(f"--out {sweep_dir}: cannot create it "
                          f"({type(e).__name__}: {e}): give a writable "
                          "folder") from None
    manifest = dict(
        version=1, name=p.base.name, config=p.config_path, sets=p.sets,
        grid=[[k, v] for k, v in p.grid], seeds=p.seeds,
        created=datetime.datetime.now().isoformat(timespec="seconds"),
        base_config=_config_json(p.base),
        cells=[dict(name=c.name, settings=c.settings, overrides=c.overrides,
                    status="pending") for c in p.cells])
    write_manifest(sweep_dir, manifest)
  echo(f"[sweep] directory: {sweep_dir}" + (" (resuming)" if resume else ""))

  n, failures = len(p.cells), 0
  spent, spent_work = 0.0, 0.0
  t_start = time.perf_counter()
  for k, (cell, cfg, entry) in enumerate(zip(p.cells, p.configs,
                                             manifest["cells"]), 1):
    cell_dir = os.path.join(sweep_dir, cell.name)
    if entry["status"] == "done" and _complete(cell_dir):
      echo(f"[sweep] cell {k}/{n} {cell.name}: finished earlier, skipped")
      continue
    left = sum(w for w, e in zip(work[k - 1:], manifest["cells"][k - 1:])
               if e["status"] != "done")
    eta = _hms(spent / spent_work * left) if spent_work else "after the first cell"
    state = ("resuming" if os.path.exists(os.path.join(cell_dir, "config.json"))
             else "starting")
    echo(f"[sweep] cell {k}/{n} {cell.name}: {state} ({describe(cell)}); "
         f"elapsed {_hms(time.perf_counter() - t_start)}, ETA {eta}")
    entry.update(status="running",
                 started=datetime.datetime.now().isoformat(timespec="seconds"))
    entry.pop("error", None)
    write_manifest(sweep_dir, manifest)
    t0 = time.perf_counter()
    try:
      results = experiment.run(cfg, run_dir=cell_dir, echo=echo)
    except KeyboardInterrupt as e:  # the sweep continues, not the cell
      raise Stopped(sweep_dir) from e
    except DiskFull as e:  # every later cell would fail the same way
      e.run_dir = sweep_dir  # `sweep --resume` continues this cell
      raise
    except Exception as e:  # noqa: BLE001 -- recorded; the next cell still runs
      failures += 1
      entry.update(status="failed", error=f"{type(e).__name__}: {e}")
      write_manifest(sweep_dir, manifest)
      echo(f"[sweep] cell {k}/{n} {cell.name}: FAILED: {entry['error']}")
      continue
    dt = time.perf_counter() - t0
    if distributed.is_main():
      _cell_outputs(results, cell_dir, echo)
    spent, spent_work = spent + dt, spent_work + work[k - 1]
    entry.update(status="done", seconds=dt,
                 finished=datetime.datetime.now().isoformat(timespec="seconds"))
    write_manifest(sweep_dir, manifest)
    echo(f"[sweep] cell {k}/{n} {cell.name}: done in {_hms(dt)}")
  echo(f"[sweep] {sum(c['status'] == 'done' for c in manifest['cells'])}/{n} cells "
       f"done, {failures} failed, {_hms(time.perf_counter() - t_start)}; "
       f"manifest {os.path.join(sweep_dir, MANIFEST)}")
  if (report and distributed.is_main()
      and any(c["status"] == "done" for c in manifest["cells"])):
    paths = write_report(sweep_dir)
    echo(f"[sweep] report: {os.path.dirname(paths[0])} "
         f"(fedjax-dg report {sweep_dir} rewrites it)")
  return sweep_dir, failures


def _cell_outputs(results: dict, cell_dir: str, echo) -> None:
  """The cell's own table.md and figures, as `fedjax-dg run` writes them; a
  failure here is reported and does not fail the cell (results.json is written)."""
  try:
    from fedjax_dg.report import run_summary as run_report
    run_report.write_all(results, cell_dir)
  except Exception as e:  # noqa: BLE001
    echo(f"[sweep] {cell_dir}: table.md / figures not written: "
         f"{type(e).__name__}: {e}")


# -------------------------------------------------------------------- report


def _json_override(config: dict, item: str) -> None:
  """Applies one `key=value` cell override to a config's JSON (in place):
  the value parsed as `config.coerce` would, for the fields the report reads
  (seed, data.d, algorithms, hfedf switches, scenario)."""
  key, raw = item.split("=", 1)
  *path, leaf = key.strip().split(".")
  node = config
  for part in path:
    node = node.setdefault(part, {})
  old = node.get(leaf)
  if isinstance(old, str):
    node[leaf] = raw
  elif isinstance(old, list):
    node[leaf] = [v.strip() for v in raw.split(",")]
  else:
    node[leaf] = config_lib.coerce(raw, old)


def _cell_config(cell_dir: str, manifest: dict, cell: dict) -> dict:
  """A cell's config.json, or (a cell that never started) the sweep's base
  config with the cell's overrides."""
  path = os.path.join(cell_dir, "config.json")
  if os.path.isfile(path):
    with open(path) as f:
      return json.load(f)
  config = copy.deepcopy(manifest.get("base_config") or {})
  for item in cell.get("overrides", ()):
    try:
      _json_override(config, item)
    except (ConfigError, ValueError):
      pass  # a field the report does not read
  return config


def load_records(sweep_dir: str) -> tuple[dict, list[dict]]:
  """(manifest, records) of a sweep directory, or of a single run directory
  (one `fedjax-dg run` output, read as a one-cell sweep).

  Every run the directory planned that has not finished (a target of a
  stopped run, every run of a pending / failed cell: a seed or grid point)
  is a `missing` record (`tables.missing_run`): the tables mark what it
  leaves partial, and `manifest["missing"]` lists it as {cell: (status,
  [(algorithm, target)])}; cells are "complete" in `manifest["complete"]`.
  """
  if os.path.isfile(os.path.join(sweep_dir, MANIFEST)):
    manifest = read_manifest(sweep_dir)
  elif os.path.isfile(os.path.join(sweep_dir, "results.json")):
    manifest = dict(name=os.path.basename(os.path.normpath(sweep_dir)), cells=[
        dict(name=".", settings={}, status="done")])
  else:
    raise DataError(f"{sweep_dir} holds neither {MANIFEST} (a sweep) nor "
                            "results.json (a run)")
  records, loaded, unstarted = [], [], []
  for cell in manifest["cells"]:
    cell_dir = os.path.normpath(os.path.join(sweep_dir, cell["name"]))
    name = os.path.basename(cell_dir) if cell["name"] == "." else cell["name"]
    config = _cell_config(cell_dir, manifest, cell)
    path = os.path.join(cell_dir, "results.json")
    if not os.path.isfile(path):
      unstarted.append((cell, name, config))
      continue
    with open(path) as f:
      results = json.load(f)
    loaded.append((cell, name, config, results))
    if results.get("warnings"):
      manifest.setdefault("warnings", {})[name] = list(results["warnings"])
    manifest.setdefault("dataset", results.get("dataset"))
    held = manifest.setdefault("targets", [])
    held += [str(t) for t in results.get("targets", ()) if str(t) not in held]
  held = manifest.get("targets", [])
  missing, complete = {}, []
  for cell, name, config, results in loaded:
    done = {(r["algorithm"], str(r["target"])) for r in results["runs"]}
    planned = [(a, str(t)) for a in results.get("algorithms", ())
               for t in results.get("targets", ())]
    absent = [p for p in planned if p not in done]
    if absent:  # a run directory's own status is unknown: stopped or running
      missing[name] = (cell.get("status", "?") if cell["name"] != "."
                       else "unfinished", absent)
    elif cell.get("status") == "done" or cell["name"] == ".":
      complete.append(name)
    records += tables.records_from_cell(
        name, cell["settings"], config,
        dict(results, runs=results["runs"]
             + [tables.missing_run(a, t) for a, t in absent]))
  if loaded:  # a cell that never wrote results.json: every run it plans
    for cell, name, config in unstarted:
      absent = [(a, t) for a in config.get("algorithms", ()) for t in held]
      missing[name] = (cell.get("status", "?"), absent)
      records += tables.records_from_cell(
          name, cell["settings"], config,
          dict(runs=[tables.missing_run(a, t) for a, t in absent]))
  manifest["missing"], manifest["complete"] = missing, complete
  return manifest, records


def missing_lines(manifest: dict) -> list[str]:
  """One line per cell with unfinished runs: its status and which
  algorithms / targets (a whole cell: its seed and grid point)."""
  lines = []
  for name, (status, absent) in manifest.get("missing", {}).items():
    per = {}
    for a, t in absent:
      per.setdefault(a, []).append(t)
    what = "; ".join(f"{a}: targets {', '.join(ts)}" for a, ts in per.items())
    lines.append(f"- `{name}` ({status}): {len(absent)} run(s) missing: "
                 + (what or "none planned known"))
  return lines


def report_tables(records: list[dict], ds=None) -> list[tuple[str, tables.Table]]:
  """(file stem, table) of every table the records support."""
  present = sorted({r["d"] for r in records})
  ds = list(ds) if ds else present
  missing = [d for d in ds if d not in present]
  if missing:
    raise ConfigError(f"--d {missing}: no finished run has those d; present: {present}")
  out = [("table2", tables.table2(records)),
         ("table2_best", tables.table2(records, "best"))]
  scenarios = tables.scenario_table(records)
  if scenarios is not None:
    out.insert(0, ("scenarios", scenarios))
  t3 = tables.table3(records)
  if t3 is not None:
    out.append(("table3", t3))
  out += [(f"per_domain_d{d}", tables.per_domain(records, d)) for d in ds]
  out.append(("summary", tables.summary(records)))
  return out


def write_report(sweep_dir: str, out: str | None = None, ds=None) -> list[str]:
  """Writes report.md, one .md and .csv per table, runs.csv and curves.png."""
  manifest, records = load_records(sweep_dir)
  if not tables.finished(records):
    raise ConfigError(f"{sweep_dir}: no finished run yet, nothing to report")
  out = out or os.path.join(sweep_dir, REPORT_DIR)
  os.makedirs(out, exist_ok=True)
  paths = []

  def write(name, text):
    path = os.path.join(out, name)
    with open(path, "w") as f:
      f.write(text)
    paths.append(path)

  parts = report_tables(records, ds)
  for stem, table in parts:
    write(f"{stem}.md", table.markdown())
    write(f"{stem}.csv", table.csv())
  write("runs.csv", tables.long_table(records).csv())
  cells = manifest["cells"]
  done, absent = len(tables.finished(records)), len(records) - len(
      tables.finished(records))
  head = [f"# Sweep report: {manifest.get('name')} ({manifest.get('dataset')})", "",
          f"Directory `{os.path.abspath(sweep_dir)}`; "
          f"{len(manifest['complete'])}/{len(cells)} cells complete, {done} of "
          f"{done + absent} planned runs finished."]
  if manifest.get("config"):
    head.append(f"Config `{manifest['config']}`, --set {manifest.get('sets')}, "
                f"grid {manifest.get('grid')}, seeds {manifest.get('seeds')}.")
  if manifest.get("warnings"):
    head += ["", "**Stand-ins: numbers that do not follow the protocol** "
             "(each cell's results.json `warnings`):", ""]
    head += [f"- `{cell}`: {w}" for cell, ws in manifest["warnings"].items()
             for w in ws]
  if absent:
    head += ["", f"**{tables.PARTIAL} PARTIAL: {absent} planned run(s) have not "
             f"finished**; every value they leave partial is marked "
             f"{tables.PARTIAL} (a mean over the finished runs only). "
             "Missing:", ""] + missing_lines(manifest) + [
             "", "Continue with `fedjax-dg "
             + ("sweep" if os.path.isfile(os.path.join(sweep_dir, MANIFEST))
                else "run") + f" --resume {sweep_dir}`, then report again."]
  head += ["", "id = each client's model on its own held-out 10 % source split "
           "(mean over clients); ood = on the unseen target domain. Final = the "
           "evaluation after the last round (the papers' protocol); best = the "
           "highest value of the evaluation history (every train.eval_every rounds; "
           "its ood uses at most train.ood_eval_max target images). Every number "
           "is computed from the cells' results.json; runs.csv lists each run.", ""]
  write("report.md", "\n".join(head + [t.markdown() for _, t in parts]))
  paths.append(plots.sweep_curves(records, os.path.join(out, "curves.png")))
  return paths


def column_labels(dirs: list[str]) -> list[str]:
  """One label per directory: its name, or its path below the directories'
  common folder where two names coincide."""
  paths = [os.path.abspath(d) for d in dirs]
  if len(set(paths)) < len(paths):
    raise ConfigError(f"report: a directory is given twice in {list(dirs)}")
  names = [os.path.basename(p) for p in paths]
  if len(set(names)) == len(names):
    return names
  root = os.path.commonpath(paths)
  return [os.path.relpath(p, root) for p in paths]


def check_comparable(labels: list[str], manifests: list[dict]) -> None:
  """One dataset and the same held-out targets in every directory, else a
  ConfigError naming each directory's."""
  seen = [(m.get("dataset"), sorted(m.get("targets", []))) for m in manifests]
  if len(set((d, tuple(t)) for d, t in seen)) > 1:
    held = "; ".join(f"{label}: {d}, targets {', '.join(t)}"
                     for label, (d, t) in zip(labels, seen))
    raise ConfigError(
        f"report: these runs are not comparable ({held}): one table needs one "
        "dataset and the same held-out targets in every directory; report "
        "them separately (fedjax-dg report DIR)")


COMPARED = (("comparison_ood", "ood_acc"), ("comparison_id", "id_acc"),
            ("comparison_ood_best", "best_ood_acc"))


def compare(dirs: list[str], out: str | None = None) -> list[str]:
  """`fedjax-dg report DIR DIR...`: one comparison table per metric (rows =
  algorithms, columns = each directory's targets, mean ± std over seeds) as
  markdown and CSV, every run in runs.csv and the curves, labelled by
  directory; written to `out` (default: a new `compare-<time>` folder beside
  the first directory). Returns the paths, report.md first."""
  from fedjax_dg.run import experiment
  labels = column_labels(dirs)
  loaded = [load_records(d) for d in dirs]
  for d, (_, records) in zip(dirs, loaded):
    if not tables.finished(records):
      raise ConfigError(f"{d}: no finished run yet, nothing to compare")
  check_comparable(labels, [m for m, _ in loaded])
  groups = [(label, records) for label, (_, records) in zip(labels, loaded)]
  out = out or experiment.make_run_dir(
      os.path.dirname(os.path.abspath(dirs[0])), "compare", field="--out")
  os.makedirs(out, exist_ok=True)
  written = {}
  parts = [(stem, table) for stem, table in (
      (stem, tables.comparison(groups, metric)) for stem, metric in COMPARED)
      if table.rows]   # no id accuracy without an id split (val_fraction=0)
  for stem, table in parts:
    written[f"{stem}.md"] = table.markdown()
    written[f"{stem}.csv"] = table.csv()
  tagged = [dict(r, cell=f"{label}/{r['cell']}", variant=f"{r['variant']} "
                 f"({label})", row=f"{r['row']} ({label})")
            for label, records in groups for r in records]
  written["runs.csv"] = tables.long_table(tagged).csv()
  manifest = loaded[0][0]
  head = [f"# Comparison of {len(dirs)} runs ({manifest.get('dataset')}, "
          f"targets {', '.join(manifest.get('targets', []))})", ""]
  for label, d, (m, records) in zip(labels, dirs, loaded):
    done = len(tables.finished(records))
    head.append(f"- `{label}`: `{os.path.abspath(d)}` ({m.get('name')}; "
                f"{done} runs)" + (
                    f"; {tables.PARTIAL} PARTIAL, {len(records) - done} "
                    "planned runs not finished:" if len(records) > done else ""))
    head += ["  " + line for line in missing_lines(m)]
    head += [f"  - stand-in (`{cell}`): {w}"
             for cell, ws in m.get("warnings", {}).items() for w in ws]
  written["report.md"] = "\n".join(head + [""] + [t.markdown() for _, t in parts])
  paths = []
  for name in ["report.md"] + [n for n in written if n != "report.md"]:
    paths.append(os.path.join(out, name))
    with open(paths[-1], "w") as f:
      f.write(written[name])
  paths.append(plots.sweep_curves(tagged, os.path.join(out, "curves.png")))
  return paths


# ------------------------------------------------------------------------ cli


def main_sweep(args) -> int:
  if args.resume and (args.config or args.set or args.grid or args.seeds
                      or args.out):
    raise ConfigError("--resume DIR continues a sweep with the settings in its "
                     f"{MANIFEST}; give no --config/--set/--grid/--seeds/--out")
  _, failures = run_sweep(args.config, args.set, parse_grid(args.grid),
                          parse_seeds(args.seeds), out=args.out,
                          resume=args.resume, dry_run=args.dry_run)
  return 1 if failures else 0


def main_report(args) -> int:
  if len(args.dirs) > 1:
    if args.d:
      raise ConfigError("--d selects the per-domain tables of one sweep "
                        "directory; a comparison of several has none")
    paths = compare(args.dirs, args.out)       # report.md first
    with open(paths[0]) as f:
      print(f.read())
  else:  # report.md's head (what finished, what is missing) and first table
    paths = write_report(args.dirs[0], args.out, args.d)
    with open(next(p for p in paths if p.endswith("report.md"))) as f:
      text = f.read()
    second = text.find("\n### ", text.find("### ") + 1)
    print(text if second < 0 else text[:second])
  print("wrote " + ", ".join(paths))
  return 0
