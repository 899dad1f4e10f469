"""A sweep trained in replica batches against the same sweep one run at a
time (`fedjax-dg sweep --replicas R` for each R of `--caps`, 1 = one run at
a time), side by side on this machine: wall time, runs per hour, peak memory
of the process and the largest difference between their numbers.

Each sweep runs in a fresh process (as the command runs it, with
`use_cpu_devices`), the caps alternating, `--repeats` times; ratios of
medians against the first cap are printed. Default: the hFedF Table 2 shape
of docs/results.md (small CNN, 16 px, 400 images per domain, 10 rounds,
targets 0/30/60, d = 1, 2, 3) with `--seeds 0`, caps 1 and 0 (by memory).

    python benchmarks/sweep_batches.py [--seeds 0] [--repeats 1] [--rounds 10]
    # a GPU: seeds share a program only without the per-seed subsample
    python benchmarks/sweep_batches.py --seeds 0,1,2,3,4,5,6,7 \
        --caps 1,4,16,64 --set data.max_per_domain=0
    # where a cap's time goes: each sweep under cProfile, the top of its
    # cumulative times printed and the .pstats files kept in DIR
    python benchmarks/sweep_batches.py ... --profile DIR

The profile is of the host's Python (cProfile slows Python-heavy phases, so
its walls are not the timing's); the device's work shows where the host
waits for it (`block_until_ready`, transfers to the host).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

PROFILE_TOP = 40
TABLE2_SHAPE = ["data.targets=0,30,60", "model.name=small_cnn",
                "data.image_size=16", "data.max_per_domain=400",
                "train.epochs=1", "train.eval_every=5",
                "train.ood_eval_max=0", "train.progress=False"]


def sweep(out: str, replicas: int, seeds: str, rounds: int, grid: str,
          config: str, extra: list[str],
          profile: str | None = None) -> tuple[float, float]:
  """(wall seconds, peak RSS GiB) of one `fedjax-dg sweep` process (its own
  peak, from os.wait4: no /usr/bin/time, which GPU images may lack);
  `profile`: run it under cProfile, writing its stats there."""
  prof = ["-m", "cProfile", "-o", profile] if profile else []
  cmd = [sys.executable, *prof, "-m", "fedjax_dg.cli", "sweep", "--config", config,
         "--grid", grid, "--seeds", seeds, "--out", out,
         "--replicas", str(replicas), "--set", f"train.rounds={rounds}"]
  for s in TABLE2_SHAPE + extra:
    cmd += ["--set", s]
  with tempfile.TemporaryFile("w+") as so, tempfile.TemporaryFile("w+") as se:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=so, stderr=se, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    so.seek(0), se.seek(0)
    stdout, stderr = so.read(), se.read()
  if proc.returncode != 0:
    sys.exit(f"sweep --replicas {replicas} failed (exit {proc.returncode}):\n"
             f"{stdout[-3000:]}\n{stderr[-3000:]}")
  with open(os.path.join(out, "stdout.txt"), "w") as f:
    f.write(stdout)
  return wall, usage.ru_maxrss / 2**20      # ru_maxrss: KiB on Linux


def finals(out: str) -> dict:
  """(cell, algorithm, target) -> (id_acc, ood_acc) of every run."""
  got = {}
  for path in glob.glob(os.path.join(out, "*", "results.json")):
    cell = os.path.basename(os.path.dirname(path))
    with open(path) as f:
      for r in json.load(f)["runs"]:
        got[(cell, r["algorithm"], r["target"])] = (
            r["final"].get("id_acc"), r["final"].get("ood_acc"))
  return got


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seeds", default="0")
  ap.add_argument("--grid", default="data.d=1,2,3")
  ap.add_argument("--rounds", type=int, default=10)
  ap.add_argument("--repeats", type=int, default=1)
  ap.add_argument("--caps", default="1,0",
                  help="--replicas values (1: one run at a time; 0: by memory)")
  ap.add_argument("--set", action="append", default=[], dest="extra",
                  help="more KEY=VALUE settings of every sweep")
  ap.add_argument("--profile", metavar="DIR",
                  help="run each sweep under cProfile: DIR/r<cap>_<repeat>"
                  ".pstats, and the top cumulative times printed")
  ap.add_argument("--config", default=os.path.join(
      os.path.dirname(__file__), "..", "experiments", "table2.py"))
  args = ap.parse_args(argv)
  caps = [int(c) for c in args.caps.split(",")]
  walls = {c: [] for c in caps}
  peaks = {c: [] for c in caps}
  if args.profile:
    os.makedirs(args.profile, exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp:
    for k in range(args.repeats):
      for cap in caps:  # alternating: the same load on every cap
        out = os.path.join(tmp, f"r{cap}_{k}")
        prof = (os.path.join(args.profile, f"r{cap}_{k}.pstats")
                if args.profile else None)
        wall, peak = sweep(out, cap, args.seeds, args.rounds, args.grid,
                           args.config, args.extra, prof)
        walls[cap].append(wall)
        peaks[cap].append(peak)
        print(f"repeat {k}: --replicas {cap}: {wall:.0f} s wall, "
              f"peak RSS {peak:.2f} GiB", flush=True)
    base = finals(os.path.join(tmp, f"r{caps[0]}_0"))
    runs = len(base)
    plans = {}
    diffs = {}
    for cap in caps:
      got = finals(os.path.join(tmp, f"r{cap}_0"))
      assert got.keys() == base.keys(), "the sweeps ran other runs"
      diffs[cap] = max(abs(a - b) for key in base
                       for a, b in zip(base[key], got[key]) if a is not None)
      with open(os.path.join(tmp, f"r{cap}_0", "stdout.txt")) as f:
        plans[cap] = [l for l in f if l.startswith("  ")
                      or "replica batches" in l]
  first = statistics.median(walls[caps[0]])
  print(f"\n{runs} runs ({args.grid}, seeds {args.seeds}, {args.rounds} "
        f"rounds), {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
  print("| --replicas | median wall s | s per run | runs per hour | ratio | "
        "peak RSS GiB | largest final-accuracy difference |")
  print("|---:|---:|---:|---:|---:|---:|---:|")
  for cap in caps:
    m = statistics.median(walls[cap])
    print(f"| {cap} | {m:.0f} | {m / runs:.1f} | {3600 * runs / m:.0f} | "
          f"{first / m:.2f}x | {max(peaks[cap]):.2f} | {diffs[cap]:.4f} |")
  for cap in caps:
    if plans[cap]:
      print(f"\nthe batches of --replicas {cap}:\n" + "".join(plans[cap]))
  if args.profile:
    for cap in caps:
      print(f"\n--replicas {cap}, repeat 0, under cProfile: the {PROFILE_TOP} "
            "largest cumulative times of fedjax_dg's functions")
      stats = pstats.Stats(os.path.join(args.profile, f"r{cap}_0.pstats"))
      stats.sort_stats("cumulative").print_stats("fedjax_dg", PROFILE_TOP)


if __name__ == "__main__":
  main()
