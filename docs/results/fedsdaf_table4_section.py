"""The tables of docs/results.md's FedSDAF Table 4 section, printed from the
runs.csv of one sweep or of several sweeps of the same protocol over
disjoint seeds (a 10-seed result run as two 5-seed halves), so the section
is restated from the committed CSVs, not retyped.

    python docs/results/fedsdaf_table4_section.py \
        docs/results/<half 1>/runs.csv docs/results/<half 2>/runs.csv

Each runs.csv's sweep.json (beside it) must hold the same base config but
for the seeds, no (algorithm, seed, target) run may appear twice and none
may have diverged: a SystemExit says which file and run, and how. Prints, final evaluation,
accuracy in %:
1. per algorithm: id mean over the targets, ood per target as mean ± sample
   std over seeds, ood mean over the targets, and the mean of
   `best_client_ood_acc` (the best client's own model chosen on the target,
   the released code's selection) for the variants with per-client models;
   each marked ↑ / ↓ / ≈ by the 95 % interval of its paired difference with
   FedAvg (Adapter) over seeds (`report.stats`);
2. those paired differences of the id and ood means, with their intervals;
3. FedSDAF (all components) minus each ablation, paired the same way.
"""

from __future__ import annotations

import csv
import json
import os
import sys

import numpy as np

from fedjax_dg.report import stats, tables

REFERENCE = "fedavg_adapter"
FULL = "fedsdaf"  # every component: what the ablations are compared with
TARGETS = ("tint", "inverse", "sketch", "texture")
# Variants that evaluate one global model: no best client to pick.
ONE_MODEL = ("fedavg_adapter", "fedsdaf_di", "fedsdaf_head")


def _protocol(path: str) -> dict:
  """The base config of the sweep `path` (a runs.csv) came from, seeds
  removed."""
  manifest = os.path.join(os.path.dirname(path), "sweep.json")
  if not os.path.exists(manifest):
    raise SystemExit(f"{path}: no sweep.json beside it: cannot check that it "
                     "ran the same protocol as the others")
  with open(manifest) as f:
    base = json.load(f)["base_config"]
  base.pop("seed", None)
  return base


def load(paths: list[str]) -> tuple[dict, list[str], dict[str, str], set]:
  """{(algorithm, metric): {(seed, target): value in %}}, the algorithms
  in file order, their display names, the seeds."""
  runs: dict = {}
  order: list[str] = []
  names: dict[str, str] = {}
  first = None
  for path in paths:
    base = _protocol(path)
    if first is None:
      first = (path, base)
    elif base != first[1]:
      diff = sorted(k for k in set(base) | set(first[1])
                    if base.get(k) != first[1].get(k))
      raise SystemExit(f"{path}: its sweep's config differs from {first[0]}'s "
                       f"in {diff}: not the same protocol")
    with open(path) as f:
      for r in csv.DictReader(f):
        a, key = r["algorithm"], (int(r["seed"]), r["target"])
        if r.get("diverged", "").strip().lower() in ("true", "1", "yes"):
          raise SystemExit(f"{path}: {a} seed {key[0]} target {key[1]} "
                           "diverged: its numbers are not a result")
        if a not in names:
          order.append(a)
          names[a] = r["variant"].split(" [")[0]
        for metric in ("id_acc", "ood_acc", "best_client_ood_acc"):
          values = runs.setdefault((a, metric), {})
          if key in values:
            raise SystemExit(f"{path}: {a} seed {key[0]} target {key[1]} is "
                             "in an earlier file too: the halves' seeds "
                             "must be disjoint")
          values[key] = 100 * float(r[metric])
  seeds = {s for v in runs.values() for s, _ in v}
  return runs, order, names, seeds


def span(d: stats.Difference) -> str:
  return f"{d.mean:+.1f} [{d.low:+.1f}, {d.high:+.1f}]"


def on(values: dict, target: str) -> dict:
  return {k: v for k, v in values.items() if k[1] == target}


def table(title: str, header: list[str], rows: list[list[str]]) -> str:
  return tables.Table(title, header, rows, [], []).markdown()


def main(paths: list[str]) -> None:
  runs, order, names, seeds = load(paths)
  if REFERENCE not in order:
    raise SystemExit(f"no {REFERENCE} runs: it is the reference")
  print(f"{len(order)} algorithms, {len(seeds)} seeds "
        f"({', '.join(map(str, sorted(seeds)))}), "
        f"{len(runs[(REFERENCE, 'ood_acc')]) * len(order)} runs\n")
  ref = {m: runs[(REFERENCE, m)] for m in ("id_acc", "ood_acc")}
  rows = []
  for a in order:
    cmp = a != REFERENCE

    def marked(values, ref_values, text):
      return (text + " " + tables.significance(
          stats.paired_difference(values, ref_values)) if cmp else text)

    ood = runs[(a, "ood_acc")]
    row = [names[a], marked(runs[(a, "id_acc")], ref["id_acc"],
                            f"{np.mean(list(runs[(a, 'id_acc')].values())):.1f}")]
    for t in TARGETS:
      v = np.asarray(list(on(ood, t).values()))
      row.append(marked(on(ood, t), on(ref["ood_acc"], t),
                        f"{v.mean():.1f} ± {v.std(ddof=1):.1f}"))
    row.append(marked(ood, ref["ood_acc"], f"{np.mean(list(ood.values())):.1f}"))
    best = runs[(a, "best_client_ood_acc")]
    row.append("(one model)" if a in ONE_MODEL
               else f"{np.mean(list(best.values())):.1f}")
    rows.append(row)
  print(table(f"Final accuracy (%), mean ± sample std over {len(seeds)} seeds",
              ["algorithm", "id μ"] + [f"ood {t}" for t in TARGETS]
              + ["ood μ", "ood, best client on target"], rows))
  rows = [[names[a]] + [span(stats.paired_difference(runs[(a, m)], ref[m]))
                        for m in ("id_acc", "ood_acc")]
          for a in order if a != REFERENCE]
  print(table(f"Paired differences with {names[REFERENCE]}, μ over the "
              f"targets, 95 % interval over {len(seeds)} seeds",
              ["algorithm", "id", "ood"], rows))
  if FULL not in order:
    return
  full = {m: runs[(FULL, m)] for m in ("id_acc", "ood_acc")}
  rows = [[names[a]] + [span(stats.paired_difference(full[m], runs[(a, m)]))
                        for m in ("id_acc", "ood_acc")]
          for a in order if a not in (REFERENCE, FULL)]
  print(table(f"{names[FULL]} minus each ablation (Table 4's question: what "
              f"removing a component costs), 95 % interval over "
              f"{len(seeds)} seeds", ["without", "id", "ood"], rows))


if __name__ == "__main__":
  if len(sys.argv) < 2:
    raise SystemExit(__doc__)
  main(sys.argv[1:])
