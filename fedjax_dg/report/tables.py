"""Paper-shaped tables of many runs: pure functions over records (`records`).

Everything here is computed from results; nothing is typed in. Each table is
a `Table` (markdown with display strings, CSV with numbers): rows are
variants (`records.run_record`) in display order, columns the shape's (d x
{μ_id, μ_ood}, per-domain, scenarios, directories...); accuracies in
percent, the long CSV keeps fractions.

Differences with the reference (an algorithm's registry name, FedAvg
unless set: `algorithms.REFERENCE`, `fedjax-dg report --reference`; its
runs with the same other settings, `records.is_reference`) are paired over
seeds with a 95 % confidence interval (`stats.paired_difference`): a value
is marked ↑ / ↓ only where the interval excludes zero, `SIMILAR` ("≈")
where it holds zero, and not at all with fewer than two paired seeds;
`differences` lists every interval, `paired` the per-(seed, target) values
behind them.

Partial results: a value over fewer runs than planned (a *missing* record,
`records.missing_run`: a stopped run, a pending or failed cell) is marked
`PARTIAL` ("†") in every table, the notes say so, and the CSVs count them
(`missing_runs`, `..._seeds`): never a mean over a partial set shown as
complete.
"""

from __future__ import annotations

import csv
import dataclasses
import io

from fedjax_dg import algorithms
from fedjax_dg.report import stats
from fedjax_dg.report.records import (ablation_rank, ablation_table_name,
                                      aggregate, display_name, eval_label,
                                      federated, finished, first_seen,
                                      is_reference, missing_count, section_of,
                                      seed_values, sorted_ds, table_rank)

METRICS = {"final": ("id_acc", "ood_acc"),
           "best": ("best_id_acc", "best_ood_acc")}
# Marks a value over fewer runs than planned (targets or seeds missing).
PARTIAL = "†"
PARTIAL_NOTE = (f" {PARTIAL} = partial: some of the planned runs (targets or "
                "seeds) have not finished; the value is over the finished ones "
                "only (report.md lists what is missing).")
# Marks a value over a run that diverged (`records.diverged`); never bold.
DIVERGED = "‡"
DIVERGED_NOTE = (f" {DIVERGED} = diverged: a run behind the value ended with "
                 "a training loss far above a uniform guess's (`diverged` in "
                 "its results.json; report.md lists them); such a value is "
                 "never bold.")


# ------------------------------------------------------------------ formatting


def mark(stat) -> str:
  """`PARTIAL` for a Stat / Agg over fewer runs than planned, `DIVERGED` for
  one over a run that diverged (both when both), else ''."""
  if stat is None:
    return ""
  return ((PARTIAL if stat.absent else "")
          + (DIVERGED if getattr(stat, "diverged", 0) else ""))


def with_notes(notes: str, rows: list[list[str]]) -> str:
  """`notes` with the PARTIAL / DIVERGED explanations when a row holds a
  value so marked."""
  cells = [cell for row in rows for cell in row[1:]]
  if any(PARTIAL in cell for cell in cells):
    notes += PARTIAL_NOTE
  if any(DIVERGED in cell for cell in cells):
    notes += DIVERGED_NOTE
  return notes


def variants(records: list[dict]) -> list[dict]:
  """Row descriptors in display order: grouped by `extra` (first seen), then the
  papers' algorithm order (`records.table_rank`), an algorithm's ablations in
  its ablation table's order (`records.ablation_rank`), then first seen."""
  rows = {}
  for i, r in enumerate(records):
    rows.setdefault(r["variant"], dict(variant=r["variant"], algorithm=r["algorithm"],
                                       label=r["label"], extra=r["extra"], seen=i))
  extras = first_seen(r["extra"] for r in records)
  name = lambda v: v["variant"].split(" [")[0]

  def key(v):
    return (extras.index(v["extra"]), table_rank(v["algorithm"]),
            ablation_rank(v["algorithm"], name(v)), v["seen"])

  return sorted(rows.values(), key=key)


def reference_variant(rows: list[dict], row: dict, reference: str) -> str | None:
  """The variant of algorithm `reference` (`records.is_reference`) compared
  with `row` (same extra settings); None for the reference itself, Central
  and Local-only."""
  if (is_reference(row["algorithm"], reference)
      or not federated(row["algorithm"])):
    return None
  for r in rows:
    if is_reference(r["algorithm"], reference) and r["extra"] == row["extra"]:
      return r["variant"]
  return None


# Marks a difference with the reference whose interval holds zero.
SIMILAR = "≈"
NO_INTERVAL = "n<2"


def significance(diff: stats.Difference | None) -> str:
  """"↑" / "↓" when the paired difference's interval lies above / below
  zero, `SIMILAR` when it holds zero; '' without an interval (no reference,
  fewer than two paired seeds)."""
  if diff is None or diff.excludes_zero is None:
    return ""
  if not diff.excludes_zero:
    return SIMILAR
  return "↑" if diff.mean > 0 else "↓"


def difference_of(values: dict, variant: str, ref: str | None, d,
                target: str | None = None) -> stats.Difference | None:
  """The paired difference `variant` − `ref` at `d` (`values`:
  `records.seed_values`), over every target or over `target` only; None
  without a reference."""
  if ref is None:
    return None
  x, r = values.get((variant, d), {}), values.get((ref, d), {})
  if target is not None:
    x = {k: v for k, v in x.items() if k[1] == target}
    r = {k: v for k, v in r.items() if k[1] == target}
  return stats.paired_difference(x, r)


def _significance_note(diffs: list, reference: str) -> str:
  """The notes' sentence on the marks that `diffs` (the differences behind a
  table's marks, with algorithm `reference`) produce."""
  diffs = [x for x in diffs if x is not None and x.mean is not None]
  if not diffs:
    return ""
  name = display_name(reference)
  note = (f" ↑ / ↓ = above / below {name} run with the same other settings: "
          "the 95 % confidence interval of the paired difference over seeds "
          "excludes zero (μ: differences.md; the per-seed values: paired.csv); "
          f"{SIMILAR} = the interval holds "
          "zero, no difference established.")
  if any(x.excludes_zero is None for x in diffs):
    note += f" No mark: fewer than 2 seeds paired with {name}, no interval."
  return note


def pct(value: float | None, digits: int = 1) -> str:
  return "-" if value is None else f"{100 * value:.{digits}f}"


def number(value: float | None):
  """Percent for CSV cells (full precision); empty when missing."""
  return "" if value is None else 100 * value


# ----------------------------------------------------------------------- tables


@dataclasses.dataclass
class Table:
  """A table as markdown (display strings) and as CSV (numbers)."""
  title: str
  header: list[str]
  rows: list[list[str]]
  csv_header: list[str]
  csv_rows: list[list]
  notes: str = ""

  def markdown(self) -> str:
    lines = [f"### {self.title}", ""]
    if self.notes:
      lines += [self.notes, ""]
    lines += ["| " + " | ".join(self.header) + " |",
              "|" + "|".join(["---"] + ["---:"] * (len(self.header) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in self.rows]
    return "\n".join(lines) + "\n"

  def csv(self) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(self.csv_header)
    for row in self.csv_rows:
      writer.writerow(["" if v is None else (repr(v) if isinstance(v, float) else v)
                       for v in row])
    return buf.getvalue()


def _bold_best(rows: list[list[str]], values: list[list[float | None]],
               eligible: list[bool], groups: list[str]) -> None:
  """Bolds the best eligible value of every column within each group (in
  place); a value marked `DIVERGED` is never bold (nor the best)."""
  for g in set(groups):
    idx = [i for i, (e, gg) in enumerate(zip(eligible, groups)) if e and gg == g]
    if len(idx) < 2:
      continue
    for j in range(len(values[0])):
      col = [(values[i][j], i) for i in idx if values[i][j] is not None
             and DIVERGED not in rows[i][j + 1]]
      if not col:
        continue
      best = max(v for v, _ in col)
      for v, i in col:
        if v == best:
          rows[i][j + 1] = f"**{rows[i][j + 1]}**"


def table2(records: list[dict], which: str = "final",
           reference: str = algorithms.REFERENCE) -> Table:
  """Table 2 shape: rows = algorithms, columns = d x {μ_id, μ_ood}; μ over target
  domains and seeds; ↑ / ↓ / ≈ vs algorithm `reference` (same other settings)
  by the paired difference's interval (`significance`) when it is present;
  the CSV's `..._vs_<reference>` columns hold the differences of μ.

  Args:
    records: run records, one per (cell, algorithm, target, seed) run
      (`records.records_from_cell` of each cell's results.json, or
      `records.records_from_runs_csv` of a report's runs.csv).
    reference: the algorithm every other is compared with (a registry name;
      FedAvg by default).
    which: "final" (the last evaluation) or "best" (the best over rounds).

  Returns:
    A `Table`: `markdown()` is table2.md, `csv()` table2.csv.
  """
  id_key, ood_key = METRICS[which]
  ds = sorted_ds(records)
  # (aggregate, per-seed values) of id, then ood.
  metrics = [(aggregate(records, k), seed_values(records, k))
             for k in (id_key, ood_key)]
  mu = lambda agg, v, d: agg[(v, d)].mu if (v, d) in agg else None
  rows_meta = variants(records)
  lab = eval_label(records)
  header = ["algorithm"] + [f"d={d} {m}" for d in ds
                            for m in ("μ_id", f"μ_{lab}")]
  csv_header = ["variant", "algorithm", "settings"] + [
      f"d{d}_{m}{s}" for d in ds for m in ("id", "ood")
      for s in ("", f"_vs_{reference}")] + ["missing_runs"]
  rows, csv_rows, values, diffs = [], [], [], []
  for row in rows_meta:
    ref = reference_variant(rows_meta, row, reference)
    v, line, nums = row["variant"], [row["variant"]], []
    out = [v, row["algorithm"], row["label"]]
    for d in ds:
      for agg, per_seed in metrics:
        x = mu(agg, v, d)
        r = mu(agg, ref, d) if ref else None
        diff = difference_of(per_seed, v, ref, d)
        diffs.append(diff)
        line.append((pct(x) + mark(agg.get((v, d))) + " "
                     + significance(diff)).strip())
        nums.append(x)
        out += [number(x), "" if x is None or r is None else 100 * (x - r)]
    rows.append(line)
    csv_rows.append(out + [missing_count(records, v)])
    values.append(nums)
  _bold_best(rows, values,
             [federated(r["algorithm"]) for r in rows_meta],
             [r["extra"] for r in rows_meta])
  label = {"final": "final evaluation",
           "best": "best evaluation over rounds (optimistic: picks the round on "
                   "the evaluation data; the hFedF papers report the final "
                   "round, HyperGenFL the best)"}[which]
  notes = (f"Accuracy (%), {label}; μ = mean over held-out target domains of the "
           "mean over seeds; bold = best federated method per column."
           + _significance_note(diffs, reference))
  return Table(f"Table 2 shape ({which})", header, rows, csv_header, csv_rows,
               with_notes(notes, rows))


SCENARIO_ORDER = ("standard", "advanced", "extreme")


def scenario_table(records: list[dict]) -> Table | None:
  """HyperGenFL's Table 2-5 shape: rows = algorithms, columns = Table 1
  scenarios x {best over rounds (the paper's number), final}; accuracy on the
  held-out evaluation split, mean ± std over seeds (μ over targets if several).
  None when no record has a scenario."""
  recs = [r for r in records if r.get("scenario")]
  if not recs:
    return None
  order = lambda s: (SCENARIO_ORDER.index(s) if s in SCENARIO_ORDER
                     else len(SCENARIO_ORDER), s)
  scenarios = sorted({r["scenario"] for r in recs}, key=order)
  aggs = {w: aggregate(recs, METRICS[w][1], rows="row", columns="scenario")
          for w in ("best", "final")}
  lab = eval_label(recs)
  rows_meta, seen = [], set()
  for v in variants(recs):   # paper order; one row per variant sans scenario
    row = next(r["row"] for r in recs if r["variant"] == v["variant"])
    if row not in seen:
      seen.add(row)
      rows_meta.append(dict(v, row=row))
  header = ["algorithm"] + [f"{s} {w}" for s in scenarios for w in ("best", "final")]
  csv_header = ["row", "algorithm"] + [f"{s}_{w}{x}" for s in scenarios
                                       for w in ("best", "final")
                                       for x in ("", "_std", "_seeds")]
  rows, csv_rows, values = [], [], []
  for meta in rows_meta:
    line, out, nums = [meta["row"]], [meta["row"], meta["algorithm"]], []
    for s in scenarios:
      for w in ("best", "final"):
        agg = aggs[w].get((meta["row"], s))
        mean = agg.mu if agg else None
        stds = [st.std for st in agg.per_target.values()] if agg else []
        std = stds[0] if len(stds) == 1 else None
        seeds = min(st.seeds for st in agg.per_target.values()) if agg else 0
        line.append(pct(mean) + (f" ± {100 * std:.1f}" if std is not None else "")
                    + mark(agg))
        nums.append(mean)
        out += [number(mean), "" if std is None else 100 * std, seeds]
    rows.append(line)
    csv_rows.append(out)
    values.append(nums)
  _bold_best(rows, values, [True] * len(rows), [""] * len(rows))
  notes = (f"Accuracy (%) on the held-out {lab} split: best = the highest "
           "evaluation over rounds (what the HyperGenFL paper reports), final = "
           "after the last round; mean ± std over seeds. Bold = best per column.")
  return Table("Scenario table (HyperGenFL Tables 2-5 shape)", header, rows,
               csv_header, csv_rows, with_notes(notes, rows))


def per_domain(records: list[dict], d: int, which: str = "final",
               reference: str = algorithms.REFERENCE) -> Table:
  """Tables 4/5 (and 11-17) shape at one d: per held-out domain mean ± std over
  seeds, id then ood, μ = mean over domains; ↑ / ↓ / ≈ vs algorithm
  `reference` by the paired difference's interval, per domain over its seeds
  (`significance`).

  Args:
    records: run records, one per (cell, algorithm, target, seed) run
      (`records.records_from_cell` of each cell's results.json, or
      `records.records_from_runs_csv` of a report's runs.csv).
    reference: the algorithm every other is compared with (a registry name;
      FedAvg by default).
    d: the source domains per client of the rows shown (`data.d`).
    which: "final" or "best".

  Returns:
    A `Table`: `markdown()` is per_domain_d<d>.md, `csv()` its CSV.
  """
  id_key, ood_key = METRICS[which]
  sub = [r for r in records if r["d"] == d]
  targets = first_seen(r["target"] for r in sub)
  agg = {"id": aggregate(sub, id_key), "ood": aggregate(sub, ood_key)}
  per_seed = {"id": seed_values(sub, id_key), "ood": seed_values(sub, ood_key)}
  rows_meta = variants(sub)
  lab = eval_label(sub)
  header = (["algorithm"] + [f"id {t}" for t in targets] + ["id μ"]
            + [f"{lab} {t}" for t in targets] + [f"{lab} μ"])
  csv_header = ["variant", "algorithm", "settings"]
  for m in ("id", "ood"):
    for t in targets:
      csv_header += [f"{m}_{t}_mean", f"{m}_{t}_std", f"{m}_{t}_seeds"]
    csv_header += [f"{m}_mu"]
  csv_header.append("missing_runs")
  rows, csv_rows, values, diffs = [], [], [], []
  for row in rows_meta:
    ref = reference_variant(rows_meta, row, reference)
    v, line, out, nums = row["variant"], [row["variant"]], [
        row["variant"], row["algorithm"], row["label"]], []
    for m in ("id", "ood"):
      a = agg[m].get((v, d))
      for t in targets:
        s = a.per_target.get(t) if a else None
        if s is None:
          line.append("-")
          out += ["", "", 0]
          nums.append(None)
          continue
        text = (pct(s.mean) + ("" if s.std is None else f" ± {pct(s.std)}")
                + mark(s))
        diffs.append(difference_of(per_seed[m], v, ref, d, t))
        line.append((text + " " + significance(diffs[-1])).strip())
        out += [100 * s.mean, "" if s.std is None else 100 * s.std, s.seeds]
        nums.append(s.mean)
      x = a.mu if a else None
      diffs.append(difference_of(per_seed[m], v, ref, d))
      line.append((pct(x) + mark(a) + " " + significance(diffs[-1])).strip())
      out.append(number(x))
      nums.append(x)
    rows.append(line)
    csv_rows.append(out + [missing_count(sub, v)])
    values.append(nums)
  _bold_best(rows, values, [federated(r["algorithm"]) for r in rows_meta],
             [r["extra"] for r in rows_meta])
  notes = (f"Accuracy (%) per held-out target domain, d = {d}, {which} evaluation: "
           "mean ± sample std over seeds; μ = mean over domains."
           + _significance_note(diffs, reference))
  return Table(f"Per-domain accuracy, d = {d} (Tables 4/5 shape, {which})", header,
               rows, csv_header, csv_rows, with_notes(notes, rows))


def ablation_table(records: list[dict], section: str,
                   which: str = "final") -> Table | None:
  """An ablation table's shape (hFedF's Table 3): the variants of algorithm
  module `section` (its ablation switches off, `records.ablations`, and its
  `VARIANTS`) vs the full algorithm per d, μ_id / μ_ood with the difference
  to the full algorithm in points. None when the records hold fewer than two
  of its variants."""
  id_key, ood_key = METRICS[which]
  full_name = display_name(section)
  sub = [r for r in records if section_of(r["algorithm"]) == section]
  rows_meta = variants(sub)
  if len({r["variant"] for r in rows_meta}) < 2:
    return None
  ds = sorted_ds(sub)
  agg_id, agg_ood = aggregate(sub, id_key), aggregate(sub, ood_key)

  def ref_of(row):
    """The plain full algorithm of the same group, else its first full row
    (the first value of each grid key of its section)."""
    full = [r["variant"] for r in rows_meta
            if r["algorithm"] == section and r["extra"] == row["extra"]
            and r["variant"].split(" [")[0] == full_name]
    return (full_name if full_name in full else full[0] if full else None)

  header = ["algorithm"] + [f"d={d} {m}" for d in ds for m in ("μ_id", "μ_ood")]
  csv_header = ["variant", "algorithm", "settings"] + [
      f"d{d}_{m}{s}" for d in ds for m in ("id", "ood") for s in ("", f"_vs_{section}")]
  rows, csv_rows, refs = [], [], []
  for row in rows_meta:
    ref = ref_of(row)
    if ref and ref != row["variant"] and ref not in refs:
      refs.append(ref)
    line, out = [row["variant"]], [row["variant"], row["algorithm"], row["label"]]
    for d in ds:
      for agg in (agg_id, agg_ood):
        x = agg[(row["variant"], d)].mu if (row["variant"], d) in agg else None
        r = agg[(ref, d)].mu if ref and ref != row["variant"] and (ref, d) in agg \
            else None
        delta = None if x is None or r is None else 100 * (x - r)
        partial = mark(agg.get((row["variant"], d))) or (
            mark(agg.get((ref, d))) if delta is not None else "")
        line.append(pct(x) + partial
                    + ("" if delta is None else f" ({delta:+.1f})"))
        out += [number(x), "" if delta is None else delta]
    rows.append(line)
    csv_rows.append(out)
  # A grid over the section's settings has no plain row: name what is compared.
  to = (f"full {full_name}" if refs in ([], [full_name])
        else ", ".join(f"`{r}`" for r in refs) + " (the first value of the grid)")
  notes = (f"Accuracy (%), {which} evaluation, μ over target domains and seeds; in "
           f"brackets the difference to {to} in points.")
  return Table(f"{ablation_table_name(section)} shape: {full_name} variants "
               f"({which})", header, rows,
               csv_header, csv_rows, with_notes(notes, rows))


def comparison(groups: list[tuple[str, list[dict]]],
               metric: str = "ood_acc") -> Table:
  """Runs of several directories side by side (`fedjax-dg report DIR DIR...`):
  rows = algorithms (variants), one column group per (label, records) group
  (split per d where a group holds several: "label d=2"), each the group's
  targets then μ. A cell is the mean ± sample std over seeds of `metric` (a
  record field), μ the mean over targets of those means (as every table
  here). The groups are expected to share their held-out targets
  (`reports.compare` refuses others)."""
  split = []
  for label, recs in groups:
    ds = sorted_ds(recs)
    split += [(label + (f" d={d}" if len(ds) > 1 else ""),
               [r for r in recs if r["d"] == d], d) for d in ds]
  every = [r for _, recs in groups for r in recs]
  targets = first_seen(r["target"] for r in every)
  aggs = [(label, aggregate(recs, metric), d) for label, recs, d in split]
  rows_meta = [v for v in variants(every)
               if any((v["variant"], d) in agg for _, agg, d in aggs)]
  header = ["algorithm"] + [f"{label} {t}" for label, _, _ in aggs
                            for t in targets + ["μ"]]
  csv_header = ["variant", "algorithm"] + [
      f"{label}:{t}_{x}" for label, _, _ in aggs for t in targets
      for x in ("mean", "std", "seeds")] + [f"{label}:mu" for label, _, _ in aggs]
  rows, csv_rows = [], []
  for v in rows_meta:
    line, stats, mus = [v["variant"]], [], []
    for _, agg, d in aggs:
      a = agg.get((v["variant"], d))
      for t in targets:
        s = a.per_target.get(t) if a else None
        line.append("-" if s is None else pct(s.mean) + (
            "" if s.std is None else f" ± {pct(s.std)}") + mark(s))
        stats += ["", "", 0] if s is None else [
            100 * s.mean, "" if s.std is None else 100 * s.std, s.seeds]
      line.append(pct(a.mu if a else None) + mark(a))
      mus.append(number(a.mu if a else None))
    rows.append(line)
    csv_rows.append([v["variant"], v["algorithm"]] + stats + mus)
  lab = eval_label(every)
  what = {"id_acc": "id", "ood_acc": lab, "best_id_acc": "best id",
          "best_ood_acc": f"best {lab}"}.get(metric, metric)
  notes = (f"{what} accuracy (%) per held-out target, one column group per "
           "directory: mean ± sample std over seeds (no std with one seed); μ = "
           "mean over targets.")
  return Table(f"Comparison: {what} accuracy", header, rows, csv_header,
               csv_rows, with_notes(notes, rows))


SUMMARY_METRICS = ("id_acc", "ood_acc", "best_id_acc", "best_ood_acc",
                   "ood_at_best_id")


def summary(records: list[dict]) -> Table:
  """One row per (variant, d): μ of every metric, with target / seed / run counts
  (the data behind the figures: few-shot k, clients N, epochs, EMA decay...)."""
  lab = eval_label(records)
  metrics, names = list(SUMMARY_METRICS), ["μ_id", f"μ_{lab}", "best μ_id",
                                           f"best μ_{lab}", f"μ_{lab} at best id"]
  if any(r.get("best_client_ood_acc") is not None for r in records):
    metrics.append("best_client_ood_acc")   # per-client models (FedSDAF)
    names.append(f"μ_{lab} best client")
  aggs = {m: aggregate(records, m) for m in metrics}
  rows_meta = variants(records)
  header = ["algorithm", "d"] + names + ["targets", "seeds"]
  csv_header = ["variant", "algorithm", "settings", "d"] + metrics + [
      "targets", "seeds", "runs", "missing_runs"]
  rows, csv_rows = [], []
  for row in rows_meta:
    for d in sorted_ds(records):
      base = aggs["id_acc"].get((row["variant"], d))
      if base is None:
        continue
      mus = [aggs[m][(row["variant"], d)].mu if (row["variant"], d) in aggs[m]
             else None for m in metrics]
      marks = [mark(aggs[m].get((row["variant"], d))) for m in metrics]
      seeds = max(s.seeds for s in base.per_target.values())
      rows.append([row["variant"], str(d)]
                  + [pct(x) + k for x, k in zip(mus, marks)]
                  + [str(len(base.per_target)), str(seeds)])
      csv_rows.append([row["variant"], row["algorithm"], row["label"], d]
                      + [number(x) for x in mus]
                      + [len(base.per_target), seeds, base.runs,
                         missing_count(records, row["variant"], d)])
  notes = ("Accuracy (%), μ over target domains of the mean over seeds. best = the "
           "highest evaluation over rounds; 'at best id' = ood accuracy at the "
           "round of the highest id accuracy (selection on the clients' own "
           "validation splits)." + (
               " 'best client' = the best of the clients' own final models "
               "on the target, chosen on the target itself (what FedSDAF's "
               "released code reports; not a federated-DG result)."
               if "best_client_ood_acc" in metrics else ""))
  return Table("Summary per setting", header, rows, csv_header, csv_rows,
               with_notes(notes, rows))


LONG_FIELDS = ("cell", "seed", "d", "algorithm", "variant", "target",
               "final_round", "id_acc", "ood_acc", "best_id_acc", "best_id_round",
               "best_ood_acc", "best_ood_round", "ood_at_best_id", "seconds",
               "best_client_ood_acc", "commit", "dirty", "diverged")


def long_table(records: list[dict]) -> Table:
  """Every (cell, algorithm, target, seed) run: final and best-over-rounds
  metrics (fractions, not percent), the fedjax_dg commit it ran at and
  whether that tree was dirty (empty: not recorded), why it counts as
  diverged (empty: it did not), and one column per grid key."""
  records = finished(records)
  keys = first_seen(k for r in records for k in r["settings"] if k != "seed")
  csv_header = list(LONG_FIELDS) + keys
  csv_rows = [[r.get(f) for f in LONG_FIELDS]
              + [r["settings"].get(k, "") for k in keys] for r in records]
  blown = lambda r: DIVERGED if r.get("diverged") else ""
  rows = [[str(r["cell"]), r["algorithm"], r["target"], pct(r["id_acc"]) + blown(r),
           pct(r["ood_acc"]) + blown(r), pct(r["best_id_acc"]) + blown(r),
           pct(r["best_ood_acc"]) + blown(r)]
          for r in records]
  lab = eval_label(records)
  return Table("Every run", ["cell", "algorithm", "target", "id", lab, "best id",
                             f"best {lab}"], rows, csv_header, csv_rows)


