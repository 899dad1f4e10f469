"""Where a sweep's time goes (not a test): one `fedjax-dg sweep` in this
process, a timer around every phase of every run, and a per-phase table.

It measures which parts of a sweep are
paid once per run whatever its rounds (set-up, compile, evaluation compile,
checkpoints, reports) and which grow with the rounds, so the gain of sharing
one program between R runs can be read off.

The sweep runs as `fedjax-dg sweep` runs it (`sweep.run_sweep` into a
temporary directory, JAX set up by `cli.setup_jax`: one XLA:CPU device per
core and the persistent compilation cache, here a fresh empty one unless
`--jax-cache DIR`). The phases are timed by wrapping, inside this process
only, the module attributes the sweep calls (`assemble.load_dataset`,
`assemble.federate`, `engine.run`, the chunk and evaluation programs,
`Checkpointer.save` ...); no library code changes. Times are exclusive: a
phase's time excludes the phases timed inside it, and compilation
(`jax.monitoring`'s /jax/core/compile/ trace, lowering and backend-compile
spans, merged so nested traces count once) is taken out of the phase it
happened in and shown as its own rows. The chunk and evaluation results are
waited for (`block_until_ready`) so their time is theirs; orbax writes
checkpoints in a background thread, whose waiting shows at `close`.

Shapes (the exact commands of docs/results.md):

  table2  the hFedF Table 2 shape (experiments/table2.py, small CNN 16x16,
          400 per domain, 10 rounds, 3 targets: 21 runs a cell), cells
          d=1 seed 0 and d=1 seed 1 in this order (`--seeds`, `--d`)
  table1  the FedCCRL Table 1 shape (experiments/styled_fmnist_table1.py,
          9 methods), one target (`--target`) and `--rounds 2`; the
          per-chunk rows are also extrapolated to the config's 10 rounds

    nice -n 5 .venv/bin/python benchmarks/sweep_time.py table2
    nice -n 5 .venv/bin/python benchmarks/sweep_time.py table1 --rounds 2
    .venv/bin/python benchmarks/sweep_time.py table2 --seeds 0 --set train.rounds=2  # quick

Process start (`python -c "import ..."` of what `fedjax-dg sweep` imports,
JAX set up) is timed in subprocesses before the sweep, median of
`--import-reps`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# This checkout's fedjax_dg, not the one the venv installed (a worktree).
sys.path.insert(0, REPO)

SHAPES = dict(
    table2=dict(
        config="experiments/table2.py",
        sets=["data.targets=0,30,60", "model.name=small_cnn",
              "data.image_size=16", "data.max_per_domain=400",
              "train.epochs=1", "train.rounds=10", "train.eval_every=5",
              "train.ood_eval_max=0", "train.progress=False"],
        seeds="0,1", d="1"),
    table1=dict(
        config="experiments/styled_fmnist_table1.py",
        sets=["train.progress=False"], seeds="0", d=None),
)

# Table rows: (row, how often it is paid, scales with the chunks). A phase
# label maps to a row in `ROW_OF`; compile time maps by the phase it
# happened in (`COMPILE_ROW_OF`, default "compile: other").
ROWS = [
    ("process start + imports", "per process", False),
    ("sweep validation (sweep.check)", "per sweep", False),
    ("dataset load", "per cell", False),
    ("partition", "per cell", False),
    ("model + algorithm build", "per algorithm", False),
    ("run set-up (data to devices, init)", "per run", False),
    ("compile: rounds program", "per run", False),
    ("compile: eval program", "per run", False),
    ("compile: other (init, NaN guard, ...)", "per run", False),
    ("rounds (chunks, excl. compile)", "per round", True),
    ("NaN guard + metrics to host", "per chunk", True),
    ("eval between chunks", "per chunk", True),
    ("eval at the end", "per run", False),
    ("metrics.jsonl + TensorBoard", "per chunk", True),
    ("checkpoint save", "per chunk", True),
    ("checkpoint open / close / remove", "per run", False),
    ("results.json, config.json", "per run", False),
    ("table.md + figures (write_all)", "per cell", False),
    ("sweep report (write_report)", "per sweep", False),
    ("other (untimed)", "-", False),
]
ROW_OF = {
    "validate": "sweep validation (sweep.check)",
    "load": "dataset load", "partition": "partition",
    "model": "model + algorithm build", "algorithm": "model + algorithm build",
    "setup": "run set-up (data to devices, init)",
    "chunk": "rounds (chunks, excl. compile)",
    "guard": "NaN guard + metrics to host",
    "eval": "eval between chunks", "eval_final": "eval at the end",
    "log": "metrics.jsonl + TensorBoard",
    "ckpt_save": "checkpoint save", "ckpt": "checkpoint open / close / remove",
    "results": "results.json, config.json",
    "write_all": "table.md + figures (write_all)",
    "report": "sweep report (write_report)",
}
COMPILE_ROW_OF = {"chunk": "compile: rounds program",
                  "eval": "compile: eval program",
                  "eval_final": "compile: eval program"}
COMPILE_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
                  "/jax/core/compile/backend_compile_duration": "xla"}


class Timeline:
  """Phase intervals (label, cell, run, start, end) and compile spans, all on
  `time.time()` (the clock of jax.monitoring's spans), turned into exclusive
  seconds by `exclusive`."""

  def __init__(self):
    self.phases, self.spans, self.counts, self.modules = [], [], [], []
    self.cell, self.run = "sweep", None

  @contextlib.contextmanager
  def phase(self, label: str):
    start = time.time()
    try:
      yield
    finally:
      self.phases.append((label, self.cell, self.run, start, time.time()))

  def timed(self, label: str, fn, block: bool = False):
    """`fn` wrapped in `phase(label)`; `block`: waits for its jax results."""
    import jax

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
      with self.phase(label):
        out = fn(*args, **kwargs)
        return jax.block_until_ready(out) if block else out
    return wrapper

  def on_span(self, event: str, start: float, end: float, **_):
    if event in COMPILE_EVENTS:
      self.spans.append((COMPILE_EVENTS[event], start, end))

  def on_event(self, event: str, **_):
    if event.startswith("/jax/compilation_cache/cache_"):
      self.counts.append((self.cell, event.rsplit("/", 1)[1]))

  def on_duration(self, event: str, secs: float, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      self.counts.append((self.cell, "xla_compiles"))
    elif event == "/jax/core/compile/jaxpr_trace_duration":
      self.counts.append((self.cell, "traces"))
    elif event == "/jax/compilation_cache/cache_retrieval_time_sec":
      self.counts.append((self.cell, ("retrieval_s", secs)))

  def on_log(self, record) -> None:
    """jax's persistent-cache hit / miss log lines: (cell, hit?, module)."""
    msg = record.getMessage()
    if "ersistent compilation cache hit" in msg or "CACHE MISS" in msg:
      self.modules.append((self.cell, "hit" in msg, msg.split("'")[1]))

  def exclusive(self) -> dict:
    """{(cell, run, label, compile kind or None): seconds}: each instant goes
    to the innermost open phase, as compile time of `kind` (xla over lower
    over trace) while a compile span is open."""
    marks = []
    for i, (_, _, _, s, e) in enumerate(self.phases):
      marks += [(s, 1, "p", i), (e, 0, "p", i)]
    for kind, s, e in self.spans:
      marks += [(s, 1, kind, None), (e, 0, kind, None)]
    marks.sort(key=lambda m: (m[0], m[1]))
    # Phases end in the order they were entered in reverse (one thread): the
    # innermost open phase is the latest-started one still open.
    open_, depth, out, prev = [], dict(trace=0, lower=0, xla=0), {}, None
    for t, starting, what, i in marks:
      if prev is not None and t > prev and open_:
        label, cell, run, _, _ = self.phases[max(open_, key=lambda j: self.phases[j][3])]
        kind = next((k for k in ("xla", "lower", "trace") if depth[k]), None)
        key = (cell, run, label, kind)
        out[key] = out.get(key, 0.0) + t - prev
      prev = t
      if what == "p":
        open_.append(i) if starting else open_.remove(i)
      else:
        depth[what] += 1 if starting else -1
    return out


def instrument(tl: Timeline) -> None:
  """Wraps, in this process, what a sweep calls with `tl`'s timers."""
  from fedjax_dg import engine
  from fedjax_dg.engine import checkpoint, placement, runner
  from fedjax_dg.report import metrics_log, run_summary
  from fedjax_dg.run import assemble, directory, experiment, reports, sweep

  assemble.load_dataset = tl.timed("load", assemble.load_dataset)
  assemble.federate = tl.timed("partition", assemble.federate)
  sweep.check = tl.timed("validate", sweep.check)

  def builder(label, fn):  # a build belongs to no run: the next run's set-up
    def wrapper(*args, **kwargs):
      tl.run = None
      return tl.timed(label, fn)(*args, **kwargs)
    return wrapper
  assemble.make_model = builder("model", assemble.make_model)
  assemble.algorithm = builder("algorithm", assemble.algorithm)

  cell_run = experiment.run

  def run_cell(cfg, run_dir=None, **kwargs):
    tl.cell, tl.run = os.path.basename(run_dir), None
    with tl.phase("cell"):
      return cell_run(cfg, run_dir, **kwargs)
  experiment.run = run_cell

  engine_run = engine.run

  def run_one(alg, data, model, cfg, *, checkpoint_dir=None, on_eval=None):
    tl.run = os.path.basename(checkpoint_dir or alg.name)
    with tl.phase("setup"):
      return engine_run(alg, data, model, cfg, checkpoint_dir=checkpoint_dir,
                        on_eval=on_eval)
  engine.run = run_one

  make_programs = runner.programs

  def programs(*args, **kwargs):
    progs = make_programs(*args, **kwargs)
    return progs._replace(chunk=tl.timed("chunk", progs.chunk, block=True))
  runner.programs = programs
  runner._nonfinite = tl.timed("guard", runner._nonfinite)

  for store in (placement.DeviceStore, placement.HostStore):
    evaluate = store.evaluate

    def timed_eval(self, state, frozen, ood, details=False, _evaluate=evaluate):
      label = "eval_final" if details else "eval"
      return tl.timed(label, _evaluate, block=True)(self, state, frozen, ood,
                                                    details=details)
    store.evaluate = timed_eval
    store.initial = tl.timed("setup", store.initial, block=True)

  ckpt = checkpoint.Checkpointer
  ckpt.save = tl.timed("ckpt_save", ckpt.save)
  ckpt.__init__ = tl.timed("ckpt", ckpt.__init__)
  ckpt.close = tl.timed("ckpt", ckpt.close)
  experiment.shutil = types.SimpleNamespace(
      rmtree=tl.timed("ckpt", shutil.rmtree))

  metrics_log.RunLog.log = tl.timed("log", metrics_log.RunLog.log)
  metrics_log.RunLog.sync = tl.timed("log", metrics_log.RunLog.sync)
  metrics_log.RunLog.close = tl.timed("log", metrics_log.RunLog.close)
  directory.write_results = tl.timed("results", directory.write_results)
  directory.write_start = tl.timed("results", directory.write_start)
  run_summary.write_all = tl.timed("write_all", run_summary.write_all)
  write_report = reports.write_report

  def report(*args, **kwargs):
    tl.cell, tl.run = "sweep", None
    return tl.timed("report", write_report)(*args, **kwargs)
  reports.write_report = report


def process_start(reps: int) -> list[float]:
  """Seconds of a fresh interpreter importing what `fedjax-dg sweep` imports
  and setting JAX up (devices made), `reps` times."""
  code = ("import fedjax_dg, jax; from fedjax_dg import cli; "
          "from fedjax_dg.run import sweep; cli.setup_jax(); jax.devices()")
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
    times.append(time.perf_counter() - t0)
  return times


def rss_gib() -> float:
  """Peak resident memory of this process so far (ru_maxrss: KiB on Linux)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def table(tl: Timeline, start_s: float, scale: float | None,
          cells: list[str]) -> tuple[str, dict]:
  """The per-phase table (markdown) and its numbers."""
  excl = tl.exclusive()
  sums = {}   # (cell, row) -> seconds
  runs = {}   # (cell, run) -> {row: seconds}
  compile_kinds, compile_where = {}, {}
  for (cell, run, label, kind), secs in excl.items():
    if kind is not None:
      where = (cell, label)
      compile_where[where] = compile_where.get(where, 0.0) + secs
      row = COMPILE_ROW_OF.get(label, "compile: other (init, NaN guard, ...)")
      compile_kinds[(cell, kind)] = compile_kinds.get((cell, kind), 0.0) + secs
    else:
      row = ROW_OF.get(label, "other (untimed)")
    sums[(cell, row)] = sums.get((cell, row), 0.0) + secs
    if run is not None:
      per = runs.setdefault((cell, run), {})
      per[row] = per.get(row, 0.0) + secs
  sums[("process", "process start + imports")] = start_s
  # The sweep's own phases (validation, report, manifests) in one column.
  columns = ["sweep"] + cells
  wall = {c: sum(v for (cc, _), v in sums.items() if cc == c) for c in columns}
  head = ["phase", "paid"]
  for c in columns:
    head += [f"{c} s", "share"]
  head += [f"per run mean / median s ({cells[0]})"]
  if scale:
    head += [f"{cells[0]} s, extrapolated", "share"]
  lines = ["| " + " | ".join(head) + " |",
           "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
  scaled = {}
  for row, paid, chunks in ROWS:
    scaled[row] = sums.get((cells[0], row), 0.0) * (scale if chunks and scale else 1)
  total_scaled = sum(scaled.values())
  numbers = dict(rows={}, wall=wall, compile_kinds={
      f"{c}/{k}": v for (c, k), v in compile_kinds.items()}, compile_where={
      f"{c}/{k}": v for (c, k), v in compile_where.items()})
  for row, paid, chunks in ROWS:
    if row == "process start + imports":
      cols = [f"{start_s:.1f} (1 process)", "-"] + ["", ""] * (len(columns) - 1)
    else:
      cols = []
      for c in columns:
        v = sums.get((c, row))
        cols += (["", ""] if v is None else
                 [f"{v:.1f}", f"{100 * v / wall[c]:.0f} %" if wall[c] else "-"])
    vals = [per.get(row, 0.0) for (c, _), per in runs.items() if c == cells[0]]
    med = statistics.median(vals) if vals and any(vals) else None
    cols.append("" if med is None else
                f"{statistics.mean(vals):.2f} / {med:.2f}")
    if scale and (cells[0], row) not in sums:
      cols += ["", ""]
    elif scale:
      cols += [f"{scaled[row]:.1f}",
               f"{100 * scaled[row] / total_scaled:.0f} %" if total_scaled else "-"]
    if any(c not in ("", "-") for c in cols[:-1 - (2 if scale else 0)]) or med:
      lines.append(f"| {row} | {paid} | " + " | ".join(cols) + " |")
    numbers["rows"][row] = dict(paid=paid, **{
        c: sums.get((c, row)) for c in columns}, per_run_median=med,
        per_run_mean=statistics.mean(vals) if vals else None,
        extrapolated=scaled[row] if scale else None)
  tot = ["**all**", ""]
  for c in columns:
    tot += [f"**{wall[c]:.1f}**", "100 %"]
  per_run = [sum(p.values()) for (c, _), p in runs.items() if c == cells[0]]
  tot.append(f"{statistics.mean(per_run):.2f} / {statistics.median(per_run):.2f}"
             f" ({len(per_run)} runs)" if per_run else "")
  if scale:
    tot += [f"**{total_scaled:.1f}**", "100 %"]
  lines.append("| " + " | ".join(tot) + " |")
  numbers["runs"] = {f"{c}/{r}": per for (c, r), per in runs.items()}
  return "\n".join(lines), numbers


def by_algorithm(runs: dict, cell: str) -> str:
  """Per algorithm, its runs of `cell` (mean over targets): compile, rounds,
  the rest; where the fixed part of a run is large and where it is not."""
  groups = {}
  for key, per in runs.items():
    c, run = key.split("/", 1)
    if c == cell:
      groups.setdefault(run.split("--")[0], []).append(per)
  lines = ["| algorithm | runs | compile s | rounds s | rest s | run s | "
           "rounds share |", "|---|---:|---:|---:|---:|---:|---:|"]
  for name, pers in groups.items():
    comp = statistics.mean(sum(v for k, v in p.items() if k.startswith("compile"))
                           for p in pers)
    rounds = statistics.mean(p.get("rounds (chunks, excl. compile)", 0.0)
                             for p in pers)
    total = statistics.mean(sum(p.values()) for p in pers)
    lines.append(f"| {name} | {len(pers)} | {comp:.2f} | {rounds:.2f} | "
                 f"{total - comp - rounds:.2f} | {total:.2f} | "
                 f"{100 * rounds / total:.0f} % |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("shape", choices=sorted(SHAPES))
  p.add_argument("--seeds", help="comma-separated seeds, one cell each "
                 "(table2: 0,1; table1: 0)")
  p.add_argument("--d", help="table2: the data.d of the cells (default 1)")
  p.add_argument("--target", default="gray",
                 help="table1: the one held-out domain (default gray)")
  p.add_argument("--rounds", type=int, default=2,
                 help="table1: rounds run (the rest extrapolated to the "
                 "config's train.rounds); table2 runs its 10")
  p.add_argument("--set", action="append", default=[],
                 help="more key=value overrides, after the shape's")
  p.add_argument("--jax-cache", default="fresh",
                 help="the persistent compilation cache: 'fresh' (an empty "
                 "temporary directory, as a first sweep) or a directory")
  p.add_argument("--import-reps", type=int, default=3)
  p.add_argument("--keep", help="leave the sweep directory here (default: a "
                 "temporary directory, removed)")
  p.add_argument("--json", help="also write the numbers here")
  args = p.parse_args(argv)

  shape = SHAPES[args.shape]
  sets = list(shape["sets"])
  grid = []
  scale, full_rounds = None, None
  if args.shape == "table2":
    grid = [("data.d", [args.d or shape["d"]])]
  else:
    sets += [f"data.targets={args.target}", f"train.rounds={args.rounds}"]
  sets += args.set
  seeds = [int(s) for s in (args.seeds or shape["seeds"]).split(",")]

  load_before = os.getloadavg()
  print(f"# sweep_time {args.shape}: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load average before {load_before}", flush=True)
  starts = process_start(args.import_reps)
  start_s = statistics.median(starts)
  print(f"# process start + imports: {', '.join(f'{t:.2f}' for t in starts)} s "
        f"(median {start_s:.2f})", flush=True)

  tmp = tempfile.mkdtemp(prefix="sweep_time-")
  if args.jax_cache == "fresh":
    os.environ["FEDJAX_DG_JAX_CACHE"] = os.path.join(tmp, "jax_cache")
  else:
    os.environ["FEDJAX_DG_JAX_CACHE"] = args.jax_cache
  t_import = time.perf_counter()
  # Imported here, after the process-start timing and with the cache set.
  import jax
  import fedjax_dg
  from fedjax_dg import cli
  from fedjax_dg.run import config as config_lib
  from fedjax_dg.run import sweep
  cli.setup_jax()
  print(f"# jax {jax.__version__}, {len(jax.devices())} devices "
        f"({jax.devices()[0].platform}), compilation cache "
        f"{os.environ['FEDJAX_DG_JAX_CACHE']}; {fedjax_dg.__file__}; imports in this process "
        f"{time.perf_counter() - t_import:.1f} s", flush=True)
  config_path = os.path.join(REPO, shape["config"])
  if args.shape == "table1":
    base = config_lib.apply_overrides(config_lib.load(config_path), args.set)
    full_rounds, every = int(base.train.rounds), int(base.train.eval_every)
    scale = math.ceil(full_rounds / every) / math.ceil(args.rounds / every)
    if full_rounds / args.rounds != scale:
      print(f"# note: rounds scale {full_rounds / args.rounds:.2f}, chunks "
            f"scale {scale:.2f}; the table scales every per-chunk row by the "
            "chunks", flush=True)

  tl = Timeline()
  jax.monitoring.register_event_time_span_listener(tl.on_span)
  jax.monitoring.register_event_listener(tl.on_event)
  jax.monitoring.register_event_duration_secs_listener(tl.on_duration)
  instrument(tl)
  handler = logging.Handler(logging.DEBUG)
  handler.emit = tl.on_log
  compiler_log = logging.getLogger("jax._src.compiler")
  compiler_log.setLevel(logging.DEBUG)
  compiler_log.addHandler(handler)
  compiler_log.propagate = False
  out = args.keep or os.path.join(tmp, "sweep")
  rss_cells = {}

  def echo(line):
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)
    if "done in" in line or "FAILED" in line:
      rss_cells[tl.cell] = rss_gib()

  cpu0, t0 = os.times(), time.perf_counter()
  print(f"# fedjax-dg sweep --config {shape['config']} "
        + " ".join(f"--set {s}" for s in sets)
        + "".join(f" --grid {k}={','.join(v)}" for k, v in grid)
        + f" --seeds {','.join(map(str, seeds))}", flush=True)
  with tl.phase("sweep"):
    _, failed = sweep.run_sweep(config_path, sets, grid, seeds, out=out,
                                echo=echo)
  wall = time.perf_counter() - t0
  cpu1 = os.times()
  cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
  cells = [c for c in dict.fromkeys(p[1] for p in tl.phases)
           if c not in ("sweep",)]
  md, numbers = table(tl, start_s, scale, cells)
  print()
  if scale:
    print(f"Measured with train.rounds={args.rounds}; 'extrapolated': every "
          f"per-round / per-chunk row x {scale:g} for the config's "
          f"{full_rounds} rounds (linear; compile and per-run rows as measured).")
  print(md)
  print()
  for c in cells:
    print(f"Per algorithm in {c} (mean over its runs; compile is paid by the "
          "first run of each algorithm in a cell):")
    print(by_algorithm(numbers["runs"], c))
    print()
  for c in cells + ["sweep"]:
    kinds = {k: numbers["compile_kinds"].get(f"{c}/{k}", 0.0)
             for k in ("trace", "lower", "xla")}
    counts = [what for cc, what in tl.counts if cc == c]
    retrieval = sum(w[1] for w in counts if isinstance(w, tuple))
    print(f"compile in {c}: trace {kinds['trace']:.1f} s, lowering "
          f"{kinds['lower']:.1f} s, XLA backend {kinds['xla']:.1f} s "
          f"(incl. persistent-cache reads {retrieval:.1f} s); traces "
          f"{counts.count('traces')}, XLA compiles "
          f"{counts.count('xla_compiles')}, persistent cache hits "
          f"{counts.count('cache_hits')}, misses {counts.count('cache_misses')}"
          "; by the phase it happened in: " + ", ".join(
              f"{k.split('/', 1)[1]} {v:.1f} s"
              for k, v in sorted(numbers["compile_where"].items())
              if k.startswith(c + "/")))
  first = {m for c, _, m in tl.modules if c == cells[0]}
  for c in cells[1:]:
    again = sorted({m for cc, hit, m in tl.modules if cc == c and not hit
                    and m in first})
    print(f"persistent-cache misses in {c} of programs {cells[0]} compiled "
          f"too (the same program, another HLO): {len(again)}: "
          + ", ".join(again))
  for c in cells:
    if c in rss_cells:
      print(f"peak RSS after {c}: {rss_cells[c]:.2f} GiB")
  load_after = os.getloadavg()
  print(f"sweep wall {wall:.1f} s, process CPU {cpu:.1f} s ({cpu / wall:.2f} "
        f"cores), failed cells {failed}; peak RSS {rss_gib():.2f} GiB; load "
        f"average before {load_before}, after {load_after}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(shape=args.shape, sets=sets, seeds=seeds, grid=grid,
                     process_start=starts, sweep_wall=wall, cpu=cpu,
                     peak_rss_gib=rss_gib(), rss_after_cell=rss_cells,
                     load_before=load_before, load_after=load_after,
                     **numbers), f, indent=1)
  if not args.keep:
    shutil.rmtree(tmp, ignore_errors=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
