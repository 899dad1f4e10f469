"""The tables of docs/results.md's section on the federated DG benchmark's
offline grid, printed from its report's runs.csv, so the section is restated
from the committed CSV, not retyped.

    python docs/results/feddg_grid_section.py \
        docs/results/feddg_benchmark_offline_10seeds/runs.csv \
        --plot docs/results/feddg_benchmark_offline_10seeds/differences.png

Prints, final evaluation, accuracy in %:
1. the held-out (ood) accuracy of every method in every (lambda, C) cell,
   mean ± sample std over the seeds, marked ↑ / ↓ / ≈ by the 95 % interval
   of its paired difference with FedAvg of the same cell (`report.stats`);
2. those paired differences with their intervals, the same for the
   in-domain (id) accuracy;
3. the effect of the client count (C = 50 minus C = 5, per lambda) and of
   heterogeneity (lambda 0 minus lambda 1, per C) on each method's ood
   accuracy: the mean of the per-seed differences and its 95 % t interval
   (seed s of one cell against seed s of the other: independent runs, so
   the interval is that of a difference of means).
`--plot PNG` also draws table 2's ood differences, one panel per (lambda, C).
"""

from __future__ import annotations

import csv
import sys

import numpy as np

from fedjax_dg.report import stats

LAMS = ("1.0", "0.1", "0.0")
CS = ("5", "50")


def load(path: str) -> tuple[dict, list[str], dict[str, str]]:
  """{(algorithm, lam, C, metric): {(seed, target): value in %}}, the
  algorithms in file order, their display names."""
  runs: dict = {}
  order: list[str] = []
  names: dict[str, str] = {}
  with open(path) as f:
    for r in csv.DictReader(f):
      a = r["algorithm"]
      if a not in names:
        order.append(a)
        names[a] = r["variant"].split(" [")[0]
      for metric in ("ood_acc", "id_acc"):
        key = (a, r["data.lam"], r["data.num_clients"], metric)
        runs.setdefault(key, {})[(int(r["seed"]), r["target"])] = (
            100 * float(r[metric]))
  return runs, order, names


def mark(d: stats.Difference) -> str:
  if d.low is None:
    return "n<2"
  return "↑" if d.low > 0 else "↓" if d.high < 0 else "≈"


def span(d: stats.Difference) -> str:
  return f"{d.mean:+.1f} [{d.low:+.1f}, {d.high:+.1f}] {mark(d)}"


def table(head: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(head) + " |",
           "|---|" + "---:|" * (len(head) - 1)]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  return "\n".join(lines)


def main(path: str) -> None:
  runs, order, names = load(path)
  cells = [(lam, c) for lam in LAMS for c in CS]
  head = ["method"] + [f"λ {float(lam):g}, C {c}" for lam, c in cells]
  seeds = {s for v in runs.values() for s, _ in v}
  print(f"{len(order)} methods, {len(seeds)} seeds, "
        f"{sum(len(v) for k, v in runs.items() if k[3] == 'ood_acc')} runs\n")

  rows = []
  for a in order:
    row = [names[a]]
    for lam, c in cells:
      v = np.asarray(list(runs[(a, lam, c, "ood_acc")].values()))
      cell = f"{v.mean():.1f} ± {v.std(ddof=1):.1f}"
      if a != "fedavg":
        cell += " " + mark(stats.paired_difference(
            runs[(a, lam, c, "ood_acc")], runs[("fedavg", lam, c, "ood_acc")]))
      row.append(cell)
    rows.append(row)
  print("ood accuracy (%), mean ± std over seeds\n")
  print(table(head, rows) + "\n")

  for metric in ("ood_acc", "id_acc"):
    rows = []
    for a in order[1:]:
      rows.append([names[a]] + [span(stats.paired_difference(
          runs[(a, lam, c, metric)], runs[("fedavg", lam, c, metric)]))
          for lam, c in cells])
    print(f"{metric[:-4]}: difference with FedAvg, 95 % paired interval\n")
    print(table(head, rows) + "\n")

  print("ood: C = 50 minus C = 5, and lambda 0 minus lambda 1\n")
  rows = []
  for a in order:
    row = [names[a]]
    for lam in LAMS:
      row.append(span(stats.paired_difference(runs[(a, lam, "50", "ood_acc")],
                                              runs[(a, lam, "5", "ood_acc")])))
    for c in CS:
      row.append(span(stats.paired_difference(runs[(a, "0.0", c, "ood_acc")],
                                              runs[(a, "1.0", c, "ood_acc")])))
    rows.append(row)
  print(table(["method"] + [f"C 50 − 5, λ {float(l):g}" for l in LAMS]
              + [f"λ 0 − 1, C {c}" for c in CS], rows))


def plot(path: str, out: str) -> None:
  """Every method's ood difference with FedAvg and its 95 % interval, one
  panel per (lambda, C): rows C, columns lambda."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  runs, order, names = load(path)
  methods = order[1:]
  fig, axes = plt.subplots(len(CS), len(LAMS), figsize=(12, 7), sharex=True,
                           sharey=True, constrained_layout=True)
  for i, c in enumerate(CS):
    for j, lam in enumerate(LAMS):
      ax = axes[i, j]
      ds = [stats.paired_difference(runs[(a, lam, c, "ood_acc")],
                                    runs[("fedavg", lam, c, "ood_acc")])
            for a in methods]
      ys = np.arange(len(methods))[::-1]
      colors = ["tab:green" if d.low > 0 else "tab:red" if d.high < 0
                else "tab:gray" for d in ds]
      ax.barh(ys, [d.mean for d in ds], color=colors, alpha=0.7)
      ax.errorbar([d.mean for d in ds], ys,
                  xerr=[[d.mean - d.low for d in ds],
                        [d.high - d.mean for d in ds]],
                  fmt="none", ecolor="black", capsize=2, lw=0.8)
      ax.axvline(0, color="black", lw=0.8)
      ax.set_yticks(ys, [names[a] for a in methods])
      ax.set_title(f"λ = {float(lam):g}, C = {c}")
      ax.grid(axis="x", alpha=0.3)
      if i == len(CS) - 1:
        ax.set_xlabel("ood accuracy − FedAvg's (points), 95 % interval")
  fig.suptitle("Rotated Fashion-MNIST, 75° held out: each method against "
               "FedAvg of the same cell (green above, red below, gray: "
               "no difference established)")
  fig.savefig(out, dpi=100)


if __name__ == "__main__":
  main(sys.argv[1])
  if "--plot" in sys.argv:
    plot(sys.argv[1], sys.argv[sys.argv.index("--plot") + 1])
