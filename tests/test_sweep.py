"""`fedjax-dg sweep` / `fedjax-dg report` end to end (tiny settings, the offline
dataset), the table functions on constructed results, and the experiment files."""

import csv
import datetime
import glob
import json
import os
import shlex
import statistics

import numpy as np
import pytest

from conftest import tiny_experiment
from fedjax_dg import cli
from fedjax_dg.errors import DataError
from fedjax_dg.run import assemble, experiment, provenance, reports, sweep
from fedjax_dg.report import tables
from fedjax_dg.report.records import aggregate, display_name, records_from_cell

CELLS = ["data.d=1__seed=0", "data.d=2__seed=0"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  d = tmp_path_factory.mktemp("sweep")
  path = d / "tiny.py"
  tiny_experiment(path, d / "runs", algorithms=("fedavg", "local_only"),
                  max_per_domain=30)
  return str(path), str(d)


def _no_run_figures(monkeypatch):
  """Cells' run directories without run_summary.write_all's matplotlib figures
  (~1-3 s each; no test here looks at them, test_cli.py does); the sweep's
  own report (plots.sweep_curves) is kept."""
  from fedjax_dg.report import plots
  monkeypatch.setattr(plots, "ALL", {})


@pytest.fixture(scope="module")
def swept(tiny):
  path, d = tiny
  out = os.path.join(d, "sw")
  with pytest.MonkeyPatch.context() as mp:
    _no_run_figures(mp)
    assert cli.main(["sweep", "--config", path, "--grid", "data.d=1,2",
                     "--seeds", "0", "--out", out]) == 0
  return out


def _json(path):
  with open(path) as f:
    return json.load(f)


def _csv(path):
  with open(path) as f:
    return list(csv.DictReader(f))


def test_sweep_writes_manifest_and_one_run_directory_per_cell(swept):
  manifest = _json(os.path.join(swept, "sweep.json"))
  assert [c["name"] for c in manifest["cells"]] == CELLS
  assert [c["status"] for c in manifest["cells"]] == ["done", "done"]
  assert manifest["grid"] == [["data.d", ["1", "2"]]] and manifest["seeds"] == [0]
  for name, d in zip(CELLS, (1, 2)):
    assert _json(os.path.join(swept, name, "config.json"))["data"]["d"] == d
    res = _json(os.path.join(swept, name, "results.json"))
    assert {(r["algorithm"], r["target"]) for r in res["runs"]} == {
        (a, t) for a in ("fedavg", "local_only") for t in ("0", "75")}
  # The sweep ends with its report.
  assert os.path.isfile(os.path.join(swept, "report", "table2.md"))


def test_a_batched_cell_counts_its_share_of_the_batches_not_the_sweep(swept):
  """Both cells trained in the same two batches (2 cells x 2 targets each)
  and finished together, in the last one: each cell's seconds is its runs'
  share of those batches (their run seconds plus the batches' overhead),
  the same for both, and together no more than the sweep's wall time; the
  time since the sweep began would count both cells' work in each (the
  manifest says the same as results.json)."""
  manifest = _json(os.path.join(swept, "sweep.json"))
  seconds = []
  for entry in manifest["cells"]:
    res = _json(os.path.join(swept, entry["name"], "results.json"))
    assert {r["replicas"] for r in res["runs"]} == {4}
    assert res["seconds"] == res["seconds_this_part"] == entry["seconds"]
    assert sum(r["seconds"] for r in res["runs"]) <= res["seconds"]
    seconds.append(res["seconds"])
  assert seconds[0] == seconds[1]
  at = lambda stamp: datetime.datetime.fromisoformat(stamp).timestamp()
  wall = max(at(c["finished"]) for c in manifest["cells"]) - at(manifest["created"])
  assert sum(seconds) <= wall + 1.0  # the stamps are whole seconds


def test_resume_skips_finished_cells_and_finishes_an_interrupted_one(
    swept, capsys, monkeypatch):
  _no_run_figures(monkeypatch)
  path = os.path.join(swept, CELLS[1], "results.json")
  full = _json(path)
  kept = [r for r in full["runs"] if (r["algorithm"], r["target"]) != ("fedavg", "75")]
  with open(path, "w") as f:
    json.dump(dict(full, runs=kept), f)
  manifest = _json(os.path.join(swept, "sweep.json"))
  manifest["cells"][1]["status"] = "running"      # as if killed mid-cell
  with open(os.path.join(swept, "sweep.json"), "w") as f:
    json.dump(manifest, f)
  first = open(os.path.join(swept, CELLS[0], "results.json")).read()
  capsys.readouterr()

  assert cli.main(["sweep", "--resume", swept]) == 0
  printed = capsys.readouterr().out
  assert f"cell 1/2 {CELLS[0]}: finished earlier, skipped" in printed
  assert f"cell 2/2 {CELLS[1]}: resuming" in printed
  assert printed.count("already finished, kept from results.json") == 3
  assert open(os.path.join(swept, CELLS[0], "results.json")).read() == first
  res = _json(path)
  assert len(res["runs"]) == 4
  rerun = {(r["algorithm"], r["target"]): r for r in res["runs"]}[("fedavg", "75")]
  old = {(r["algorithm"], r["target"]): r for r in full["runs"]}[("fedavg", "75")]
  assert rerun["final"]["ood_acc"] == old["final"]["ood_acc"]
  assert [c["status"] for c in _json(os.path.join(swept, "sweep.json"))["cells"]] \
      == ["done", "done"]
  # Resuming a finished sweep computes nothing.
  assert cli.main(["sweep", "--resume", swept]) == 0
  assert capsys.readouterr().out.count("finished earlier, skipped") == 2


def test_report_numbers_equal_an_independent_computation(swept, tmp_path, capsys):
  out = str(tmp_path / "rep")
  assert cli.main(["report", swept, "--out", out]) == 0
  assert "Table 2 shape" in capsys.readouterr().out
  for f in ("report.md", "table2.md", "table2.csv", "table2_best.csv",
            "per_domain_d1.md", "per_domain_d1.csv", "per_domain_d2.csv",
            "summary.csv", "runs.csv", "curves.png"):
    assert os.path.getsize(os.path.join(out, f)) > 0, f

  runs = {}   # (d, algorithm, target) -> run, straight from the cells' results.json
  for name, d in zip(CELLS, (1, 2)):
    for r in _json(os.path.join(swept, name, "results.json"))["runs"]:
      runs[(d, r["algorithm"], r["target"])] = r

  t2 = {row["algorithm"]: row for row in _csv(os.path.join(out, "table2.csv"))}
  best = {row["algorithm"]: row for row in _csv(os.path.join(out, "table2_best.csv"))}
  for alg in ("fedavg", "local_only"):
    for d in (1, 2):
      for m in ("id", "ood"):
        final = statistics.mean(runs[(d, alg, t)]["final"][f"{m}_acc"]
                                for t in ("0", "75"))
        assert float(t2[alg][f"d{d}_{m}"]) == pytest.approx(100 * final, abs=1e-9)
        peak = statistics.mean(max(h[f"{m}_acc"] for h in runs[(d, alg, t)]["history"])
                               for t in ("0", "75"))
        assert float(best[alg][f"d{d}_{m}"]) == pytest.approx(100 * peak, abs=1e-9)
      assert t2["fedavg"][f"d{d}_ood_vs_fedavg"] == ""
      assert t2["local_only"][f"d{d}_ood_vs_fedavg"] == ""   # non-federated

  pd = {row["algorithm"]: row for row in _csv(os.path.join(out, "per_domain_d2.csv"))}
  for alg in ("fedavg", "local_only"):
    for t in ("0", "75"):
      assert float(pd[alg][f"id_{t}_mean"]) == pytest.approx(
          100 * runs[(2, alg, t)]["final"]["id_acc"], abs=1e-9)
      assert pd[alg][f"id_{t}_std"] == "" and pd[alg][f"id_{t}_seeds"] == "1"

  rows = _csv(os.path.join(out, "runs.csv"))
  assert len(rows) == 8
  for row in rows:
    r = runs[(int(row["d"]), row["algorithm"], row["target"])]
    assert float(row["ood_acc"]) == pytest.approx(r["final"]["ood_acc"], abs=1e-12)
    ids = [h["id_acc"] for h in r["history"]]
    assert float(row["best_id_acc"]) == pytest.approx(max(ids), abs=1e-12)
    at = r["history"][ids.index(max(ids))]
    assert int(row["best_id_round"]) == at["round"]
    assert float(row["ood_at_best_id"]) == pytest.approx(at["ood_acc"], abs=1e-12)
    assert row["cell"] == f"data.d={row['d']}__seed=0" and row["data.d"] == row["d"]
  # Every run traceable: the commit of this checkout (run.provenance); a
  # dirty flag that is unknown (a copy git does not track) is an empty cell.
  head = provenance.source()
  dirty = "" if head["dirty"] is None else str(head["dirty"])
  assert {(row["commit"], row["dirty"]) for row in rows} == {
      (head["commit"], dirty)}
  assert f"- fedjax_dg commit: {head['commit']}" in open(
      os.path.join(out, "report.md")).read()


@pytest.mark.parametrize("grid,needle", [
    ("train.nope=1,2", "--grid train.nope=1: unknown config key 'train.nope'"),
    ("train.rounds=1,x", "--grid train.rounds=x"),
    ("data.d=1,6", "sweep cell data.d=6, seed=0"),
    ("algorithms=fedavg|fedavg,nope", "unknown algorithm 'nope'"),
    ("seed=1,2", "--seeds"),
    ("data.d=1,1", "repeated value"),
])
def test_invalid_grid_stops_before_compute_naming_it(tiny, capsys, grid, needle):
  path, d = tiny
  out = os.path.join(d, "never")
  assert cli.main(["sweep", "--config", path, "--grid", grid, "--out", out]) == 2
  err = capsys.readouterr().err
  assert needle in err, err
  assert not os.path.exists(out)


def test_a_grid_value_the_scenario_would_replace_is_refused(tiny, capsys):
  path, d = tiny
  out = os.path.join(d, "never")
  assert cli.main(["sweep", "--config", path, "--set", "scenario=extreme",
                   "--grid", "data.alpha=0.5,0.1", "--out", out]) == 2
  err = capsys.readouterr().err
  assert "sweep cell data.alpha=0.5" in err and "drop one of the two" in err, err
  assert not os.path.exists(out)


def test_resume_refuses_new_settings(swept, capsys):
  assert cli.main(["sweep", "--resume", swept, "--seeds", "1"]) == 2
  assert "--resume" in capsys.readouterr().err


# ------------------------------------------------------ tables on constructed data


def _value(alg, d, target, seed, metric):
  """Known, distinct accuracies: each factor moves the value by a known amount."""
  base = {"fedavg": 0.50, "hfedf": 0.55, "local_only": 0.40, "hfedf_no_ema": 0.53}
  return (base[alg] + 0.03 * d + {"A": 0.0, "B": 0.1}[target]
          + [0.0, 0.02, 0.07][seed] + (0.2 if metric == "id" else 0.0))


def _constructed():
  """Cells (seed x d) as results dicts: 3 seeds, d = 1, 2, targets A, B."""
  recs = []
  for seed in range(3):
    for d in (1, 2):
      runs = []
      for alg in ("fedavg", "hfedf", "local_only", "hfedf_no_ema"):
        for t in ("A", "B"):
          fid, food = _value(alg, d, t, seed, "id"), _value(alg, d, t, seed, "ood")
          # The history peaks at round 2, higher than the final round 3.
          history = [dict(round=1, id_acc=fid - 0.1, ood_acc=food - 0.1),
                     dict(round=2, id_acc=fid + 0.05, ood_acc=food - 0.01),
                     dict(round=3, id_acc=fid, ood_acc=food + 0.02)]
          runs.append(dict(algorithm=alg, target=t, seconds=1.0, history=history,
                           final=dict(round=3, id_acc=fid, ood_acc=food)))
      config = dict(seed=seed, data=dict(d=d), hfedf=dict(gradalign=True, ema=True))
      recs += records_from_cell(
          f"data.d={d}__seed={seed}", {"data.d": str(d), "seed": str(seed)}, config,
          dict(runs=runs, algorithms=[], targets=["A", "B"]))
  return recs


def _rows(table):
  return {row[0]: dict(zip(table.csv_header, row)) for row in table.csv_rows}


def test_table2_means_over_targets_and_seeds_with_arrows_vs_fedavg():
  table = tables.table2(_constructed())
  rows = _rows(table)
  assert list(rows) == ["Local-only", "FedAvg", "hFedF", "hFedF w/o EMA"]
  for alg, name in (("fedavg", "FedAvg"), ("hfedf", "hFedF"),
                    ("local_only", "Local-only"), ("hfedf_no_ema", "hFedF w/o EMA")):
    for d in (1, 2):
      for m in ("id", "ood"):
        want = statistics.mean(_value(alg, d, t, s, m) for t in "AB" for s in range(3))
        assert rows[name][f"d{d}_{m}"] == pytest.approx(100 * want)
  assert rows["hFedF"]["d1_ood_vs_fedavg"] == pytest.approx(5.0)
  assert rows["hFedF w/o EMA"]["d2_id_vs_fedavg"] == pytest.approx(3.0)
  md = table.markdown()
  hfedf_line = next(line for line in md.splitlines() if line.startswith("| hFedF |"))
  assert "↑" in hfedf_line and "↓" not in hfedf_line and "**" in hfedf_line
  local_line = next(line for line in md.splitlines() if "Local-only" in line)
  assert "↑" not in local_line and "↓" not in local_line   # non-federated
  best = _rows(tables.table2(_constructed(), "best"))
  want = statistics.mean(_value("fedavg", 1, t, s, "id") + 0.05
                         for t in "AB" for s in range(3))
  assert best["FedAvg"]["d1_id"] == pytest.approx(100 * want)


def test_per_domain_mean_and_sample_std_over_seeds():
  table = tables.per_domain(_constructed(), d=2)
  rows = _rows(table)
  for t in "AB":
    seeds = [_value("hfedf", 2, t, s, "ood") for s in range(3)]
    assert rows["hFedF"][f"ood_{t}_mean"] == pytest.approx(100 * statistics.mean(seeds))
    assert rows["hFedF"][f"ood_{t}_std"] == pytest.approx(100 * statistics.stdev(seeds))
    assert rows["hFedF"][f"ood_{t}_seeds"] == 3
  assert rows["FedAvg"]["id_mu"] == pytest.approx(100 * statistics.mean(
      _value("fedavg", 2, t, s, "id") for t in "AB" for s in range(3)))
  std = 100 * statistics.stdev([0.0, 0.02, 0.07])
  line = next(r for r in table.rows if r[0] == "hFedF")
  # Best federated value of its column: bold.
  assert line[1] == f"**{100 * (0.55 + 0.06 + 0.2 + 0.03):.1f} ± {std:.1f} ↑**"


def test_table3_differences_to_full_hfedf():
  table = tables.ablation_table(_constructed(), "hfedf")
  rows = _rows(table)
  assert list(rows) == ["hFedF", "hFedF w/o EMA"]
  assert rows["hFedF w/o EMA"]["d1_ood_vs_hfedf"] == pytest.approx(-2.0)
  assert rows["hFedF"]["d1_ood_vs_hfedf"] == ""
  assert tables.ablation_table(
      [r for r in _constructed() if r["algorithm"] == "fedavg"], "hfedf") is None


def test_table3_of_a_grid_names_its_reference():
  """An hfedf.* grid (Fig. 11's EMA sweep) has no plain hFedF row: differences are
  to the grid's first value, and the notes say so."""
  recs = []
  for decay, acc in (("0.25", 0.6), ("0.75", 0.65)):
    runs = [dict(algorithm="hfedf", target="A", history=[],
                 final=dict(round=1, id_acc=acc, ood_acc=acc))]
    recs += records_from_cell(
        f"c{decay}", {"hfedf.ema_decay": decay, "seed": "0"},
        dict(seed=0, data=dict(d=1), hfedf=dict(ema_decay=float(decay))),
        dict(runs=runs))
  table = tables.ablation_table(recs, "hfedf")
  rows = _rows(table)
  first, second = list(rows)
  assert "0.25" in first and "0.75" in second
  assert rows[second]["d1_ood_vs_hfedf"] == pytest.approx(5.0)
  assert f"`{first}`" in table.notes and "full hFedF" not in table.notes
  assert "difference to full hFedF" in tables.ablation_table(
      _constructed(), "hfedf").notes


def test_records_best_over_rounds_and_ablation_names_from_grid():
  rec = _constructed()[0]
  assert (rec["best_id_round"], rec["best_ood_round"]) == (2, 3)
  assert rec["best_id_acc"] == pytest.approx(rec["id_acc"] + 0.05)
  assert rec["ood_at_best_id"] == pytest.approx(rec["ood_acc"] - 0.01)
  # hfedf.* grid keys name hFedF's row and are dropped from FedAvg's, whose
  # duplicate runs then collapse instead of counting as extra seeds.
  recs = []
  for ema in (True, False):
    runs = [dict(algorithm=a, target="A", history=[],
                 final=dict(round=1, id_acc=v, ood_acc=v))
            for a, v in (("fedavg", 0.5), ("hfedf", 0.6 if ema else 0.7))]
    recs += records_from_cell(
        f"c{ema}", {"hfedf.ema": str(ema), "seed": "0"},
        dict(seed=0, data=dict(d=1), hfedf=dict(ema=ema)),
        dict(runs=runs))
  assert [r["variant"] for r in recs] == ["FedAvg", "hFedF", "FedAvg",
                                          "hFedF w/o EMA"]
  agg = aggregate(recs, "id_acc")
  assert agg[("FedAvg", 1)].per_target["A"].seeds == 1
  assert agg[("FedAvg", 1)].runs == 2


# ------------------------------------------------ report of several directories


def _write_cell(path, seed, *, shift=0.0, dataset="rotated_fashion_mnist",
                targets=("A", "B"), algs=("fedavg", "hfedf")):
  """A run directory as `fedjax-dg run` leaves it (config.json, results.json),
  accuracies `_value(alg, 1, target, seed, metric) + shift`."""
  os.makedirs(path)
  runs = [dict(algorithm=a, target=t, seconds=1.0,
               history=[dict(round=1, id_acc=_value(a, 1, t, seed, "id") + shift,
                             ood_acc=_value(a, 1, t, seed, "ood") + shift)],
               final=dict(round=1, id_acc=_value(a, 1, t, seed, "id") + shift,
                          ood_acc=_value(a, 1, t, seed, "ood") + shift))
          for a in algs for t in targets]
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(dict(seed=seed, data=dict(d=1)), f)
  with open(os.path.join(path, "results.json"), "w") as f:
    json.dump(dict(name=os.path.basename(path), dataset=dataset,
                   targets=list(targets), algorithms=list(algs), runs=runs), f)


def _write_sweep(path, seeds, **kw):
  os.makedirs(path)
  cells = [dict(name=f"seed={s}", settings={"seed": str(s)}, status="done")
           for s in seeds]
  with open(os.path.join(path, "sweep.json"), "w") as f:
    json.dump(dict(name=os.path.basename(path), cells=cells), f)
  for s in seeds:
    _write_cell(os.path.join(path, f"seed={s}"), s, **kw)


def test_report_of_several_directories_compares_them_over_seeds(tmp_path, capsys):
  a, b, out = (str(tmp_path / n) for n in ("sweepA", "runB", "cmp"))
  _write_sweep(a, (0, 1, 2))
  _write_cell(b, 0, shift=0.1)
  assert cli.main(["report", a, b, "--out", out]) == 0
  assert "| algorithm | sweepA A | sweepA B | sweepA μ | runB A | runB B | runB μ |" \
      in capsys.readouterr().out
  for stem, m in (("comparison_ood", "ood"), ("comparison_id", "id")):
    rows = {r["variant"]: r for r in _csv(os.path.join(out, f"{stem}.csv"))}
    assert list(rows) == ["FedAvg", "hFedF"]
    for alg, name in (("fedavg", "FedAvg"), ("hfedf", "hFedF")):
      for t in "AB":
        seeds = [_value(alg, 1, t, s, m) for s in range(3)]
        row = rows[name]
        assert float(row[f"sweepA:{t}_mean"]) == pytest.approx(
            100 * statistics.mean(seeds))
        assert float(row[f"sweepA:{t}_std"]) == pytest.approx(
            100 * statistics.stdev(seeds))
        assert row[f"sweepA:{t}_seeds"] == "3"
        assert float(row[f"runB:{t}_mean"]) == pytest.approx(
            100 * (_value(alg, 1, t, 0, m) + 0.1))
        assert row[f"runB:{t}_std"] == "" and row[f"runB:{t}_seeds"] == "1"
      assert float(rows[name]["runB:mu"]) == pytest.approx(100 * statistics.mean(
          _value(alg, 1, t, 0, m) + 0.1 for t in "AB"))
  runs = _csv(os.path.join(out, "runs.csv"))
  assert len(runs) == 3 * 4 + 4
  assert {r["cell"] for r in runs} == {"sweepA/seed=0", "sweepA/seed=1",
                                       "sweepA/seed=2", "runB/runB"}
  report = open(os.path.join(out, "report.md")).read()
  assert "Comparison of 2 runs (rotated_fashion_mnist, targets A, B)" in report
  assert os.path.getsize(os.path.join(out, "curves.png")) > 0


@pytest.mark.parametrize("other,needle", [
    (dict(targets=("A",)), "runB: rotated_fashion_mnist, targets A)"),
    (dict(dataset="pacs"), "runB: pacs, targets A, B"),
])
def test_report_refuses_to_compare_other_data_or_targets(tmp_path, capsys, other,
                                                         needle):
  a, b = str(tmp_path / "runA"), str(tmp_path / "runB")
  _write_cell(a, 0)
  _write_cell(b, 0, **other)
  assert cli.main(["report", a, b]) == 2
  err = capsys.readouterr().err
  assert "not comparable" in err and needle in err
  assert "runA: rotated_fashion_mnist, targets A, B" in err
  assert not glob.glob(str(tmp_path / "compare-*"))   # nothing written


def test_report_labels_directories_by_name_or_path_and_refuses_repeats(tmp_path,
                                                                       capsys):
  x, y = str(tmp_path / "x" / "run"), str(tmp_path / "y" / "run")
  assert reports.column_labels([x, str(tmp_path / "z")]) == ["run", "z"]
  assert reports.column_labels([x, y]) == ["x/run", "y/run"]
  _write_cell(x, 0)
  assert cli.main(["report", x, x]) == 2
  assert "given twice" in capsys.readouterr().err
  _write_cell(y, 1)
  assert cli.main(["report", x, y, "--d", "1"]) == 2
  assert "--d" in capsys.readouterr().err
  assert cli.main(["report", x, y]) == 0    # default: compare-<time> beside x
  (made,) = glob.glob(str(tmp_path / "x" / "compare-*"))
  assert "| algorithm | x/run A |" in open(os.path.join(made, "report.md")).read()


def test_report_of_runs_without_an_id_split_has_no_id_table(tmp_path):
  """HyperGenFL's scenarios train on whole partitions (no id accuracy)."""
  dirs = [str(tmp_path / n) for n in ("a", "b")]
  for d in dirs:
    _write_cell(d, 0)
    res = _json(os.path.join(d, "results.json"))
    for r in res["runs"]:
      for point in r["history"] + [r["final"]]:
        del point["id_acc"]
    with open(os.path.join(d, "results.json"), "w") as f:
      json.dump(res, f)
  out = str(tmp_path / "cmp")
  paths = reports.compare(dirs, out)
  names = {os.path.basename(p) for p in paths}
  assert "comparison_ood.csv" in names and "comparison_id.csv" not in names
  assert "id accuracy" not in open(paths[0]).read()


def test_report_compares_a_sweep_over_d_with_one_of_its_cells(swept, tmp_path):
  """A directory holding several d splits into one column group per d; the
  group of d = 1 equals the d = 1 cell read on its own."""
  out = str(tmp_path / "cmp")
  cell = os.path.join(swept, CELLS[0])
  assert cli.main(["report", swept, cell, "--out", out]) == 0
  rows = {r["variant"]: r for r in _csv(os.path.join(out, "comparison_ood.csv"))}
  res = _json(os.path.join(cell, "results.json"))
  for r in res["runs"]:
    row = rows[display_name(r["algorithm"])]
    want = 100 * r["final"]["ood_acc"]
    assert float(row[f"sw d=1:{r['target']}_mean"]) == pytest.approx(want)
    assert float(row[f"{CELLS[0]}:{r['target']}_mean"]) == pytest.approx(want)
    assert row[f"sw d=2:{r['target']}_mean"] != ""


# ------------------------------------------------------------- experiment files


def _commands(doc):
  """The `fedjax-dg sweep ...` commands of a docstring (with continuations)."""
  lines, out, cur = doc.splitlines(), [], None
  for line in lines:
    s = line.strip()
    if cur is not None:
      cur += " " + s.rstrip("\\")
      if not s.endswith("\\"):
        out.append(cur)
        cur = None
    elif s.startswith("fedjax-dg sweep"):
      if s.endswith("\\"):
        cur = s.rstrip("\\")
      else:
        out.append(s)
  return [shlex.split(c)[2:] for c in out]


EXPERIMENTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments")
SWEEPS = sorted(f for f in glob.glob(os.path.join(EXPERIMENTS, "*.py"))
                if os.path.basename(f).startswith(("table", "fig")))


def test_every_paper_table_and_figure_has_a_sweep_config():
  names = {os.path.basename(f)[:-3] for f in SWEEPS}
  for stem in ("table2", "table3", "table4_5", "fig3_few_shot", "fig4_clients",
               "fig8_embeddings", "fig9_local_epochs", "fig10_long_run",
               "fig11_ema_decay"):
    assert stem in names


@pytest.mark.parametrize("path", SWEEPS, ids=os.path.basename)
def test_experiment_docstring_commands_are_valid_and_match_sweep(path):
  source = open(path).read()
  doc = source.split('"""')[1]
  assert "GPU" in doc and "estimate" in doc and "CPU" in doc
  assert "--set data.name=" in source and "data.manual_dir=" in source
  commands = _commands(doc)
  assert len(commands) >= 2, path
  default = sweep.plan(path)        # the file's SWEEP grid and seeds
  for args in commands:
    assert args[:2] == ["--config", f"experiments/{os.path.basename(path)}"]
    sets, grid, seeds = [], [], None
    for flag, value in zip(args[2::2], args[3::2]):
      {"--set": sets, "--grid": grid}.get(flag, []).append(value)
      seeds = value if flag == "--seeds" else seeds
    p = sweep.plan(path, sets, sweep.parse_grid(grid), sweep.parse_seeds(seeds))
    # The documented grid and seeds are the file's defaults.
    assert [c.name for c in p.cells] == [c.name for c in default.cells]


FEDCCRL = sorted(glob.glob(os.path.join(EXPERIMENTS, "fedccrl_*.py")))


def _assert_paper_clients(cfg, names):
  """Each algorithm's clients resolve to FedCCRL's Sec. 4.2 optimizer (Adam,
  lr 1e-3, the cosine over the run; weight decay 1e-4, the code's) whatever
  its module's `CLIENT` says (SGD for FedADG, FedIIR, CCST): the settings,
  and the first step on a fixed gradient against Adam written out (bias-
  corrected first step g / (|g| + eps), torch-style decay added to g, the
  cosine at half the run = 0.5). SGD, another lr or no decay fail it."""
  import jax.numpy as jnp
  import numpy as np
  from fedjax_dg import algorithms
  from fedjax_dg.client.update import RunProgress
  w, g = np.array([1.0, -2.0, 3.0]), np.array([0.5, 0.0, -4.0])
  g_wd = g + 1e-4 * w
  want = -1e-3 * 0.5 * g_wd / (np.abs(g_wd) + 1e-8)
  for name in names:
    section = algorithms.spec(name).section
    assert algorithms.client_settings(dict(cfg.client), dict(
        cfg[section].client)) == dict(optimizer="adam", lr=1e-3,
                                      weight_decay=1e-4, momentum=0.0,
                                      schedule="cosine"), name
    opt = assemble.client_optimizer(cfg, name)
    assert isinstance(opt, RunProgress), name
    params = {"w": jnp.asarray(w, jnp.float32)}
    update, _ = opt.update({"w": jnp.asarray(g, jnp.float32)},
                           opt.init(params), params, progress=0.5)
    np.testing.assert_allclose(update["w"], want, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("path", FEDCCRL, ids=os.path.basename)
def test_fedccrl_experiments_plan_and_validate_before_any_data(path):
  """Every cell of FedCCRL's table / figure files is a valid run config (its
  algorithms exist, its grid keys are real settings), every method trains
  with the paper's optimizer, and the documented commands plan the file's
  own grid."""
  from fedjax_dg import algorithms
  p = sweep.plan(path)
  assert p.cells and len({c.name for c in p.cells}) == len(p.cells)
  assert sweep.check(p, data=False) == [1] * len(p.cells)  # every cell validates
  assert set(p.base.algorithms) <= set(algorithms.available())
  assert p.base.train.rounds == 10 and p.base.train.epochs == 3
  assert p.base.model.name == "mobilenet_v3_large"
  _assert_paper_clients(p.configs[0], p.base.algorithms)
  doc = open(path).read().split('"""')[1]
  for args in _commands(doc):
    assert args[:2] == ["--config", f"experiments/{os.path.basename(path)}"]


def test_styled_fmnist_table1_plans_and_validates_before_any_data():
  """The reduced-budget Table 1 run: the nine methods, 3 seeds, the paper's
  10 x 3 schedule and optimizer for every method, the committed AdaIN
  stand-in found (and readable at its depth) from any working directory,
  and its documented sweep command plans the same cells."""
  from fedjax_dg.models import adain
  name = "styled_fmnist_table1.py"
  path = os.path.join(EXPERIMENTS, name)
  p = sweep.plan(path)
  assert sweep.check(p, data=False) == [1, 1, 1]
  assert [c.settings["seed"] for c in p.cells] == ["0", "1", "2"]
  assert sorted(p.base.algorithms) == sorted([
      "fedavg", "fedprox", "fedsr", "fedadg", "fediir", "feddg_ga", "ccst",
      "elcfs", "fedccrl"])
  assert (p.base.train.rounds, p.base.train.epochs) == (10, 3)
  assert (p.base.data.name, p.base.data.targets) == ("styled_fashion_mnist",
                                                     "all")
  _assert_paper_clients(p.configs[0], p.base.algorithms)
  for f in (p.base.ccst.vgg, p.base.ccst.decoder):
    assert os.path.isabs(f) and os.path.isfile(f), f
  adain.load(p.base.ccst.vgg, p.base.ccst.decoder, p.base.ccst.depth)
  commands = _commands(open(path).read().split('"""')[1])
  assert commands
  for args in commands:
    assert args[:2] == ["--config", f"experiments/{name}"]
    seeds = dict(zip(args[2::2], args[3::2])).get("--seeds")
    assert [c.name for c in sweep.plan(path, seeds=sweep.parse_seeds(
        seeds)).cells] == [c.name for c in p.cells]


FEDSDAF = sorted(glob.glob(os.path.join(EXPERIMENTS, "fedsdaf_table*.py")))


def test_fedsdaf_offline_experiment_validates_before_any_data():
  """The reduced-budget FedSDAF file: every algorithm a ViT variant, the tiny
  ViT's sizes set, and its cells (both offline datasets) validate."""
  path = os.path.join(EXPERIMENTS, "fedsdaf_offline.py")
  for sets in ([], ["data.name=rotated_fashion_mnist"]):
    p = sweep.plan(path, sets)
    assert sweep.check(p, data=False) == [1] * len(p.cells)
  assert p.base.model.name == "vit_tiny" and p.base.model.vit.patch == 7
  assert set(p.base.algorithms) >= {"fedavg_adapter", "fedsdaf", "fedsdaf_di"}


@pytest.mark.parametrize("path", FEDSDAF, ids=os.path.basename)
def test_fedsdaf_experiments_plan_and_validate_before_any_data(path):
  """FedSDAF's table files: every cell a valid run config on the paper's
  ViT-B/16 budget, the documented commands plan the file's own grid."""
  from fedjax_dg import algorithms
  p = sweep.plan(path)
  assert p.cells and len({c.name for c in p.cells}) == len(p.cells)
  assert sweep.check(p, data=False) == [1] * len(p.cells)
  assert set(p.base.algorithms) <= set(algorithms.available())
  assert "fedsdaf" in p.base.algorithms
  assert (p.base.train.rounds, p.base.train.epochs) == (200, 30)
  assert p.base.model.name == "vit_b16"
  default = sweep.plan(path)
  doc = open(path).read().split('"""')[1]
  for args in _commands(doc):
    assert args[:2] == ["--config", f"experiments/{os.path.basename(path)}"]
    sets = [v for f, v in zip(args[2::2], args[3::2]) if f == "--set"]
    assert [c.name for c in sweep.plan(path, sets).cells] == [
        c.name for c in default.cells]


# ------------------------------------------------- partial sweeps and runs


def test_report_of_a_stopped_run_names_what_is_missing_and_marks_it(tmp_path,
                                                                    capsys):
  """A run stopped part way (FedAvg has target A only): the report says
  which runs are missing and marks every mean they leave partial; the
  values are over the finished runs (computed here from _value)."""
  run, out = str(tmp_path / "run"), str(tmp_path / "rep")
  _write_cell(run, 0)
  res = _json(os.path.join(run, "results.json"))
  res["runs"] = [r for r in res["runs"]
                 if (r["algorithm"], r["target"]) != ("fedavg", "B")]
  with open(os.path.join(run, "results.json"), "w") as f:
    json.dump(res, f)
  assert cli.main(["report", run, "--out", out]) == 0
  printed = capsys.readouterr().out
  assert "0/1 cells complete, 3 of 4 planned runs finished" in printed
  assert "PARTIAL: 1 planned run(s) have not finished" in printed
  assert "- `run` (unfinished): 1 run(s) missing: fedavg: targets B" in printed
  assert "fedjax-dg run --resume" in printed
  rows = _rows_csv(os.path.join(out, "per_domain_d1.csv"))
  assert rows["FedAvg"]["missing_runs"] == "1" and rows["hFedF"][
      "missing_runs"] == "0"
  assert rows["FedAvg"]["ood_B_seeds"] == "0"
  assert float(rows["FedAvg"]["ood_mu"]) == pytest.approx(
      100 * _value("fedavg", 1, "A", 0, "ood"))
  md = open(os.path.join(out, "per_domain_d1.md")).read()
  fedavg = next(l for l in md.splitlines() if l.startswith("| FedAvg |"))
  hfedf = next(l for l in md.splitlines() if l.startswith("| hFedF |"))
  assert fedavg.count("†") == 2 and "†" not in hfedf   # id μ, ood μ
  assert "† = partial" in md
  t2 = open(os.path.join(out, "table2.md")).read()
  assert next(l for l in t2.splitlines() if l.startswith("| FedAvg |")
              ).count("†") == 2
  assert _rows_csv(os.path.join(out, "summary.csv"))["FedAvg"][
      "missing_runs"] == "1"
  runs = _csv(os.path.join(out, "runs.csv"))
  assert len(runs) == 3   # finished runs only


def _rows_csv(path):
  return {r["variant"]: r for r in _csv(path)}


def test_report_of_a_sweep_missing_a_seed_counts_and_marks_it(tmp_path,
                                                              capsys):
  """Seed 2 of 0, 1, 2 never ran (pending, no directory): per target the
  mean ± std over the two seeds that did, marked partial, the missing
  cell listed with its runs (from the manifest's base config); a comparison
  with a complete run marks the partial side."""
  sw, out = str(tmp_path / "sw"), str(tmp_path / "rep")
  _write_sweep(sw, (0, 1))
  manifest = _json(os.path.join(sw, "sweep.json"))
  manifest["base_config"] = dict(seed=0, algorithms=["fedavg", "hfedf"],
                                 data=dict(d=1))
  manifest["cells"].append(dict(name="seed=2", settings={"seed": "2"},
                                overrides=["seed=2"], status="pending"))
  with open(os.path.join(sw, "sweep.json"), "w") as f:
    json.dump(manifest, f)
  assert cli.main(["report", sw, "--out", out]) == 0
  printed = capsys.readouterr().out
  assert "2/3 cells complete, 8 of 12 planned runs finished" in printed
  assert ("- `seed=2` (pending): 4 run(s) missing: fedavg: targets A, B; "
          "hfedf: targets A, B") in printed
  assert "fedjax-dg sweep --resume" in printed
  rows = _rows_csv(os.path.join(out, "per_domain_d1.csv"))
  for name, alg in (("FedAvg", "fedavg"), ("hFedF", "hfedf")):
    seeds = [_value(alg, 1, "A", s, "ood") for s in (0, 1)]
    assert rows[name]["ood_A_seeds"] == "2" and rows[name]["missing_runs"] == "2"
    assert float(rows[name]["ood_A_mean"]) == pytest.approx(
        100 * statistics.mean(seeds))
    assert float(rows[name]["ood_A_std"]) == pytest.approx(
        100 * statistics.stdev(seeds))
  md = open(os.path.join(out, "per_domain_d1.md")).read()
  assert next(l for l in md.splitlines() if l.startswith("| FedAvg |")
              ).count("†") == 6   # id A, B, μ and ood A, B, μ
  run = str(tmp_path / "run")
  _write_cell(run, 0)
  cmp_out = str(tmp_path / "cmp")
  assert cli.main(["report", sw, run, "--out", cmp_out]) == 0
  report = open(os.path.join(cmp_out, "report.md")).read()
  assert "4 planned runs not finished" in report
  line = next(l for l in open(os.path.join(cmp_out, "comparison_ood.md"))
              if l.startswith("| FedAvg |"))
  cells = [c.strip() for c in line.strip().strip("|").split("|")]
  assert all("†" in c for c in cells[1:4]) and not any("†" in c
                                                       for c in cells[4:])


# ---------------------------------------------------------- replica batches


def test_a_batched_sweep_equals_one_run_at_a_time(tiny, swept, monkeypatch):
  """The sweep above trained its runs in replica batches (FedAvg's and
  Local-only's runs of both cells and targets together: `replicas` in
  results.json); the same sweep with --replicas 1 (each cell an
  experiment.run, one run after another) gives every run's history, round
  metrics, final scores and metrics.jsonl lines bit for bit (one CPU
  device: both map)."""
  path, d = tiny
  _no_run_figures(monkeypatch)
  out = os.path.join(d, "one_by_one")
  # The second cell alone (its runs were batched with the first cell's).
  assert cli.main(["sweep", "--config", path, "--grid", "data.d=2",
                   "--seeds", "0", "--out", out, "--replicas", "1"]) == 0
  for name in CELLS[1:]:
    batched = {(r["algorithm"], r["target"]): r
               for r in _json(os.path.join(swept, name, "results.json"))["runs"]}
    alone = {(r["algorithm"], r["target"]): r
             for r in _json(os.path.join(out, name, "results.json"))["runs"]}
    assert batched.keys() == alone.keys()
    # 2 cells x 2 targets a batch (a run redone by the resume test above:
    # alone)
    assert sum(r.get("replicas") == 4 for r in batched.values()) >= 1
    for key, run in batched.items():
      assert "replicas" not in alone[key]
      for field in ("final", "history", "round_metrics"):
        assert run[field] == alone[key][field], (key, field)
    # Each replica's evaluations went to its own cell's metrics log.
    lines = lambda root: sorted(open(os.path.join(root, name,
                                                  "metrics.jsonl")).readlines())
    assert lines(swept) == lines(out) and len(lines(out)) == 8


def _two_seeds_opened(tiny, tmp_path):
  """The tiny sweep's cells for seeds 0 and 1, checked and opened."""
  return _opened(tiny[0], tmp_path, seeds=[0, 1])


def _opened(path, tmp_path, seeds):
  """The cells of the experiment file `path` for `seeds`, checked and
  opened (run directories under tmp_path)."""
  from fedjax_dg.run import experiment
  p = sweep.plan(path, seeds=seeds)
  loaded = {}
  sweep.check(p, loaded=loaded)
  return [experiment.open_run(cfg, run_dir=str(tmp_path / c.name),
                              echo=lambda *a: None, dataset=loaded[k])
          for k, (c, cfg) in enumerate(zip(p.cells, p.configs))]


def test_a_sweep_forgets_each_algorithms_programs_after_its_last_batch(
    tiny, tmp_path, monkeypatch):
  """A long sweep holds only the programs still to run: each batch key's
  recipe leaves `built` and the engine's caches (`forget_programs`)
  right after its last batch, once, and never before (the batches are
  interleaved across keys here: a key forgotten early would recompile)."""
  from fedjax_dg import engine
  from fedjax_dg.errors import NonFiniteError
  from fedjax_dg.run import batches
  cells = _two_seeds_opened(tiny, tmp_path)
  planned, built = batches.plan(cells, max_replicas=1)
  keys = [b.key for b in planned]
  recipes = {k: rec for k, (rec, _) in built.items()}
  events = []
  monkeypatch.setattr(engine, "run_batch", lambda rec, datas, *a, **kw: (
      events.append(("train", rec))
      or [NonFiniteError("not trained")] * len(datas)))
  monkeypatch.setattr(engine, "forget_programs",
                      lambda rec: events.append(("forget", rec)))
  batches.run(planned, built, cells, echo=lambda *a: None,
              on_cell_done=lambda c, errors: None)
  assert len(set(keys)) == 2 and len(keys) == 8  # per algorithm
  assert keys != sorted(keys, key=keys.index)  # interleaved
  want = []
  for i, key in enumerate(keys):
    want.append(("train", recipes[key]))
    if key not in keys[i + 1:]:
      want.append(("forget", recipes[key]))
  assert [(e, id(a)) for e, a in events] == [(e, id(a)) for e, a in want]
  assert not built
  for opened in cells:
    opened.log.close()


def test_seeds_batch_together_each_with_its_own_seed_data_and_values(
    tiny, tmp_path, monkeypatch):
  """Two seeds x two targets: each seed's max_per_domain subsample gives
  its own input normalization, but the normalization (like the learning
  rate) is an argument of the program, not a constant of it: one batch per
  algorithm spans both seeds and both targets, and engine.run_batch gets
  each replica's own seed, data and values (its cell's normalization).
  --replicas caps a batch, and the plan says so."""
  from fedjax_dg import engine
  from fedjax_dg.errors import NonFiniteError
  from fedjax_dg.run import batches
  cells = _two_seeds_opened(tiny, tmp_path)
  means = [tuple(c.model(0).mean) for c in cells]
  assert means[0] != means[1]  # the subsamples' statistics differ
  planned, built = batches.plan(cells)
  assert sorted(len(b.jobs) for b in planned) == [4, 4]  # per algorithm
  assert len(built) == 2
  for b in planned:
    assert {(j.cell, j.target) for j in b.jobs} == {(0, 0), (0, 1), (1, 0),
                                                    (1, 1)}
    assert len({j.name for j in b.jobs}) == 1
  lines = batches.explain(planned, cells)
  assert any(line.startswith("  fedavg: 4 runs in 1 batch of 4; it spans "
                             "seeds 0,1 x targets") for line in lines), lines
  capped, _ = batches.plan(cells, max_replicas=1)
  assert len(capped) == 8
  assert "the batch cap" in " ".join(batches.explain(capped, cells))
  calls = []
  monkeypatch.setattr(engine, "run_batch", lambda rec, datas, model, cfg,
                      seeds, **kw: (calls.append((datas, seeds, kw["values"]))
                                    or [NonFiniteError("not trained")] * len(datas)))
  batches.run(planned, built, cells, echo=lambda *a: None,
              on_cell_done=lambda c, errors: None)
  assert [s for _, seeds, _ in calls for s in seeds] == [
      int(cells[j.cell].cfg.seed) for b in planned for j in b.jobs]
  assert {tuple(seeds) for _, seeds, _ in calls} == {(0, 0, 1, 1)}
  for (datas, _, values), b in zip(calls, planned, strict=True):
    assert all(d is cells[j.cell].feds[j.target]
               for d, j in zip(datas, b.jobs, strict=True))
    for v, j in zip(values, b.jobs, strict=True):
      np.testing.assert_array_equal(v["mean"], np.float32(
          cells[j.cell].model(j.target).mean))
  for opened in cells:
    opened.log.close()


def test_runs_built_from_their_data_batch_through_their_prepare(
    tmp_path, monkeypatch):
  """ELCFS builds its amplitude bank from each run's clients; its module's
  `prepare` makes the bank a value of the program, so its two targets
  share one batch (and one program) as FedAvg's do; a module that builds
  from its data without a `prepare` would run alone, and the plan would
  say why."""
  from fedjax_dg import algorithms
  from fedjax_dg.run import batches
  path = tiny_experiment(tmp_path / "elcfs.py", tmp_path / "runs",
                         algorithms=("fedavg", "elcfs"), max_per_domain=30)
  cells = _opened(path, tmp_path, seeds=[0])
  planned, built = batches.plan(cells)
  by_name = {}
  for b in planned:
    by_name.setdefault(b.jobs[0].name, []).append(b)
  assert [len(b.jobs) for b in by_name["elcfs"]] == [2]
  assert [len(b.jobs) for b in by_name["fedavg"]] == [2]
  assert all(b.key is not None for b in planned)
  spec = algorithms.spec("elcfs")
  assert spec.uses_data({}) and spec.batchable({})
  # Without its prepare: each run alone, and the plan says why.
  monkeypatch.setattr(algorithms.Spec, "prepares", property(
      lambda self: self.name != "elcfs" and hasattr(self.module, "prepare")))
  planned, _ = batches.plan(cells)
  alone = [b for b in planned if b.jobs[0].name == "elcfs"]
  assert [len(b.jobs) for b in alone] == [1, 1]
  assert all(b.key is None for b in alone)
  assert any(line.startswith("  elcfs: 2 runs in 2 batches of 1; each run "
                             "alone: it is built from its run's data")
             for line in batches.explain(planned, cells))
  cells[0].log.close()


def test_one_algorithm_over_seeds_targets_and_learning_rates_compiles_once(
    tmp_path, caplog):
  """4 seeds x 2 targets x 2 client learning rates of FedAvg: 16 runs whose
  input normalizations (each seed's subsample) and learning rates differ
  are one batch, and XLA compiles one rounds program and one evaluation
  program for all of them (JAX's own compile log). A value baked into a
  program (the normalization or the learning rate as a constant, as before
  recipes) would make 8 or 16 of each; the runs still differ by their
  learning rate (it reached them)."""
  import jax
  import logging
  from fedjax_dg.run import batches
  path = tiny_experiment(tmp_path / "lr.py", tmp_path / "runs",
                         algorithms=("fedavg",), targets="0,75",
                         max_per_domain=30)
  p = sweep.plan(path, grid=[("client.lr", ["0.001", "0.01"])],
                 seeds=[0, 1, 2, 3])
  loaded = {}
  sweep.check(p, loaded=loaded)
  cells = [experiment.open_run(cfg, run_dir=str(tmp_path / c.name),
                               echo=lambda *a: None, dataset=loaded[k])
           for k, (c, cfg) in enumerate(zip(p.cells, p.configs))]
  planned, built = batches.plan(cells)
  assert [len(b.jobs) for b in planned] == [16]
  jax.config.update("jax_log_compiles", True)
  try:
    with caplog.at_level(logging.WARNING):
      batches.run(planned, built, cells, echo=lambda *a: None,
                  on_cell_done=lambda c, errors: None)
  finally:
    jax.config.update("jax_log_compiles", False)
  compiled = [r.getMessage() for r in caplog.records
              if "Finished XLA compilation of" in r.getMessage()]
  count = lambda name: sum(f"jit({name})" in m for m in compiled)
  assert count("replica_chunk") == 1, compiled
  assert count("replica_scores") == 1, compiled
  finals = {}
  for opened, cell in zip(cells, p.cells):
    for run in opened.results["runs"]:
      finals.setdefault(cell.settings["client.lr"], []).append(
          run["final"]["id_acc_per_client"])
    opened.log.close()
  assert len(finals) == 2 and finals["0.001"] != finals["0.01"]


def test_the_federated_dg_benchmark_grid_plans_and_validates():
  """experiments/feddg_benchmark_offline.py: lambda (1, 0.1, 0) x C (5, 50)
  x its seeds of its 12 methods (the benchmark's that the library has, and
  V-REx), every cell a valid run of the heterogeneous partition, every
  method's clients on the one Adam (lr 1e-3, no decay, constant) whatever
  its module's CLIENT says (SCAFFOLD's SGD 0.01); its documented commands
  plan its own grid."""
  from fedjax_dg import algorithms
  path = os.path.join(EXPERIMENTS, "feddg_benchmark_offline.py")
  p = sweep.plan(path)
  assert len(p.cells) == 3 * 2 * 3
  assert sweep.check(p, data=False) == [1] * len(p.cells)
  assert {(c.data.lam, c.data.num_clients) for c in p.configs} == {
      (lam, n) for lam in (1.0, 0.1, 0.0) for n in (5, 50)}
  assert p.base.data.partition == "heterogeneous"
  assert p.base.train.cohort_size == 0 and p.base.train.epochs == 1
  assert sorted(p.base.algorithms) == sorted([
      "fedavg", "fedprox", "scaffold", "elcfs", "fedadg", "fedsr", "fedgma",
      "irm", "vrex", "fish", "mmd", "coral", "groupdro", "afl"])
  for name in p.base.algorithms:
    section = algorithms.spec(name).section
    assert algorithms.client_settings(dict(p.base.client), dict(
        p.base[section].client)) == dict(optimizer="adam", lr=1e-3,
                                         weight_decay=0.0, momentum=0.0,
                                         schedule="constant"), name
  doc = open(path).read().split('"""')[1]
  for args in _commands(doc):
    assert args[:2] == ["--config", f"experiments/{os.path.basename(path)}"]
    seeds = dict(zip(args[2::2], args[3::2])).get("--seeds")
    planned = sweep.plan(path, seeds=sweep.parse_seeds(seeds))
    assert {c.data.lam for c in planned.configs} == {1.0, 0.1, 0.0}


def _client_of(cfg, name):
  from fedjax_dg import algorithms
  section = algorithms.spec(name).section
  return algorithms.client_settings(dict(cfg.client), dict(cfg[section].client))


def test_the_federated_dg_benchmark_pacs_table_plans_and_validates():
  """experiments/feddg_benchmark_pacs.py: lambda (1, 0.1, 0) x 3 seeds of
  the benchmark's 13 methods that the library has (no V-REx: the benchmark
  reports none), each cell valid and resolving, on the released sweeps'
  protocol: PACS at 224 px, photo held out, 100 clients, 80 rounds of 1
  epoch, every client every round, batch 32, Adam lr 3e-5 for every method
  but FedProx's and SCAFFOLD's 1e-5, FedADG's weight decay 5e-5, and the
  sweeps' hparam1 / hparam2; its documented command plans its own grid."""
  path = os.path.join(EXPERIMENTS, "feddg_benchmark_pacs.py")
  p = sweep.plan(path)
  assert [(c.data.lam, c.seed) for c in p.configs] == [
      (lam, seed) for seed in (0, 1, 2) for lam in (1.0, 0.1, 0.0)]
  assert sweep.check(p, data=False) == [1] * len(p.cells)
  for cfg in p.configs:
    assemble.resolve(cfg)
  b = p.base
  assert sorted(b.algorithms) == sorted([
      "fedavg", "fedprox", "scaffold", "elcfs", "fedadg", "fedsr", "fedgma",
      "irm", "fish", "mmd", "coral", "groupdro", "afl"])
  assert (b.data.name, b.data.image_size, b.data.targets) == ("pacs", 224,
                                                              "photo")
  assert (b.data.partition, b.data.num_clients) == ("heterogeneous", 100)
  assert (b.data.normalization, b.model.name) == ("imagenet",
                                                  "mobilenet_v3_large")
  assert (b.train.rounds, b.train.epochs, b.train.batch_size,
          b.train.cohort_size) == (80, 1, 32, 0)
  adam = dict(optimizer="adam", lr=3e-5, weight_decay=0.0, momentum=0.0,
              schedule="constant")
  lrs = {"fedprox": 1e-5, "scaffold": 1e-5}
  for name in b.algorithms:
    want = dict(adam, lr=lrs.get(name, 3e-5),
                weight_decay=5e-5 if name in ("fedadg", "afl") else 0.0)
    assert _client_of(b, name) == want, name
  assert (b.fedprox.mu, b.fedadg.alpha, b.fedsr.l2r_coeff,
          b.fedsr.cmi_coeff) == (1.0, 0.15, 0.01, 0.001)
  assert (b.fedgma.threshold, b.fedgma.step_size) == (0.1, 0.1)
  assert (b.irm.penalty_weight, b.irm.anneal_steps) == (1000.0, 100)
  assert (b.mmd.penalty_weight, b.coral.penalty_weight,
          b.groupdro.eta) == (1.0, 1.0, 0.01)
  assert (b.fish.meta_lr, b.afl.lambda_lr) == (0.1, 0.1)
  doc = open(path).read().split('"""')[1]
  commands = _commands(doc)
  assert commands
  for args in commands:
    assert args[:2] == ["--config", f"experiments/{os.path.basename(path)}"]
    sets = [v for f, v in zip(args[2::2], args[3::2]) if f == "--set"]
    assert [c.name for c in sweep.plan(path, sets).cells] == [
        c.name for c in p.cells]


def test_the_federated_dg_benchmark_pacs_client_study_plans_and_validates():
  """experiments/feddg_benchmark_pacs_clients.py: C = 10, 50, 100, 200 at
  lambda 0, the study's four methods at batch 128, FedAvg's weight decay
  5e-5 and SCAFFOLD's lr 1e-5 (its sweep files), the main table's protocol
  otherwise."""
  path = os.path.join(EXPERIMENTS, "feddg_benchmark_pacs_clients.py")
  p = sweep.plan(path)
  assert [c.data.num_clients for c in p.configs] == [10, 50, 100, 200]
  assert {(c.data.lam, c.seed) for c in p.configs} == {(0.0, 0)}
  assert sweep.check(p, data=False) == [1] * len(p.cells)
  for cfg in p.configs:
    assemble.resolve(cfg)
  b = p.base
  assert b.algorithms == ("fedavg", "scaffold", "fedsr", "fedgma")
  assert (b.data.targets, b.train.rounds, b.train.batch_size) == ("photo", 80,
                                                                  128)
  assert _client_of(b, "fedavg")["weight_decay"] == 5e-5
  assert _client_of(b, "scaffold")["lr"] == 1e-5
  assert {_client_of(b, n)["lr"] for n in ("fedavg", "fedsr", "fedgma")} == {
      3e-5}
  doc = open(path).read().split('"""')[1]
  for args in _commands(doc):
    assert args[:2] == ["--config", f"experiments/{os.path.basename(path)}"]


def test_the_federated_dg_benchmark_pacs_table_without_pacs_says_how_to_get_it(
    tmp_path, monkeypatch):
  """Where PACS is not there, the sweep stops before any run with the
  dataset's message: where it looked and where to download it."""
  monkeypatch.delenv("FEDJAX_DG_PACS_DIR", raising=False)
  path = os.path.join(EXPERIMENTS, "feddg_benchmark_pacs.py")
  p = sweep.plan(path, [f"data.data_dir={tmp_path}"])
  with pytest.raises(DataError) as e:
    sweep.check(p)
  assert "does not exist or is empty" in str(e.value)
  assert "Download PACS" in str(e.value)


def test_sweep_curves_panel_by_the_grids_general_settings():
  """A grid over data settings (the federated DG benchmark's lambda x C):
  one row of panels per grid point, each line the algorithm with its own
  settings only; a scenario keeps its row; a sweep without a grid, one
  unnamed panel."""
  from fedjax_dg.report import plots
  from fedjax_dg.report.records import _names
  grid = dict(_names("mmd", "MMD", {"data.lam": "0.1", "mmd.penalty_weight":
                                    "0.1", "data.num_clients": "50"}),
              scenario=None)
  assert plots._panel_line(grid) == (
      "data.lam=0.1, data.num_clients=50", "MMD [mmd.penalty_weight=0.1]")
  plain = dict(_names("fedavg", "FedAvg", {"data.lam": "1.0"}), scenario=None)
  assert plots._panel_line(plain) == ("data.lam=1.0", "FedAvg")
  alone = dict(_names("fedavg", "FedAvg", {}), scenario=None)
  assert plots._panel_line(alone) == (None, "FedAvg")
  scen = dict(_names("fedavg", "FedAvg", {"scenario": "standard"}),
              scenario="standard")
  assert plots._panel_line(scen) == ("scenario standard", "FedAvg")
