"""The paired differences with FedAvg (`report.stats`) and how the tables and
`fedjax-dg report` show them (against FedAvg, or another algorithm with
--reference): intervals against scipy's paired t test and a
plain loop, pairing by seed over the target mean, the marks, one seed, runs
that only one side finished."""

import csv
import json
import os

import numpy as np
import pytest
from scipy import stats as scipy_stats

from fedjax_dg import cli
from fedjax_dg.report import comparisons, stats, tables
from fedjax_dg.report.records import records_from_cell
from test_sweep import _write_sweep

TARGETS = ("A", "B", "C")


def _values(rng, seeds, targets=TARGETS, seed_effect=0.0):
  """{(seed, target): value} with a shared per-seed offset `seed_effect`."""
  offset = {s: seed_effect * rng.normal() for s in seeds}
  return {(s, t): 0.5 + offset[s] + 0.05 * rng.normal()
          for s in seeds for t in targets}


def _by_seed_loop(values, reference):
  """d_s written out: per seed, the mean over its paired targets."""
  out = {}
  for seed in sorted({s for s, _ in values}):
    diffs = [values[(seed, t)] - reference[(seed, t)]
             for s, t in values if s == seed and (seed, t) in reference]
    if diffs:
      out[seed] = sum(diffs) / len(diffs)
  return out


@pytest.mark.parametrize("n", [2, 3, 5, 10])
def test_interval_equals_scipy_paired_t_on_the_seeds_target_means(n):
  rng = np.random.default_rng(n)
  seeds = list(range(n))
  x, r = _values(rng, seeds), _values(rng, seeds)
  diff = stats.paired_difference(x, r)
  x_s = [np.mean([x[(s, t)] for t in TARGETS]) for s in seeds]
  r_s = [np.mean([r[(s, t)] for t in TARGETS]) for s in seeds]
  want = scipy_stats.ttest_rel(x_s, r_s).confidence_interval(0.95)
  loop = _by_seed_loop(x, r)
  assert diff.n == n and diff.pairs == n * len(TARGETS) and diff.unpaired == 0
  assert diff.per_seed == pytest.approx(loop, abs=1e-12)
  assert diff.mean == pytest.approx(np.mean(x_s) - np.mean(r_s), abs=1e-12)
  assert (diff.low, diff.high) == pytest.approx((want.low, want.high), abs=1e-12)
  d = list(loop.values())
  low, high = scipy_stats.t.interval(0.95, n - 1, loc=np.mean(d),
                                     scale=scipy_stats.sem(d))
  assert (diff.low, diff.high) == pytest.approx((low, high), abs=1e-12)
  assert diff.excludes_zero == (low > 0 or high < 0)


def _coverage(n, samples=2000, resamples=400):
  """(t, bootstrap): how often the 95 % interval of the mean of n normal
  values holds the true mean (0), over `samples` draws: `stats.interval`,
  and the percentile bootstrap of the mean (`resamples` resamples each)."""
  rng = np.random.default_rng(n)
  draws = rng.normal(size=(samples, n))
  t_hits = 0
  for d in draws:
    low, high = stats.interval(dict(enumerate(d)))
    t_hits += low <= 0 <= high
  idx = rng.integers(0, n, size=(samples, resamples, n))
  means = np.take_along_axis(draws[:, None, :], idx, axis=2).mean(axis=2)
  low, high = np.percentile(means, [2.5, 97.5], axis=1)
  return t_hits / samples, float(np.mean((low <= 0) & (0 <= high)))


@pytest.mark.parametrize("n,bootstrap_below", [(3, 0.82), (5, 0.88), (10, 0.93)])
def test_t_interval_covers_95_percent_where_the_bootstrap_under_covers(
    n, bootstrap_below):
  """The module docstring's reason for t over a percentile bootstrap,
  simulated (2000 normal samples of n seeds): the t interval holds the true
  mean 95 % of the time (within 3 standard errors of a 2000-draw rate), the
  bootstrap ~73 / 84 / 90 % at n = 3 / 5 / 10."""
  t_cover, boot_cover = _coverage(n)
  assert abs(t_cover - 0.95) < 3 * np.sqrt(0.95 * 0.05 / 2000), t_cover
  assert boot_cover < bootstrap_below, boot_cover


def test_pairs_by_seed_whatever_the_order_and_averages_targets_first():
  """A large seed effect shared by both sides: pairing by seed removes it,
  so the consistent +1 point difference is significant; the reference's
  keys in another order do not change it; n is the seeds, not the seeds x
  targets pairs (an interval over 15 pairs would be narrower)."""
  rng = np.random.default_rng(0)
  seeds = [3, 7, 11, 20, 42]
  r = _values(rng, seeds, seed_effect=0.2)
  x = {k: v + 0.01 + 0.002 * rng.normal() for k, v in r.items()}
  shuffled = dict(sorted(r.items(), key=lambda kv: (-kv[0][0], kv[0][1])))
  diff = stats.paired_difference(x, shuffled)
  assert diff == stats.paired_difference(x, r)
  assert diff.n == 5 and list(diff.per_seed) == seeds
  assert diff.per_seed == pytest.approx(_by_seed_loop(x, r), abs=1e-15)
  assert diff.excludes_zero and diff.low > 0
  # Unpaired (Welch, the seeds' target means) the seed effect hides it.
  x_s = [np.mean([x[(s, t)] for t in TARGETS]) for s in seeds]
  r_s = [np.mean([r[(s, t)] for t in TARGETS]) for s in seeds]
  assert scipy_stats.ttest_ind(x_s, r_s, equal_var=False).pvalue > 0.5
  # Per (seed, target) units would give 14 degrees of freedom.
  d = [x[k] - r[k] for k in r]
  assert diff.high - diff.low > 1.5 * (2 * scipy_stats.t.ppf(0.975, 14)
                                       * scipy_stats.sem(d))


def test_one_seed_has_no_interval():
  diff = stats.paired_difference({(0, "A"): 0.6, (0, "B"): 0.7},
                                 {(0, "A"): 0.5, (0, "B"): 0.5})
  assert diff.mean == pytest.approx(0.15) and diff.n == 1
  assert (diff.low, diff.high, diff.excludes_zero) == (None, None, None)
  assert tables.significance(diff) == ""
  none = stats.paired_difference({}, {(0, "A"): 0.5})
  assert (none.mean, none.n, none.unpaired) == (None, 0, 1)


def test_missing_pairs_are_left_out_per_seed():
  """Target B of seed 1 finished for the algorithm only, seed 2 for the
  reference only: seed 1 averages A and C, seed 2 drops out of n."""
  x = {(s, t): 0.6 + 0.01 * s + 0.1 * (t == "C") for s in (0, 1, 3)
       for t in TARGETS}
  r = {(s, t): 0.5 + 0.02 * s * (t == "A") for s in (0, 1, 2, 3)
       for t in TARGETS if (s, t) != (1, "B")}
  diff = stats.paired_difference(x, r)
  assert diff.n == 3 and diff.pairs == 8 and diff.unpaired == 1 + 3
  want = {s: np.mean([x[(s, t)] - r[(s, t)] for t in TARGETS
                      if (s, t) in r]) for s in (0, 1, 3)}
  assert diff.per_seed == pytest.approx(want, abs=1e-15)
  assert diff.per_seed[1] == pytest.approx(
      ((x[(1, "A")] - r[(1, "A")]) + (x[(1, "C")] - r[(1, "C")])) / 2)


@pytest.mark.parametrize("low,high,mean,want", [
    (0.01, 0.03, 0.02, "↑"), (-0.03, -0.01, -0.02, "↓"),
    (-0.01, 0.03, 0.01, tables.SIMILAR), (-0.03, 0.01, -0.01, tables.SIMILAR)])
def test_the_mark_follows_the_interval_not_the_mean(low, high, mean, want):
  diff = stats.Difference(mean, low, high, 3, {}, excludes_zero=low > 0 or high < 0)
  assert tables.significance(diff) == want


# ------------------------------------------------------- tables and report


def _records(accuracy, seeds=(0, 1, 2), targets=("A", "B"), d=1):
  """Records of cells seed x d: `accuracy(alg, seed, target)` as id and ood."""
  recs = []
  for seed in seeds:
    runs = [dict(algorithm=a, target=t, history=[], final=dict(
        round=1, id_acc=accuracy(a, seed, t), ood_acc=accuracy(a, seed, t)))
            for a in ("local_only", "fedavg", "fedprox", "fedsr") for t in targets]
    recs += records_from_cell(f"seed={seed}", {"seed": str(seed)},
                              dict(seed=seed, data=dict(d=d)), dict(runs=runs))
  return recs


NOISE = {0: 0.04, 1: -0.03, 2: 0.01}   # per seed; its mean is above zero


def _accuracy(alg, seed, target):
  """FedProx: +2 points every seed (significant); FedSR: +0.67 on average
  but -3 points at seed 1 (the interval holds zero); Local-only below."""
  base = 0.5 + 0.05 * seed + 0.1 * (target == "B")
  return base + {"fedavg": 0.0, "fedprox": 0.02 + 0.001 * seed,
                 "fedsr": NOISE[seed], "local_only": -0.1}[alg]


def _line(table, name):
  return next(r for r in table.rows if r[0] == name)


def test_table2_marks_by_the_interval_and_leaves_the_reference_unmarked():
  table = tables.table2(_records(_accuracy))
  marks = lambda name: [c.strip("*").split()[-1] for c in _line(table, name)[1:]]
  assert marks("FedProx") == ["↑", "↑"] and marks("FedSR") == ["≈", "≈"]
  for name in ("FedAvg", "Local-only"):     # the reference; not federated
    assert not any(m in c for c in _line(table, name)[1:]
                   for m in ("↑", "↓", "≈"))
  assert "≈ = the interval holds zero" in table.notes
  assert "No mark" not in table.notes
  per_domain = tables.per_domain(_records(_accuracy), 1)
  for name, mark in (("FedProx", "↑"), ("FedSR", "≈")):   # A, B, μ; id, ood
    assert [c.strip("*").split()[-1] for c in _line(per_domain, name)[1:]] \
        == [mark] * 6


def test_table2_with_one_seed_marks_nothing_and_says_why():
  table = tables.table2(_records(_accuracy, seeds=(0,)))
  assert not any(m in c for row in table.rows for c in row[1:]
                 for m in ("↑", "↓", "≈"))
  assert "No mark: fewer than 2 seeds" in table.notes
  diffs = comparisons.differences(_records(_accuracy, seeds=(0,)))
  assert _line(diffs, "FedProx")[3] == "+2.0 (n<2)"
  assert {r[diffs.csv_header.index("significant")] for r in diffs.csv_rows} \
      == {"n<2"}


def test_differences_table_rows_equal_scipy_on_the_records():
  recs = _records(_accuracy)
  table = comparisons.differences(recs)
  assert [r[0] for r in table.rows] == ["FedProx", "FedSR"]  # not FedAvg, Local
  assert table.header == ["algorithm", "d", "seeds", "μ_id final", "μ_ood final",
                          "μ_id best", "μ_ood best"]
  rows = [dict(zip(table.csv_header, r)) for r in table.csv_rows]
  assert len(rows) == 2 * 4
  for row in rows:
    alg = row["algorithm"]
    d_s = [np.mean([_accuracy(alg, s, t) - _accuracy("fedavg", s, t)
                    for t in "AB"]) for s in range(3)]
    ci = scipy_stats.ttest_rel([100 * x for x in d_s], [0.0] * 3
                               ).confidence_interval()
    assert row["difference"] == pytest.approx(100 * np.mean(d_s))
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((ci.low, ci.high))
    assert (row["seeds"], row["pairs"], row["unpaired"]) == (3, 6, 0)
    assert row["significant"] == {"fedprox": "yes", "fedsr": "no"}[alg]
    assert row["reference"] == "FedAvg"
  assert _line(table, "FedSR")[4].endswith("] ≈")
  low, high = (100 * x for x in stats.interval(
      {s: NOISE[s] for s in range(3)}))
  assert _line(table, "FedSR")[4] == f"+0.7 [{low:+.1f}, {high:+.1f}] ≈"


def test_differences_mark_a_partial_pair_and_paired_lists_it():
  recs = [r for r in _records(_accuracy)
          if not (r["algorithm"] == "fedavg" and (r["seed"], r["target"])
                  == (1, "B"))]
  table = comparisons.differences(recs)
  cell = _line(table, "FedProx")[4]
  assert cell.startswith("+2.1†") and "†" in table.notes
  rows = [dict(zip(table.csv_header, r)) for r in table.csv_rows]
  assert {r["unpaired"] for r in rows} == {1}
  paired = [dict(zip(comparisons.paired(recs).csv_header, r))
            for r in comparisons.paired(recs).csv_rows]
  alone = [p for p in paired if (p["seed"], p["target"]) == (1, "B")]
  assert len(alone) == 2 * 4 and all(p["reference_value"] == ""
                                     and p["difference"] == "" for p in alone)


def _csv(path):
  with open(path) as f:
    return list(csv.DictReader(f))


def test_report_writes_prints_and_lists_the_intervals(tmp_path, capsys):
  """A fake 3-seed sweep (test_sweep's cells) with hFedF's gain over FedAvg
  varying by seed: differences.md / .csv and paired.csv written, named in
  report.md, the intervals printed; the CSVs' numbers from the cells'
  results.json by scipy."""
  sw, out = str(tmp_path / "sw"), str(tmp_path / "rep")
  _write_sweep(sw, (0, 1, 2))
  for s in (0, 1, 2):
    path = os.path.join(sw, f"seed={s}", "results.json")
    with open(path) as f:
      res = json.load(f)
    for r in res["runs"]:
      if r["algorithm"] == "hfedf":
        r["final"]["ood_acc"] += NOISE[s]
    with open(path, "w") as f:
      json.dump(res, f)
  assert cli.main(["report", sw, "--out", out]) == 0
  printed = capsys.readouterr().out
  assert "### Differences with FedAvg (paired over seeds, 95 % CI)" in printed
  assert "| hFedF | 1 | 3 |" in printed
  report = open(os.path.join(out, "report.md")).read()
  assert "paired.csv" in report and "### Differences with FedAvg" in report
  runs = {}
  for s in (0, 1, 2):
    with open(os.path.join(sw, f"seed={s}", "results.json")) as f:
      for r in json.load(f)["runs"]:
        runs[(r["algorithm"], s, r["target"])] = r["final"]["ood_acc"]
  d_s = [100 * np.mean([runs[("hfedf", s, t)] - runs[("fedavg", s, t)]
                        for t in "AB"]) for s in range(3)]
  ci = scipy_stats.ttest_rel(d_s, [0.0] * 3).confidence_interval()
  (row,) = [r for r in _csv(os.path.join(out, "differences.csv"))
            if (r["evaluation"], r["metric"]) == ("final", "ood")]
  assert float(row["difference"]) == pytest.approx(np.mean(d_s))
  assert (float(row["ci_low"]), float(row["ci_high"])) == pytest.approx(
      (ci.low, ci.high))
  assert row["significant"] == "no" and row["seeds"] == "3"
  per_seed = dict(p.split(":") for p in row["per_seed"].split(";"))
  assert [float(per_seed[str(s)]) for s in range(3)] == pytest.approx(d_s)
  paired = [r for r in _csv(os.path.join(out, "paired.csv"))
            if (r["evaluation"], r["metric"]) == ("final", "ood")]
  assert len(paired) == 3 * 2
  for p in paired:
    key = (int(p["seed"]), p["target"])
    assert float(p["value"]) == pytest.approx(100 * runs[("hfedf", *key)])
    assert float(p["reference_value"]) == pytest.approx(
        100 * runs[("fedavg", *key)])
    assert float(p["difference"]) == pytest.approx(
        float(p["value"]) - float(p["reference_value"]))


# ------------------------------------------------- another reference algorithm


def test_differences_with_another_reference_equal_scipy_against_it():
  """--reference fedprox: every other federated algorithm against FedProx
  (scipy's paired t on the per-seed target means), FedProx's own row gone,
  FedAvg's there; the texts and the CSVs name FedProx, never FedAvg."""
  recs = _records(_accuracy)
  table = comparisons.differences(recs, reference="fedprox")
  assert [r[0] for r in table.rows] == ["FedAvg", "FedSR"]
  assert table.title == "Differences with FedProx (paired over seeds, 95 % CI)"
  assert "(algorithm − FedProx)" in table.notes and "FedAvg" not in table.notes
  rows = [dict(zip(table.csv_header, r)) for r in table.csv_rows]
  assert len(rows) == 2 * 4
  for row in rows:
    alg = row["algorithm"]
    d_s = [100 * np.mean([_accuracy(alg, s, t) - _accuracy("fedprox", s, t)
                          for t in "AB"]) for s in range(3)]
    ci = scipy_stats.ttest_rel(d_s, [0.0] * 3).confidence_interval()
    assert row["difference"] == pytest.approx(np.mean(d_s))
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((ci.low, ci.high))
    assert row["significant"] == {"fedavg": "yes", "fedsr": "no"}[alg]
    assert row["reference"] == "FedProx"
  paired = [dict(zip(comparisons.paired(recs, "fedprox").csv_header, r))
            for r in comparisons.paired(recs, "fedprox").csv_rows]
  assert {p["reference"] for p in paired} == {"FedProx"}
  for p in paired:
    assert p["reference_value"] == pytest.approx(
        100 * _accuracy("fedprox", p["seed"], p["target"]))


def test_tables_mark_against_another_reference_and_name_it():
  """FedProx as the reference: its row unmarked, FedAvg's ↓ (2 points
  below every seed), FedSR's ≈; the notes and the CSV columns name it."""
  recs = _records(_accuracy)
  table = tables.table2(recs, reference="fedprox")
  marks = lambda name: [c.strip("*").split()[-1] for c in _line(table, name)[1:]]
  assert marks("FedAvg") == ["↓", "↓"] and marks("FedSR") == ["≈", "≈"]
  for name in ("FedProx", "Local-only"):
    assert not any(m in c for c in _line(table, name)[1:]
                   for m in ("↑", "↓", "≈"))
  assert "below FedProx run with" in table.notes and "FedAvg" not in table.notes
  assert "d1_ood_vs_fedprox" in table.csv_header
  row = dict(zip(table.csv_header,
                 next(r for r in table.csv_rows if r[0] == "FedAvg")))
  assert row["d1_ood_vs_fedprox"] == pytest.approx(-100 * np.mean(
      [0.02 + 0.001 * s for s in range(3)]))
  per_domain = tables.per_domain(recs, 1, reference="fedprox")
  assert [c.strip("*").split()[-1] for c in _line(per_domain, "FedAvg")[1:]] \
      == ["↓"] * 6
  assert "FedAvg" not in per_domain.notes and "FedProx" in per_domain.notes


def test_report_reference_option_compares_with_it_and_refuses_others(
    tmp_path, capsys):
  """`fedjax-dg report DIR --reference hfedf`: FedAvg's difference with hFedF
  printed and written (the negation of hFedF's with FedAvg); a name the
  registry does not know, an algorithm without runs in DIR and several DIRs
  are errors naming what to do."""
  sw, out = str(tmp_path / "sw"), str(tmp_path / "rep")
  _write_sweep(sw, (0, 1, 2))
  assert cli.main(["report", sw, "--out", out, "--reference", "hfedf"]) == 0
  printed = capsys.readouterr().out
  assert "### Differences with hFedF (paired over seeds, 95 % CI)" in printed
  assert "| FedAvg | 1 | 3 |" in printed
  report = open(os.path.join(out, "report.md")).read()
  assert "Differences with hFedF are paired" in report
  assert "Differences with FedAvg" not in report  # nor any table's notes:
  assert "FedAvg run with" not in report and "hFedF run with" in report
  (row,) = [r for r in _csv(os.path.join(out, "differences.csv"))
            if (r["evaluation"], r["metric"]) == ("final", "ood")]
  assert (row["variant"], row["reference"]) == ("FedAvg", "hFedF")
  runs = {}
  for s in (0, 1, 2):
    with open(os.path.join(sw, f"seed={s}", "results.json")) as f:
      for r in json.load(f)["runs"]:
        runs[(r["algorithm"], s, r["target"])] = r["final"]["ood_acc"]
  assert float(row["difference"]) == pytest.approx(100 * np.mean(
      [runs[("fedavg", s, t)] - runs[("hfedf", s, t)]
       for s in range(3) for t in "AB"]))
  for argv, needle in (
      ([sw, "--reference", "nope"], "--reference: unknown algorithm 'nope'; "
       "allowed: ("),
      ([sw, "--reference", "fedprox"], "--reference fedprox: no finished run "
       f"of FedProx in {sw}; algorithms there: fedavg, hfedf"),
      ([sw, sw + "/seed=0", "--reference", "hfedf"], "--reference selects")):
    assert cli.main(["report", *argv, "--out", out]) == 2
    assert needle in capsys.readouterr().err
