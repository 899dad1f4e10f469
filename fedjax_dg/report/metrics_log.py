"""A run's metrics where researchers look, written as the run goes: after every
evaluation (chunk boundary) of every (algorithm, target), so a crashed run keeps
its curves up to its last chunk.

* `<run_dir>/metrics.jsonl`: one strict-JSON object per line (`algorithm`,
  `target`, `round`, `train_loss`, `id_acc`, `ood_acc` and every other scalar
  entry of the history; `null` for a non-finite value, never a bare NaN).
* `<run_dir>/tb/<algorithm>[--<target>]/`: TensorBoard event files (tensorboardX),
  one scalar tag per metric, the round as the step.

A resumed run re-evaluates the chunks after its last checkpoint: their lines are
replaced, never duplicated, and when a run finishes its lines are made equal to
its history in results.json (`sync`).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time

JSONL = "metrics.jsonl"
TB_DIR = "tb"


def _scalar(value):
  """A JSON scalar for a history value (a non-finite float as None), or
  `_NOT_SCALAR` for lists and dicts (per-client values stay in results.json)."""
  if value is None or isinstance(value, (bool, str)):
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    return float(value) if math.isfinite(value) else None
  return _NOT_SCALAR


_NOT_SCALAR = object()


def record(algorithm: str, target, entry: dict) -> dict:
  """One metrics.jsonl object: the run's key and the entry's scalar values
  (non-finite as None). `target` is written as results.json writes it."""
  out = dict(algorithm=algorithm, target=str(target))
  for k, v in entry.items():
    if k in out:
      raise ValueError(f"history entry key {k!r} collides with the record key")
    v = _scalar(v)
    if v is not _NOT_SCALAR:
      out[k] = v
  return out


def line(rec: dict) -> str:
  """`rec` as one line of strict JSON (refuses NaN / inf instead of writing them)."""
  return json.dumps(rec, allow_nan=False) + "\n"


def tb_dir(run_dir: str, algorithm: str, target) -> str:
  """`<run_dir>/tb/<algorithm>[--<target>]` (no suffix for a run without a
  held-out target)."""
  name = algorithm if target is None else f"{algorithm}--{target}"
  return os.path.join(run_dir, TB_DIR, name)


def read(path: str) -> list[dict]:
  """The records of a metrics.jsonl (a line cut by a crash is dropped)."""
  out = []
  with open(path) as f:
    for text in f:
      try:
        out.append(json.loads(text))
      except json.JSONDecodeError:
        if text.endswith("\n"):  # a complete line that is not JSON: not ours
          raise
  return out


class RunLog:
  """The metrics.jsonl and TensorBoard writers of one run directory."""

  def __init__(self, run_dir: str):
    self.run_dir = run_dir
    self.path = os.path.join(run_dir, JSONL)
    self.records = read(self.path) if os.path.exists(self.path) else []
    self._writers = {}

  def _rewrite(self) -> None:
    tmp = self.path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(line(r) for r in self.records)
    os.replace(tmp, self.path)

  def _writer(self, algorithm: str, target: str):
    key = (algorithm, target)
    if key not in self._writers:
      import tensorboardX
      self._writers[key] = tensorboardX.SummaryWriter(
          logdir=tb_dir(self.run_dir, algorithm,
                        None if target == "None" else target),
          flush_secs=10**6,
          # tensorboardX names files by the second: a resume (or a second
          # writer) within the same second would truncate the earlier file.
          filename_suffix=f".{os.getpid()}.{time.time_ns()}")
    return self._writers[key]

  def log(self, algorithm: str, target, entry: dict) -> None:
    """Writes one evaluation of (algorithm, target) to both, flushed to disk."""
    rec = record(algorithm, target, entry)
    stale = [r for r in self.records
             if (r["algorithm"], r["target"]) == (rec["algorithm"], rec["target"])
             and r.get("round", -1) >= rec.get("round", -1)]
    if stale:  # chunks re-evaluated after a resume: replace their lines
      self.records = [r for r in self.records if not any(r is s for s in stale)]
      self._rewrite()
    self.records.append(rec)
    with open(self.path, "a") as f:
      f.write(line(rec))
    self._tb(rec)

  def _tb(self, rec: dict) -> None:
    writer = self._writer(rec["algorithm"], rec["target"])
    step = int(rec.get("round") or 0)
    for k, v in rec.items():
      if k not in ("algorithm", "target", "round") and isinstance(
          v, (int, float)) and not isinstance(v, bool):
        writer.add_scalar(k, v, step)
    writer.flush()

  def callback(self, algorithm: str, target):
    """The engine's `on_eval` for (algorithm, target)."""
    return lambda entry: self.log(algorithm, target, entry)

  def sync(self, algorithm: str, target, history: list[dict]) -> None:
    """Makes the lines of (algorithm, target) equal to its `history` (a run
    restored from a checkpoint written before this file existed, or kept from
    results.json)."""
    key = (algorithm, str(target))
    want = [record(algorithm, target, e) for e in history]
    have = [r for r in self.records if (r["algorithm"], r["target"]) == key]
    if have != want:
      self.records = [r for r in self.records
                      if (r["algorithm"], r["target"]) != key] + want
      self._rewrite()
      for rec in want:  # TensorBoard gets the evaluations it never saw
        if rec not in have:
          self._tb(rec)

  def close(self) -> None:
    for w in self._writers.values():
      w.close()
    self._writers = {}


class NoLog:
  """RunLog's calls, writing nothing: the log of processes other than 0."""

  def callback(self, algorithm: str, target) -> None:
    return None

  def sync(self, algorithm: str, target, history: list[dict]) -> None:
    pass

  def close(self) -> None:
    pass
