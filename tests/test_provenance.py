"""Every number traceable: the code, data and machine a run records
(`run.provenance`), and the reports and runs.csv that say them
(`report.origin`). Seconds: no engine run (test_cli.py's resume test covers
a real run's results.json)."""

import csv
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import synthetic_domains
from fedjax_dg import cli
from fedjax_dg.report import origin
from fedjax_dg.run import provenance

pytestmark = pytest.mark.skipif(shutil.which("git") is None,
                                reason="needs the git command")


def _git(folder, *args) -> str:
  return subprocess.run(["git", "-C", str(folder), *args], check=True,
                        capture_output=True, text=True).stdout


def _repo(tmp_path):
  """A git repository with a committed package folder `pkg`."""
  repo = tmp_path / "repo"
  (repo / "pkg").mkdir(parents=True)
  (repo / "pkg" / "__init__.py").write_text("x = 1\n")
  _git(repo, "init", "-q")
  _git(repo, "add", ".")
  _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
       "-m", "one")
  return repo


def test_a_clean_checkout_records_its_commit_and_not_dirty(tmp_path):
  repo = _repo(tmp_path)
  src = provenance.git_source(str(repo / "pkg"), "9.9")
  assert src == dict(commit=_git(repo, "rev-parse", "HEAD").strip(),
                     dirty=False, diff="", version="9.9")
  assert _git(repo, "status", "--porcelain") == ""


def test_a_dirty_tree_is_reported_dirty_with_a_digest_of_its_changes(tmp_path):
  repo = _repo(tmp_path)
  head = _git(repo, "rev-parse", "HEAD").strip()
  (repo / "pkg" / "__init__.py").write_text("x = 2\n")
  edited = provenance.git_source(str(repo / "pkg"), "9.9")
  assert _git(repo, "status", "--porcelain") != ""
  assert edited["commit"] == head and edited["dirty"] is True
  assert len(edited["diff"]) == 16
  (repo / "pkg" / "__init__.py").write_text("x = 3\n")  # other changes
  assert provenance.git_source(str(repo / "pkg"), "9.9")["diff"] != edited["diff"]
  (repo / "pkg" / "__init__.py").write_text("x = 1\n")
  (repo / "new.py").write_text("")                       # untracked: dirty too
  assert provenance.git_source(str(repo / "pkg"), "9.9")["dirty"] is True


def test_this_checkout_is_found_from_the_package_not_the_cwd(tmp_path,
                                                             monkeypatch):
  """From any working directory, the package's own checkout: its commit and
  whether it is dirty. Where the package is a copy that git does not track
  (mutation testing runs the tests on one, in mutants/), "unknown", as for an
  installed package: git asked independently which case this is."""
  monkeypatch.chdir(tmp_path)                            # not a repository
  src = provenance.git_source(provenance.PACKAGE_DIR)
  root = os.path.dirname(provenance.PACKAGE_DIR)
  tracked = subprocess.run(
      ["git", "-C", root, "ls-files", "--error-unmatch",
       os.path.join(provenance.PACKAGE_DIR, "__init__.py")],
      capture_output=True).returncode == 0
  if not tracked:
    assert src["commit"] == (
        f"unknown (installed package {provenance.package_version()})")
    return
  assert src["commit"] == _git(root, "rev-parse", "HEAD").strip()
  assert src["dirty"] == bool(_git(root, "status", "--porcelain"))


def test_a_package_outside_a_checkout_says_unknown_and_never_crashes(
    tmp_path, monkeypatch):
  copy = tmp_path / "site-packages" / "pkg"
  copy.mkdir(parents=True)
  unknown = dict(commit="unknown (installed package 9.9)", dirty=None,
                 diff=None, version="9.9")
  assert provenance.git_source(str(copy), "9.9") == unknown
  # Untracked inside a repository (a venv's site-packages in a checkout).
  repo = _repo(tmp_path)
  (repo / "venv" / "pkg").mkdir(parents=True)
  (repo / "venv" / "pkg" / "m.py").write_text("")
  assert provenance.git_source(str(repo / "venv" / "pkg"), "9.9") == unknown
  monkeypatch.setenv("PATH", "")                         # no git at all
  assert provenance.git_source(str(repo / "pkg"), "9.9") == unknown
  assert provenance.git_source(str(repo / "pkg"))["commit"] == (
      f"unknown (installed package {provenance.package_version()})")


def test_the_environment_names_versions_devices_and_cpu():
  env = provenance.environment()
  assert env["python"] == platform.python_version()
  for p in ("jax", "jaxlib", "flax", "optax", "numpy"):
    assert env[p] == importlib.metadata.version(p), p
  assert env["jax"] == jax.__version__
  assert env["backend"] == jax.default_backend()
  assert env["device_kind"] == jax.devices()[0].device_kind
  assert (env["devices"], env["processes"]) == (jax.device_count(),
                                                jax.process_count())
  if sys.platform.startswith("linux"):
    with open("/proc/cpuinfo") as f:
      names = [l.split(":", 1)[1].strip() for l in f
               if l.lower().startswith(("model name", "hardware"))]
    assert names and env["cpu"] == names[0]


def test_the_data_record_names_the_dataset_counts_its_images_and_fingerprints():
  """data.json's record (`data_of`): the name, every image counted, and a
  fingerprint that changes when one label does."""
  ds = synthetic_domains(num_domains=3, per_domain=7)
  rec = provenance.data_of(ds)
  assert rec == dict(dataset=ds.name, images=21, fingerprint=ds.fingerprint())
  labels = ds.labels.copy()
  labels[5] = (labels[5] + 1) % 3
  other = provenance.data_of(dataclasses.replace(ds, labels=labels))
  assert other["images"] == 21 and other["fingerprint"] != rec["fingerprint"]


def test_a_resume_with_other_code_warns_and_the_same_code_does_not():
  src = dict(commit="a" * 40, dirty=False, diff="", version="0.1.0")
  env = provenance.environment()
  now = dict(source=src, data={}, environment=env)
  assert provenance.resume_warnings(src, env, now) == []
  assert provenance.resume_warnings(None, None, now) == []   # older run dir
  for other in (dict(src, commit="b" * 40),
                dict(src, dirty=True, diff="0123456789abcdef")):
    (w,) = provenance.resume_warnings(other, env, now)
    assert "resumed with other fedjax_dg code" in w
    assert origin.source_text(other) in w and "a" * 40 in w
  # Dirty at start and at resume, other uncommitted changes: still other code.
  dirty = dict(src, dirty=True, diff="0" * 16)
  assert provenance.resume_warnings(
      dirty, env, dict(now, source=dict(dirty, diff="1" * 16)))
  # An environment.json of an older fedjax_dg (fewer keys): only those compared.
  old = {k: env[k] for k in ("jax", "backend", "devices", "processes")}
  assert provenance.resume_warnings(src, old, now) == []
  (w,) = provenance.resume_warnings(src, dict(old, devices=99), now)
  assert "resumed in another environment (devices 99 ->" in w


# ----------------------------------------------------------------- reports


def _results(path, runs_commit, source, *, data=True, algs=("fedavg",),
             shift=0.0, seed=0):
  """A run directory: config.json, results.json of a finished run per
  algorithm and target A, B; `runs_commit`: each run's own `commit` (None:
  not recorded)."""
  os.makedirs(path)
  runs = [dict(algorithm=a, target=t, seconds=1.0,
               **({"source": dict(commit=runs_commit, dirty=False)}
                  if runs_commit else {}),
               history=[dict(round=1, id_acc=0.5 + shift + k / 10,
                             ood_acc=0.4 + shift + j / 10)],
               final=dict(round=1, id_acc=0.5 + shift + k / 10,
                          ood_acc=0.4 + shift + j / 10))
          for k, a in enumerate(algs) for j, t in enumerate("AB")]
  extra = {}
  if data:
    extra = dict(source=source, data=dict(dataset="rotated_fashion_mnist",
                                          images=12, fingerprint="f" * 16),
                 environment=provenance.environment())
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(dict(seed=seed, data=dict(d=1)), f)
  with open(os.path.join(path, "results.json"), "w") as f:
    json.dump(dict(name="r", dataset="rotated_fashion_mnist",
                   targets=["A", "B"], algorithms=list(algs), runs=runs,
                   **extra), f)


def _csv(path):
  with open(path) as f:
    return list(csv.DictReader(f))


def test_runs_csv_and_report_carry_each_runs_commit(tmp_path, capsys):
  src = dict(commit="c" * 40, dirty=True, diff="d" * 16, version="0.1.0")
  run, out = str(tmp_path / "run"), str(tmp_path / "rep")
  _results(run, None, src)                  # runs without their own commit
  assert cli.main(["report", run, "--out", out]) == 0
  rows = _csv(os.path.join(out, "runs.csv"))
  assert [(r["commit"], r["dirty"]) for r in rows] == [("c" * 40, "True")] * 2
  report = open(os.path.join(out, "report.md")).read()
  assert ("- fedjax_dg commit: " + "c" * 40 + " + uncommitted changes "
          + "d" * 16) in report
  assert "- data: rotated_fashion_mnist, 12 images, fingerprint " + "f" * 16 \
      in report
  env = provenance.environment()
  assert f"jaxlib {env['jaxlib']}" in report and f"CPU {env['cpu']}" in report
  # A run's own commit wins (a resumed run's runs ran at different commits).
  run2, out2 = str(tmp_path / "run2"), str(tmp_path / "rep2")
  _results(run2, "e" * 40, src)
  assert cli.main(["report", run2, "--out", out2]) == 0
  assert {r["commit"] for r in _csv(os.path.join(out2, "runs.csv"))} == {"e" * 40}
  # A run recorded before any of this: said, not guessed.
  run3, cmp = str(tmp_path / "run3"), str(tmp_path / "cmp")
  _results(run3, None, None, data=False)
  assert cli.main(["report", run, run3, "--out", cmp]) == 0
  rows = _csv(os.path.join(cmp, "runs.csv"))
  assert sorted(r["commit"] for r in rows) == ["", "", "c" * 40, "c" * 40]
  report = open(os.path.join(cmp, "report.md")).read()
  assert "fedjax_dg commit: not recorded" in report
  assert "fedjax_dg commit: " + "c" * 40 in report
  capsys.readouterr()


def test_the_provenance_lines_count_what_differs():
  a, b = dict(commit="a" * 40, dirty=False), dict(commit="b" * 40, dirty=False)
  lines = origin.provenance_lines([a, a, b, None], [{}, {}])
  assert lines[2] == ("- fedjax_dg commit: " + "a" * 40 + " (2 runs); "
                      + "b" * 40 + " (1 run); not recorded (1 run)")
  assert lines[3] == "- data: not recorded"
  fm = dict(dataset="fm", images=10, fingerprint="f")
  lines = origin.provenance_lines([a], [{}, dict(data=fm), dict(data=fm)])
  assert lines[3] == ("- data: not recorded (1 run directory); fm, 10 images, "
                      "fingerprint f (2 run directories)")


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location(
    "results_derive", os.path.join(REPO, "docs", "results", "derive.py"))
derive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(derive)


# Fixtures: the tables of real reports (tests/data/report_tables/).
TABLES = os.path.join(REPO, "tests", "data", "report_tables")


def test_a_reports_tables_are_made_again_from_its_committed_runs_csv(tmp_path):
  """docs/results/derive.py: an hFedF Table 2 sweep's tables (3 seeds, 189
  runs) from its runs.csv alone equal the report's own (columns added since
  aside)."""
  src = os.path.join(TABLES, "hfedf_table2")
  derive.derive(str(tmp_path), [os.path.join(src, "runs.csv")])
  for name in ("table2.csv", "per_domain_d2.csv", "summary.csv"):
    committed = _csv(os.path.join(src, name))
    made = _csv(os.path.join(tmp_path, name))
    assert len(made) == len(committed) > 0, name
    for a, b in zip(committed, made):
      assert {k: b[k] for k in a} == a, name


def test_a_grid_sweeps_tables_come_back_from_its_runs_csv(tmp_path):
  """With grid labels in the row names ("hFedF [hfedf.ema_decay=0.5]") and
  several seeds: every table CSV of the report, made again, is identical."""
  sw, out, again = (str(tmp_path / n) for n in ("sw", "rep", "again"))
  cells = []
  for seed in (0, 1):
    for ema in ("0.5", "0.9"):
      name = f"hfedf.ema_decay={ema}__seed={seed}"
      cells.append(dict(name=name, settings={"hfedf.ema_decay": ema,
                                             "seed": str(seed)}, status="done"))
      _results(os.path.join(sw, name), "a" * 40, None, algs=("fedavg", "hfedf"),
               shift=0.01 * seed + (0.02 if ema == "0.9" else 0.0), seed=seed)
  with open(os.path.join(sw, "sweep.json"), "w") as f:
    json.dump(dict(name="sw", cells=cells), f)
  assert cli.main(["report", sw, "--out", out]) == 0
  derive.derive(again, [os.path.join(out, "runs.csv")])
  names = sorted(n for n in os.listdir(out) if n.endswith(".csv")
                 and n not in ("runs.csv", "paired.csv"))
  assert "summary.csv" in names and "differences.csv" in names
  for name in names:
    assert _csv(os.path.join(again, name)) == _csv(os.path.join(out, name)), name


def test_the_best_client_on_the_target_is_in_runs_csv_and_summary(tmp_path):
  """FedSDAF's "best client on the target" (what its released code reports):
  the best of the clients' final models on the target, per run and as μ."""
  run, out = str(tmp_path / "run"), str(tmp_path / "rep")
  _results(run, None, None)
  res = json.load(open(os.path.join(run, "results.json")))
  for r, per_client in zip(res["runs"], ([0.3, 0.6, 0.5], [0.2, 0.1, 0.4])):
    r["final"]["ood_acc_per_client"] = per_client
  with open(os.path.join(run, "results.json"), "w") as f:
    json.dump(res, f)
  assert cli.main(["report", run, "--out", out]) == 0
  assert [float(r["best_client_ood_acc"])
          for r in _csv(os.path.join(out, "runs.csv"))] == [0.6, 0.4]
  (row,) = _csv(os.path.join(out, "summary.csv"))
  assert float(row["best_client_ood_acc"]) == pytest.approx(50.0)
  assert "best client" in open(os.path.join(out, "summary.md")).read()


_spec1 = importlib.util.spec_from_file_location(
    "results_table1_section",
    os.path.join(REPO, "docs", "results", "table1_section.py"))
table1_section = importlib.util.module_from_spec(_spec1)
_spec1.loader.exec_module(table1_section)


def test_the_table1_sections_tables_are_the_committed_reports(capsys):
  """docs/results/table1_section.py prints docs/results.md's FedCCRL Table 1
  tables from the three reports of one sweep (against FedAvg, FedCCRL,
  FedProx): every algorithm's per-domain row (FedAvg's too) and, in the
  differences table, each column's interval as the right report's
  differences.csv holds it."""
  src = os.path.join(TABLES, "table1", "vs_fedavg")
  reports = {"FedAvg": src,
             "FedCCRL": os.path.join(TABLES, "table1", "vs_fedccrl"),
             "FedProx": os.path.join(TABLES, "table1", "vs_fedprox")}
  table1_section.main(reports["FedAvg"], reports["FedCCRL"], reports["FedProx"])
  out = capsys.readouterr().out
  names = [r["variant"] for r in _csv(os.path.join(src, "per_domain_d1.csv"))]
  assert len(names) == 9 and names[0] == "FedAvg"
  per_domain, diffs = out.split("\n\n")[:2]
  assert [l.split("|")[1].strip() for l in per_domain.splitlines()[2:]] == names
  rows = {l.split("|")[1].strip(): [c.strip() for c in l.split("|")[2:6]]
          for l in diffs.splitlines()[2:]}
  assert list(rows) == names
  columns = [("FedAvg", "id"), ("FedAvg", "ood"), ("FedProx", "ood"),
             ("FedCCRL", "ood")]
  for col, (ref, metric) in enumerate(columns):
    for r in _csv(os.path.join(reports[ref], "differences.csv")):
      if r["evaluation"] != "final" or r["metric"] != metric:
        continue
      lo, hi = float(r["ci_low"]), float(r["ci_high"])
      mark = "↑" if lo > 0 else ("↓" if hi < 0 else "≈")
      assert rows[r["variant"]][col] == (
          f"{float(r['difference']):+.1f} [{lo:+.1f}, {hi:+.1f}] {mark}")
  assert rows["FedAvg"][0] == rows["FedProx"][2] == rows["FedCCRL"][3] == ""


_spec4 = importlib.util.spec_from_file_location(
    "results_fedsdaf_table4_section",
    os.path.join(REPO, "docs", "results", "fedsdaf_table4_section.py"))
fedsdaf_section = importlib.util.module_from_spec(_spec4)
_spec4.loader.exec_module(fedsdaf_section)
FEDSDAF_3SEEDS = os.path.join(REPO, "docs", "results",
                              "fedsdaf_offline_2026-11-27")


def test_the_fedsdaf_sections_differences_are_the_committed_reports(capsys):
  """docs/results/fedsdaf_table4_section.py restates the committed FedSDAF
  report: each variant's id / ood interval as its differences.csv holds it."""
  fedsdaf_section.main([os.path.join(FEDSDAF_3SEEDS, "runs.csv")])
  out = capsys.readouterr().out
  chunks = out.strip().split("\n\n")
  (title,) = [i for i, c in enumerate(chunks) if c.startswith("### Paired")]
  rows = {l.split("|")[1].strip(): [c.strip() for c in l.split("|")[2:4]]
          for l in chunks[title + 1].splitlines()[2:]}
  want = {}
  for r in _csv(os.path.join(FEDSDAF_3SEEDS, "differences.csv")):
    if r["evaluation"] == "final" and r["metric"] in ("id", "ood"):
      want.setdefault(r["variant"].split(" [")[0], {})[r["metric"]] = (
          f"{float(r['difference']):+.1f} [{float(r['ci_low']):+.1f}, "
          f"{float(r['ci_high']):+.1f}]")
  assert len(want) == 5
  assert rows == {v: [m["id"], m["ood"]] for v, m in want.items()}
  # The ablation table: FedSDAF minus each variant, from the same runs.
  (title,) = [i for i, c in enumerate(chunks) if "minus each ablation" in c]
  ablations = [l.split("|")[1].strip()
               for l in chunks[title + 1].splitlines()[2:]]
  assert ablations == [v for v in want if v != "FedSDAF"]
  # Its first ood mean, recomputed: per seed, the mean over the targets of
  # FedSDAF's ood minus w/o BKD's; then the mean over the seeds.
  by = {}
  for r in _csv(os.path.join(FEDSDAF_3SEEDS, "runs.csv")):
    by[(r["algorithm"], r["seed"], r["target"])] = 100 * float(r["ood_acc"])
  seeds = sorted({k[1] for k in by})
  per_seed = [np.mean([by[("fedsdaf", s, t)] - by[("fedsdaf_no_bkd", s, t)]
                       for t in fedsdaf_section.TARGETS]) for s in seeds]
  first = chunks[title + 1].splitlines()[2]
  assert first.split("|")[3].strip().startswith(f"{np.mean(per_seed):+.1f} [")


def test_the_fedsdaf_section_refuses_overlapping_or_different_halves(tmp_path):
  """Two halves must hold disjoint seeds of one protocol."""
  runs = os.path.join(FEDSDAF_3SEEDS, "runs.csv")
  with pytest.raises(SystemExit, match="seeds must be disjoint"):
    fedsdaf_section.main([runs, runs])
  other = tmp_path / "other"
  other.mkdir()
  with open(os.path.join(FEDSDAF_3SEEDS, "sweep.json")) as f:
    manifest = json.load(f)
  manifest["base_config"]["train"]["rounds"] += 1
  (other / "sweep.json").write_text(json.dumps(manifest))
  (other / "runs.csv").write_text(open(runs).read())
  with pytest.raises(SystemExit, match=r"differs .* in \['train'\]"):
    fedsdaf_section.main([runs, str(other / "runs.csv")])


_spec5 = importlib.util.spec_from_file_location(
    "results_dtype_section",
    os.path.join(REPO, "docs", "results", "dtype_section.py"))
dtype_section = importlib.util.module_from_spec(_spec5)
_spec5.loader.exec_module(dtype_section)


def _dtype_runs(path, rows):
  header = ["cell", "seed", "algorithm", "variant", "target", "id_acc",
            "ood_acc", "data.d", "model.dtype"]
  with open(path, "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(header)
    w.writerows(rows)


def test_the_dtype_section_pairs_each_bf16_run_with_its_float32_run(
    tmp_path, capsys):
  """bfloat16 − float32 per seed (the mean over targets of each pair), its
  mean and Student-t interval: recomputed with scipy on a planted CSV where
  bf16 is 2 points above float32 on one target and 1 below on the other."""
  from scipy import stats as scipy_stats  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  rows, diffs, f32_means = [], [], []
  for seed in range(5):
    base = rng.uniform(0.5, 0.7, size=2)
    noise = rng.normal(0, 0.005, size=2)
    for dtype, acc in (("float32", base), ("bfloat16", base + [0.02, -0.01]
                                           + noise)):
      for t, target in enumerate(("0", "30")):
        rows.append([f"s{seed}", seed, "hfedf", "hFedF", target, 0.9,
                     acc[t], 1, dtype])
    diffs.append(100 * np.mean([0.02, -0.01] + noise))
    f32_means.append(100 * base.mean())
  path = tmp_path / "runs.csv"
  _dtype_runs(path, rows)
  dtype_section.main(str(path))
  out = capsys.readouterr().out
  (ood,) = [l for l in out.splitlines() if l.startswith("| hFedF | ood")]
  cells = [c.strip() for c in ood.split("|")[1:-1]]
  lo, hi = scipy_stats.t.interval(0.95, len(diffs) - 1, loc=np.mean(diffs),
                                  scale=scipy_stats.sem(diffs))
  mark = "↑" if lo > 0 else ("↓" if hi < 0 else "≈")
  assert cells[4] == f"{np.mean(diffs):+.1f} [{lo:+.1f}, {hi:+.1f}] {mark}"
  assert cells[2] == (f"{np.mean(f32_means):.1f} ± "
                      f"{np.std(f32_means, ddof=1):.1f}")
  spread = np.std(f32_means, ddof=1)
  assert cells[5] == ("yes" if abs(np.mean(diffs)) <= spread else "no")
  (id_row,) = [l for l in out.splitlines() if l.startswith("| hFedF | id")]
  assert "+0.0 [+0.0, +0.0]" in id_row  # id equal on both sides


def test_the_dtype_section_refuses_a_run_without_its_partner(tmp_path):
  rows = [["a", 0, "fedavg", "FedAvg", "0", 0.9, 0.5, 1, "float32"],
          ["b", 0, "fedavg", "FedAvg", "0", 0.9, 0.5, 1, "bfloat16"],
          ["c", 1, "fedavg", "FedAvg", "0", 0.9, 0.5, 1, "float32"]]
  path = tmp_path / "runs.csv"
  _dtype_runs(path, rows)
  with pytest.raises(SystemExit, match="seed 1 target 0.*has only float32"):
    dtype_section.main(str(path))
  _dtype_runs(path, [r[:-1] + ["float16"] for r in rows])
  with pytest.raises(SystemExit, match="'float16' is not one of"):
    dtype_section.main(str(path))
