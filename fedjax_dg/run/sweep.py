"""`fedjax-dg sweep`: grids of experiments, one run directory per cell.

A sweep is the cartesian product of grid values x seeds over one experiment
config. Each product element (a *cell*) is one run directory (what
`experiment.run` makes: the config's algorithms x held-out target domains) in
its own subdirectory, named from its settings (`data.d=2__seed=1`). The runs
of every cell are trained in replica batches (`batches`: runs of one
algorithm that share a program, e.g. seeds x targets x splits, as one
`engine.run_batch`), each recorded in its own cell; `--replicas 1` runs
one at a time, by the same path. `sweep.json` in the
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

When the sweep ends, its report is written once (`reports.write_report`:
what `fedjax-dg report DIR` writes); the cells hold their records
(results.json, metrics.jsonl, TensorBoard events), not tables or figures of
their own: `fedjax-dg report CELL_DIR` draws one cell's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import importlib.util
import itertools
import json
import os
import re
import time

from fedjax_dg import distributed
from fedjax_dg.errors import ConfigError, DiskFull, Stopped
from fedjax_dg.run import (assemble, batches, checks, directory, experiment,
                           ignored, lock, presets, reports, sweep_state)
from fedjax_dg.run import config as config_lib


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
  if text is None:
    return None
  if not text.strip():
    raise config_lib.ConfigError(
        f"--seeds {text!r} names no seed: give one or more, e.g. --seeds "
        "0,1,2 (without --seeds: the experiment file's SWEEP seeds, else its "
        "seed)")
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
         use_defaults: bool = True, base=None) -> Plan:
  """Every cell's config; errors name the bad key or `key=value`. `base`:
  the config after `sets` when the file is not read (a resumed sweep whose
  config file is gone: its manifest's).

  Checks only config keys and types (no data, no algorithm registry): see `check`.
  """
  config_path = os.path.abspath(config_path)
  if base is None:
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
  given = ignored.given_keys(sets, keys)   # what the command line sets (`ignored`)
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
        ignored.check(cfg, given)
      except ConfigError as e:
        raise ConfigError(f"sweep cell {cell_name(settings)}: {e}") from None
      cells.append(Cell(name, settings, overrides))
      configs.append(cfg)
  ignored.check_sections(given, [cfg.algorithms for cfg in configs])
  return Plan(config_path, list(sets), list(merged.items()), seeds, base, cells,
              configs)


def check(p: Plan, *, data: bool = True, loaded: dict | None = None
          ) -> list[int]:
  """Validates every cell before any compute, as `experiment.run` would: names,
  engine settings and (with `data`) every federation on the real dataset.

  Returns each cell's number of held-out targets (for the ETA); `loaded`
  (optional) gets each cell's dataset, by cell index (cells share them).
  """
  for cell, cfg in zip(p.cells, p.configs):
    try:
      checks.validate(cfg)
    except ConfigError as e:
      raise ConfigError(f"sweep cell {describe(cell)}: {e}") from None
  if not data:
    return [1] * len(p.cells)
  datasets, checked, num_targets = {}, {}, []
  for cell, cfg in zip(p.cells, p.configs):
    try:
      cfg = assemble.resolve(cfg)
    except ConfigError as e:
      raise ConfigError(f"sweep cell {describe(cell)}: {e}") from None
    d = cfg.data
    load_key = (d.name, d.image_size, d.data_dir, d.manual_dir, d.max_per_domain,
                cfg.seed if d.max_per_domain else None)
    if load_key not in datasets:
      datasets[load_key] = assemble.load_dataset(cfg)
    dataset = datasets[load_key]
    if loaded is not None:
      loaded[len(num_targets)] = dataset
    fed_key = (load_key, d.to_json(), cfg.seed, cfg.train.to_json())
    try:
      targets = assemble.target_domains(cfg, dataset.domain_names)
      if fed_key not in checked:
        ecfg = assemble.engine_config(cfg)
        for target in targets:
          ecfg.validate(assemble.federate(cfg, dataset, target).num_clients)
        checked[fed_key] = True
    except ConfigError as e:
      raise ConfigError(f"sweep cell {describe(cell)}: {e}") from None
    num_targets.append(len(targets))
  return num_targets


def _check_fresh(out: str, part=None) -> None:
  """`--out` can start a new sweep: it holds no sweep and nothing else (but
  lock files); checked before the validation and again under the folder's
  lock. A part (`part`) joins a sweep its fellow parts made instead."""
  if os.path.exists(os.path.join(out, directory.MANIFEST)):
    raise ConfigError(f"{out} already holds a sweep: continue it with --resume {out}")
  if os.path.isdir(out) and {f for f in os.listdir(out)
                             if not f.endswith(".lock")}:
    raise ConfigError(f"--out {out} exists and is not empty")


def _work(cfg, num_targets: int) -> float:
  """Relative cost of a cell (for the ETA): rounds x epochs x runs."""
  t = cfg.train
  per_round = 1 if t.local_steps else max(t.epochs, 1)
  return float(t.rounds * per_round * len(cfg.algorithms) * max(num_targets, 1))


# ------------------------------------------------------------------ manifest


def _config_json(cfg) -> dict:
  return json.loads(cfg.to_json())


def _stored_base(manifest: dict, echo):
  """None while the sweep's config file exists (`plan` reads it, and a
  changed file is refused); else the config the manifest holds (the file's
  with the sweep's --set), with the fields it records as set (older
  manifests: those that differ from the defaults)."""
  if os.path.isfile(manifest["config"]):
    return None
  echo(f"[sweep] {manifest['config']} no longer exists: resuming with the "
       f"config {directory.MANIFEST} holds (that file's, with the sweep's "
       "--set)")
  stored = manifest["base_config"]
  given = manifest.get("explicit")
  return config_lib.from_json(
      stored, given=config_lib.changed_keys(stored) if given is None else given)


# ----------------------------------------------------------------------- run


def parse_part(spec: str | None) -> tuple[int, int] | None:
  """`--part I/N` -> (I, N), 1 <= I <= N; None -> None."""
  if spec is None:
    return None
  try:
    i, n = (int(v) for v in spec.split("/"))
  except ValueError:
    raise ConfigError(f"--part {spec!r}: give I/N, e.g. 2/4 (part 2 of 4)"
                      ) from None
  if not 1 <= i <= n:
    raise ConfigError(f"--part {spec}: I must be in 1..N (1..{n})")
  return i, n


def part_cells(num_cells: int, part: tuple[int, int] | None) -> range:
  """The cell indices part (I, N) trains: the I-th of N contiguous blocks
  of sizes as equal as they can be (every cell for None)."""
  if part is None:
    return range(num_cells)
  i, n = part
  return range((i - 1) * num_cells // n, i * num_cells // n)


@lock.released  # the folder's sweep lock (`lock.hold`) until it returns
def run_sweep(config_path: str | None = None, sets=(), grid=(), seeds=None, *,
              out: str | None = None, resume: str | None = None,
              dry_run: bool = False, report: bool = True,
              max_replicas: int = 0, replica_mapping: str = "auto",
              part: tuple[int, int] | None = None,
              echo=print) -> tuple[str | None, int]:
  """Runs (or resumes) a sweep; returns (sweep directory, number of failed
  cells). `max_replicas`: runs per replica batch (`batches`; 0: as many as
  fit in memory; 1: one run after another); `replica_mapping`: how a
  batch's replicas are mapped (`engine.programs.replica_mapping`).

  `part` = (I, N): this process trains the I-th of N blocks of the cells
  (`part_cells`), so N processes or machines (a job array) share one sweep
  folder (`out`, on a disk they all see): the first to start writes its
  sweep.json, the others join it, each updates only its own cells, each
  part resumes on its own (`--resume DIR --part I/N`), and the last to
  finish writes the report over all of them (`fedjax-dg report DIR` any
  time)."""
  if max_replicas < 0:
    raise ConfigError(f"--replicas {max_replicas}: allowed values are 0 (as "
                      "many as fit in memory), 1 (one run at a time) or a "
                      "larger batch cap")
  echo = distributed.main_only(echo)
  if part is not None and not (out or resume):
    raise ConfigError("--part I/N shares one sweep folder between the parts: "
                      "give it with --out DIR (the same for every part)")
  if resume:
    manifest = directory.read_manifest(resume)
    if not dry_run:  # one sweep per folder: read again under the lock
      sweep_state.hold(resume, part)
      manifest = directory.read_manifest(resume)
    sweep_state.check_parts(resume, manifest, part)
    p = plan(manifest["config"], manifest["sets"],
             [(k, v) for k, v in manifest["grid"]], manifest["seeds"],
             use_defaults=False, base=_stored_base(manifest, echo))
    if [c.name for c in p.cells] != [c["name"] for c in manifest["cells"]]:
      raise ConfigError(f"{resume}: the cells of {directory.MANIFEST} do not match its grid")
    drift = config_lib.drift(manifest["base_config"], _config_json(p.base))
    if drift:
      raise ConfigError(f"{manifest['config']} changed since the sweep started "
                       f"(resuming would mix settings): {'; '.join(drift)}")
    sweep_dir = resume
  else:
    if not config_path:
      raise ConfigError("sweep needs --config experiments/<file>.py (or --resume DIR)")
    p = plan(config_path, sets, grid, seeds)
    joining = part is not None and os.path.isfile(os.path.join(
        out, directory.MANIFEST))
    if out and not joining:
      _check_fresh(out, part)
    if out:
      directory.check_output_dir(out, "--out")
    else:
      directory.check_output_dir(p.base.output_dir)
  loaded: dict = {}
  num_targets = check(p, loaded=loaded)
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
        directory.make_run_dir(p.base.output_dir, f"sweep-{p.base.name}")
        if distributed.is_main() else ""))
    if distributed.is_main():
      try:
        os.makedirs(sweep_dir, exist_ok=True)
      except OSError as e:
        raise ConfigError(f"--out {sweep_dir}: cannot create it "
                          f"({type(e).__name__}: {e}): give a writable "
                          "folder") from None
      # One sweep per folder: checked again under the lock.
      sweep_state.hold(sweep_dir, part)
    manifest = dict(
        version=1, name=p.base.name, config=p.config_path, sets=p.sets,
        grid=[[k, v] for k, v in p.grid], seeds=p.seeds,
        created=datetime.datetime.now().isoformat(timespec="seconds"),
        base_config=_config_json(p.base),
        explicit=config_lib.explicit_keys(p.base),   # what was set
        **({"parts": part[1]} if part else {}),
        cells=[dict(name=c.name, settings=c.settings, overrides=c.overrides,
                    status="pending") for c in p.cells])
    if part is None:
      if distributed.is_main():
        _check_fresh(sweep_dir)
      directory.write_manifest(sweep_dir, manifest)
    else:  # the first part writes it, the others join it
      with lock.exclusive(os.path.join(sweep_dir, sweep_state.MANIFEST_LOCK)):
        if os.path.isfile(os.path.join(sweep_dir, directory.MANIFEST)):
          manifest = sweep_state.join(sweep_dir, manifest, p)
          resume = sweep_dir
        else:
          _check_fresh(sweep_dir, part)
          directory.write_manifest(sweep_dir, manifest)
      sweep_state.check_parts(sweep_dir, manifest, part)
  echo(f"[sweep] directory: {sweep_dir}" + (" (resuming)" if resume else ""))

  n, t_start = len(p.cells), time.perf_counter()
  mine = part_cells(n, part)
  if part is not None:
    echo(f"[sweep] part {part[0]}/{part[1]}: cells {mine.start + 1}-"
         f"{mine.stop} of {n}")
  with sweep_state.no_stuck_cells(sweep_dir, manifest,
                                  fresh=not resume and part is None,
                                  echo=echo, mine=mine):
    failures = _cells_in_batches(p, manifest, sweep_dir, loaded, max_replicas,
                                 replica_mapping, echo, mine)
  if part is not None:  # the other parts' cells as they are now
    manifest = directory.read_manifest(sweep_dir)
  ours = [manifest["cells"][k] for k in mine]
  echo(f"[sweep] {sum(c['status'] == 'done' for c in ours)}/{len(ours)} cells "
       f"done, {failures} failed, {batches.hms(time.perf_counter() - t_start)}; "
       f"manifest {os.path.join(sweep_dir, directory.MANIFEST)}")
  waiting = [c["name"] for c in manifest["cells"]
             if c["status"] in ("pending", "running")]
  if part is not None and waiting:
    echo(f"[sweep] part {part[0]}/{part[1]} done; {len(waiting)} cells of "
         "other parts are not finished: the last part to end writes the "
         f"report (fedjax-dg report {sweep_dir} writes it over what is "
         "done any time)")
  elif (report and distributed.is_main()
        and any(c["status"] == "done" for c in manifest["cells"])):
    paths = reports.write_report(sweep_dir)
    echo(f"[sweep] report: {os.path.dirname(paths[0])} "
         f"(fedjax-dg report {sweep_dir} rewrites it)")
  return sweep_dir, failures


def _cells_in_batches(p: Plan, manifest: dict, sweep_dir: str, loaded: dict,
                      max_replicas: int, mapping: str, echo,
                      mine: range | None = None) -> int:
  """Every pending cell's (of `mine`: a part's) run directory opened, their
  runs trained in replica batches (`batches`); a cell is finished when its
  last run is recorded. Returns the failed cells."""
  n, cells, index, failures = len(p.cells), [], [], 0
  for k, (cell, cfg, entry) in enumerate(zip(p.cells, p.configs,
                                             manifest["cells"])):
    if mine is not None and k not in mine:
      continue
    cell_dir = os.path.join(sweep_dir, cell.name)
    if entry["status"] == "done" and directory.cell_complete(cell_dir):
      echo(f"[sweep] cell {k + 1}/{n} {cell.name}: finished earlier, skipped")
      continue
    try:
      cells.append(experiment.open_run(cfg, run_dir=cell_dir, echo=echo,
                                       dataset=loaded.get(k)))
    except KeyboardInterrupt as e:
      raise Stopped(sweep_dir) from e
    except DiskFull as e:
      e.run_dir = sweep_dir
      raise
    except Exception as e:  # noqa: BLE001 -- recorded; the other cells run
      failures += 1
      sweep_state.mark(sweep_dir, manifest, entry, "failed",
            error=f"{type(e).__name__}: {e}")
      echo(f"[sweep] cell {k + 1}/{n} {cell.name}: FAILED: {entry['error']}")
      continue
    index.append(k)
    opened = cells[-1]
    echo(f"[sweep] cell {k + 1}/{n} {cell.name}: "
         f"{'resuming' if opened.resume else 'starting'} ({describe(cell)}); "
         f"{len(opened.pending())} runs to do")
    for i, name in opened.finished():
      echo(f"{name} / {opened.targets[i]}: already finished, kept from "
           "results.json")
    sweep_state.mark(sweep_dir, manifest, entry, "running")

  def cell_done(c: int, errors: list) -> None:
    nonlocal failures
    opened, entry = cells[c], manifest["cells"][index[c]]
    opened.write()
    opened.log.close()
    name = p.cells[index[c]].name
    if not errors:  # runs stopped as non-finite in an earlier part
      errors = [(f"{a} / {t}: NonFiniteError: {why}", None)
                for (a, t), why in opened.stopped().items()]
    if errors:
      failures += 1
      sweep_state.mark(sweep_dir, manifest, entry, "failed",
            error="; ".join(message for message, _ in errors))
      where = sweep_state.write_tracebacks(opened.run_dir, errors)
      echo(f"[sweep] cell {index[c] + 1}/{n} {name}: FAILED: {entry['error']}"
           + (f" (traceback: {where})" if where else ""))
      return
    with contextlib.suppress(FileNotFoundError):  # an earlier part's
      os.remove(os.path.join(opened.run_dir, sweep_state.ERROR_FILE))
    sweep_state.mark(sweep_dir, manifest, entry, "done",
          seconds=opened.results["seconds_this_part"])
    echo(f"[sweep] cell {index[c] + 1}/{n} {name}: done")

  planned, built = batches.plan(cells, max_replicas)
  runs = sum(len(b.jobs) for b in planned)
  echo(f"[sweep] {runs} runs to do in {len(planned)} replica batches "
       f"({'at most ' + str(max_replicas) if max_replicas else 'sized by memory'}"
       " each; --replicas 1 runs one at a time):")
  for line in batches.explain(planned, cells):
    echo(line)
  try:
    batches.run(planned, built, cells, echo=echo, on_cell_done=cell_done,
                mapping=mapping, prefix="[sweep] ")
  except KeyboardInterrupt as e:
    for opened in cells:
      opened.write()
      opened.log.close()
    raise Stopped(sweep_dir) from e
  except DiskFull as e:
    e.run_dir = sweep_dir
    raise
  return failures


# ------------------------------------------------------------------------ cli


def main_sweep(args) -> int:
  if args.resume and (args.config or args.set or args.grid or args.seeds
                      or args.out):
    raise ConfigError("--resume DIR continues a sweep with the settings in its "
                     f"{directory.MANIFEST}; give no --config/--set/--grid/--seeds/--out")
  _, failures = run_sweep(args.config, args.set, parse_grid(args.grid),
                          parse_seeds(args.seeds), out=args.out,
                          resume=args.resume, dry_run=args.dry_run,
                          max_replicas=args.replicas,
                          replica_mapping=args.replica_mapping,
                          part=parse_part(args.part))
  return 1 if failures else 0


