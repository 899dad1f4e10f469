"""Every number traceable: the code, data and machine a run records
(`run.provenance`), and the reports and runs.csv that say them
(`report.origin`). Seconds: no engine run (test_cli.py's resume test covers
a real run's results.json)."""

import csv
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys

import jax
import pytest

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
  monkeypatch.chdir(tmp_path)                            # not a repository
  src = provenance.git_source(provenance.PACKAGE_DIR)
  root = os.path.dirname(provenance.PACKAGE_DIR)
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


def _results(path, runs_commit, source, *, data=True):
  """A run directory: config.json, results.json of two finished runs;
  `runs_commit`: each run's own `commit` (None: not recorded)."""
  os.makedirs(path)
  runs = [dict(algorithm="fedavg", target=t, seconds=1.0,
               **({"source": dict(commit=runs_commit, dirty=False)}
                  if runs_commit else {}),
               history=[dict(round=1, id_acc=0.5, ood_acc=0.4)],
               final=dict(round=1, id_acc=0.5, ood_acc=0.4)) for t in "AB"]
  extra = {}
  if data:
    extra = dict(source=source, data=dict(dataset="rotated_fashion_mnist",
                                          images=12, fingerprint="f" * 16),
                 environment=provenance.environment())
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(dict(seed=0, data=dict(d=1)), f)
  with open(os.path.join(path, "results.json"), "w") as f:
    json.dump(dict(name="r", dataset="rotated_fashion_mnist",
                   targets=["A", "B"], algorithms=["fedavg"], runs=runs,
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
