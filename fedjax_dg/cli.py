"""`fedjax-dg run | demo | prepare | sweep | report | partition | doctor`."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import textwrap

from fedjax_dg import distributed
from fedjax_dg.errors import ConfigError

# The demo's configs live in the package (`fedjax_dg.run.configs`), not in a path.
DEMO = "fedjax_dg.run.configs.demo"
FULL = "fedjax_dg.run.configs.rfmnist_hfedf"


def setup_jax(processes=None) -> str:
  """Sets up JAX for runs: one XLA:CPU device per core (`engine.use_cpu_devices`;
  clients then run on the cores concurrently), a persistent XLA compilation
  cache (runs with the same shapes, e.g. another target domain or a second
  `make demo`, reuse compiled programs instead of recompiling), and with
  `processes` (`distributed.Settings`) joins a multi-process run."""
  import jax
  from fedjax_dg import distributed, engine
  from fedjax_dg.data import locations
  engine.use_cpu_devices()
  distributed.initialize(processes or distributed.Settings())
  path = os.environ.get("FEDJAX_DG_JAX_CACHE") or os.path.join(
      locations.data_dir_default(), "jax_cache")
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  return path


def _config(config_path: str | None, overrides: list[str],
            module: str | None = None):
  """An experiment file's (`config_path`) or a packaged config's (`module`)
  config with the `--set` overrides."""
  import importlib
  from fedjax_dg.run import config as config_lib
  from fedjax_dg.run import ignored
  cfg = (importlib.import_module(module).get_config() if module
         else config_lib.load(config_path))
  cfg = config_lib.apply_overrides(cfg, overrides)
  given = ignored.given_keys(overrides)  # a --set another setting overrides
  ignored.check(cfg, given)
  ignored.check_sections(given, [cfg.algorithms])
  return cfg


def _resume_config(run_dir: str, overrides: list[str],
                   module: str | None = None):
  """The config `run_dir` was run with (its config.json) with the `--set`
  overrides: what `--resume DIR` runs without --config. A --set that changes
  a stored value is refused later (`directory.check_resume`); with
  `module` (demo), a run of another config is refused here."""
  import importlib
  from fedjax_dg.run import config as config_lib
  from fedjax_dg.run import directory
  path = os.path.join(run_dir, "config.json")
  if not os.path.isdir(run_dir):
    raise ConfigError(f"--resume {run_dir}: no such run directory")
  if not os.path.isfile(path):
    if os.path.isfile(os.path.join(run_dir, directory.MANIFEST)):
      raise ConfigError(f"--resume {run_dir}: a sweep directory; continue it "
                        f"with: fedjax-dg sweep --resume {run_dir}")
    raise ConfigError(f"--resume {run_dir}: holds no config.json, so it is not "
                      "a run directory of fedjax-dg run / demo")
  cfg = config_lib.from_json(directory.read_json(path))
  if module:
    want = importlib.import_module(module).get_config().name
    if cfg.name != want:
      raise ConfigError(
          f"--resume {run_dir}: a run of name={cfg.name!r}, not of this demo "
          f"({want!r}): continue it with fedjax-dg run --resume {run_dir}")
  return config_lib.apply_overrides(cfg, overrides)


def _estimate(config_path: str | None, overrides: list[str],
              resume: str | None) -> int:
  """`run --estimate`: one measured round per algorithm, the protocol's
  memory per device, round time and total printed (`run.estimate`); no run
  directory."""
  from fedjax_dg.run import estimate
  if config_path is None or resume is not None:
    raise ConfigError("run --estimate needs --config experiments/<file>.py "
                      "(and no --resume): it costs that config's protocol")
  setup_jax()
  cfg = _config(config_path, overrides)
  for line in estimate.estimate(cfg, config_path=config_path,
                                sets=overrides).lines():
    print(line)
  return 0


def _run(config_path: str | None, overrides: list[str], resume: str | None,
         module: str | None = None, processes=None) -> int:
  """Runs an experiment file (`config_path`) or a packaged config (`module`);
  `resume` without `config_path`: the run directory's own config."""
  from fedjax_dg.run import experiment
  from fedjax_dg.report import run_summary
  if resume is None and config_path is None and module is None:
    raise ConfigError("run needs --config experiments/<file>.py (or --resume "
                      "DIR to continue a run directory)")
  setup_jax(processes)
  if resume is not None and config_path is None:
    cfg = _resume_config(resume, overrides, module)
  else:
    cfg = _config(config_path, overrides, module)
  results = experiment.run(cfg, run_dir=resume, resume=resume is not None)
  if not distributed.is_main():  # process 0 reports and writes
    return 0
  print()
  print(run_summary.terminal_summary(results))
  if run_summary.warnings_text(results):
    print(run_summary.warnings_text(results), file=sys.stderr)
  paths = run_summary.write_all(results, results["run_dir"])
  names = ["results.json"] + [os.path.relpath(p, results["run_dir"])
                              for p in paths]
  print(f"\nrun directory: {results['run_dir']}")
  print(textwrap.fill(f"wrote there: {', '.join(names)} (table.md: the full "
                      "table, best over rounds too)", run_summary.WIDTH,
                      subsequent_indent="  ", break_on_hyphens=False))
  return 0


def parser() -> argparse.ArgumentParser:
  """The `fedjax-dg` command's parser: every command and option (the docs'
  CLI reference is generated from it)."""
  parser = argparse.ArgumentParser(prog="fedjax-dg", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  p_run = sub.add_parser("run", help="run an experiment config")
  p_run.add_argument("--config", help="experiments/<file>.py (with --resume: "
                     "optional, the run directory's config.json is used)")
  p_run.add_argument("--estimate", action="store_true",
                     help="before booking a GPU: run ONE round of each "
                     "algorithm (at one local epoch) and print the full "
                     "protocol's memory per device, time per round and "
                     "estimated total (and its SWEEP's); writes no run "
                     "directory (not a dry run: it computes one round)")
  p_demo = sub.add_parser("demo", help="hFedF vs FedAvg on Rotated Fashion-MNIST")
  p_demo.add_argument("--full", action="store_true",
                      help=f"the paper-scale protocol ({FULL})")
  for p in (p_run, p_demo):
    p.add_argument("--resume", metavar="DIR", help="continue an interrupted "
                   "run directory with the config it stores (config.json); a "
                   "--config or --set that disagrees with it is refused")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.rounds=50")
  p_prep = sub.add_parser(
      "prepare", help="prepare a dataset once (TFDS array_record); `prepare "
      "folder --manual-dir DIR --name NAME`: a DomainBed-layout folder of yours")
  p_prep.add_argument("name", help="a dataset (see `fedjax-dg datasets`) or "
                      "'folder'")
  p_prep.add_argument("--manual-dir", default=None,
                      help="the raw data folder (<root>/<domain>/<class>/<image> "
                      "for DomainBed-layout datasets)")
  p_prep.add_argument("--name", dest="dataset_name", default=None,
                      help="with `prepare folder`: the new dataset's name")
  p_prep.add_argument("--force", action="store_true",
                      help="prepare again even if the prepared data look "
                      "current (their caches go too)")
  sub.add_parser("datasets", help="list the datasets (built-in and prepared "
                 "folders) and whether each is prepared")
  p_algs = sub.add_parser(
      "algorithms", help="list the algorithms and their settings; with "
      "--config, the MiB of one checkpoint of each on that config's model and "
      "federation (a markdown table)")
  p_algs.add_argument("--config", action="append", default=[],
                      help="experiments/<file>.py (repeat: a column each)")
  p_algs.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a field of every --config, as for run")
  p_algs.add_argument("--all", action="store_true", help="with --config: every "
                      "registered algorithm, not only the configs' own")
  p_part = sub.add_parser(
      "partition", help="the federation a run would build (no training): "
      "per-client counts by domain or class, as a table and a plot")
  p_part.add_argument("--config", required=True, help="experiments/<file>.py")
  p_part.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config field, as for run")
  p_part.add_argument("--by", choices=("domains", "classes"), default="domains",
                      help="count each client's training examples per domain "
                      "(default) or per class")
  p_part.add_argument("--plot", metavar="OUT.png",
                      help="also draw the counts, one panel per target domain")
  p_part.add_argument("--plot-kind", choices=("bar", "heatmap"), default="bar",
                      help="stacked bars per client (default) or a heatmap")
  sub.add_parser("doctor", help="is this machine ready? backend, devices, "
                 "versions, data; what to do for each problem (exit code 1 "
                 "when something required is missing; datasets are optional)")
  p_sweep = sub.add_parser(
      "sweep", help="grid values x seeds of a config, one run directory per cell")
  p_sweep.add_argument("--config", help="experiments/<file>.py")
  p_sweep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field in every cell")
  p_sweep.add_argument("--grid", action="append", default=[],
                       metavar="KEY=V1,V2",
                       help="sweep a field over values (| separates values that "
                       "hold commas); repeat for a cartesian product")
  p_sweep.add_argument("--seeds", help="comma-separated seeds, e.g. 0,1,2")
  p_sweep.add_argument("--out", help="the sweep directory (default: a new one "
                       "under output_dir)")
  p_sweep.add_argument("--resume", metavar="DIR",
                       help="continue a sweep: skip finished cells")
  p_sweep.add_argument("--replicas", type=int, default=0, metavar="R",
                       help="runs trained together as one program (replica "
                       "batches of seeds, targets, splits that share shapes): "
                       "at most R per batch; 0 (default): as many as fit in "
                       "memory; 1: one run after another")
  p_sweep.add_argument("--replica-mapping", default="auto",
                       choices=("auto", "map", "vmap", "shard"),
                       help="how a batch's replicas run: map (one after "
                       "another, each as it would run alone: the same numbers"
                       " bit for bit; auto on CPU), vmap (batched; auto on "
                       "GPU/TPU), shard (split over the devices; float order "
                       "differs)")
  p_sweep.add_argument("--part", metavar="I/N", default=None,
                       help="train the I-th of N blocks of the cells: N "
                       "processes or machines (a job array) share one --out "
                       "folder; each part resumes on its own (--resume DIR "
                       "--part I/N); the last to end writes the report")
  p_sweep.add_argument("--dry-run", action="store_true",
                       help="validate and list the cells, compute nothing")
  p_report = sub.add_parser(
      "report", help="paper-shaped tables (markdown + CSV) of a sweep or run "
      "directory; of several: one comparison table, a column group per directory")
  p_report.add_argument("dirs", nargs="+", metavar="DIR",
                        help="a sweep or run directory; several: compared "
                        "(one dataset, the same held-out targets)")
  p_report.add_argument("--out", help="output folder (default: DIR/report; "
                        "several DIRs: a new compare-<time> beside the first)")
  p_report.add_argument("--d", type=int, action="append", default=None,
                        help="d of the per-domain tables (default: every d; "
                        "one DIR only)")
  p_report.add_argument("--reference", metavar="NAME", default=None,
                        help="the algorithm (registry name, `fedjax-dg "
                        "algorithms`) every other is compared with: the "
                        "marks and differences.md (default: fedavg, where "
                        "DIR has it; a NAME must have a finished run in DIR; "
                        "one DIR only)")
  for p in (p_run, p_demo, p_sweep):
    distributed.add_flags(p)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = parser().parse_args(argv)
  try:
    if args.command == "prepare":
      import tensorflow_datasets as tfds
      from fedjax_dg.data import locations, sources
      tfds.disable_progress_bar()
      print(locations.data_dir_line())
      print(sources.prepare(args.name, manual_dir=args.manual_dir,
                            dataset_name=args.dataset_name, force=args.force))
      return 0
    if args.command == "datasets":
      from fedjax_dg.data import lookup
      print(lookup.describe_available())
      return 0
    if args.command == "partition":
      from fedjax_dg import federation_view
      return federation_view.main(args)
    if args.command == "doctor":
      from fedjax_dg import doctor
      return doctor.main()
    if args.command == "algorithms":
      from fedjax_dg import algorithms
      from fedjax_dg.run import disk
      if not args.config:
        print(algorithms.describe())
        return 0
      cfgs = [_config(path, args.set) for path in args.config]
      print(disk.checkpoint_table(
          cfgs, algorithms.available() if args.all else None))
      return 0
    if args.command == "demo":
      return _run(None, args.set, args.resume,
                  module=FULL if args.full else DEMO,
                  processes=distributed.from_args(args))
    if args.command == "report":
      from fedjax_dg.run import reports
      return reports.main_report(args)
    if args.command == "sweep":
      processes = distributed.from_args(args)
      folder = args.resume or args.out
      if folder and os.path.isdir(folder) and not (
          args.dry_run or processes.enabled):
        # A folder another sweep holds is refused before JAX is imported.
        from fedjax_dg.run import lock
        lock.check_free(folder, shared=args.part is not None)
      from fedjax_dg.run import sweep
      setup_jax(processes)
      return sweep.main_sweep(args)
    if args.estimate:
      return _estimate(args.config, args.set, args.resume)
    return _run(args.config, args.set, args.resume,
                processes=distributed.from_args(args))
  except ConfigError as e:  # a setting or input to fix; anything else is a bug
    print(f"fedjax-dg: error: {e}", file=sys.stderr)
    run_dir = getattr(e, "run_dir", None)  # errors.DiskFull
    if run_dir is not None:
      print("Once there is space, continue with:\n  "
            + resume_command(args, run_dir), file=sys.stderr)
    return 2
  except KeyboardInterrupt as e:
    run_dir = getattr(e, "run_dir", None)  # errors.Stopped
    if run_dir is None:
      print("\nfedjax-dg: stopped before a run directory was made: nothing to "
            "continue; run the same command again.", file=sys.stderr)
    else:
      print(f"\nfedjax-dg: stopped. Finished runs are in {run_dir} and every "
            "unfinished one has its last checkpoint; continue with:\n  "
            + resume_command(args, run_dir), file=sys.stderr)
    return 130


def resume_command(args, run_dir: str) -> str:
  """The command line (shell-quoted) that continues `run_dir` (a run or
  sweep directory of the parsed `args` of run / demo / sweep): its settings
  are in the directory (config.json, the sweep's manifest)."""
  words = ["fedjax-dg", args.command]
  if getattr(args, "full", False):
    words.append("--full")
  return shlex.join(words + ["--resume", run_dir])


if __name__ == "__main__":
  sys.exit(main())
