"""Records of finished runs, and their aggregation over seeds and targets.

The unit of every sweep table (`tables`) and figure (`plots.sweep_curves`) is
a *record*: one (sweep cell, algorithm, held-out target) run, built by
`records_from_cell` from a cell's `config.json` and `results.json`:

  cell, seed, d, algorithm, variant, label, extra, settings, target,
  final_round, id_acc, ood_acc                       (final evaluation)
  best_id_acc, best_id_round, best_ood_acc, best_ood_round,
  ood_at_best_id                                     (over the evaluation history)
  seconds, curve                                     (curve: [(round, id, ood)])
  best_client_ood_acc       (the best client model's final ood accuracy: with
                             per-client models, chosen on the target itself)
  commit, dirty, source         (the fedjax_dg code it ran at: `origin`)

`variant` is the row label: the algorithm's display name (from the registry,
`algorithms.Spec.display_name`; with an algorithm's ablation switches off in
the cell's config, "<name> w/o <switch>": `Spec.ablations`), then in brackets
the cell's grid settings that can affect that algorithm (`label`): "hFedF
[hfedf.ema_decay=0.75]", "FedAvg [data.few_shot_k=5]". Settings of another
algorithm's section are dropped (FedAvg ignores hfedf.*). `extra` is the part
of `label` outside the algorithm's own section: rows with equal `extra` are
compared (with the reference algorithm, and within an ablation table).

Aggregation: per (variant, d, target) the runs of each seed are averaged
(identical duplicates from irrelevant grid keys collapse: `seed_values`),
then the mean and sample standard deviation (`ddof=1`) over seeds are taken
per target, and μ is the mean over target domains of those per-target means
(the papers' μ). The same per-seed values, paired by seed, give the
differences with the reference (`stats.paired_difference`).

A run planned and not finished is a *missing* record (`missing=True`, no
metrics: `missing_run`); the aggregates count them (`absent`) so that the
tables can mark a partial value.

A finished run whose training blew up without going non-finite (`diverged`:
its final training loss far above chance level's) is recorded as it ran, with
the reason in results.json's `diverged`; its record says so, the aggregates
count it (`diverged`) and the tables mark it and never bold it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from fedjax_dg import algorithms
from fedjax_dg.data import splits
from fedjax_dg.errors import ConfigError
from fedjax_dg.report import origin


# A run whose final training loss exceeds this many times ln(classes) (the
# cross-entropy of a uniform guess, where a fresh model starts) has diverged.
# Normal runs end below 1 x ln(C) with a cross-entropy objective and below
# 2.7 x with FedSDAF's sum of losses (every registered algorithm at its
# defaults; the committed Styled Fashion-MNIST Table 1 and Fig. 11 runs);
# runs that blew up end at 1e12-1e31 (Adam lr 1e9, SGD lr 500: docs/testing.md,
# "Sweep drills"). Their first round may be diverged already (its loss the
# mean over its local steps), so the rule does not compare with it.
DIVERGENCE_FACTOR = 100


def diverged(history: list[dict], num_classes: int) -> str | None:
  """Why a finished run counts as diverged (one sentence), or None: its last
  evaluation's training loss (`history[-1]["train_loss"]`, the mean over
  that evaluation's rounds) is above `DIVERGENCE_FACTOR` x ln(`num_classes`).
  What `OpenRun.record` writes into results.json's `diverged`."""
  loss = history[-1].get("train_loss") if history else None
  limit = DIVERGENCE_FACTOR * math.log(max(int(num_classes), 2))
  if loss is None or not math.isfinite(loss) or loss <= limit:
    return None
  return (f"diverged: final training loss {loss:.3g} > {limit:.3g} "
          f"({DIVERGENCE_FACTOR} x ln {num_classes}, a uniform guess's); its "
          "accuracies are those of a blown-up model (a learning rate too "
          "large?)")


def eval_label(records: list[dict]) -> str:
  """Display name of the held-out evaluation of these records ("test" or
  "ood", `splits.eval_label`). Only headers and notes change; record fields
  and CSV columns keep "ood"."""
  return splits.eval_label(r["target"] for r in records)


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
  """False for Central / Local-only: no arrows against the reference, never
  bolded."""
  spec = _spec(algorithm)
  return spec.federated if spec else True


def ablations(algorithm: str) -> dict[str, str]:
  """{key: label} of the ablation switches a run of `algorithm` can turn off
  in its section (`Spec.ablations`); only the module's own name has them (a
  variant fixes them)."""
  spec = _spec(algorithm)
  return spec.ablations if spec and spec.name == spec.section else {}


def ablation_sections(records: list[dict]) -> list[str]:
  """The sections of the records' algorithms that declare ablations
  (`Spec.ablations`), in first-seen order: one ablation table each."""
  sections = first_seen(section_of(r["algorithm"]) for r in records)
  return [s for s in sections if ablations(s)]


def ablation_table_name(section: str) -> str:
  """The paper's name of `section`'s ablation table (`Spec.ablation_table`)."""
  return algorithms.spec(section).ablation_table


def ablation_rank(algorithm: str, name: str) -> int:
  """The place of display name `name` among its module's ablation rows: the
  full algorithm, then its variants in `VARIANTS` order; the same for every
  row of a module without ablations."""
  spec = _spec(algorithm)
  if spec is None or not algorithms.spec(spec.section).ablations:
    return 0
  names = [display_name(spec.section)] + [display_name(v)
                                          for v in spec.variants]
  return names.index(name) if name in names else len(names)


def table_rank(algorithm: str) -> tuple[int, int]:
  """The algorithm's place among the tables' rows (`Spec.table_rank`); a name
  the registry no longer knows ranks with the unlisted ones."""
  spec = _spec(algorithm)
  return spec.table_rank if spec else (len(algorithms.TABLE_ORDER), 0)


def is_reference(algorithm: str, reference: str = algorithms.REFERENCE) -> bool:
  """Whether `algorithm` is the tables' baseline: `reference` (a registry
  name; `fedjax-dg report --reference`), FedAvg unless set."""
  return algorithm == reference


def display_name(algorithm: str, config: dict | None = None) -> str:
  """The paper's name (`Spec.display_name`); with the run's `config`, the
  ablation switches it turns off (`ablations`): "<name> w/o <label>"."""
  spec = _spec(algorithm)
  name = spec.display_name if spec else algorithm
  switches = ablations(algorithm)
  if not switches or not config:
    return name
  section = config.get(spec.section, {})
  off = [label for key, label in switches.items() if section.get(key) is False]
  return name + (" w/o " + " & ".join(off) if off else "")


def split_settings(algorithm: str, settings: dict) -> tuple[dict, dict]:
  """(own, general): the grid settings that can affect `algorithm`, minus seed and
  d (own columns). `own` are keys of the algorithm's config section (they name
  its row); `general` the rest (data, train, client...: they group the rows that
  are compared, e.g. with FedAvg). A key under another algorithm's section
  (`hfedf.ema` for FedAvg) cannot change this algorithm's run and is dropped;
  its ablation switches (`ablations`) are part of its name instead.
  """
  own, general = {}, {}
  for key, value in settings.items():
    if key in ("seed", "data.d"):
      continue
    section = key.split(".", 1)[0]
    if section in algorithms.modules():
      if section != section_of(algorithm):
        continue
      if key.split(".", 1)[1] in ablations(algorithm):
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
               run: dict, source: dict | None = None) -> dict:
  """One record from one entry of results.json's `runs`; `source`: its
  results.json's (the commit of a run that records none)."""
  algorithm = run["algorithm"]
  final = run.get("final") or {}
  ran_at = origin.run_source(run, source) or {}
  curve = [(h["round"], h.get("id_acc"), h.get("ood_acc"))
           for h in run.get("history") or []]
  if not curve and final:
    curve = [(final.get("round"), final.get("id_acc"), final.get("ood_acc"))]
  best_id, best_id_round = _best(curve, 1)
  best_ood, best_ood_round = _best(curve, 2)
  ood_at_best_id = next((c[2] for c in curve if c[0] == best_id_round), None)
  per_client = final.get("ood_acc_per_client")
  return dict(
      cell=cell, seed=seed, d=d, algorithm=algorithm,
      **_names(algorithm, display_name(algorithm, config), settings),
      scenario=config.get("scenario") or None,
      settings=dict(settings), target=str(run["target"]),
      final_round=final.get("round"), id_acc=final.get("id_acc"),
      ood_acc=final.get("ood_acc"),
      best_id_acc=best_id, best_id_round=best_id_round,
      best_ood_acc=best_ood, best_ood_round=best_ood_round,
      ood_at_best_id=ood_at_best_id, seconds=run.get("seconds"), curve=curve,
      best_client_ood_acc=max(per_client) if per_client else None,
      commit=ran_at.get("commit"), dirty=ran_at.get("dirty"),
      source=ran_at or None, diverged=run.get("diverged") or None,
      missing=bool(run.get("missing")))


def _names(algorithm: str, name: str, settings: dict) -> dict:
  """A record's `variant`, `label`, `extra` and `row` (module docstring)
  from the algorithm's display name and the cell's grid settings."""
  own, general = split_settings(algorithm, settings)
  label = ", ".join(f"{k}={v}" for k, v in {**own, **general}.items())
  # The scenario table's row: the variant without its scenario setting.
  row = ", ".join(f"{k}={v}" for k, v in {**own, **general}.items()
                  if k != "scenario")
  return dict(variant=name + (f" [{label}]" if label else ""), label=label,
              extra=", ".join(f"{k}={v}" for k, v in general.items()),
              row=name + (f" [{row}]" if row else ""))


def _parsed(text: str):
  """A runs.csv cell as the record held it: None, bool, int, float or str."""
  if text == "":
    return None
  if text in ("True", "False"):
    return text == "True"
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def records_from_runs_csv(rows: list[dict], fields) -> list[dict]:
  """Records of the finished runs a report's runs.csv lists (`rows`: its
  csv.DictReader rows; `fields`: the fixed columns, `tables.LONG_FIELDS`,
  the others being grid keys), so the tables of a report whose
  results.json files are gone can be made again from its committed
  runs.csv (docs/results/derive.py). A field the file lacks (an older
  fedjax_dg's: `commit`) is None; `curve` is empty (no figures); every grid
  value is a string, as in a sweep."""
  out = []
  for row in rows:
    record = dict.fromkeys(fields)
    record.update({k: _parsed(v) for k, v in row.items() if k in fields})
    settings = {k: v for k, v in row.items() if k not in fields}
    settings["seed"] = str(record["seed"])
    label = _names(record["algorithm"], "", settings)["label"]
    name = record["variant"]
    if label and name.endswith(f" [{label}]"):
      name = name[:-len(f" [{label}]")]
    record.update(_names(record["algorithm"], name, settings),
                  cell=str(record["cell"]), target=str(record["target"]),
                  scenario=settings.get("scenario"), settings=settings,
                  curve=[], missing=False,
                  source=(dict(commit=record["commit"], dirty=record["dirty"])
                          if record["commit"] else None))
    out.append(record)
  return out


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
  return [run_record(cell, seed, d, settings, config, r, results.get("source"))
          for r in results["runs"]]


@dataclasses.dataclass
class Stat:
  """One target domain's value over seeds."""
  mean: float
  std: float | None   # sample std over seeds; None with one seed
  seeds: int
  absent: int = 0     # planned runs (seeds) of this target not finished
  diverged: int = 0   # finished runs of this target that diverged


@dataclasses.dataclass
class Agg:
  """One (variant, d): per-target stats and μ (mean over targets)."""
  per_target: dict[str, Stat]
  mu: float | None
  runs: int
  absent: int = 0     # planned runs not finished: seeds or whole targets
  diverged: int = 0   # finished runs that diverged (`diverged`)


def _std(values, ddof: int) -> float | None:
  if len(values) <= ddof:
    return None
  return float(np.std(values, ddof=ddof))


def seed_values(records: list[dict], metric: str, *, rows: str = "variant",
                columns: str = "d") -> dict[tuple, dict[tuple[int, str], float]]:
  """{(variant, d): {(seed, target): value}} of `metric` over the finished
  runs, the runs of one seed averaged (identical duplicates from irrelevant
  grid keys collapse), keys in first-seen order; other record fields as the
  row / column keys. The values `aggregate` and the paired differences
  (`stats.paired_difference`) start from."""
  runs: dict[tuple, dict[tuple[int, str], list[float]]] = {}
  for r in records:
    if r.get("missing") or r.get(metric) is None:
      continue
    runs.setdefault((r[rows], r[columns]), {}).setdefault(
        (r["seed"], r["target"]), []).append(float(r[metric]))
  return {key: {k: float(np.mean(v)) for k, v in cells.items()}
          for key, cells in runs.items()}


def aggregate(records: list[dict], metric: str, ddof: int = 1, *,
              rows: str = "variant", columns: str = "d"
              ) -> dict[tuple[str, Any], Agg]:
  """{(variant, d): Agg} of `metric` (a record field such as "ood_acc"); other
  record fields as the row / column keys: {(row, scenario): Agg}."""
  runs: dict[tuple, int] = {}
  absent: dict[tuple, int] = {}
  blown: dict[tuple, int] = {}
  for r in records:
    if r.get("missing"):
      key = (r[rows], r[columns], r["target"])
      absent[key] = absent.get(key, 0) + 1
    elif r.get(metric) is not None:
      runs[(r[rows], r[columns])] = runs.get((r[rows], r[columns]), 0) + 1
      if r.get("diverged"):
        key = (r[rows], r[columns], r["target"])
        blown[key] = blown.get(key, 0) + 1
  out: dict[tuple, Agg] = {}
  for (variant, d), cells in seed_values(records, metric, rows=rows,
                                         columns=columns).items():
    by_target: dict[str, dict[int, float]] = {}
    for (seed, target), value in cells.items():
      by_target.setdefault(target, {})[seed] = value
    agg = out[(variant, d)] = Agg({}, None, runs[(variant, d)])
    for target, seeds in by_target.items():
      values = [v for _, v in sorted(seeds.items())]
      agg.per_target[target] = Stat(float(np.mean(values)), _std(values, ddof),
                                    len(values),
                                    absent.get((variant, d, target), 0),
                                    blown.get((variant, d, target), 0))
    agg.mu = float(np.mean([s.mean for s in agg.per_target.values()]))
    agg.diverged = sum(s.diverged for s in agg.per_target.values())
  for (variant, d, _), n in absent.items():  # the μ over what finished
    if (variant, d) in out:
      out[(variant, d)].absent += n
  return out


def missing_count(records: list[dict], variant: str, d=None) -> int:
  """Planned runs of `variant` (at `d`, or every d) that have not finished."""
  return sum(1 for r in records if r.get("missing") and r["variant"] == variant
             and (d is None or r["d"] == d))


def finished(records: list[dict]) -> list[dict]:
  """The records of finished runs (not `missing`)."""
  return [r for r in records if not r.get("missing")]


def first_seen(items) -> list:
  seen = {}
  for x in items:
    seen.setdefault(x, None)
  return list(seen)


def sorted_ds(records) -> list[int]:
  return sorted({r["d"] for r in records})


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
