"""Paper-shaped tables from sweep results: pure functions over loaded dicts.

Everything here is computed from results; nothing is typed in. The unit is a
*record*: one finished (sweep cell, algorithm, held-out target) run, built by
`records_from_cell` from a cell's `config.json` and `results.json`:

  cell, seed, d, algorithm, variant, label, extra, settings, target,
  final_round, id_acc, ood_acc                       (final evaluation)
  best_id_acc, best_id_round, best_ood_acc, best_ood_round,
  ood_at_best_id                                     (over the evaluation history)
  seconds, curve                                     (curve: [(round, id, ood)])

`variant` is the row label: the algorithm's paper name (hFedF's ablations as
"hFedF w/o GradAlign & EMA", from the algorithm name or the cell's
hfedf.gradalign / hfedf.ema), then in brackets the cell's grid settings that can
affect that algorithm (`label`): "hFedF [hfedf.ema_decay=0.75]",
"FedAvg [data.few_shot_k=5]". Settings of another algorithm's section are
dropped (FedAvg ignores hfedf.*). `extra` is the part of `label` outside the
algorithm's own section: rows with equal `extra` are compared (with FedAvg in
Tables 2 and 4/5, with full hFedF in Table 3).

Aggregation (every table): per (variant, d, target) the runs of each seed are
averaged (identical duplicates from irrelevant grid keys collapse), then the mean
and sample standard deviation (`ddof=1`) over seeds are taken per target, and μ is
the mean over target domains of those per-target means (the papers' μ column).
Tables show accuracies in percent; the long CSV keeps fractions.

Partial results: `sweep.load_records` adds a *missing* record (`missing=True`,
no metrics) for every run a sweep or run directory planned that has not
finished (a stopped run, a pending or failed cell: targets or seeds). A value
over fewer runs than planned is marked `PARTIAL` ("†") in every table, the
notes say so, and the CSVs count them (`missing_runs`, `..._seeds`): never a
mean over a partial set shown as complete.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from typing import Any

import numpy as np

from fedjax_dg import algorithms
from fedjax_dg.data import splits
from fedjax_dg.errors import ConfigError

# The papers' row order (hFedF's tables, then HyperGenFL's): a display
# preference only. Names and sections come from the algorithm registry; an
# algorithm not listed here follows in first-seen order.
ORDER = ("central", "local_only", "fedavg", "fedprox", "pfedhn", "fedsr",
         "fedgma", "moon", "fedsam", "fedlaw", "feddf", "fedbe", "hypergenfl",
         "hfedf", "hfedf_no_gradalign", "hfedf_no_ema", "hfedf_no_both")
REFERENCE = "fedavg"
ABLATIONS = (("hfedf.gradalign", "GradAlign"), ("hfedf.ema", "EMA"))
# Paper order of Table 3's rows.
ABLATION_ORDER = ("hFedF", "hFedF w/o GradAlign", "hFedF w/o EMA",
                  "hFedF w/o GradAlign & EMA")

METRICS = {"final": ("id_acc", "ood_acc"),
           "best": ("best_id_acc", "best_ood_acc")}
# Marks a value over fewer runs than planned (targets or seeds missing).
PARTIAL = "†"
PARTIAL_NOTE = (f" {PARTIAL} = partial: some of the planned runs (targets or "
                "seeds) have not finished; the value is over the finished ones "
                "only (report.md lists what is missing).")


def eval_label(records: list[dict]) -> str:
  """Display name of the held-out evaluation of these records ("test" or
  "ood", `splits.eval_label`). Only headers and notes change; record fields
  and CSV columns keep "ood"."""
  return splits.eval_label(r["target"] for r in records)


# --------------------------------------------------------------------- records


def _spec(algorithm: str) -> algorithms.Spec | None:
  """The registry's entry, or None for a name it no longer knows (an old run)."""
  try:
    return algorithms.spec(algorithm)
  except ConfigError:
    return None


def section_of(algorithm: str) -> str:
  """The algorithm's config section (hfedf_no_ema: hfedf)."""
  spec = _spec(algorithm)
  return spec.section if spec else algorithm


def federated(algorithm: str) -> bool:
  """False for Central / Local-only: no arrows against FedAvg, never bolded."""
  spec = _spec(algorithm)
  return spec.federated if spec else True


def is_hfedf(algorithm: str) -> bool:
  return section_of(algorithm) == "hfedf"


def display_name(algorithm: str, config: dict | None = None) -> str:
  """Paper name; for hFedF, the ablation switches that are off in `config`."""
  spec = _spec(algorithm)
  name = spec.display_name if spec else algorithm
  if algorithm != "hfedf" or not config:
    return name
  section = config.get("hfedf", {})
  off = [label for key, label in ABLATIONS
         if section.get(key.split(".", 1)[1]) is False]
  return name + (" w/o " + " & ".join(off) if off else "")


def split_settings(algorithm: str, settings: dict) -> tuple[dict, dict]:
  """(own, general): the grid settings that can affect `algorithm`, minus seed and
  d (own columns). `own` are keys of the algorithm's config section (they name
  its row); `general` the rest (data, train, client...: they group the rows that
  are compared, e.g. with FedAvg). A key under another algorithm's section
  (`hfedf.ema` for FedAvg) cannot change this algorithm's run and is dropped;
  hFedF's ablation switches are part of its name instead.
  """
  own, general = {}, {}
  for key, value in settings.items():
    if key in ("seed", "data.d"):
      continue
    section = key.split(".", 1)[0]
    if section in algorithms.modules():
      if section != section_of(algorithm):
        continue
      if algorithm == "hfedf" and key in dict(ABLATIONS):
        continue
      own[key] = value
    else:
      general[key] = value
  return own, general


def _best(curve: list[tuple], index: int):
  """(value, round) of the highest entry at `index`; the earliest round on ties."""
  points = [(c[index], c[0]) for c in curve if c[index] is not None]
  if not points:
    return None, None
  value = max(p[0] for p in points)
  return value, min(r for v, r in points if v == value)


def run_record(cell: str, seed: int, d: int, settings: dict, config: dict,
               run: dict) -> dict:
  """One record from one entry of results.json's `runs`."""
  algorithm = run["algorithm"]
  own, general = split_settings(algorithm, settings)
  label = ", ".join(f"{k}={v}" for k, v in {**own, **general}.items())
  extra = ", ".join(f"{k}={v}" for k, v in general.items())
  name = display_name(algorithm, config)
  # The scenario table's row: the variant without its scenario setting.
  row = ", ".join(f"{k}={v}" for k, v in {**own, **general}.items()
                  if k != "scenario")
  final = run.get("final") or {}
  curve = [(h["round"], h.get("id_acc"), h.get("ood_acc"))
           for h in run.get("history") or []]
  if not curve and final:
    curve = [(final.get("round"), final.get("id_acc"), final.get("ood_acc"))]
  best_id, best_id_round = _best(curve, 1)
  best_ood, best_ood_round = _best(curve, 2)
  ood_at_best_id = next((c[2] for c in curve if c[0] == best_id_round), None)
  return dict(
      cell=cell, seed=seed, d=d, algorithm=algorithm,
      variant=name + (f" [{label}]" if label else ""), label=label, extra=extra,
      scenario=config.get("scenario") or None,
      row=name + (f" [{row}]" if row else ""),
      settings=dict(settings), target=str(run["target"]),
      final_round=final.get("round"), id_acc=final.get("id_acc"),
      ood_acc=final.get("ood_acc"),
      best_id_acc=best_id, best_id_round=best_id_round,
      best_ood_acc=best_ood, best_ood_round=best_ood_round,
      ood_at_best_id=ood_at_best_id, seconds=run.get("seconds"), curve=curve,
      missing=bool(run.get("missing")))


def missing_run(algorithm: str, target) -> dict:
  """A results.json-shaped run that was planned and has not finished: its
  record (`run_record`) has `missing=True` and no metrics."""
  return dict(algorithm=algorithm, target=str(target), missing=True,
              final={}, history=[])


def records_from_cell(cell: str, settings: dict, config: dict,
                      results: dict) -> list[dict]:
  """Records of every finished run of one cell (its config.json, results.json)."""
  seed = int(config.get("seed", 0))
  d = int(config.get("data", {}).get("d", 1))
  return [run_record(cell, seed, d, settings, config, r) for r in results["runs"]]


# ----------------------------------------------------------------- aggregation


@dataclasses.dataclass
class Stat:
  """One target domain's value over seeds."""
  mean: float
  std: float | None   # sample std over seeds; None with one seed
  seeds: int
  absent: int = 0     # planned runs (seeds) of this target not finished


@dataclasses.dataclass
class Agg:
  """One (variant, d): per-target stats and μ (mean over targets)."""
  per_target: dict[str, Stat]
  mu: float | None
  runs: int
  absent: int = 0     # planned runs not finished: seeds or whole targets


def mark(stat) -> str:
  """`PARTIAL` for a Stat / Agg over fewer runs than planned, else ''."""
  return PARTIAL if stat is not None and stat.absent else ""


def _std(values, ddof: int) -> float | None:
  if len(values) <= ddof:
    return None
  return float(np.std(values, ddof=ddof))


def aggregate(records: list[dict], metric: str, ddof: int = 1, *,
              rows: str = "variant", columns: str = "d"
              ) -> dict[tuple[str, Any], Agg]:
  """{(variant, d): Agg} of `metric` (a record field such as "ood_acc"); other
  record fields as the row / column keys: {(row, scenario): Agg}."""
  by_seed: dict[tuple, dict[int, list[float]]] = {}
  runs: dict[tuple, int] = {}
  absent: dict[tuple, int] = {}
  for r in records:
    if r.get("missing"):
      key = (r[rows], r[columns], r["target"])
      absent[key] = absent.get(key, 0) + 1
      continue
    if r.get(metric) is None:
      continue
    key = (r[rows], r[columns], r["target"])
    by_seed.setdefault(key, {}).setdefault(r["seed"], []).append(float(r[metric]))
    runs[key[:2]] = runs.get(key[:2], 0) + 1
  out: dict[tuple, Agg] = {}
  for (variant, d, target), seeds in by_seed.items():
    values = [float(np.mean(v)) for _, v in sorted(seeds.items())]
    agg = out.setdefault((variant, d), Agg({}, None, runs[(variant, d)]))
    agg.per_target[target] = Stat(float(np.mean(values)), _std(values, ddof),
                                  len(values),
                                  absent.get((variant, d, target), 0))
  for agg in out.values():
    agg.mu = float(np.mean([s.mean for s in agg.per_target.values()]))
  for (variant, d, _), n in absent.items():  # the μ over what finished
    if (variant, d) in out:
      out[(variant, d)].absent += n
  return out


def missing_count(records: list[dict], variant: str, d=None) -> int:
  """Planned runs of `variant` (at `d`, or every d) that have not finished."""
  return sum(1 for r in records if r.get("missing") and r["variant"] == variant
             and (d is None or r["d"] == d))


def _notes(notes: str, rows: list[list[str]]) -> str:
  """`notes` with the PARTIAL explanation when a row holds a marked value."""
  if any(PARTIAL in cell for row in rows for cell in row[1:]):
    return notes + PARTIAL_NOTE
  return notes


def finished(records: list[dict]) -> list[dict]:
  """The records of finished runs (not `missing`)."""
  return [r for r in records if not r.get("missing")]


def _first_seen(items) -> list:
  seen = {}
  for x in items:
    seen.setdefault(x, None)
  return list(seen)


def _variants(records: list[dict]) -> list[dict]:
  """Row descriptors in display order: grouped by `extra` (first seen), then the
  papers' algorithm order, hFedF ablations in Table 3's order, then first seen."""
  rows = {}
  for i, r in enumerate(records):
    rows.setdefault(r["variant"], dict(variant=r["variant"], algorithm=r["algorithm"],
                                       label=r["label"], extra=r["extra"], seen=i))
  extras = _first_seen(r["extra"] for r in records)
  name = lambda v: v["variant"].split(" [")[0]

  def key(v):
    alg_rank = ORDER.index(v["algorithm"]) if v["algorithm"] in ORDER else len(ORDER)
    abl_rank = (ABLATION_ORDER.index(name(v)) if name(v) in ABLATION_ORDER
                else len(ABLATION_ORDER))
    return extras.index(v["extra"]), alg_rank, abl_rank, v["seen"]

  return sorted(rows.values(), key=key)


def _reference(rows: list[dict], row: dict) -> str | None:
  """The FedAvg variant compared with `row` (same extra settings)."""
  if row["algorithm"] == REFERENCE or not federated(row["algorithm"]):
    return None
  for r in rows:
    if r["algorithm"] == REFERENCE and r["extra"] == row["extra"]:
      return r["variant"]
  return None


def arrow(value: float | None, reference: float | None) -> str:
  if value is None or reference is None:
    return ""
  return "↑" if value > reference else "↓" if value < reference else "="


def pct(value: float | None, digits: int = 1) -> str:
  return "-" if value is None else f"{100 * value:.{digits}f}"


def _num(value: float | None):
  """Percent for CSV cells (full precision); empty when missing."""
  return "" if value is None else 100 * value


def _sorted_ds(records) -> list[int]:
  return sorted({r["d"] for r in records})


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
  """Bolds the best eligible value of every column within each group (in place)."""
  for g in set(groups):
    idx = [i for i, (e, gg) in enumerate(zip(eligible, groups)) if e and gg == g]
    if len(idx) < 2:
      continue
    for j in range(len(values[0])):
      col = [(values[i][j], i) for i in idx if values[i][j] is not None]
      if not col:
        continue
      best = max(v for v, _ in col)
      for v, i in col:
        if v == best:
          rows[i][j + 1] = f"**{rows[i][j + 1]}**"


def table2(records: list[dict], which: str = "final") -> Table:
  """Table 2 shape: rows = algorithms, columns = d x {μ_id, μ_ood}; μ over target
  domains and seeds; ↑/↓ vs FedAvg (same other settings) when FedAvg is present."""
  id_key, ood_key = METRICS[which]
  ds = _sorted_ds(records)
  agg_id, agg_ood = aggregate(records, id_key), aggregate(records, ood_key)
  mu = lambda agg, v, d: agg[(v, d)].mu if (v, d) in agg else None
  rows_meta = _variants(records)
  lab = eval_label(records)
  header = ["algorithm"] + [f"d={d} {m}" for d in ds
                            for m in ("μ_id", f"μ_{lab}")]
  csv_header = ["variant", "algorithm", "settings"] + [
      f"d{d}_{m}{s}" for d in ds for m in ("id", "ood")
      for s in ("", "_vs_fedavg")] + ["missing_runs"]
  rows, csv_rows, values = [], [], []
  for row in rows_meta:
    ref = _reference(rows_meta, row)
    v, line, nums = row["variant"], [row["variant"]], []
    out = [v, row["algorithm"], row["label"]]
    for d in ds:
      for agg in (agg_id, agg_ood):
        x = mu(agg, v, d)
        r = mu(agg, ref, d) if ref else None
        line.append((pct(x) + mark(agg.get((v, d))) + " "
                     + arrow(x, r)).strip())
        nums.append(x)
        out += [_num(x), "" if x is None or r is None else 100 * (x - r)]
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
           "mean over seeds. Arrows compare with FedAvg; bold = best federated "
           "method per column.")
  return Table(f"Table 2 shape ({which})", header, rows, csv_header, csv_rows,
               _notes(notes, rows))


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
  for v in _variants(recs):   # paper order; one row per variant sans scenario
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
        out += [_num(mean), "" if std is None else 100 * std, seeds]
    rows.append(line)
    csv_rows.append(out)
    values.append(nums)
  _bold_best(rows, values, [True] * len(rows), [""] * len(rows))
  notes = (f"Accuracy (%) on the held-out {lab} split: best = the highest "
           "evaluation over rounds (what the HyperGenFL paper reports), final = "
           "after the last round; mean ± std over seeds. Bold = best per column.")
  return Table("Scenario table (HyperGenFL Tables 2-5 shape)", header, rows,
               csv_header, csv_rows, _notes(notes, rows))


def per_domain(records: list[dict], d: int, which: str = "final") -> Table:
  """Tables 4/5 (and 11-17) shape at one d: per held-out domain mean ± std over
  seeds, id then ood, μ = mean over domains; arrows vs FedAvg."""
  id_key, ood_key = METRICS[which]
  sub = [r for r in records if r["d"] == d]
  targets = _first_seen(r["target"] for r in sub)
  agg = {"id": aggregate(sub, id_key), "ood": aggregate(sub, ood_key)}
  rows_meta = _variants(sub)
  lab = eval_label(sub)
  header = (["algorithm"] + [f"id {t}" for t in targets] + ["id μ"]
            + [f"{lab} {t}" for t in targets] + [f"{lab} μ"])
  csv_header = ["variant", "algorithm", "settings"]
  for m in ("id", "ood"):
    for t in targets:
      csv_header += [f"{m}_{t}_mean", f"{m}_{t}_std", f"{m}_{t}_seeds"]
    csv_header += [f"{m}_mu"]
  csv_header.append("missing_runs")
  rows, csv_rows, values = [], [], []
  for row in rows_meta:
    ref = _reference(rows_meta, row)
    v, line, out, nums = row["variant"], [row["variant"]], [
        row["variant"], row["algorithm"], row["label"]], []
    for m in ("id", "ood"):
      a = agg[m].get((v, d))
      ra = agg[m].get((ref, d)) if ref else None
      for t in targets:
        s = a.per_target.get(t) if a else None
        rs = ra.per_target.get(t) if ra else None
        if s is None:
          line.append("-")
          out += ["", "", 0]
          nums.append(None)
          continue
        text = (pct(s.mean) + ("" if s.std is None else f" ± {pct(s.std)}")
                + mark(s))
        line.append((text + " " + arrow(s.mean, rs.mean if rs else None)).strip())
        out += [100 * s.mean, "" if s.std is None else 100 * s.std, s.seeds]
        nums.append(s.mean)
      x = a.mu if a else None
      line.append((pct(x) + mark(a) + " "
                   + arrow(x, ra.mu if ra else None)).strip())
      out.append(_num(x))
      nums.append(x)
    rows.append(line)
    csv_rows.append(out + [missing_count(sub, v)])
    values.append(nums)
  _bold_best(rows, values, [federated(r["algorithm"]) for r in rows_meta],
             [r["extra"] for r in rows_meta])
  notes = (f"Accuracy (%) per held-out target domain, d = {d}, {which} evaluation: "
           "mean ± sample std over seeds; μ = mean over domains. Arrows compare "
           "with FedAvg.")
  return Table(f"Per-domain accuracy, d = {d} (Tables 4/5 shape, {which})", header,
               rows, csv_header, csv_rows, _notes(notes, rows))


def table3(records: list[dict], which: str = "final") -> Table | None:
  """Table 3 shape: hFedF variants (ablations, hfedf_* algorithms) vs full hFedF
  per d, μ_id / μ_ood with the difference to full hFedF in points. None when the
  records hold fewer than two hFedF variants."""
  id_key, ood_key = METRICS[which]
  sub = [r for r in records if is_hfedf(r["algorithm"])]
  rows_meta = _variants(sub)
  if len({r["variant"] for r in rows_meta}) < 2:
    return None
  ds = _sorted_ds(sub)
  agg_id, agg_ood = aggregate(sub, id_key), aggregate(sub, ood_key)

  def ref_of(row):
    """Plain hFedF of the same group, else its first full-hFedF row (the first
    value of each hfedf.* grid key)."""
    full = [r["variant"] for r in rows_meta
            if r["algorithm"] == "hfedf" and r["extra"] == row["extra"]
            and r["variant"].split(" [")[0] == display_name("hfedf")]
    return (display_name("hfedf") if display_name("hfedf") in full else
            full[0] if full else None)

  header = ["algorithm"] + [f"d={d} {m}" for d in ds for m in ("μ_id", "μ_ood")]
  csv_header = ["variant", "algorithm", "settings"] + [
      f"d{d}_{m}{s}" for d in ds for m in ("id", "ood") for s in ("", "_vs_hfedf")]
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
        out += [_num(x), "" if delta is None else delta]
    rows.append(line)
    csv_rows.append(out)
  # A grid over hfedf.* settings has no plain hFedF row: name what is compared.
  to = ("full hFedF" if refs in ([], [display_name("hfedf")])
        else ", ".join(f"`{r}`" for r in refs) + " (the first value of the grid)")
  notes = (f"Accuracy (%), {which} evaluation, μ over target domains and seeds; in "
           f"brackets the difference to {to} in points.")
  return Table(f"Table 3 shape: hFedF variants ({which})", header, rows,
               csv_header, csv_rows, _notes(notes, rows))


def comparison(groups: list[tuple[str, list[dict]]],
               metric: str = "ood_acc") -> Table:
  """Runs of several directories side by side (`fedjax-dg report DIR DIR...`):
  rows = algorithms (variants), one column group per (label, records) group
  (split per d where a group holds several: "label d=2"), each the group's
  targets then μ. A cell is the mean ± sample std over seeds of `metric` (a
  record field), μ the mean over targets of those means (as every table
  here). The groups are expected to share their held-out targets
  (`sweep.compare` refuses others)."""
  split = []
  for label, recs in groups:
    ds = _sorted_ds(recs)
    split += [(label + (f" d={d}" if len(ds) > 1 else ""),
               [r for r in recs if r["d"] == d], d) for d in ds]
  every = [r for _, recs in groups for r in recs]
  targets = _first_seen(r["target"] for r in every)
  aggs = [(label, aggregate(recs, metric), d) for label, recs, d in split]
  rows_meta = [v for v in _variants(every)
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
      mus.append(_num(a.mu if a else None))
    rows.append(line)
    csv_rows.append([v["variant"], v["algorithm"]] + stats + mus)
  lab = eval_label(every)
  what = {"id_acc": "id", "ood_acc": lab, "best_id_acc": "best id",
          "best_ood_acc": f"best {lab}"}.get(metric, metric)
  notes = (f"{what} accuracy (%) per held-out target, one column group per "
           "directory: mean ± sample std over seeds (no std with one seed); μ = "
           "mean over targets.")
  return Table(f"Comparison: {what} accuracy", header, rows, csv_header,
               csv_rows, _notes(notes, rows))


SUMMARY_METRICS = ("id_acc", "ood_acc", "best_id_acc", "best_ood_acc",
                   "ood_at_best_id")


def summary(records: list[dict]) -> Table:
  """One row per (variant, d): μ of every metric, with target / seed / run counts
  (the data behind the figures: few-shot k, clients N, epochs, EMA decay...)."""
  aggs = {m: aggregate(records, m) for m in SUMMARY_METRICS}
  rows_meta = _variants(records)
  lab = eval_label(records)
  header = ["algorithm", "d", "μ_id", f"μ_{lab}", "best μ_id", f"best μ_{lab}",
            f"μ_{lab} at best id", "targets", "seeds"]
  csv_header = ["variant", "algorithm", "settings", "d"] + [
      m for m in SUMMARY_METRICS] + ["targets", "seeds", "runs", "missing_runs"]
  rows, csv_rows = [], []
  for row in rows_meta:
    for d in _sorted_ds(records):
      base = aggs["id_acc"].get((row["variant"], d))
      if base is None:
        continue
      mus = [aggs[m][(row["variant"], d)].mu if (row["variant"], d) in aggs[m]
             else None for m in SUMMARY_METRICS]
      marks = [mark(aggs[m].get((row["variant"], d))) for m in SUMMARY_METRICS]
      seeds = max(s.seeds for s in base.per_target.values())
      rows.append([row["variant"], str(d)]
                  + [pct(x) + k for x, k in zip(mus, marks)]
                  + [str(len(base.per_target)), str(seeds)])
      csv_rows.append([row["variant"], row["algorithm"], row["label"], d]
                      + [_num(x) for x in mus]
                      + [len(base.per_target), seeds, base.runs,
                         missing_count(records, row["variant"], d)])
  notes = ("Accuracy (%), μ over target domains of the mean over seeds. best = the "
           "highest evaluation over rounds; 'at best id' = ood accuracy at the "
           "round of the highest id accuracy (selection on the clients' own "
           "validation splits).")
  return Table("Summary per setting", header, rows, csv_header, csv_rows,
               _notes(notes, rows))


LONG_FIELDS = ("cell", "seed", "d", "algorithm", "variant", "target",
               "final_round", "id_acc", "ood_acc", "best_id_acc", "best_id_round",
               "best_ood_acc", "best_ood_round", "ood_at_best_id", "seconds")


def long_table(records: list[dict]) -> Table:
  """Every (cell, algorithm, target, seed) run: final and best-over-rounds
  metrics (fractions, not percent) and one column per grid key."""
  records = finished(records)
  keys = _first_seen(k for r in records for k in r["settings"] if k != "seed")
  csv_header = list(LONG_FIELDS) + keys
  csv_rows = [[r[f] for f in LONG_FIELDS] + [r["settings"].get(k, "") for k in keys]
              for r in records]
  rows = [[str(r["cell"]), r["algorithm"], r["target"], pct(r["id_acc"]),
           pct(r["ood_acc"]), pct(r["best_id_acc"]), pct(r["best_ood_acc"])]
          for r in records]
  lab = eval_label(records)
  return Table("Every run", ["cell", "algorithm", "target", "id", lab, "best id",
                             f"best {lab}"], rows, csv_header, csv_rows)


def curves(records: list[dict], metric: str = "ood") -> dict[tuple, tuple]:
  """{(variant, d): (rounds, mean)}: the evaluation history of `metric` ("id" or
  "ood") averaged over targets and seeds, on the rounds every run has."""
  index = {"id": 1, "ood": 2}[metric]
  groups: dict[tuple, list] = {}
  for r in records:
    pts = {c[0]: c[index] for c in r["curve"] if c[index] is not None}
    if pts:
      groups.setdefault((r["variant"], r["d"]), []).append(pts)
  out = {}
  for key, runs in groups.items():
    rounds = sorted(set.intersection(*(set(p) for p in runs)))
    if rounds:
      out[key] = (rounds, [float(np.mean([p[x] for p in runs])) for x in rounds])
  return out
