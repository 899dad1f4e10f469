"""Every algorithm against the reference, with statistics: the paired
differences over seeds and their 95 % intervals (`differences`, from
`stats.paired_difference`) and the per-(seed, target) values behind them
(`paired`), as report tables (`tables.Table`).
"""

from __future__ import annotations

from fedjax_dg import algorithms
from fedjax_dg.report import stats
from fedjax_dg.report.records import (display_name, eval_label, finished,
                                      missing_count, seed_values, sorted_ds)
from fedjax_dg.report.tables import (METRICS, NO_INTERVAL, PARTIAL, SIMILAR,
                                     Table, difference_of, number,
                                     reference_variant, significance,
                                     variants, with_notes)


# The differences' columns: (evaluation, metric) -> record field (`METRICS`).
COMPARED_METRICS = tuple((w, m) for w in ("final", "best") for m in ("id", "ood"))


def _compared(records: list[dict], reference: str):
  """(row, reference variant, d) of every variant that faces a variant of
  algorithm `reference` (`reference_variant`: not the reference itself, not Central
  / Local-only) and has a finished run at d, in the tables' row order."""
  rows_meta = variants(records)
  done = {(r["variant"], r["d"]) for r in finished(records)}
  for row in rows_meta:
    ref = reference_variant(rows_meta, row, reference)
    for d in sorted_ds(records):
      if ref is not None and (row["variant"], d) in done:
        yield row, ref, d


def _compared_values(records: list[dict]) -> dict[tuple[str, str], dict]:
  """{(evaluation, metric): `records.seed_values`} of `COMPARED_METRICS`."""
  return {(w, m): seed_values(records, METRICS[w][("id", "ood").index(m)])
          for w, m in COMPARED_METRICS}


def _interval_text(diff: stats.Difference, partial: str = "",
                   seeds: int | None = None) -> str:
  """'+1.2 [-0.4, +2.8] ≈' in points ('+1.2† ...' when `partial`; '(n=2)'
  after it when the difference has other than the row's `seeds`);
  '+1.2 (n<2)' without an interval."""
  if diff.mean is None:
    return "-"
  text = f"{100 * diff.mean:+.1f}{partial}"
  if diff.excludes_zero is None:
    return f"{text} ({NO_INTERVAL})"
  return (f"{text} [{100 * diff.low:+.1f}, {100 * diff.high:+.1f}] "
          + significance(diff)
          + (f" (n={diff.n})" if seeds is not None and diff.n != seeds else ""))


def differences(records: list[dict],
                reference: str = algorithms.REFERENCE) -> Table:
  """Every algorithm against the reference (algorithm `reference` run with
  the same other settings; its variant in the CSV's `reference` column) per
  d: the paired difference over seeds of μ in points with its 95 % interval
  (`stats.paired_difference`), final and best over rounds, id and ood.
  Markdown: one row per (variant, d); CSV: one row per (variant, d,
  evaluation, metric) with the interval, the counts and the per-seed
  differences.

  Args:
    records: run records, one per (cell, algorithm, target, seed) run
      (`records.records_from_cell` of each cell's results.json, or
      `records.records_from_runs_csv` of a report's runs.csv).
    reference: the algorithm every other is compared with (a registry name;
      FedAvg by default).

  Returns:
    A `tables.Table` (`markdown()` is differences.md, `csv()`
    differences.csv); a difference prints as `+1.1 [+0.2, +1.9] ↑`.
  """
  per_seed = _compared_values(records)
  lab = eval_label(records)
  csv_header = ["variant", "algorithm", "settings", "reference", "d",
                "evaluation", "metric", "difference", "ci_low", "ci_high",
                "seeds", "pairs", "unpaired", "missing_runs", "significant",
                "per_seed"]
  found, csv_rows = [], []
  for row, ref, d in _compared(records, reference):
    missing = (missing_count(records, row["variant"], d)
               + missing_count(records, ref, d))
    diffs = [difference_of(per_seed[c], row["variant"], ref, d)
             for c in COMPARED_METRICS]
    found.append((row, d, diffs, missing))
    for (w, m), x in zip(COMPARED_METRICS, diffs):
      if x.mean is None:
        continue
      sig = "" if x.excludes_zero is None else "yes" if x.excludes_zero else "no"
      csv_rows.append([
          row["variant"], row["algorithm"], row["label"], ref, d, w, m,
          100 * x.mean, number(x.low), number(x.high), x.n, x.pairs, x.unpaired,
          missing, sig or NO_INTERVAL,
          ";".join(f"{s}:{100 * v!r}" for s, v in x.per_seed.items())])
  # Only the columns some difference fills (no id without an id split).
  cols = [j for j, _ in enumerate(COMPARED_METRICS)
          if any(diffs[j].mean is not None for _, _, diffs, _ in found)]
  header = ["algorithm", "d", "seeds"] + [
      f"μ_{lab if m == 'ood' else m} {w}"
      for w, m in (COMPARED_METRICS[j] for j in cols)]
  rows = []
  for row, d, diffs, missing in found:
    partial = PARTIAL if missing or any(x.unpaired for x in diffs) else ""
    seeds = max(x.n for x in diffs)
    rows.append([row["variant"], str(d), str(seeds)]
                + [_interval_text(diffs[j], partial, seeds) for j in cols])
  name = display_name(reference)
  notes = (f"Difference with {name} run with the same other settings, in "
           "accuracy points (μ over held-out targets): per seed the mean over "
           f"targets of (algorithm − {name}), then the mean over seeds and its "
           "95 % Student-t confidence interval [low, high] (paired by seed; "
           f"fedjax_dg/report/stats.py). ↑ / ↓ = the interval excludes zero, "
           f"{SIMILAR} = it holds zero (no difference established), "
           f"{NO_INTERVAL} = one seed, no interval. paired.csv lists the "
           "per-(seed, target) values behind each difference.")
  return Table(f"Differences with {name} (paired over seeds, 95 % CI)", header,
               rows, csv_header, csv_rows, with_notes(notes, rows))


def paired(records: list[dict],
           reference: str = algorithms.REFERENCE) -> Table:
  """The values behind `differences`: per (variant, d, evaluation, metric,
  seed, target) the algorithm's and the reference's accuracy (percent) and
  their difference (points); a (seed, target) that one side has not
  finished has the other side's value and no difference.

  Args:
    records: run records, one per (cell, algorithm, target, seed) run
      (`records.records_from_cell` of each cell's results.json, or
      `records.records_from_runs_csv` of a report's runs.csv).
    reference: the algorithm every other is compared with (a registry name;
      FedAvg by default).

  Returns:
    A `tables.Table` whose `csv()` is paired.csv (no markdown rows).
  """
  per_seed = _compared_values(records)
  csv_header = ["variant", "algorithm", "reference", "d", "evaluation",
                "metric", "seed", "target", "value", "reference_value",
                "difference"]
  csv_rows = []
  for row, ref, d in _compared(records, reference):
    for (w, m), values in per_seed.items():
      x = values.get((row["variant"], d), {})
      r = values.get((ref, d), {})
      for seed, target in sorted(set(x) | set(r)):
        a, b = x.get((seed, target)), r.get((seed, target))
        csv_rows.append([row["variant"], row["algorithm"], ref, d, w, m, seed,
                         target, number(a), number(b),
                         "" if a is None or b is None else 100 * (a - b)])
  return Table("Paired values", csv_header, [], csv_header, csv_rows)
