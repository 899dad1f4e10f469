"""What a sweep of tiny runs costs besides their compute, side by side with
another checkout (not a test).

The overhead regime: 64 tiny runs (FedAvg, MLP, 8x8 Rotated Fashion-MNIST,
60 images a domain, 16 seeds x 4 held-out targets, 10 rounds, an evaluation
every 5) compute for milliseconds each, so a sweep of them measures what a
run costs besides its rounds: process start and imports, set-up, compiles,
host work per chunk, checkpoints, records and the report. An accelerator
is in that regime for any small model; a 2-core CPU is in it for these.

Each sweep is one `fedjax-dg sweep` process, timed whole (process start
included), with a fresh empty persistent compilation cache
(`FEDJAX_DG_JAX_CACHE`) so every compile is paid; this checkout and
`--baseline DIR` (another checkout of fedjax_dg, run with its own code on
`PYTHONPATH`) alternate, `--repeats` times each, and the ratios of the
medians are printed with every wall time.

    python benchmarks/sweep_overhead.py                       # this checkout
    python benchmarks/sweep_overhead.py --baseline ../old --repeats 3
    python benchmarks/sweep_overhead.py --seeds 4 --targets 0,15   # smaller
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["algorithms=fedavg", "model.name=mlp", "data.image_size=8",
        "data.max_per_domain=60", "train.rounds=10", "train.eval_every=5",
        "train.progress=False"]


def sweep(checkout: str, seeds: int, targets: str, extra: list[str]
          ) -> tuple[float, float, int]:
  """(wall seconds, peak RSS GiB, exit code) of one sweep process of
  `checkout`'s fedjax_dg."""
  work = tempfile.mkdtemp(prefix="sweep_overhead_")
  out = os.path.join(work, "sweep")
  cmd = [sys.executable, "-m", "fedjax_dg.cli", "sweep", "--config",
         os.path.join(checkout, "experiments", "demo.py"),
         "--seeds", ",".join(map(str, range(seeds))), "--out", out,
         "--set", f"data.targets={targets}"]
  for s in TINY + extra:
    cmd += ["--set", s]
  env = dict(os.environ, PYTHONPATH=checkout,
             FEDJAX_DG_JAX_CACHE=os.path.join(work, "jax_cache"))
  try:
    with tempfile.TemporaryFile("w+") as log:
      t0 = time.perf_counter()
      proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                              env=env, cwd=checkout)
      _, status, usage = os.wait4(proc.pid, 0)
      wall = time.perf_counter() - t0
      code = os.waitstatus_to_exitcode(status)
      if code:
        log.seek(0)
        print(log.read()[-3000:], file=sys.stderr)
  finally:
    shutil.rmtree(work, ignore_errors=True)
  return wall, usage.ru_maxrss / 2**20, code


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--baseline", help="another fedjax_dg checkout to compare")
  ap.add_argument("--seeds", type=int, default=16)
  ap.add_argument("--targets", default="0,15,30,45")
  ap.add_argument("--repeats", type=int, default=1)
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="more settings for both sweeps")
  args = ap.parse_args(argv)
  runs = args.seeds * len(args.targets.split(","))
  sides = [("this", HERE)] + ([("baseline", os.path.abspath(args.baseline))]
                              if args.baseline else [])
  walls = {name: [] for name, _ in sides}
  for k in range(args.repeats):
    for name, checkout in sides:  # alternating: drift hits both
      wall, rss, code = sweep(checkout, args.seeds, args.targets, args.set)
      walls[name].append(wall)
      print(f"repeat {k + 1} {name:8s} {wall:7.1f} s  {wall / runs:6.2f} s a run"
            f"  peak RSS {rss:.2f} GiB  exit {code}", flush=True)
      if code:
        return code
  print(f"\n{runs} runs ({args.seeds} seeds x targets {args.targets}); median "
        "wall, process start included:")
  med = {name: statistics.median(w) for name, w in walls.items()}
  for name, _ in sides:
    print(f"  {name:8s} {med[name]:7.1f} s  {med[name] / runs:6.2f} s a run")
  if args.baseline:
    ratios = [b / a for a, b in zip(walls["this"], walls["baseline"])]
    print(f"  baseline / this: {med['baseline'] / med['this']:.1f}x (pair by "
          f"pair {', '.join(f'{r:.1f}' for r in ratios)})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
