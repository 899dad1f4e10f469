"""One sweep per folder: an OS file lock held for a sweep's whole life.

`hold(sweep_dir)` takes an exclusive `fcntl.flock` on `sweep_dir/sweep.lock`
and writes the holder's process id, host and start time into it. The kernel
releases the lock when the holder's file is closed: when `run_sweep` returns
(`released`), or when its process dies however it dies (SIGKILL included), so
a stale lock never blocks a resume. A second writer (a new sweep on the same
`--out`, a `--resume` beside a running sweep) is refused with one message
naming the holder. The lock file stays in the folder (removing it would let a
third process lock a new file while the second still holds the old one).

Several processes of one multi-process sweep (`distributed`): only process 0
takes the lock (the others write no sweep files).
"""

from __future__ import annotations

import datetime
import fcntl
import functools
import json
import os
import socket
import threading

from fedjax_dg import distributed
from fedjax_dg.errors import ConfigError

LOCK = "sweep.lock"

# The lock files this process holds, per call of a function under `released`.
_held = threading.local()


class Busy(ConfigError):
  """Another process holds the folder's sweep lock."""


def holder(path: str) -> dict:
  """What a lock file says of its holder ({} when unreadable or empty: the
  holder is writing it, or a fedjax_dg without a holder record made it)."""
  try:
    with open(path) as f:
      record = json.load(f)
    return record if isinstance(record, dict) else {}
  except (OSError, ValueError):
    return {}


def part_lock(index: int, parts: int) -> str:
  """The lock file of part `index` of `parts` (`sweep --part I/N`)."""
  return f"sweep.part-{index}-of-{parts}.lock"


def hold(sweep_dir: str, name: str = LOCK, shared: bool = False) -> None:
  """Takes the lock `name` of `sweep_dir` (an existing folder) for the rest
  of the call of the function it runs under (`released`), or raises `Busy`
  naming the process that holds it. `shared`: several holders at once (the
  parts of one sweep hold `LOCK` shared, each its own `part_lock`
  exclusive; a whole sweep holds `LOCK` exclusive, so it never runs beside
  them)."""
  if not distributed.is_main():
    return
  path = os.path.join(sweep_dir, name)
  try:
    f = open(path, "a+")  # pylint: disable=consider-using-with
  except OSError as e:
    raise ConfigError(f"{sweep_dir}: cannot write its lock file {LOCK} "
                      f"({type(e).__name__}: {e}); a sweep writes into its "
                      "folder: give a writable one") from None
  _take(f, sweep_dir, path, shared)
  if not shared:  # a shared lock's file names the last exclusive holder
    f.seek(0)
    f.truncate()
    json.dump(dict(pid=os.getpid(), host=socket.gethostname(),
                   started=datetime.datetime.now().isoformat(
                       timespec="seconds")), f)
    f.flush()
  stack = getattr(_held, "files", None)
  if stack:
    stack[-1].append(f)
  else:  # not under `released`: held until the process ends
    _held.__dict__.setdefault("orphans", []).append(f)


def _take(f, sweep_dir: str, path: str, shared: bool) -> None:
  """Locks the open lock file `f` without waiting, or closes it and raises
  `Busy` naming the process that holds it."""
  try:
    fcntl.flock(f, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
  except BlockingIOError:
    f.close()
    raise _busy(sweep_dir, path) from None


def _busy(sweep_dir: str, path: str) -> Busy:
  other = holder(path)
  who = (f"process {other.get('pid', '?')} on host {other.get('host', '?')}"
         + (f" (since {other['started']})" if other.get("started") else "")
         if other else "another process (it is still writing its id)")
  return Busy(
      f"{sweep_dir} is in use by another sweep: {who} holds {path}. Only "
      "one sweep writes a folder at a time; wait for that one to end (or "
      "stop it), then continue with fedjax-dg sweep --resume "
      f"{sweep_dir}")


def check_free(sweep_dir: str, shared: bool = False) -> None:
  """Raises `Busy` (as `hold` would) when another process holds
  `sweep_dir`'s sweep lock, keeping nothing: the CLI asks before it
  imports JAX, and `hold` asks again when the sweep takes the lock. A
  folder without a lock file is free."""
  path = os.path.join(sweep_dir, LOCK)
  try:
    f = open(path)  # pylint: disable=consider-using-with
  except OSError:
    return  # no lock file (or none readable): `hold` decides
  with f:  # closing it gives back what `_take` took
    _take(f, sweep_dir, path, shared)


class exclusive:
  """`with exclusive(path):` a short exclusive lock on `path` (waits for
  it): the parts of a sweep make its manifest and update their cells in it
  one at a time."""

  def __init__(self, path: str):
    self.path = path

  def __enter__(self):
    self.f = open(self.path, "a+")  # pylint: disable=consider-using-with
    fcntl.flock(self.f, fcntl.LOCK_EX)
    return self

  def __exit__(self, *exc):
    self.f.close()


def released(fn):
  """`fn` releases every lock it took (`hold`) when it returns or raises."""

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    stack = _held.__dict__.setdefault("files", [])
    stack.append([])
    try:
      return fn(*args, **kwargs)
    finally:
      for f in stack.pop():
        f.close()  # closing the file releases its flock

  return wrapper
