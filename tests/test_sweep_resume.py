"""A sweep's runs in batches survive what stops them: a replica stopped as
non-finite, a damaged checkpoint, a full disk, a kill at any moment. Each
test's docstring names the drill it holds (docs/testing.md, "Sweep
drills")."""

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import synthetic_federation, tiny_experiment
from fedjax_dg import cli, engine, models
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client import objectives
from fedjax_dg.data.federated import pack_padded
from fedjax_dg.errors import NonFiniteError
from fedjax_dg.optim import make_optimizer

CFG = engine.EngineConfig(rounds=4, eval_every=1, epochs=1, batch_size=8,
                          cohort_size=2, client_mapping="map", progress=False,
                          eval_batch_size=16, checkpoint_every=0.0)


def test_a_stopped_replica_never_blocks_the_resume_of_its_batch(tmp_path):
  """Drill 1: one replica of a batch goes non-finite at its first round; the
  batch is interrupted after 2 of 4 rounds (the healthy replicas'
  checkpoints hold round 2, the stopped one's none); resumed, the healthy
  replicas continue from their own round 2 and end as their uninterrupted
  runs, and the stopped one stops again, named."""
  good = synthetic_federation(num_clients=3, per_domain=30)
  x = np.asarray(good.train.x, np.float32) / 255.0
  bad_x = x.copy()
  bad_x[0, 0, 0, 0, 0] = np.inf
  as_float = lambda xs: dataclasses.replace(good, packed_train=pack_padded(
      good.train.replace(x=xs)))
  datas = [as_float(x), as_float(bad_x), as_float(x)]
  model = models.get_model("mlp", input_shape=good.image_shape,
                           num_classes=good.num_classes, mean=(0.5,),
                           std=(0.25,), hidden=8)
  alg = fedavg(model, make_optimizer("sgd", 0.1),
               objectives.cross_entropy(model))
  seeds = (1, 2, 3)
  dirs = [str(tmp_path / f"r{r}") for r in range(3)]
  first = engine.run_batch(alg, datas, model,
                           dataclasses.replace(CFG, rounds=2), seeds,
                           checkpoint_dirs=dirs)
  assert isinstance(first[1], NonFiniteError)
  stops = []
  seen = [[], [], []]
  resumed = engine.run_batch(alg, datas, model, CFG, seeds,
                             checkpoint_dirs=dirs,
                             on_eval=[s.append for s in seen],
                             on_stop=[stops.append] * 3)
  assert [[e["round"] for e in s] for s in seen] == [[3, 4], [], [3, 4]]
  assert isinstance(resumed[1], NonFiniteError) and "seed 2" in str(resumed[1])
  assert stops == [resumed[1]]
  for r in (0, 2):
    alone = engine.run(alg, datas[r], model,
                       dataclasses.replace(CFG, seed=seeds[r]))
    assert resumed[r].history == alone.history
    assert resumed[r].final == alone.final


def _tiny(tmp_path, **kw):
  return tiny_experiment(tmp_path / "tiny.py", tmp_path / "runs",
                         algorithms=("fedavg",), targets="0,75", **kw)


def _sweep(path, out, *args):
  return cli.main(["sweep", "--config", path, "--out", str(out), *args])


def test_a_non_finite_run_is_said_at_once_recorded_and_not_retried(
    tmp_path, capsys):
  """Drill 7: a learning rate of 1e30 sends one cell's runs to NaN. The
  message is printed when the replicas stop (before any cell is done),
  the cell fails with the reason, the report names the reason and does not
  offer --resume for it, and a resume does not train it again (it would
  stop the same way): exit 1 both times."""
  path = _tiny(tmp_path)
  out = tmp_path / "sw"
  assert _sweep(path, out, "--seeds", "0", "--grid",
                "client.lr=0.01,1e30") == 1
  text = capsys.readouterr().out
  assert "went non-finite" in text
  first_done = min(text.index(line) for line in text.splitlines()
                   if line.endswith(": done") or ": FAILED:" in line)
  assert text.index("went non-finite") < first_done
  manifest = json.load(open(out / "sweep.json"))
  bad = next(c for c in manifest["cells"] if "1e30" in c["name"])
  assert bad["status"] == "failed" and "non-finite" in bad["error"]
  stopped = json.load(open(out / bad["name"] / "results.json"))["stopped"]
  assert {(r["algorithm"], r["target"]) for r in stopped} == {
      ("fedavg", "0"), ("fedavg", "75")}
  report = open(out / "report" / "report.md").read()
  assert "was stopped:" in report and "went non-finite" in report
  assert "--resume" not in report
  assert cli.main(["sweep", "--resume", str(out)]) == 1
  again = capsys.readouterr().out
  assert "0 runs to do" in again and "batch 1/" not in again
  assert "FAILED" in again and "went non-finite" in again  # still said


def test_one_at_a_time_and_batched_sweeps_record_the_same_runs(tmp_path):
  """Drill 7: `--replicas 1` and batched sweeps train the same runs, a
  non-finite one included (it no longer stops its cell's other target in
  one mode only), with the same numbers and reasons (a batch's message
  also names the replica and its seed)."""
  import re
  unlabelled = lambda e: re.sub(r" \(replica \d+, seed \d+\)", "", e)
  path = _tiny(tmp_path)
  kept = {}
  for replicas in ("1", "0"):
    out = tmp_path / f"sw{replicas}"
    assert _sweep(path, out, "--seeds", "0", "--grid", "client.lr=0.01,1e30",
                  "--replicas", replicas) == 1
    cells = {}
    for d in sorted(os.listdir(out)):
      if os.path.isfile(out / d / "results.json"):
        res = json.load(open(out / d / "results.json"))
        cells[d] = ({(r["target"], json.dumps(r["final"], sort_keys=True))
                     for r in res["runs"]},
                    {(r["target"], unlabelled(r["error"]))
                     for r in res.get("stopped", [])})
    kept[replicas] = cells
  assert kept["1"] == kept["0"]
  assert any(stopped for _, stopped in kept["0"].values())


@pytest.mark.slow  # three sweep processes; the engine's own is default
def test_a_damaged_checkpoint_in_a_batch_costs_only_its_run(tmp_path):
  """Drill 2: a sweep of two seeds x two targets is killed after its
  first chunks were checkpointed; one run's checkpoint is then truncated.
  The resume says so once (results.json's warnings name that run's
  folder), that run alone starts over, the others continue, and the
  numbers equal an uninterrupted sweep's; no traceback is printed."""
  path = _tiny(tmp_path)
  whole = tmp_path / "whole"
  assert _start(path, whole, "--seeds", "0,1").wait(timeout=600) == 0
  out = tmp_path / "sw"
  proc = _start(path, out, "--seeds", "0,1")
  _wait_for_checkpoints(out, proc, count=4)
  proc.kill()
  proc.wait()
  damaged = _truncate_one_checkpoint(out)
  done = subprocess.run([sys.executable, "-m", "fedjax_dg.cli", "sweep",
                         "--resume", str(out)], capture_output=True,
                        text=True, env=_env(), timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "Traceback" not in done.stderr
  assert "Event loop is closed" not in done.stderr + done.stdout
  said = [w for cell in os.listdir(out) if os.path.isfile(
      out / cell / "results.json")
          for w in json.load(open(out / cell / "results.json"))["warnings"]
          if "could not be read" in w]
  assert len(said) == 1 and damaged in said[0]
  assert_same_runs(_finals(out), _finals(whole))


def test_a_full_disk_in_a_batch_is_one_message_and_the_resume_command(
    tmp_path, capsys, monkeypatch):
  """Drill 3: the disk fills while a batch writes its checkpoints: one
  message, the resume command, exit 2, no raw OSError; the resume then
  finishes the sweep."""
  import errno
  import orbax.checkpoint as ocp
  path = _tiny(tmp_path)
  out = tmp_path / "sw"
  real = ocp.CheckpointManager.save

  def full(self, *a, **kw):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(ocp.CheckpointManager, "save", full)
  assert _sweep(path, out, "--seeds", "0,1") == 2
  err = capsys.readouterr().err
  assert "no space left on device" in err and "Traceback" not in err
  assert err.strip().splitlines()[-1].strip() == (
      f"fedjax-dg sweep --resume {out}")
  monkeypatch.setattr(ocp.CheckpointManager, "save", real)
  assert cli.main(["sweep", "--resume", str(out)]) == 0


# -------------------------------------------------- kills at random points


def _env():
  tests = os.path.dirname(__file__)
  return dict(os.environ, PYTHONPATH=os.pathsep.join(
      [os.path.dirname(tests), os.environ.get("PYTHONPATH", "")]))


def _start(path, out, *args):
  return subprocess.Popen([sys.executable, "-m", "fedjax_dg.cli", "sweep",
                           "--config", path, "--out", str(out), *args],
                          stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, env=_env())


def _checkpoints(out) -> list[str]:
  found = []
  for root, dirs, _ in os.walk(out):
    found += [os.path.join(root, d) for d in dirs if d.isdigit()
              and os.path.basename(os.path.dirname(os.path.join(root, d)))
              .count("--")]
  return found


def _wait_for_checkpoints(out, proc, count, timeout=300):
  t0 = time.time()
  while len(_checkpoints(out)) < count:
    assert proc.poll() is None, "the sweep ended before it was killed"
    assert time.time() - t0 < timeout
    time.sleep(0.05)


def _truncate_one_checkpoint(out) -> str:
  """Truncates every file of the first run's latest checkpoint; returns
  that run's checkpoint folder."""
  first = os.path.dirname(sorted(_checkpoints(out))[0])
  step = max((c for c in _checkpoints(out) if os.path.dirname(c) == first),
             key=lambda c: int(os.path.basename(c)))
  for root, _, files in os.walk(step):
    for f in files:
      p = os.path.join(root, f)
      with open(p, "r+b") as fh:
        fh.truncate(os.path.getsize(p) // 2)
  return os.path.dirname(step)


def _finals(out) -> dict:
  got = {}
  for cell in sorted(os.listdir(out)):
    path = os.path.join(out, cell, "results.json")
    if os.path.isfile(path):
      for r in json.load(open(path))["runs"]:
        got[cell, r["algorithm"], r["target"]] = (r["final"], r["history"])
  return got


def assert_same_runs(a: dict, b: dict) -> None:
  """The same runs, each with the same final evaluation and history: the
  accuracies exactly (counts), the float sums (calibration, nll) within
  1e-6: a run resumed alone is scored in its own batch size where its
  batch mates' larger splits set another, which moves their summation
  order only."""
  assert sorted(a) == sorted(b)

  def same(x, y, where):
    if isinstance(x, dict):
      assert sorted(x) == sorted(y), where
      for k in x:
        same(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, (list, tuple)):
      assert len(x) == len(y), where
      for i, (u, v) in enumerate(zip(x, y)):
        same(u, v, f"{where}[{i}]")
    elif isinstance(x, float) and "calibration" in where:
      assert x == pytest.approx(y, rel=1e-6, abs=1e-9), where
    else:
      assert x == y, where
  for k in a:
    same(a[k], b[k], str(k))


@pytest.mark.slow
def test_a_sweep_killed_at_random_points_resumes_to_the_same_numbers(
    tmp_path):
  """Three trials, each killing a batched sweep (SIGKILL or SIGTERM) at a
  random moment, then resuming it (and killing the resume too, once):
  every trial ends with the uninterrupted sweep's runs, history included,
  none missing or doubled. Seeded, so a failure repeats."""
  path = tiny_experiment(tmp_path / "tiny.py", tmp_path / "runs",
                         algorithms=("fedavg", "local_only"),
                         targets="0,75")
  whole = tmp_path / "whole"  # in a process of its own, as the trials (the
  t0 = time.time()            # CLI's CPU devices: docs/architecture.md)
  assert _start(path, whole, "--seeds", "0,1").wait(timeout=900) == 0
  length = time.time() - t0
  rng = random.Random(0)
  for trial in range(3):
    out = tmp_path / f"trial{trial}"
    proc = _start(path, out, "--seeds", "0,1")
    for kill in range(2):
      time.sleep(rng.uniform(0.3, 1.5) * length)
      if proc.poll() is not None:
        break
      proc.send_signal(rng.choice([signal.SIGKILL, signal.SIGTERM]))
      proc.wait()
      proc = subprocess.Popen([sys.executable, "-m", "fedjax_dg.cli",
                               "sweep", "--resume", str(out)],
                              stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=_env())
    assert proc.wait(timeout=900) in (0, 1)
    if proc.returncode:  # killed before its manifest was whole: start over
      assert subprocess.run([sys.executable, "-m", "fedjax_dg.cli", "sweep",
                             "--resume", str(out)], env=_env(),
                            capture_output=True, timeout=900).returncode == 0
    assert_same_runs(_finals(out), _finals(whole))
