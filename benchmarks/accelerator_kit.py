"""The accelerator kit: the commands that measure, on one GPU, what
docs/benchmarks.md's "GPU measurements" section reports, and write it to
docs/bench-logs/<date>/. It runs in two parts, each one command
of at most 8 minutes (`--part 1`, `--part 2`): the first GPU run (H200,
2026-11-27) showed that compiling alone takes 10-33 s per program, and the
kit compiles about 30 of them.

Everything is prepared here so that a short session on a GPU measures: the
kit only runs the existing benchmark scripts, each step a subprocess with its
arguments, its own time budget and its own log:

  part 1
  round_<alg>_C<C> one FedAvg / hFedF round of the Table 9 Inception CNN at
                  32 px, 10 local steps of batch 64 per client, C = 64, 256,
                  1,024 (benchmarks/round_time.py, its variants' processes
                  started at once): the engine vmapped in float32 and with
                  `model.dtype="bfloat16"`, the jitted per-client loop, and
                  PyTorch (torch_reference.py, on the GPU); medians of 2
                  timed rounds, the first (compiling) round's time, and
                  ratios to the float32 engine
  part 2
  demo            the demo's job as `make demo` runs it after setup:
                  `fedjax-dg prepare rotated_fashion_mnist` then `fedjax-dg
                  demo`, each timed (`make demo` itself would first build
                  .venv with pip, which a machine without network cannot;
                  the setup is not timed)
  scale           benchmarks/scale.py at N = 100 and 10,000 clients (cohort
                  100): round time and device memory, FedAvg and Local-only,
                  host and device placement; ratios N = 10,000 / N = 100
  fedsdaf         benchmarks/fedsdaf.py's round at C = 16 with ViT-B/16 at
                  224 px (random weights: cost, not accuracy), FedSDAF
                  against FedAvg (Adapter)

What is not there is said, never crashed on: without torch the PyTorch rows
say "torch not installed" (the kit never installs anything), on a checkout
without `model.dtype` the bf16 rows say so; the hFedF loop and PyTorch rows
are not run where their C per-client hypernetwork gradients (181 MiB each)
would not fit in 60 % of the device's memory (the engine holds none), nor
FedAvg's PyTorch row at C = 1,024 (10,240 steps one after another a round).

Budgets: each step has one (`BUDGETS`, `--budget STEP=S`), unused seconds
roll over to the next, and the kit stops at `--deadline` (480 s a part): a
step that would start with too little time left is skipped with a note; a
step past its budget is killed and keeps what its log holds (round_time's
timed rounds as they came). The summary (kit_summary.json and .md) is
rewritten after every step, so a kit stopped at any point keeps what it
measured.

    python benchmarks/accelerator_kit.py --part 1             # on the GPU
    python benchmarks/accelerator_kit.py --part 2             # on the GPU
    python benchmarks/accelerator_kit.py --dry-run            # CPU, tiny sizes
    python benchmarks/accelerator_kit.py --steps demo,round_fedavg --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # this checkout's fedjax_dg, not an installed one
from fedjax_dg.run import config as run_config  # noqa: E402
DEADLINE_S = 480         # per part: one part fits one 8-minute device call
# Seconds per step on the GPU; a dry run gives every step DRY_BUDGET_S. From
# the first GPU run (H200, 2026-11-27, docs/bench-logs/2026-11-27/kit_h200_run1/):
# each round_time variant took 19-44 s to be ready (set-up 8-11 s, the
# compiling warm-up round 10-33 s), the demo's prepare 35 s and its first
# three targets 65 s; the first budgets (35-100 s a step, all variants
# started one after another) measured no timed round at all.
BUDGETS = {"demo": 240, "round_fedavg_C64": 60, "round_hfedf_C64": 80,
           "round_fedavg_C256": 75, "round_hfedf_C256": 100,
           "round_fedavg_C1024": 90, "round_hfedf_C1024": 75, "scale": 100,
           "fedsdaf": 130}
# The kit in two parts, each one command of at most DEADLINE_S: 15 minutes on
# a GPU run one with room for a rerun, or both back to back.
PARTS = {"1": "round", "2": "demo,scale,fedsdaf"}
DRY_BUDGET_S = 120
MIN_STEP_S = 15          # a step starting with less than this is skipped
# One hFedF hypernetwork gradient of the Inception CNN (47.3 M parameters,
# docs/benchmarks.md "Server steps"): the loop and PyTorch hold C of them.
HFEDF_GRAD_GIB = 181 / 1024
ALG_NAMES = {"fedavg": "FedAvg", "hfedf": "hFedF"}
ROUND_VARIANTS = ("engine", "engine_bf16", "loop", "torch")
VARIANT_NAMES = {"engine": "engine fp32 (vmap)", "engine_bf16": "engine bf16 (vmap)",
                 "loop": "jitted per-client loop", "torch": "PyTorch"}


@dataclasses.dataclass(frozen=True)
class Sizes:
  """What one mode measures: the GPU's sizes or the dry run's tiny ones."""
  clients: tuple[int, ...]
  round_args: tuple[str, ...]        # round_time.py: model, image size, steps
  reps: tuple[int, ...]              # timed rounds per variant, per C
  scale_args: tuple[str, ...]
  scale_clients: tuple[int, int]     # N: the first is the ratios' base
  scale_algorithms: tuple[str, ...]
  scale_placements: tuple[str, ...]
  fedsdaf_args: tuple[str, ...]
  fedsdaf_clients: int
  demo_sets: tuple[str, ...]         # --set of `fedjax-dg demo`


GPU_SIZES = Sizes(
    clients=(64, 256, 1024),
    round_args=("--model", "inception_cnn", "--size", "32", "--steps", "10"),
    reps=(2, 2, 2),
    scale_args=("--data", "random", "--cohort", "100", "--per-client", "64",
                "--rounds", "5", "--reps", "2"),
    scale_clients=(100, 10_000),
    scale_algorithms=("fedavg", "local_only"),
    scale_placements=("host", "device"),
    fedsdaf_args=("--size", "224", "--patch", "16", "--dim", "768", "--depth",
                  "12", "--heads", "12", "--mlp-ratio", "4", "--per-client",
                  "32", "--batch", "16", "--reps", "2"),
    fedsdaf_clients=16,
    demo_sets=())

DRY_SIZES = Sizes(
    clients=(2,),
    round_args=("--model", "mlp", "--size", "8", "--steps", "1"),
    reps=(1,),
    scale_args=("--data", "random", "--cohort", "4", "--per-client", "8",
                "--batch", "4", "--epochs", "1", "--rounds", "2", "--reps", "1"),
    scale_clients=(10, 40),
    scale_algorithms=("fedavg",),
    scale_placements=("host",),
    fedsdaf_args=("--size", "16", "--patch", "8", "--dim", "16", "--depth", "1",
                  "--heads", "2", "--mlp-ratio", "2", "--per-client", "8",
                  "--batch", "8", "--reps", "1"),
    fedsdaf_clients=2,
    demo_sets=("train.rounds=1", "train.eval_every=1", "data.max_per_domain=40",
               "data.image_size=8", "data.targets=0", "algorithms=fedavg"))


# ------------------------------------------------------------------- machine


def _run_text(argv: list[str]) -> str:
  try:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30,
                          cwd=ROOT).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def machine() -> dict:
  """What the numbers were measured on and with, read without starting JAX
  (the kit's own process must not take the GPU)."""
  gpu = _run_text(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                   "--format=csv,noheader,nounits"]).splitlines()
  name, mem_mib, driver = ([s.strip() for s in gpu[0].split(",")] + ["", ""])[:3] \
      if gpu else ("", "0", "")
  with open("/proc/meminfo") as f:
    host_gib = int(f.readline().split()[1]) / 2**20
  versions = {}
  for pkg in ("jax", "jaxlib", "flax", "optax", "torch"):
    try:
      versions[pkg] = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      versions[pkg] = "not installed"
  dirty = bool(_run_text(["git", "status", "--porcelain", "--untracked-files=no"]))
  with open("/proc/cpuinfo") as f:
    cpu = next((line.split(":", 1)[1].strip() for line in f
                if line.startswith("model name")), platform.machine())
  return dict(
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      commit=_run_text(["git", "rev-parse", "HEAD"]), dirty=dirty,
      gpu=name, gpu_memory_gib=float(mem_mib or 0) / 1024, driver=driver,
      cpu=cpu, cores=os.cpu_count(), host_memory_gib=host_gib,
      load_average=os.getloadavg()[0], python=platform.python_version(),
      versions=versions,
      torch=importlib.util.find_spec("torch") is not None,
      bf16="dtype" in run_config.base_config().model)


# ---------------------------------------------------------------------- plan


@dataclasses.dataclass
class Step:
  """One measurement: its subprocesses (argv lists, run in order), how its
  log becomes rows, and the rows it promises (ids), each with a note where
  it will not be measured (torch absent, bf16 absent, no memory)."""
  name: str
  commands: list[list[str]]
  parse: object                      # (log text, Step) -> list of rows
  rows: dict                         # id -> row skeleton
  env: dict = dataclasses.field(default_factory=dict)


def _row(row_id: str, what: str, variant: str, note: str = "") -> dict:
  return dict(id=row_id, what=what, variant=variant, measures={}, note=note,
              ratio_of="")


def round_steps(sizes: Sizes, facts: dict, dry: bool) -> list[Step]:
  """round_time.py once per (algorithm, C): the variants side by side in one
  call (its workers alternate their timed rounds)."""
  steps = []
  memory_gib = facts["gpu_memory_gib"] or facts["host_memory_gib"]
  for c, reps in zip(sizes.clients, sizes.reps):
    for alg in ("fedavg", "hfedf"):
      what = f"{ALG_NAMES[alg]} round, C = {c:,}"
      notes = {}
      if not facts["bf16"]:
        notes["engine_bf16"] = "bf16: model.dtype not available in this checkout"
      if not facts["torch"]:
        notes["torch"] = "torch not installed"
      elif dry:
        notes["torch"] = ("not run in a dry run: the PyTorch reference is the "
                          "Inception CNN, the dry run's model the MLP")
      if alg == "fedavg" and not dry and c >= 1024:
        notes.setdefault("torch", f"not run at C = {c:,}: {c * 10:,} PyTorch "
                         "steps one after another a round; C = 256 gives "
                         "its ratio")
      need = c * HFEDF_GRAD_GIB
      if alg == "hfedf" and not dry and need > 0.6 * memory_gib:
        for v in ("loop", "torch"):
          notes.setdefault(v, f"not run: its {c:,} per-client hypernetwork "
                           f"gradients need ~{need:.0f} GiB, over 60 % of "
                           f"the device's {memory_gib:.0f} GiB")
      run = [v for v in ROUND_VARIANTS if v not in notes]
      name = f"round_{alg}_C{c}"
      rows = {f"{name}/{v}": _row(f"{name}/{v}", what, VARIANT_NAMES[v],
                                  notes.get(v, "")) for v in ROUND_VARIANTS}
      cmd = [sys.executable, os.path.join(HERE, "round_time.py"), "--algs", alg,
             "--clients", str(c), "--variants", *run, "--reps", str(reps),
             "--reps-large", str(reps), "--mapping", "vmap", "--cpu-devices",
             "1", "--no-diagnose", "--parallel-start", "--torch-device",
             "cuda" if facts["gpu"] else "cpu", *sizes.round_args]
      steps.append(Step(name, [cmd], parse_round, rows))
  return steps


def plan(sizes: Sizes, facts: dict, dry: bool, scratch: str) -> list[Step]:
  """Every step of a run, in the order they run."""
  demo_out = os.path.join(scratch, "demo_runs")
  demo_sets = [a for s in sizes.demo_sets + (f"output_dir={demo_out}",)
               for a in ("--set", s)]
  cli = [sys.executable, "-m", "fedjax_dg.cli"]
  demo = Step("demo", [cli + ["prepare", "rotated_fashion_mnist"],
                       cli + ["demo"] + demo_sets], parse_demo,
              {"demo/prepare": _row("demo/prepare", "`make demo`'s job",
                                    "fedjax-dg prepare rotated_fashion_mnist"),
               "demo/demo": _row("demo/demo", "`make demo`'s job",
                                 "fedjax-dg demo" + (" (dry-run sizes)" if dry
                                                     else ""))})
  n0, n1 = sizes.scale_clients
  scale_rows = {f"scale/{a}/{p}/{n}": _row(
      f"scale/{a}/{p}/{n}", f"scale, N = {n0:,} and {n1:,} (one cohort size)",
      f"{a}, {p} placement, N = {n:,}") for a in sizes.scale_algorithms
      for p in sizes.scale_placements for n in (n0, n1)}
  scale = Step("scale", [[sys.executable, os.path.join(HERE, "scale.py"),
                          "--clients", str(n0), str(n1), *sizes.scale_args,
                          "--algorithms", *sizes.scale_algorithms,
                          "--placements", *sizes.scale_placements]],
               parse_scale, scale_rows)
  vit = "ViT-B/16, 224 px" if not dry else "tiny ViT (dry run)"
  c = sizes.fedsdaf_clients
  fedsdaf = Step("fedsdaf", [[sys.executable, os.path.join(HERE, "fedsdaf.py"),
                              "round", *sizes.fedsdaf_args, "--clients", str(c),
                              "--variants", "fedavg_adapter", "fedsdaf",
                              "--no-torch"]],
                 parse_fedsdaf,
                 {f"fedsdaf/{v}": _row(f"fedsdaf/{v}", f"FedSDAF round, C = {c}, "
                                       f"{vit}", v)
                  for v in ("fedavg_adapter", "fedsdaf")})
  return [demo] + round_steps(sizes, facts, dry) + [scale, fedsdaf]


def select(steps: list[Step], wanted: str) -> list[Step]:
  """The steps whose name is, or starts with, one of the comma-separated
  `wanted` ("round" = every round step); "" = all."""
  if not wanted:
    return steps
  keys = [w.strip() for w in wanted.split(",") if w.strip()]
  bad = [k for k in keys if not any(s.name.startswith(k) for s in steps)]
  if bad:
    raise SystemExit(f"--steps {','.join(bad)}: no such step; the steps: "
                     + ", ".join(s.name for s in steps))
  return [s for s in steps if any(s.name.startswith(k) for k in keys)]


# ------------------------------------------------------------------- parsing


def _median(values):
  return statistics.median(values) if values else float("nan")


def parse_demo(log: str, step: Step, walls: list[float]) -> list[dict]:
  """The wall time of each command that finished (exit code 0)."""
  rows = []
  for row, wall in zip(step.rows.values(), walls):
    rows.append(dict(row, measures=dict(wall_s=wall)))
  return rows


ROUND_REP = re.compile(r"^\[(\w+) C=(\d+) (\w+)\] rep \d+/\d+: ([0-9.]+) s", re.M)
ROUND_READY = re.compile(
    r"^\[(\w+) C=(\d+) (\w+)\] ready in .*?warm-up round ([0-9.]+) s", re.M)
ROUND_ERROR = re.compile(r"^\[(\w+) C=(\d+) (\w+)\] .*?ERROR (.+)$", re.M)


def parse_round(log: str, step: Step, walls: list[float]) -> list[dict]:
  """round_time.py's timed rounds as its log printed them (as they came, so
  a step killed at its budget keeps its rounds), medians and ratios to the
  float32 engine."""
  del walls
  times, errors = {}, {}
  for alg, c, variant, seconds in ROUND_REP.findall(log):
    times.setdefault(variant, []).append(float(seconds))
  for alg, c, variant, why in ROUND_ERROR.findall(log):
    errors[variant] = why.strip()
  first = {variant: float(s) for _, _, variant, s in ROUND_READY.findall(log)}
  base = _median(times.get("engine", []))
  rows = []
  for row_id, row in step.rows.items():
    variant = row_id.rsplit("/", 1)[1]
    ts = times.get(variant, [])
    if row["note"] or not ts:
      rows.append(dict(row, note=row["note"] or errors.get(variant, "")))
      continue
    med = _median(ts)
    measures = dict(median_s=med, rounds=len(ts))
    if variant in first:       # the warm-up round: compiles, first touches
      measures["first_round_s"] = first[variant]
    ratio_of = ""
    if variant == "engine_bf16":
      measures["ratio"], ratio_of = base / med, "fp32 / bf16"
    elif variant != "engine":
      measures["ratio"], ratio_of = med / base, f"{variant} / engine fp32"
    rows.append(dict(row, measures={k: v for k, v in measures.items()
                                    if v == v}, ratio_of=ratio_of))
  return rows


def _json_line(log: str) -> dict | None:
  lines = [l for l in log.splitlines() if l.startswith("@@json ")]
  return json.loads(lines[-1][len("@@json "):]) if lines else None


def parse_scale(log: str, step: Step, walls: list[float]) -> list[dict]:
  """scale.py's @@json: per (algorithm, placement, N) the median round time,
  CPU time and device peak (live + temp), and N1 / N0 of each."""
  del walls
  got = _json_line(log)
  if got is None:
    return []
  cases = {}
  for key, r in got["rows"].items():
    data, alg, n, placement = key.split("/")[:4]
    cases[(alg, placement, int(n))] = dict(
        round_ms=1e3 * _median(r["round_s"]), cpu_ms=1e3 * _median(r["cpu_s"]),
        peak_mib=(r["live"] + r["temp"]) / 2**20)
  n0 = min(n for _, _, n in cases)
  rows = []
  for row_id, row in step.rows.items():
    _, alg, placement, n = row_id.split("/")
    m = cases.get((alg, placement, int(n)))
    if m is None:
      rows.append(row)
      continue
    first = cases[(alg, placement, n0)]
    measures = dict(m)
    if int(n) != n0:
      measures["ratio"] = m["round_ms"] / first["round_ms"]
      measures["peak_ratio"] = m["peak_mib"] / first["peak_mib"]
    rows.append(dict(row, measures=measures,
                     ratio_of=f"N = {int(n):,} / N = {n0:,}" if int(n) != n0
                     else ""))
  return rows


def parse_fedsdaf(log: str, step: Step, walls: list[float]) -> list[dict]:
  """fedsdaf.py round's @@json: medians and x FedAvg (Adapter)."""
  del walls
  got = _json_line(log)
  if got is None:
    return []
  rows = []
  for row_id, row in step.rows.items():
    r = got["results"].get(row_id.split("/", 1)[1])
    if r is None:
      rows.append(row)
      continue
    measures = dict(median_s=r["median_s"], rounds=len(r["times"]))
    if row_id != "fedsdaf/fedavg_adapter":
      measures["ratio"] = r["ratio"]
    rows.append(dict(row, measures=measures,
                     ratio_of="" if row_id == "fedsdaf/fedavg_adapter"
                     else "x FedAvg (Adapter)"))
  return rows


# ------------------------------------------------------------------- running


def run_command(argv: list[str], log_path: str, timeout: float,
                env: dict) -> tuple[int | None, float]:
  """(exit code or None when killed at `timeout`, wall seconds); output
  appended to `log_path` as it comes. The command gets its own process
  group, so a kill at the budget takes its workers too."""
  with open(log_path, "a") as log:
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT, env=env, start_new_session=True)
    try:
      rc = proc.wait(timeout=max(timeout, 0.1))
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
      rc = None
    except KeyboardInterrupt:  # its own session: Ctrl-C does not reach it
      os.killpg(proc.pid, signal.SIGKILL)
      raise
    wall = time.perf_counter() - t0
    log.write(f"# exit {rc if rc is not None else 'killed at its budget'}, "
              f"{wall:.1f} s\n")
  return rc, wall


def run_step(step: Step, out: str, timeout: float) -> dict:
  """Runs the step's commands in order within `timeout` seconds; its result:
  status ok / partial (killed at its budget, kept what it logged) / failed,
  and its rows."""
  log_path = os.path.join(out, f"kit_{step.name}.txt")
  open(log_path, "w").close()
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
      PYTHONUNBUFFERED="1", **step.env)
  t0 = time.perf_counter()
  walls, status, why = [], "ok", ""
  for argv in step.commands:
    left = timeout - (time.perf_counter() - t0)
    rc, wall = run_command(argv, log_path, left, env)
    if rc is None:
      status, why = "partial", f"killed at its budget ({timeout:.0f} s)"
      break
    if rc != 0:
      status, why = "failed", f"exit code {rc}: {_last_line(log_path)}"
      break
    walls.append(wall)
  with open(log_path) as f:
    log = f.read()
  try:
    parsed = step.parse(log, step, walls)
  except Exception as e:  # noqa: BLE001 - a bug of the kit's: the next steps run
    parsed, status = [], "failed"
    why = f"the kit could not read its log: {type(e).__name__}: {e}"
  by_id = {r["id"]: r for r in parsed}
  rows, missing = [], []
  for row_id, planned in step.rows.items():
    row = by_id.get(row_id, planned)
    if not row["measures"] and not row["note"]:
      missing.append(row_id)
      row = dict(row, note=f"not measured: {why or 'no result in its log'}")
    rows.append(row)
  if status == "ok" and missing:
    status, why = "failed", f"no result for {', '.join(missing)}"
  return dict(step=step.name, status=status, why=why,
              wall_s=time.perf_counter() - t0, log=os.path.basename(log_path),
              rows=rows)


def _last_line(path: str) -> str:
  with open(path) as f:
    lines = [l.strip() for l in f if l.strip() and not l.startswith("# exit")]
  return lines[-1][:200] if lines else "no output"


def skipped(step: Step, why: str) -> dict:
  return dict(step=step.name, status="skipped", why=why, wall_s=0.0, log="",
              rows=[dict(r, note=r["note"] or f"not run: {why}")
                    for r in step.rows.values()])


# ----------------------------------------------------------------- reporting


def fmt_seconds(s: float) -> str:
  return f"{1e3 * s:,.1f} ms" if s < 1 else f"{s:,.2f} s"


def value_text(row: dict) -> str:
  m = row["measures"]
  if not m:
    return row["note"] or "not measured yet"
  if "median_s" in m:
    first = (f"; first round {fmt_seconds(m['first_round_s'])}"
             if "first_round_s" in m else "")
    return f"{fmt_seconds(m['median_s'])} (median of {m['rounds']}{first})"
  if "wall_s" in m:
    return f"{fmt_seconds(m['wall_s'])} wall"
  return (f"{m['round_ms']:,.1f} ms / round (CPU {m['cpu_ms']:,.1f} ms), "
          f"device peak {m['peak_mib']:,.1f} MiB")


def ratio_text(row: dict) -> str:
  m = row["measures"]
  if "ratio" not in m:
    return ""
  text = f"**{m['ratio']:.2f}x** {row['ratio_of']}"
  if "peak_ratio" in m:
    text += f"; peak {m['peak_ratio']:.2f}x"
  return text


def table_rows(results: list[dict]) -> list[str]:
  """The docs' table rows (docs/benchmarks.md, "GPU measurements")."""
  lines, last = [], None
  for res in results:
    for row in res["rows"]:
      what = row["what"] if row["what"] != last else ""
      last = row["what"]
      lines.append(f"| {what} | {row['variant']} | {value_text(row)} | "
                   f"{ratio_text(row)} |")
  return lines


TABLE_HEAD = ["| measurement | variant | median | ratio |", "|---|---|---|---|"]


def write_summary(out: str, facts: dict, args, planned: list[Step],
                  results: list[dict], started: float) -> None:
  """kit_summary.json and kit_summary.md, rewritten whole after each step
  (a temporary file renamed over the old one: never half written)."""
  summary = dict(machine=facts, dry_run=args.dry_run, deadline_s=args.deadline,
                 elapsed_s=time.perf_counter() - started,
                 plan={s.name: list(s.rows) for s in planned}, steps=results)
  _write(os.path.join(out, "kit_summary.json"), json.dumps(summary, indent=1))
  gpu = facts["gpu"] or f"no GPU ({facts['cpu']}, {facts['cores']} cores)"
  md = [f"# Accelerator kit{' (dry run)' if args.dry_run else ''}, "
        f"{facts['date']}", "",
        f"{gpu}; jax {facts['versions']['jax']}, torch "
        f"{facts['versions']['torch']}; commit {facts['commit'][:12]}"
        f"{' (dirty tree)' if facts['dirty'] else ''}; "
        f"{summary['elapsed_s']:.0f} s of the {args.deadline} s deadline.", "",
        "| step | status | wall s | log |", "|---|---|---:|---|"]
  md += [f"| {r['step']} | {r['status']}{': ' + r['why'] if r['why'] else ''} "
         f"| {r['wall_s']:.1f} | {r['log']} |" for r in results]
  md += ["", *TABLE_HEAD, *table_rows(results), ""]
  _write(os.path.join(out, "kit_summary.md"), "\n".join(md))


def _write(path: str, text: str) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


# ---------------------------------------------------------------------- main


def default_out(dry: bool) -> str:
  if dry:
    return tempfile.mkdtemp(prefix="accelerator_kit_dry_")
  day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
  return os.path.join(ROOT, "docs", "bench-logs", day)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dry-run", action="store_true",
                 help="the same steps at tiny sizes on the CPU (C = 2 and 4, "
                 "8 px, an MLP in the round steps, a tiny ViT, N = 10 and 40)")
  p.add_argument("--out", default="",
                 help="where the logs and the summary go (default: "
                 "docs/bench-logs/<UTC date>/; with --dry-run a new temp dir)")
  p.add_argument("--steps", default="",
                 help="comma-separated step names or prefixes (round = every "
                 "round step); default: all")
  p.add_argument("--part", choices=sorted(PARTS) + ["all"], default="all",
                 help="1: the round steps; 2: demo, scale and FedSDAF; each "
                 f"fits one {DEADLINE_S} s call (all: both, one after another)")
  p.add_argument("--deadline", type=float, default=None,
                 help=f"seconds for the whole kit (default: {DEADLINE_S} per "
                 "part)")
  p.add_argument("--budget", action="append", default=[], metavar="STEP=S",
                 help="seconds for one step instead of BUDGETS' (repeatable)")
  args = p.parse_args(argv)
  if args.part != "all" and args.steps:
    p.error("--part and --steps: choose one")
  if args.deadline is None:
    args.deadline = float(DEADLINE_S * (len(PARTS) if args.part == "all"
                                        and not args.steps else 1))
  wanted = PARTS[args.part] if args.part != "all" else args.steps
  budgets = dict(BUDGETS)
  for item in args.budget:
    name, _, secs = item.partition("=")
    if name not in budgets or not secs.replace(".", "", 1).isdigit():
      p.error(f"--budget {item!r}: expected STEP=SECONDS with STEP one of "
              f"{', '.join(budgets)}")
    budgets[name] = float(secs)
  started = time.perf_counter()
  out = args.out or default_out(args.dry_run)
  os.makedirs(out, exist_ok=True)
  facts = machine()
  sizes = DRY_SIZES if args.dry_run else GPU_SIZES
  with tempfile.TemporaryDirectory(prefix="accelerator_kit_") as scratch:
    steps = select(plan(sizes, facts, args.dry_run, scratch), wanted)
    if args.dry_run:  # tiny programs: compiling is most of a dry run
      for step in steps:
        step.env.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS",
                            os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS", "1"))
    with open(os.path.join(out, "kit_env.txt"), "w") as f:
      json.dump(facts, f, indent=1)
    print(f"[kit] {len(steps)} steps, deadline {args.deadline:.0f} s, "
          f"writing to {out}", flush=True)
    results, budget_end = [], 0.0
    write_summary(out, facts, args, steps, results, started)
    for step in steps:
      budget = DRY_BUDGET_S if args.dry_run else budgets[step.name]
      budget_end += budget            # unused seconds roll over
      now = time.perf_counter() - started
      timeout = min(budget_end, args.deadline - 5) - now
      if timeout < min(MIN_STEP_S, budget):
        res = skipped(step, f"{args.deadline - now:.0f} s left of the kit's "
                      f"{args.deadline:.0f} s deadline")
      else:
        res = run_step(step, out, timeout)
      results.append(res)
      write_summary(out, facts, args, steps, results, started)
      print(f"[kit] {step.name}: {res['status']}"
            f"{' (' + res['why'] + ')' if res['why'] else ''} in "
            f"{res['wall_s']:.1f} s -> {res['log'] or '-'}", flush=True)
  print(f"\n[kit] {time.perf_counter() - started:.0f} s; summary: "
        f"{os.path.join(out, 'kit_summary.md')}\n")
  print("Rows to paste (docs/benchmarks.md, GPU measurements):")
  print("\n".join(TABLE_HEAD + table_rows(results)))
  return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
