"""`fedjax-dg run` end to end on the real offline dataset (tiny settings), and errors."""

import json
import os
import subprocess
import sys

import pytest

from fedjax_dg import cli, config, metrics_log

TINY = '''
from fedjax_dg.config import base_config

def get_config():
  c = base_config()
  c.name = "tiny"
  c.output_dir = {out!r}
  c.algorithms = ("hfedf", "fedavg")
  c.data.max_per_domain = 40
  c.data.image_size = 16
  c.data.targets = "0,75"
  c.model.name = "mlp"
  c.train.rounds = 2
  c.train.eval_every = 1
  c.train.epochs = 1
  c.train.batch_size = 16
  c.train.progress = False
  return c
'''


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
  d = tmp_path_factory.mktemp("cli")
  path = d / "tiny.py"
  path.write_text(TINY.format(out=str(d / "runs")))
  return str(path), str(d / "runs")


def test_run_writes_results_table_and_plots_and_never_overwrites(tiny_config, capsys):
  path, out = tiny_config
  assert cli.main(["run", "--config", path]) == 0
  printed = capsys.readouterr().out
  assert "hfedf" in printed and "ood μ" in printed
  (run_dir,) = os.listdir(out)
  res = json.load(open(os.path.join(out, run_dir, "results.json")))
  assert {(r["algorithm"], r["target"]) for r in res["runs"]} == {
      ("hfedf", "0"), ("hfedf", "75"), ("fedavg", "0"), ("fedavg", "75")}
  for r in res["runs"]:
    assert [h["round"] for h in r["history"]] == [1, 2]
    assert 0.0 <= r["final"]["ood_acc"] <= 1.0
    cal = r["final"]["calibration"]
    assert 0.0 <= cal["ood"]["ece"] <= 1.0
    assert sum(cal["id"]["hist_correct"]) + sum(cal["id"]["hist_incorrect"]) > 0
    assert ("weight_divergence" in r["final"]) == (r["algorithm"] == "hfedf")
  assert "ECE ood" in open(os.path.join(out, run_dir, "table.md")).read()
  # metrics.jsonl: strict JSON, one line per evaluation, equal to the history.
  def reject(token):
    raise AssertionError(f"bare {token} in metrics.jsonl")
  lines = [json.loads(l, parse_constant=reject)
           for l in open(os.path.join(out, run_dir, "metrics.jsonl"))]
  assert lines == [metrics_log.record(r["algorithm"], r["target"], h)
                   for r in res["runs"] for h in r["history"]]
  assert sorted(os.listdir(os.path.join(out, run_dir, "tb"))) == [
      "fedavg--0", "fedavg--75", "hfedf--0", "hfedf--75"]
  for f in ("table.md", "curves.png", "config.json", "gradalign.png",
            "confidence.png", "weight_divergence.png"):
    assert os.path.getsize(os.path.join(out, run_dir, f)) > 0
  # Finished runs' checkpoints are removed (train.keep_checkpoints=False).
  assert not os.listdir(os.path.join(out, run_dir, "checkpoints"))

  # A second run goes to a new directory; the first one's results are untouched.
  before = open(os.path.join(out, run_dir, "results.json")).read()
  assert cli.main(["run", "--config", path, "--set", "algorithms=fedavg",
                   "--set", "data.targets=0"]) == 0
  assert len(os.listdir(out)) == 2
  assert open(os.path.join(out, run_dir, "results.json")).read() == before

  # --resume re-runs only what results.json lacks.
  res["runs"] = [r for r in res["runs"] if r["algorithm"] != "fedavg"]
  json.dump(res, open(os.path.join(out, run_dir, "results.json"), "w"))
  assert cli.main(["run", "--config", path, "--resume",
                   os.path.join(out, run_dir)]) == 0
  printed = capsys.readouterr().out
  assert printed.count("already finished") == 2
  res = json.load(open(os.path.join(out, run_dir, "results.json")))
  assert len(res["runs"]) == 4

  # Where the run began is kept; resumed elsewhere, it warns and runs on.
  env_path = os.path.join(out, run_dir, "environment.json")
  env = json.load(open(env_path))
  assert env == res["environment"] and env["devices"] >= 1
  json.dump(dict(env, devices=99), open(env_path, "w"))
  assert cli.main(["run", "--config", path, "--resume",
                   os.path.join(out, run_dir)]) == 0
  assert (f"WARNING: resumed in another environment (devices 99 -> "
          f"{env['devices']})") in capsys.readouterr().out
  assert json.load(open(env_path))["devices"] == 99

  # --resume refuses other settings or data, before anything is written.
  files = {f: open(os.path.join(out, run_dir, f)).read()
           for f in ("config.json", "results.json", "data.json")}
  for extra, needle in ((["--set", "train.rounds=3"], "train.rounds: 2 -> 3"),
                        (["--set", "data.max_per_domain=30"],
                         "data.max_per_domain: 40 -> 30")):
    assert cli.main(["run", "--config", path, "--resume",
                     os.path.join(out, run_dir)] + extra) == 2
    assert needle in capsys.readouterr().err
  for f, text in files.items():
    assert open(os.path.join(out, run_dir, f)).read() == text, f
  # Same settings, other data (as after another `prepare`): refused too.
  data = json.loads(files["data.json"])
  json.dump(dict(data, fingerprint="0" * 16),
            open(os.path.join(out, run_dir, "data.json"), "w"))
  assert cli.main(["run", "--config", path, "--resume",
                   os.path.join(out, run_dir)]) == 2
  assert "run on other data" in capsys.readouterr().err
  # A directory that does not exist is an error, not a fresh run.
  assert cli.main(["run", "--config", path, "--resume",
                   os.path.join(out, "nope")]) == 2
  assert "no such run directory" in capsys.readouterr().err
  assert not os.path.exists(os.path.join(out, "nope"))


@pytest.mark.parametrize("override,needle", [
    ("algorithms=fedavg,nope", "unknown algorithm 'nope'"),
    ("data.name=mnistt", "unknown dataset data.name='mnistt'"),
    ("train.rounds=0", "rounds=0"),
    ("data.d=6", "PartitionSpec.d"),
    ("data.targets=90", "unknown domain '90'"),
    ("data.num_clients=5000", "data.num_clients=5000"),
    ("train.nonexistent=1", "unknown config key 'train.nonexistent'"),
    ("train.rounds=abc", "train.rounds"),
    ("data.partition=banana", "partition"),
    ("data.normalization=imagenets", "data.normalization"),
])
def test_invalid_settings_stop_with_a_clear_error(tiny_config, override, needle):
  path, _ = tiny_config
  proc = subprocess.run(
      [sys.executable, "-m", "fedjax_dg.cli", "run", "--config", path,
       "--set", override], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert needle in proc.stderr, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr


def test_failed_validation_leaves_no_run_directory(tiny_config):
  path, out = tiny_config
  before = set(os.listdir(out)) if os.path.isdir(out) else set()
  assert cli.main(["run", "--config", path, "--set", "data.d=6"]) == 2
  after = set(os.listdir(out)) if os.path.isdir(out) else set()
  assert after == before


def test_a_value_the_scenario_would_replace_is_refused(tiny_config, capsys):
  path, out = tiny_config
  before = set(os.listdir(out)) if os.path.isdir(out) else set()
  assert cli.main(["run", "--config", path, "--set", "scenario=extreme",
                   "--set", "data.alpha=0.5"]) == 2
  assert "data.alpha=0.5 was given too" in capsys.readouterr().err
  assert (set(os.listdir(out)) if os.path.isdir(out) else set()) == before


def test_algorithms_lists_every_algorithm_with_its_settings(capsys):
  from fedjax_dg import algorithms
  assert cli.main(["algorithms"]) == 0
  lines = capsys.readouterr().out.splitlines()
  heads = {l.split()[0]: i for i, l in enumerate(lines) if not l.startswith(" ")}
  assert list(heads) == list(algorithms.available())
  for name, i in heads.items():
    spec = algorithms.spec(name)
    assert f" {spec.display_name} (section {spec.section}" in lines[i], lines[i]
    assert ("needs data.server_fraction > 0" in lines[i]) == spec.needs_server_data
    hp = algorithms.hyperparameters(spec.section)
    if name == spec.section and hp:  # the section's settings, on the next line
      assert lines[i + 1] == "    " + ", ".join(f"{k}={v!r}" for k, v in hp.items())
    for k, v in spec.overrides.items():  # a variant: what it fixes
      assert f"{k}={v!r}" in lines[i]


def test_a_bug_is_not_dressed_as_a_config_error(tiny_config, monkeypatch):
  """Only ConfigError (a setting to fix) becomes a one-line message; any other
  exception keeps its traceback."""
  from fedjax_dg import experiment
  path, _ = tiny_config

  def broken(*args, **kwargs):
    raise ValueError("an internal bug")

  monkeypatch.setattr(experiment, "run", broken)
  with pytest.raises(ValueError, match="an internal bug"):
    cli.main(["run", "--config", path])


def test_ctrl_c_says_how_to_continue(tiny_config, monkeypatch, capsys):
  """Ctrl-C prints the run directory and the command that continues it (same
  config and --set values, shell-quoted)."""
  import shlex
  from fedjax_dg import experiment, sweep
  path, out = tiny_config
  real_run, real_run_all = experiment.run, experiment._run_all

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(experiment, "run", interrupted)  # before any directory
  assert cli.main(["run", "--config", path]) == 130
  err = capsys.readouterr().err
  assert "nothing to continue" in err and "Traceback" not in err
  monkeypatch.setattr(experiment, "run", real_run)

  calls = []

  def stop_in_the_first_run(*args, **kwargs):  # the run directory exists
    calls.append(1)
    if len(calls) == 1:
      raise KeyboardInterrupt
    return real_run_all(*args, **kwargs)

  monkeypatch.setattr(experiment, "_run_all", stop_in_the_first_run)
  sets = ["--set", "name=ctrl c", "--set", "algorithms=fedavg",
          "--set", "data.targets=0"]
  before = set(os.listdir(out)) if os.path.isdir(out) else set()
  assert cli.main(["run", "--config", path] + sets) == 130
  err = capsys.readouterr().err
  (new,) = set(os.listdir(out)) - before
  run_dir = os.path.join(out, new)
  assert f"Finished runs are in {run_dir} " in err and "Traceback" not in err
  command = err.strip().splitlines()[-1].strip()
  assert command == shlex.join(["fedjax-dg", "run", "--config", path] + sets
                               + ["--resume", run_dir])
  # Pasted, it resumes that directory with the settings it was run with.
  words = shlex.split(command)
  assert words[0] == "fedjax-dg"
  monkeypatch.setattr(experiment, "_run_all", real_run_all)
  resumed = []

  def resume(cfg, run_dir=None, resume=False, **kwargs):
    stored = json.load(open(os.path.join(run_dir, "config.json")))
    now = json.loads(experiment.resolve(cfg).to_json())
    resumed.append((run_dir, resume, config.drift(stored, now)))
    raise KeyboardInterrupt

  monkeypatch.setattr(experiment, "run", resume)
  assert cli.main(words[1:]) == 130
  assert resumed == [(run_dir, True, [])]
  capsys.readouterr()

  # A sweep is continued as a whole: `fedjax-dg sweep --resume SWEEP_DIR`.
  monkeypatch.setattr(experiment, "run", interrupted)
  sweep_dir = os.path.join(os.path.dirname(out), "sweep")
  assert cli.main(["sweep", "--config", path, "--out", sweep_dir]) == 130
  err = capsys.readouterr().err
  assert err.strip().splitlines()[-1].strip() == shlex.join(
      ["fedjax-dg", "sweep", "--resume", sweep_dir])
  assert os.path.exists(os.path.join(sweep_dir, sweep.MANIFEST))
