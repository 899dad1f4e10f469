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

Two more shapes (`--shape`), where the rounds cost what they cost:

* `table2`: the hFedF Table 2 shape of docs/results.md (7 algorithms x
  targets 0, 30, 60 x d = 1, 2, 3; small CNN, 16 px, 400 images a domain,
  10 rounds), seeds 0-2 by default: 189 runs;
* `table1`: the FedCCRL Table 1 methods that derive something from their
  data (FedCCRL, CCST, ELCFS) on Styled Fashion-MNIST at 100 images a
  domain and 2 rounds, seeds 0-1: 30 runs (`fedjax-dg prepare
  styled_fashion_mnist` first).

`--warm`: a sweep of other seeds first fills the persistent compilation
cache (one per side), and every repeat then sweeps seeds neither side has
run (the next block of them), as a user's next sweep of the same shapes
finds the cache: programs built from shapes compile nothing, programs that
embed a seed's values compile again.
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
# (experiment file, --set values, default seeds, default targets)
SHAPES = {
    "tiny": ("demo.py", ["algorithms=fedavg", "model.name=mlp",
                         "data.image_size=8", "data.max_per_domain=60",
                         "train.rounds=10", "train.eval_every=5"],
             16, "0,15,30,45"),
    "table2": ("table2.py", ["model.name=small_cnn", "data.image_size=16",
                             "data.max_per_domain=400", "train.epochs=1",
                             "train.rounds=10", "train.eval_every=5",
                             "train.ood_eval_max=0"], 3, "0,30,60"),
    "table1": ("styled_fmnist_table1.py", ["algorithms=fedccrl,ccst,elcfs",
                                           "data.max_per_domain=100",
                                           "train.rounds=2",
                                           "train.eval_every=1"], 2, "all"),
}


def sweep(checkout: str, shape: str, seeds: list[int], targets: str,
          extra: list[str], cache: str | None = None,
          keep: str | None = None) -> tuple[float, float, int]:
  """(wall seconds, peak RSS GiB, exit code) of one sweep process of
  `checkout`'s fedjax_dg (`cache`: its persistent compilation cache
  folder, kept; None: a fresh one, removed; `keep`: the sweep folder to
  write, kept, else a temporary one)."""
  work = tempfile.mkdtemp(prefix="sweep_overhead_")
  out = keep or os.path.join(work, "sweep")
  config, sets, _, _ = SHAPES[shape]
  cmd = [sys.executable, "-m", "fedjax_dg.cli", "sweep", "--config",
         os.path.join(checkout, "experiments", config),
         "--seeds", ",".join(map(str, seeds)), "--out", out,
         "--set", f"data.targets={targets}"]
  for s in sets + ["train.progress=False"] + extra:
    cmd += ["--set", s]
  env = dict(os.environ, PYTHONPATH=checkout,
             FEDJAX_DG_JAX_CACHE=cache or os.path.join(work, "jax_cache"))
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


def finals(sweep_dir: str) -> dict:
  """{(cell, algorithm, target): (id_acc, ood_acc)} of a sweep folder's
  finished runs."""
  import json
  got = {}
  for cell in sorted(os.listdir(sweep_dir)):
    path = os.path.join(sweep_dir, cell, "results.json")
    if os.path.isfile(path):
      with open(path) as f:
        for r in json.load(f)["runs"]:
          got[cell, r["algorithm"], r["target"]] = (
              r["final"].get("id_acc"), r["final"].get("ood_acc"))
  return got


def largest_difference(a: str, b: str) -> float:
  """The largest difference of the final accuracies of two sweep folders'
  runs (inf when they hold other runs)."""
  fa, fb = finals(a), finals(b)
  if sorted(fa) != sorted(fb):
    return float("inf")
  return max((abs(x - y) for k in fa for x, y in zip(fa[k], fb[k])
              if x is not None), default=0.0)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--baseline", help="another fedjax_dg checkout to compare")
  ap.add_argument("--shape", choices=tuple(SHAPES), default="tiny")
  ap.add_argument("--seeds", type=int, default=None,
                  help="seeds 0..S-1 (default: the shape's)")
  ap.add_argument("--targets", default=None)
  ap.add_argument("--runs", type=int, default=None,
                  help="the runs a sweep makes, for the per-run figure "
                  "(default: seeds x targets)")
  ap.add_argument("--repeats", type=int, default=1)
  ap.add_argument("--warm", action="store_true",
                  help="fill each side's compilation cache with a sweep of "
                  "other seeds first")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="more settings for both sweeps")
  ap.add_argument("--keep", metavar="DIR",
                  help="keep the first repeat's sweep folders as DIR/this and "
                  "DIR/baseline, and print the largest difference of their "
                  "final accuracies")
  args = ap.parse_args(argv)
  _, _, default_seeds, default_targets = SHAPES[args.shape]
  seeds = list(range(args.seeds or default_seeds))
  targets = args.targets or default_targets
  runs = args.runs or len(seeds) * len(targets.split(","))
  sides = [("this", HERE)] + ([("baseline", os.path.abspath(args.baseline))]
                              if args.baseline else [])
  caches = {}
  if args.warm:
    for name, checkout in sides:
      caches[name] = tempfile.mkdtemp(prefix=f"jax_cache_{name}_")
      others = [s + 100 for s in seeds]
      wall, _, code = sweep(checkout, args.shape, others, targets, args.set,
                            caches[name])
      print(f"warm-up {name:8s} {wall:7.1f} s (seeds {others[0]}-"
            f"{others[-1]})", flush=True)
      if code:
        return code
  walls = {name: [] for name, _ in sides}
  for k in range(args.repeats):
    # Warm: seeds no sweep of either side has run yet.
    run_seeds = [s + 1000 * (k + 1) for s in seeds] if args.warm else seeds
    for name, checkout in sides:  # alternating: drift hits both
      keep = (os.path.join(args.keep, name) if args.keep and k == 0
              else None)
      wall, rss, code = sweep(checkout, args.shape, run_seeds, targets,
                              args.set, caches.get(name), keep)
      walls[name].append(wall)
      print(f"repeat {k + 1} {name:8s} {wall:7.1f} s  {wall / runs:6.2f} s a run"
            f"  peak RSS {rss:.2f} GiB  exit {code}", flush=True)
      if code:
        return code
  for cache in caches.values():
    shutil.rmtree(cache, ignore_errors=True)
  print(f"\n{args.shape}: {runs} runs (seeds 0-{len(seeds) - 1} x targets "
        f"{targets}{', warm cache' if args.warm else ''}); median wall, "
        "process start included:")
  med = {name: statistics.median(w) for name, w in walls.items()}
  for name, _ in sides:
    print(f"  {name:8s} {med[name]:7.1f} s  {med[name] / runs:6.2f} s a run")
  if args.keep and args.baseline:
    print(f"  largest |final accuracy difference|, this vs baseline: "
          f"{largest_difference(*(os.path.join(args.keep, n) for n in ('this', 'baseline'))):.2e}")
  if args.baseline:
    ratios = [b / a for a, b in zip(walls["this"], walls["baseline"])]
    print(f"  baseline / this: {med['baseline'] / med['this']:.1f}x (pair by "
          f"pair {', '.join(f'{r:.1f}' for r in ratios)})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
