"""`fedjax-dg run` end to end on the real offline dataset (tiny settings), and errors."""

import json
import os
import subprocess
import sys

import pytest

from conftest import tiny_experiment
from fedjax_dg import cli, engine
from fedjax_dg.run import config, provenance
from fedjax_dg.report import metrics_log


def no_plots(monkeypatch):
  """run_summary.write_all without its figures (matplotlib: ~1-3 s per run
  directory): for runs whose figures no test looks at. Figures are checked
  after the first run of test_run_writes_results_table_and_plots_and_never_
  overwrites; written after a resume in test_resume_runs_the_stored_config_
  and_refuses_another."""
  from fedjax_dg.report import plots
  monkeypatch.setattr(plots, "ALL", {})


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
  d = tmp_path_factory.mktemp("cli")
  path = d / "tiny.py"
  return tiny_experiment(path, d / "runs"), str(d / "runs")


def test_run_writes_results_table_and_plots_and_never_overwrites(tiny_config, capsys,
                                                                monkeypatch):
  path, out = tiny_config
  assert cli.main(["run", "--config", path]) == 0
  printed = capsys.readouterr().out
  assert "hfedf" in printed and "ood μ" in printed
  (run_dir,) = os.listdir(out)
  # What a terminal shows: no line wider than 100 columns (but the run
  # directory's own, as long as its path); the full table is table.md.
  assert max(len(l) for l in printed.splitlines() if run_dir not in l) <= 100
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
  no_plots(monkeypatch)   # from here on no figure is looked at
  before = open(os.path.join(out, run_dir, "results.json")).read()
  assert cli.main(["run", "--config", path, "--set", "algorithms=fedavg",
                   "--set", "data.targets=0"]) == 0
  assert len(os.listdir(out)) == 2
  assert open(os.path.join(out, run_dir, "results.json")).read() == before

  # --resume re-runs only what results.json lacks (one run of four: each
  # re-run costs an engine run).
  dropped = ("fedavg", "75")
  res["runs"] = [r for r in res["runs"]
                 if (r["algorithm"], r["target"]) != dropped]
  json.dump(res, open(os.path.join(out, run_dir, "results.json"), "w"))
  assert cli.main(["run", "--config", path, "--resume",
                   os.path.join(out, run_dir)]) == 0
  printed = capsys.readouterr().out
  assert printed.count("already finished") == 3
  res = json.load(open(os.path.join(out, run_dir, "results.json")))
  assert len(res["runs"]) == 4
  assert {(r["algorithm"], r["target"]) for r in res["runs"]} == {
      ("hfedf", "0"), ("hfedf", "75"), ("fedavg", "0"), ("fedavg", "75")}

  # Where the run began is kept; resumed elsewhere, it warns and runs on.
  env_path = os.path.join(out, run_dir, "environment.json")
  env = json.load(open(env_path))
  assert env == res["environment"] and env["devices"] >= 1
  # The code, data and machine: results.json and each run (run.provenance).
  src_path = os.path.join(out, run_dir, "source.json")
  src = json.load(open(src_path))
  assert src == res["source"] == provenance.source()
  assert all(r["source"] == src for r in res["runs"])
  assert res["data"] == json.load(open(os.path.join(out, run_dir, "data.json")))
  json.dump(dict(env, devices=99), open(env_path, "w"))
  json.dump(dict(src, commit="0" * 40), open(src_path, "w"))
  assert cli.main(["run", "--config", path, "--resume",
                   os.path.join(out, run_dir)]) == 0
  printed = capsys.readouterr().out
  assert (f"WARNING: resumed in another environment (devices 99 -> "
          f"{env['devices']})") in printed
  assert ("WARNING: resumed with other fedjax_dg code than the run began "
          "with (" + "0" * 40) in printed
  said = json.load(open(os.path.join(out, run_dir, "results.json")))["warnings"]
  assert [w.split(" (")[0] for w in said] == [
      "resumed with other fedjax_dg code than the run began with",
      "resumed in another environment"]
  assert json.load(open(env_path))["devices"] == 99
  assert json.load(open(src_path))["commit"] == "0" * 40

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
def test_invalid_settings_stop_with_a_clear_error(tiny_config, override, needle,
                                                 capsys):
  """In-process (an exception other than the ConfigError that `cli.main`
  turns into exit status 2 fails the test); the first case also as the
  command `python -m fedjax_dg.cli` (a process start costs ~1.5 s: once)."""
  path, _ = tiny_config
  args = ["run", "--config", path, "--set", override]
  assert cli.main(args) == 2
  err = capsys.readouterr().err
  assert needle in err and "Traceback" not in err, err[-2000:]
  if override == "algorithms=fedavg,nope":
    proc = subprocess.run([sys.executable, "-m", "fedjax_dg.cli"] + args,
                          capture_output=True, text=True, timeout=300)
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
  from fedjax_dg.run import experiment
  path, _ = tiny_config

  def broken(*args, **kwargs):
    raise ValueError("an internal bug")

  monkeypatch.setattr(experiment, "run", broken)
  with pytest.raises(ValueError, match="an internal bug"):
    cli.main(["run", "--config", path])


def test_ctrl_c_says_how_to_continue(tiny_config, monkeypatch, capsys):
  """Ctrl-C prints the run directory and the command that continues it
  (`--resume DIR` alone: the directory stores its config, shell-quoted)."""
  import shlex
  from fedjax_dg.run import assemble, directory, experiment, sweep
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
  assert command == shlex.join(["fedjax-dg", "run", "--resume", run_dir])
  # Pasted, it resumes that directory with the settings it was run with.
  words = shlex.split(command)
  assert words[0] == "fedjax-dg"
  monkeypatch.setattr(experiment, "_run_all", real_run_all)
  resumed = []

  def resume(cfg, run_dir=None, resume=False, **kwargs):
    stored = json.load(open(os.path.join(run_dir, "config.json")))
    now = json.loads(assemble.resolve(cfg).to_json())
    resumed.append((run_dir, resume, config.drift(stored, now)))
    raise KeyboardInterrupt

  monkeypatch.setattr(experiment, "run", resume)
  assert cli.main(words[1:]) == 130
  assert resumed == [(run_dir, True, [])]
  capsys.readouterr()

  # A sweep is continued as a whole: `fedjax-dg sweep --resume SWEEP_DIR`,
  # stopped in a replica batch or (--replicas 1) in a run.
  monkeypatch.setattr(engine, "run_batch", interrupted)
  for replicas in ("0", "1"):
    sweep_dir = os.path.join(os.path.dirname(out), f"sweep{replicas}")
    assert cli.main(["sweep", "--config", path, "--out", sweep_dir,
                     "--replicas", replicas]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].strip() == shlex.join(
        ["fedjax-dg", "sweep", "--resume", sweep_dir])
    assert os.path.exists(os.path.join(sweep_dir, directory.MANIFEST))


# --------------------------------------------------------- runs that end badly


def _small(out, *extra):
  """`run` arguments of a one-round FedAvg on tiny data, into `out`."""
  return (["--set", f"output_dir={out}", "--set", "algorithms=fedavg",
           "--set", "train.rounds=1"] + list(extra))


@pytest.fixture(scope="module")
def small_run(tiny_config, tmp_path_factory):
  """A finished run directory: FedAvg, targets 0 and 75, one round."""
  path, _ = tiny_config
  out = str(tmp_path_factory.mktemp("small") / "runs")
  assert cli.main(["run", "--config", path] + _small(out)) == 0
  (name,) = os.listdir(out)
  return os.path.join(out, name)


def _copy_run(run_dir, tmp_path):
  import shutil
  dst = str(tmp_path / os.path.basename(run_dir))
  shutil.copytree(run_dir, dst)
  return dst


def test_resume_runs_the_stored_config_and_refuses_another(small_run, tmp_path,
                                                           tiny_config, capsys):
  """`run --resume DIR` needs no --config / --set: config.json is used; a
  --config or --set that disagrees is refused before anything is written.
  results.json's `seconds` is the total over the parts."""
  run_dir = _copy_run(small_run, tmp_path)
  path_json = os.path.join(run_dir, "results.json")
  res = json.load(open(path_json))
  res["runs"] = [r for r in res["runs"] if r["target"] != "75"]
  res["seconds"] = 1000.0  # as if the first part had run that long
  json.dump(res, open(path_json, "w"))
  capsys.readouterr()
  assert cli.main(["run", "--resume", run_dir]) == 0
  printed = capsys.readouterr().out
  assert printed.count("already finished, kept from results.json") == 1
  res = json.load(open(path_json))
  assert sorted(r["target"] for r in res["runs"]) == ["0", "75"]
  assert 0 < res["seconds_this_part"] < 1000
  assert res["seconds"] == pytest.approx(1000.0 + res["seconds_this_part"])

  files = {f: open(os.path.join(run_dir, f)).read()
           for f in ("config.json", "results.json", "data.json")}
  path, _ = tiny_config
  other = tmp_path / "other.py"
  other.write_text(open(path).read().replace("c.train.rounds = 2",
                                             "c.train.rounds = 3"))
  for args, needle in (
      (["--set", "train.rounds=2"], "train.rounds: 1 -> 2"),
      (["--config", str(other)] + _small(os.path.dirname(run_dir))[:4],
       "train.rounds: 1 -> 3")):
    assert cli.main(["run", "--resume", run_dir] + args) == 2
    err = capsys.readouterr().err
    assert needle in err and "fedjax-dg run --resume" in err, err
  assert cli.main(["demo", "--resume", run_dir]) == 2
  assert "not of this demo ('demo')" in capsys.readouterr().err
  for f, text in files.items():
    assert open(os.path.join(run_dir, f)).read() == text, f
  assert cli.main(["run", "--resume", str(tmp_path)]) == 2
  assert "holds no config.json" in capsys.readouterr().err
  assert cli.main(["run"]) == 2
  assert "run needs --config" in capsys.readouterr().err


def test_model_dtype_auto_says_what_it_chose_and_never_changes_on_resume(
    small_run, tmp_path, capsys):
  """model.dtype="auto": the run prints the dtype it resolved to (float32 on
  a CPU); resuming a run that began on a GPU (bfloat16) on a CPU is refused
  before anything is written, not continued in float32."""
  run_dir = _copy_run(small_run, tmp_path)
  cfg_path = os.path.join(run_dir, "config.json")
  env_path = os.path.join(run_dir, "environment.json")
  stored = json.load(open(cfg_path))
  stored["model"]["dtype"] = "auto"
  json.dump(stored, open(cfg_path, "w"))
  env = json.load(open(env_path))
  json.dump(dict(env, backend="gpu"), open(env_path, "w"))
  capsys.readouterr()
  assert cli.main(["run", "--resume", run_dir]) == 2
  err = capsys.readouterr().err
  assert "model.dtype='auto' began as bfloat16 on gpu" in err, err
  assert json.load(open(env_path))["backend"] == "gpu"  # nothing written
  json.dump(env, open(env_path, "w"))  # began on this backend
  assert cli.main(["run", "--resume", run_dir]) == 0
  assert "model.dtype=auto: float32 (cpu:" in capsys.readouterr().out


def test_a_resumed_runs_seconds_count_every_part(tiny_config, tmp_path,
                                                 monkeypatch, capsys):
  """Stopped after round 1's checkpoint (that part's time inflated by 1000
  s in it) and resumed: the run's `seconds` and results.json's count both
  parts, not only the last."""
  from fedjax_dg.engine.checkpoint import Checkpointer
  no_plots(monkeypatch)
  path, _ = tiny_config
  out = str(tmp_path / "runs")
  args = ["run", "--config", path] + _small(
      out, "--set", "data.targets=0", "--set", "train.rounds=2")
  real_save = Checkpointer.save

  def save(self, step, carry, meta, **kw):
    if step == 2:
      raise KeyboardInterrupt
    real_save(self, step, carry, dict(meta, seconds=meta["seconds"] + 1000.0),
              **kw)

  monkeypatch.setattr(Checkpointer, "save", save)
  assert cli.main(args) == 130
  (name,) = os.listdir(out)
  run_dir = os.path.join(out, name)
  first = json.load(open(os.path.join(run_dir, "results.json")))
  assert first["runs"] == [] and first["seconds"] > 0  # stopped: time kept
  monkeypatch.setattr(Checkpointer, "save", real_save)
  assert cli.main(["run", "--resume", run_dir]) == 0
  res = json.load(open(os.path.join(run_dir, "results.json")))
  (run,) = res["runs"]
  assert [h["round"] for h in run["history"]] == [1, 2]
  assert 1000 < run["seconds"] < 1000 + res["seconds"]
  assert res["seconds"] == pytest.approx(first["seconds"]
                                         + res["seconds_this_part"])


@pytest.mark.parametrize("fails", ["save", "wait_until_finished"])
def test_a_full_disk_ends_with_one_message_and_the_resume_command(
    tiny_config, tmp_path, monkeypatch, capsys, fails):
  """ENOSPC while orbax writes a checkpoint (raised by its save, or by the
  asynchronous write surfacing at the end): one message naming the
  checkpoint directory and the command that continues; no traceback. The
  sweep stops there (every later cell would fail alike)."""
  import errno
  import shlex
  import orbax.checkpoint as ocp
  path, _ = tiny_config
  out = str(tmp_path / "runs")
  no_plots(monkeypatch)

  def full(self, *args, **kwargs):
    raise RuntimeError("orbax: commit failed") from OSError(
        errno.ENOSPC, "No space left on device", "/x")

  real = getattr(ocp.CheckpointManager, fails)
  monkeypatch.setattr(ocp.CheckpointManager, fails, full)
  assert cli.main(["run", "--config", path]
                  + _small(out, "--set", "data.targets=0")) == 2
  err = capsys.readouterr().err
  (name,) = os.listdir(out)
  run_dir = os.path.join(out, name)
  ckpt = os.path.join(run_dir, "checkpoints", "fedavg--0")
  lines = err.strip().splitlines()
  assert "Traceback" not in err and len(lines) == 3, err
  assert lines[0].startswith("fedjax-dg: error: ") and ckpt in lines[0]
  assert "no space left on device" in lines[0]
  assert lines[-1].strip() == shlex.join(["fedjax-dg", "run", "--resume",
                                          run_dir])
  sweep_dir = str(tmp_path / "sweep")
  assert cli.main(["sweep", "--config", path, "--out", sweep_dir]
                  + _small(out, "--set", "data.targets=0")[2:]) == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err and err.strip().splitlines()[-1].strip() == (
      shlex.join(["fedjax-dg", "sweep", "--resume", sweep_dir]))
  manifest = json.load(open(os.path.join(sweep_dir, "sweep.json")))
  assert [c["status"] for c in manifest["cells"]] == ["running"]
  monkeypatch.setattr(ocp.CheckpointManager, fails, real)   # space freed
  assert cli.main(shlex.split(lines[-1])[1:]) == 0   # resumed
  assert len(json.load(open(os.path.join(run_dir, "results.json")))["runs"]) == 1


def test_disk_full_is_found_however_it_is_wrapped():
  import errno
  import logging
  from fedjax_dg import errors
  from fedjax_dg.engine.checkpoint import QuietDiskFull
  enospc = OSError(errno.ENOSPC, "No space left on device")
  try:
    try:
      raise enospc
    except OSError:
      raise ValueError("write failed")  # context, not cause
  except ValueError as e:
    in_context = e
  for error, full in ((enospc, True), (in_context, True),
                      (RuntimeError("[Errno 28] No space left on device"), True),
                      (OSError(errno.EACCES, "Permission denied"), False),
                      (ValueError("bad value"), False)):
    assert errors.is_disk_full(error) == full, error
  record = lambda e: logging.LogRecord("absl", logging.ERROR, "f", 1, "m", (),
                                       (type(e), e, None))
  quiet = QuietDiskFull()
  assert not quiet.filter(record(in_context))
  assert quiet.filter(record(ValueError("bad value")))


def test_a_run_failing_at_build_leaves_no_run_directory(tiny_config, tmp_path,
                                                        monkeypatch, capsys):
  from fedjax_dg import errors
  from fedjax_dg.run import assemble
  path, _ = tiny_config
  out = tmp_path / "runs"
  def build(name, model, num_clients, cfg, data=None):
    # The run's build (the checks before the directory exists build
    # stand-ins with assemble.algorithm, not recipes).
    raise errors.ConfigError("fedavg: a setting only the data refute")

  monkeypatch.setattr(assemble, "recipe", build)
  assert cli.main(["run", "--config", path]
                  + _small(out, "--set", "data.targets=0")) == 2
  assert "a setting only the data refute" in capsys.readouterr().err
  assert os.listdir(out) == []


def test_an_unwritable_output_dir_is_a_config_error_naming_it(
    tiny_config, tmp_path, monkeypatch, capsys):
  from fedjax_dg.run import directory, experiment
  path, _ = tiny_config
  afile = tmp_path / "afile"
  afile.write_text("")
  readonly = tmp_path / "ro"
  readonly.mkdir()
  real_access = os.access
  monkeypatch.setattr(os, "access", lambda p, mode: (
      False if str(p) == str(readonly) else real_access(p, mode)))
  for where, needle in ((afile, f"{str(afile)!r} is a file, not a folder"),
                        (afile / "sub", f"{str(afile)!r} is a file"),
                        (readonly / "runs", f"{str(readonly)!r} is not "
                                            "writable")):
    assert cli.main(["run", "--config", path, "--set",
                     f"output_dir={where}"]) == 2
    err = capsys.readouterr().err
    assert f"output_dir={str(where)!r}" in err and needle in err, err
    assert "--set output_dir=" in err
  assert cli.main(["sweep", "--config", path, "--out", str(afile / "sw")]) == 2
  assert f"--out={str(afile / 'sw')!r}: {str(afile)!r} is a file" in (
      capsys.readouterr().err)
  # A folder that cannot be made for another reason still names the field.
  def refuse(p, *a, **k):
    raise PermissionError(13, "Permission denied", p)
  monkeypatch.setattr(os, "makedirs", refuse)
  with pytest.raises(experiment.ConfigError, match=r"^--out='/x': cannot "
                     "create the run directory '/x/compare-"):
    directory.make_run_dir("/x", "compare", field="--out")


def test_stand_ins_are_recorded_in_results_and_table(tiny_config, tmp_path,
                                                     capsys, monkeypatch):
  """CCST without AdaIN weights and a partition leaving a source domain out:
  each a line of results.json's `warnings` and of table.md (and kept by a
  resume that rebuilds nothing), not only a stderr line."""
  from fedjax_dg.algorithms import ccst
  no_plots(monkeypatch)
  path, _ = tiny_config
  out = str(tmp_path / "runs")
  assert cli.main(["run", "--config", path] + _small(
      out, "--set", "algorithms=ccst", "--set", "ccst.depth=1",
      "--set", "data.targets=0", "--set", "data.num_clients=4")) == 0
  (name,) = os.listdir(out)
  run_dir = os.path.join(out, name)
  want = ["target 0: domain_split: num_clients * d = 4 < 5 source domains, "
          "so the smallest domains [5] are left unused", ccst.RANDOM_WEIGHTS]
  res = json.load(open(os.path.join(run_dir, "results.json")))
  assert res["warnings"] == want
  table = open(os.path.join(run_dir, "table.md")).read()
  assert table.index("Stand-ins") < table.index("| algorithm |")
  assert all(f"- **{w}**" in table for w in want)
  assert all(f"WARNING: {w}" in capsys.readouterr().err for w in want[1:])
  assert cli.main(["run", "--resume", run_dir]) == 0
  assert json.load(open(os.path.join(run_dir, "results.json")))["warnings"] \
      == want


def test_fedsdafs_random_frozen_backbone_is_a_stand_in(fed3):
  import dataclasses
  import warnings
  from conftest import model_for
  from fedjax_dg.run import assemble
  from fedjax_dg.run import config as config_lib
  from fedjax_dg.errors import StandInWarning
  model, cfg = model_for("fedsdaf", fed3), config_lib.base_config()
  with pytest.warns(StandInWarning, match="fedsdaf: no model.weights: the "
                    "frozen ViT backbone is randomly initialized"):
    assemble.algorithm("fedsdaf", model, 3, cfg)
  with warnings.catch_warnings():
    warnings.simplefilter("error", StandInWarning)
    assemble.algorithm("fedsdaf", dataclasses.replace(model, weights="w.npz"),
                       3, cfg)


def _results(algs, targets, value, missing=()):
  """A results dict as `experiment.run` returns it; accuracy value(a, t)."""
  runs = [dict(algorithm=a, target=t, warnings=[],
               final=dict(round=1, id_acc=value(a, t, "id"),
                          ood_acc=value(a, t, "ood")),
               history=[dict(round=1, id_acc=value(a, t, "id"),
                             ood_acc=value(a, t, "ood"))])
          for a in algs for t in targets if (a, t) not in missing]
  return dict(name="demo", run_dir="/r", dataset="rotated_fashion_mnist",
              targets=list(targets), algorithms=list(algs), runs=runs,
              warnings=[])


def _acc(a, t, m):
  """Distinct made-up accuracies (fractions)."""
  return (len(a) * 7 + int(t) + (3 if m == "id" else 0)) % 97 / 100


@pytest.mark.parametrize("algs,targets", [
    (("hfedf", "fedavg"), ("0", "15", "30", "45", "60", "75")),  # the demo
    (("hfedf_no_gradalign", "fedavg", "local_only", "central", "hfedf"),
     ("0", "15", "30", "45", "60", "75")),
    (("fedavg",), tuple(str(15 * i) for i in range(24))),       # wrapped
])
def test_the_printed_summary_fits_100_columns_and_says_the_means(algs,
                                                                 targets):
  import numpy as np
  from fedjax_dg.report import run_summary
  text = run_summary.terminal_summary(_results(algs, targets, _acc))
  lines = text.splitlines()
  assert max(len(line) for line in lines) <= 100, text
  for a in algs:   # μ ± std over targets, computed here with numpy
    (line,) = [l for l in lines if l.strip().startswith(a + " ")
               and "μ" in l]
    for m in ("id", "ood"):
      vals = [100 * _acc(a, t, m) for t in targets]
      assert (f"{m} μ {np.mean(vals):.1f} ± {np.std(vals):.1f}") in line
  # Every per-target value is printed under its target's column.
  header = [l for l in lines if l.startswith("algorithm")]
  cols = {t: None for t in targets}
  for l in lines:
    if l.startswith("algorithm"):
      names = l.split()[1:]
    elif l.split() and l.split()[0] == algs[0] and "μ" not in l:
      for t, v in zip(names, l.split()[1:]):
        cols.setdefault(t, v)
        cols[t] = cols[t] or v
  assert len(header) >= 2
  assert all(cols[t] == f"{100 * _acc(algs[0], t, 'ood'):.1f}" for t in targets)


def test_a_partial_run_is_marked_in_the_summary_and_table_md(tmp_path):
  from fedjax_dg.report import run_summary
  targets = ("0", "15", "30", "45", "60", "75")
  res = _results(("hfedf", "fedavg"), targets, _acc,
                 missing={("fedavg", t) for t in ("45", "60", "75")})
  text = run_summary.terminal_summary(res)
  fedavg = next(l for l in text.splitlines() if l.strip().startswith("fedavg"))
  mean = 100 * sum(_acc("fedavg", t, "ood") for t in targets[:3]) / 3
  assert f"ood μ {mean:.1f}" in fedavg and fedavg.count("†") == 2
  hfedf = next(l for l in text.splitlines() if l.strip().startswith("hfedf"))
  assert "†" not in hfedf
  assert "PARTIAL: 3 of 12 runs missing (fedavg: targets 45, 60, 75)" in text
  run_summary.write_all(res, str(tmp_path))
  table = open(tmp_path / "table.md").read()
  row = next(l for l in table.splitlines() if l.startswith("| fedavg |"))
  assert row.count("†") == 4   # id μ, best id μ, ood μ, best ood μ
  assert "PARTIAL: 3 of 12 runs missing" in table
