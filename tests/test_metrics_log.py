"""metrics.jsonl and TensorBoard event files, written as a run goes."""

import glob
import json
import math
import os
import struct

import pytest

from conftest import tiny_experiment
from fedjax_dg import cli, engine
from fedjax_dg.report import metrics_log


def reject(token):
  raise AssertionError(f"bare {token} in metrics.jsonl (not strict JSON)")


def strict_lines(path):
  with open(path) as f:
    return [json.loads(l, parse_constant=reject) for l in f]


def tb_scalars(logdir):
  """{tag: [(step, value)]} of every event file in `logdir`, read as TFRecords
  (length, crc, payload, crc) of tensorboardX's Event protos."""
  from tensorboardX.proto import event_pb2
  out = {}
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    data = open(path, "rb").read()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      for v in event.summary.value:
        out.setdefault(v.tag, []).append((event.step, v.simple_value))
  return out


def test_record_keeps_scalars_and_writes_non_finite_as_null():
  rec = metrics_log.record("fedavg", None, dict(
      round=3, train_loss=float("nan"), id_acc=0.5, ood_acc=float("inf"),
      id_acc_per_client=[0.5, None], calibration={"x": 1}))
  assert rec == dict(algorithm="fedavg", target="None", round=3,
                     train_loss=None, id_acc=0.5, ood_acc=None)
  assert json.loads(metrics_log.line(rec), parse_constant=reject) == rec
  with pytest.raises(ValueError):
    metrics_log.line(dict(a=math.nan))


def test_resumed_chunks_replace_their_lines_and_sync_matches_history(tmp_path):
  log = metrics_log.RunLog(str(tmp_path))
  for r in (1, 2, 3):
    log.log("fedavg", "0", dict(round=r, train_loss=1.0 / r))
  log.close()
  # Resumed from the checkpoint of round 1: rounds 2 and 3 are evaluated again.
  log = metrics_log.RunLog(str(tmp_path))
  log.log("fedavg", "0", dict(round=2, train_loss=0.25))
  lines = strict_lines(tmp_path / "metrics.jsonl")
  assert [(l["round"], l["train_loss"]) for l in lines] == [(1, 1.0), (2, 0.25)]
  history = [dict(round=1, train_loss=1.0), dict(round=2, train_loss=0.25),
             dict(round=3, train_loss=0.2)]
  log.sync("fedavg", "0", history)
  log.sync("hfedf", "75", history[:1])
  log.close()
  lines = strict_lines(tmp_path / "metrics.jsonl")
  assert lines == ([metrics_log.record("fedavg", "0", h) for h in history]
                   + [metrics_log.record("hfedf", "75", history[0])])
  scalars = tb_scalars(tmp_path / "tb" / "hfedf--75")
  assert scalars == {"train_loss": [(1, 1.0)]}
  # The second writer (same second, same folder) did not truncate the first's
  # file: TensorBoard keeps both writes of round 2.
  # (sync added round 3 of the history, which the resumed writer never saw).
  steps = sorted(tb_scalars(tmp_path / "tb" / "fedavg--0")["train_loss"])
  assert [s for s, _ in steps] == [1, 2, 2, 3, 3]
  assert [v for _, v in steps] == pytest.approx([1.0, 0.25, 0.5, 0.2, 1 / 3])


def test_a_crashed_run_keeps_its_first_chunk_and_resume_completes_it(
    tmp_path, monkeypatch):
  path = tmp_path / "tiny.py"
  tiny_experiment(path, tmp_path / "runs", algorithms=("fedavg",), targets="0")
  real_run = engine.run_batch
  calls = []

  def crashing_run(*args, on_eval=None, **kwargs):
    (on_eval,) = on_eval

    def on_eval_2(entry):
      calls.append(entry)
      if len(calls) == 2:
        raise RuntimeError("crash after the first chunk")
      on_eval(entry)
    return real_run(*args, on_eval=[on_eval_2], **kwargs)

  monkeypatch.setattr(engine, "run_batch", crashing_run)
  with pytest.raises(RuntimeError, match="crash after the first chunk"):
    cli.main(["run", "--config", str(path)])
  (run_dir,) = glob.glob(str(tmp_path / "runs" / "*"))
  (line,) = strict_lines(os.path.join(run_dir, "metrics.jsonl"))
  assert line["algorithm"] == "fedavg" and line["target"] == "0"
  assert line["round"] == 1
  assert set(line) >= {"train_loss", "id_acc", "ood_acc"}
  assert line["train_loss"] == pytest.approx(calls[0]["train_loss"])
  tb = tb_scalars(os.path.join(run_dir, "tb", "fedavg--0"))
  assert set(tb) == {"train_loss", "id_acc", "ood_acc"}
  assert tb["ood_acc"] == [(1, pytest.approx(calls[0]["ood_acc"]))]

  monkeypatch.setattr(engine, "run_batch", real_run)
  assert cli.main(["run", "--config", str(path), "--resume", run_dir]) == 0
  (run,) = json.load(open(os.path.join(run_dir, "results.json")))["runs"]
  lines = strict_lines(os.path.join(run_dir, "metrics.jsonl"))
  assert [l["round"] for l in lines] == [1, 2]
  for l, h in zip(lines, run["history"]):
    assert l == metrics_log.record("fedavg", "0", h)
  tb = tb_scalars(os.path.join(run_dir, "tb", "fedavg--0"))
  assert [s for s, _ in tb["id_acc"]] == [1, 2]
  assert tb["id_acc"][-1][1] == pytest.approx(run["history"][-1]["id_acc"])
