"""Checkpoints of a run: what one costs on disk (`checkpoint_bytes`,
`checkpoints_held`) and the orbax writer and reader of the scan carry and the
host history (`Checkpointer`).

The runner writes one at the end of a chunk of rounds once
`EngineConfig.checkpoint_every` seconds have passed since the last write
(asynchronously: the next chunk runs meanwhile) and resumes from the latest.
A full disk ends a run with one `DiskFull` naming the directory
(`QuietDiskFull` keeps orbax's writer threads from logging hundreds of lines
first). Nothing here depends on another engine module.
"""

from __future__ import annotations

import copy
import logging
import os

import jax
import numpy as np

from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.errors import ConfigError, DataError, DiskFull, is_disk_full


def checkpoint_bytes(alg: Algorithm) -> int:
  """Bytes of one checkpoint of `alg` (its scan carry: server and per-client
  state; shared-frozen parameters are not saved), from shapes alone."""
  carry = jax.eval_shape(alg.init, jax.random.key(0))
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(carry))


def checkpoints_held(keep: int) -> int:
  """The most checkpoints of one run on disk at once with `keep` kept: orbax
  deletes the oldest only after the next one is written and finalized, so
  `keep` + the one being written (tests/test_safety.py measures it)."""
  return keep + 1


class QuietDiskFull(logging.Filter):
  """Drops the tracebacks orbax logs (absl) from its writer threads when a
  write fails for want of space: the run ends with one `DiskFull` message
  naming the directory instead of hundreds of lines."""

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return not (error is not None and is_disk_full(error))


class Checkpointer:
  """Orbax checkpoints of the scan carry (as a flat list of leaves) + host
  history. A write that fails for want of space (ENOSPC, however orbax
  wraps it) is a `DiskFull` naming the directory."""

  def __init__(self, directory: str, keep: int = 1):
    import orbax.checkpoint as ocp
    self._ocp = ocp
    self._dir = os.path.abspath(directory)
    self._keep = keep
    self._quiet = None
    self._manager = None  # made at the first read of an existing folder or
                          # the first write: a run that never writes one
                          # costs no orbax manager

  @property
  def directory(self) -> str:
    return self._dir

  @property
  def manager(self):
    """The orbax CheckpointManager of the folder (created with it)."""
    if self._manager is None:
      ocp = self._ocp
      self._quiet = QuietDiskFull()
      logging.getLogger("absl").addFilter(self._quiet)
      try:
        self._manager = ocp.CheckpointManager(
            self._dir, options=ocp.CheckpointManagerOptions(
                max_to_keep=self._keep, create=True))
      except Exception as e:  # pylint: disable=broad-except
        logging.getLogger("absl").removeFilter(self._quiet)
        self._quiet = None
        if is_disk_full(e):
          raise self._full(e, "creating the") from None
        raise
    return self._manager

  def _full(self, error: Exception, doing: str) -> DiskFull:
    return DiskFull(
        f"{doing} checkpoint in {self._dir} failed: no space left on device "
        f"({type(error).__name__}). Free space on that disk; the complete "
        "checkpoints written before are kept")

  def latest(self) -> int | None:
    if self._manager is None and not os.path.isdir(self._dir):
      return None
    return self.manager.latest_step()

  def steps(self) -> list[int]:
    """The rounds of the checkpoints in the folder."""
    if self._manager is None and not os.path.isdir(self._dir):
      return []
    return list(self.manager.all_steps())

  @staticmethod
  def layout(carry) -> str:
    """The carry's structure, shapes and dtypes: a checkpoint is restored only
    into the same (leaves are stored as a flat list)."""
    leaves, treedef = jax.tree.flatten(carry)
    shapes = [f"{np.dtype(x.dtype)}{list(x.shape)}" for x in leaves]
    return f"{treedef} {shapes}"

  def save(self, step: int, carry, meta: dict, fresh: bool = False) -> None:
    """Writes `carry` (device or host leaves) and `meta` as round `step`,
    asynchronously. `fresh`: the caller's host (numpy) leaves are its own
    copy, never changed after (a batch's one host copy of its carry), so
    they are not copied again."""
    ocp = self._ocp
    # A copy of the meta too: the engine goes on appending to the history and
    # round metrics lists while the asynchronous write may not have read them
    # (a round-1 checkpoint holding round 2's entry doubled it on resume).
    meta = copy.deepcopy(dict(meta, layout=self.layout(carry)))
    # A copy of host (numpy) leaves: the write is asynchronous and the "host"
    # placement updates its client state in place.
    leaves = {str(i): np.array(x) if not fresh and isinstance(x, np.ndarray)
              else np.asarray(x) for i, x in enumerate(jax.tree.leaves(carry))}
    # Asynchronous: the next chunk runs while this one is written (an
    # earlier write's failure surfaces here or at `close`).
    try:
      self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(leaves), meta=ocp.args.JsonSave(meta)))
    except Exception as e:  # pylint: disable=broad-except
      if is_disk_full(e):
        raise self._full(e, f"writing round {step}'s") from None
      raise

  def close(self, failing: bool = False) -> None:
    """Waits for the last write and closes; `failing` (an error is already
    on its way out): a failure here is not raised over it."""
    if self._manager is None:
      return
    error = None
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      error = e
    try:
      self.manager.close()
    except Exception as e:  # pylint: disable=broad-except
      error = error or e
    finally:
      logging.getLogger("absl").removeFilter(self._quiet)
      self._manager = None
    if error is None or failing:
      return
    if is_disk_full(error):
      raise self._full(error, "finishing the last") from None
    raise error

  def _damaged(self, step: int, error: Exception) -> DataError:
    return DataError(
        f"the checkpoint of round {step} in {self.manager.directory} cannot be "
        f"read ({type(error).__name__}: {str(error)[:300]}): it is damaged, e.g. "
        "by a run killed while writing it or a full disk; delete that folder to "
        "start this algorithm's run over (the run directory's finished runs "
        "stay), or start a new run directory")

  def restore(self, step: int, like):
    ocp = self._ocp
    flat, treedef = jax.tree.flatten(like)
    abstract = {str(i): jax.ShapeDtypeStruct(np.shape(x), x.dtype)
                for i, x in enumerate(flat)}
    try:
      meta = self.manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # pylint: disable=broad-except
      raise self._damaged(step, e) from e
    if meta.get("layout") != self.layout(like):
      raise ConfigError(
          f"the checkpoint in {self.manager.directory} holds another state "
          "than this algorithm's (its structure, shapes or dtypes differ: a "
          "different algorithm, model or settings, or a checkpoint of an older "
          "fedjax_dg); resume with the settings it was written with, or start "
          "a new run directory")
    try:
      out = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract),
          meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      raise self._damaged(step, e) from e
    leaves = [np.asarray(out["state"][str(i)]) for i in range(len(flat))]
    return jax.tree.unflatten(treedef, leaves), out["meta"]  # on the host
