"""The table of docs/results.md's bf16-vs-float32 section, printed from the
runs.csv of one sweep with `--grid model.dtype=float32,bfloat16`, so the
section is restated from the committed CSV, not retyped.

    python docs/results/dtype_section.py docs/results/<sweep>/runs.csv

Each bfloat16 run is paired with the float32 run of the same algorithm,
seed, target and other grid keys (same data, same initialization: only the
dtype differs). A run without its partner, a diverged run or a CSV without
the `model.dtype` column stops with a SystemExit that says which. Prints,
final evaluation, accuracy in %, per algorithm and metric (id, ood):
float32 and bfloat16 as mean ± sample std over seeds (of each seed's mean
over the targets), the paired difference bfloat16 − float32 with its 95 %
interval over seeds and its mark (`report.stats`, ↑ / ↓ / ≈), and whether
|difference| is within float32's seed-to-seed std.
"""

from __future__ import annotations

import csv
import sys

import numpy as np

from fedjax_dg.report import stats, tables

DTYPES = ("float32", "bfloat16")
METRICS = (("id", "id_acc"), ("ood", "ood_acc"))
# Columns that say what a run is, not what it measured: with the grid keys,
# what pairs a bfloat16 run with its float32 partner.
_IDENTITY = ("algorithm", "seed", "target")


def load(path: str) -> tuple[dict, list[str], dict[str, str]]:
  """{(algorithm, dtype, metric): {(seed, target): value in %}}, the
  algorithms in file order and their display names."""
  with open(path) as f:
    rows = list(csv.DictReader(f))
  if not rows or "model.dtype" not in rows[0]:
    raise SystemExit(f"{path}: no model.dtype column: not a sweep with "
                     "--grid model.dtype=float32,bfloat16")
  grid = [k for k in rows[0] if "." in k and k != "model.dtype"]
  runs: dict = {}
  order: list[str] = []
  names: dict[str, str] = {}
  keys: dict[str, set] = {d: set() for d in DTYPES}
  for r in rows:
    a, dtype = r["algorithm"], r["model.dtype"]
    if dtype not in DTYPES:
      raise SystemExit(f"{path}: {a} seed {r['seed']}: model.dtype {dtype!r} "
                       f"is not one of {DTYPES}")
    if r.get("diverged", "").strip().lower() in ("true", "1", "yes"):
      raise SystemExit(f"{path}: {a} seed {r['seed']} target {r['target']} "
                       f"({dtype}) diverged: its numbers are not a result")
    if a not in names:
      order.append(a)
      names[a] = r["variant"].split(" [")[0]
    other = "/".join(f"{k}={r[k]}" for k in grid)
    key = (int(r["seed"]), r["target"] + (f" [{other}]" if other else ""))
    keys[dtype].add((a,) + key)
    for _, column in METRICS:
      runs.setdefault((a, dtype, column), {})[key] = 100 * float(r[column])
  lonely = keys["float32"] ^ keys["bfloat16"]
  if lonely:
    a, seed, target = sorted(lonely)[0]
    has = "float32" if (a, seed, target) in keys["float32"] else "bfloat16"
    raise SystemExit(f"{path}: {len(lonely)} run(s) without a partner of the "
                     f"other dtype, e.g. {a} seed {seed} target {target} has "
                     f"only {has}: finish or resume the sweep")
  return runs, order, names


def seed_means(values: dict) -> np.ndarray:
  """Each seed's mean over its targets, in seed order."""
  seeds = sorted({s for s, _ in values})
  return np.asarray([np.mean([v for (s, _), v in values.items() if s == seed])
                     for seed in seeds])


def main(path: str) -> None:
  runs, order, names = load(path)
  seeds = {s for (a, _, _), v in runs.items() for s, _ in v}
  print(f"{len(order)} algorithms, {len(seeds)} seeds, "
        f"{sum(len(v) for (_, _, m), v in runs.items() if m == 'id_acc')} runs"
        "\n")
  rows = []
  for a in order:
    for metric, column in METRICS:
      f32 = runs[(a, "float32", column)]
      bf16 = runs[(a, "bfloat16", column)]
      m32, m16 = seed_means(f32), seed_means(bf16)
      d = stats.paired_difference(bf16, f32)
      spread = m32.std(ddof=1)
      rows.append([
          names[a], metric, f"{m32.mean():.1f} ± {spread:.1f}",
          f"{m16.mean():.1f} ± {m16.std(ddof=1):.1f}",
          f"{d.mean:+.1f} [{d.low:+.1f}, {d.high:+.1f}] "
          f"{tables.significance(d)}",
          "yes" if abs(d.mean) <= spread else "no"])
  print(tables.Table(
      f"Final accuracy (%), mean ± sample std over {len(seeds)} seeds; "
      "bfloat16 − float32 paired over seeds (95 % interval)",
      ["algorithm", "metric", "float32", "bfloat16", "bfloat16 − float32",
       "|difference| ≤ float32 seed std"], rows, [], []).markdown())


if __name__ == "__main__":
  if len(sys.argv) != 2:
    raise SystemExit(__doc__)
  main(sys.argv[1])
