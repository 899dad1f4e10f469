"""Runs in replica batches: which (cell, target, algorithm) runs share one
compiled program (`plan`), and the batches trained with
`engine.run_batch`, each run recorded in its own cell's run directory
(`run`). A `fedjax-dg run` is one cell; a sweep is many; a batch may hold
one run (`--replicas 1`) or as many as fit.

Runs share a program when everything the program is built from is equal
(`batch_key`): the algorithm's recipe key (`algorithms.recipe_key`: the
algorithm, its hyperparameters other than the traced ones, its clients'
optimizer other than the learning rate, the model's architecture, the
number of clients), the engine settings other than the seed, and the data's
shapes (clients, the largest client's examples, image shape). They may
differ in the seed, the held-out target, the split (`data.d`, partitions of
equal shapes), the input normalization (a seed's `data.max_per_domain`
subsample), the learning rate and the traced hyperparameters: those are
arguments of the program (`Recipe.values`), and so is what an algorithm
builds from its run's data and seed (its module's `prepare`: FedCCRL's,
CCST's and ELCFS's style pools, hFedF's autoencoder embeddings, FedDF's,
FedBE's and FedLAW's server split). A module that builds from its data
without a `prepare` runs alone: its recipe belongs to one federation.

A batch holds at most `max_replicas` runs; 0 chooses from memory: as many
as fit in `placement.AUTO_DEVICE_SHARE` of one device's memory, each
replica holding its padded data and carry (`engine.runner.replica_bytes`)
for the whole batch. What is shared and why the rest is apart is printed at
the start (`explain`).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Callable

import numpy as np

from fedjax_dg import algorithms, engine
from fedjax_dg.engine.placement import AUTO_DEVICE_SHARE, device_capacity
from fedjax_dg.engine.runner import replica_bytes
from fedjax_dg.errors import (CheckpointWarning, DiskFull, NonFiniteError,
                              StandInWarning, is_disk_full)
from fedjax_dg.run import assemble, disk

# The parts of `batch_key` after the recipe key's, named for `explain`.
KEY_PARTS = algorithms.RECIPE_KEY_PARTS + (
    "the engine settings (train.*)", "train.keep_checkpoints",
    "the data's shapes (the largest client's examples)")


# `opened` / `cells`: `experiment.OpenRun`s (experiment imports this module,
# never the other way).


@dataclasses.dataclass(frozen=True)
class Job:
  """One run: algorithm `name` on target `target` (an index into the cell's
  `OpenRun.targets`) of cell `cell` (an index into the open cells)."""
  cell: int
  target: int
  name: str


@dataclasses.dataclass
class Batch:
  jobs: list[Job]
  key: tuple | None      # None: runs alone (`alone` says why)
  alone: str | None
  bytes_each: int        # one replica's device bytes (data + carry)


def stand_ins(call, where: str, echo=None, kinds=(StandInWarning,)):
  """(call(), the warnings of `kinds` it raised as "where: message"
  strings; `StandInWarning`s by default): what a run records in
  results.json's `warnings`. Each is also echoed (`echo`), never only a
  stderr line."""
  with warnings.catch_warnings(record=True) as caught:
    for kind in kinds:
      warnings.simplefilter("always", kind)
    out = call()
  said = []
  for w in caught:
    if issubclass(w.category, kinds):
      text = str(w.message)
      said.append(text if not where or text.startswith(f"{where}:")
                  else f"{where}: {text}")
    else:  # another warning: as it would have been shown
      warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
  for line in said:
    if echo is not None:
      echo(f"WARNING: {line}")
  return out, said


def _recipe_key(opened, job: Job) -> tuple:
  fed = opened.feds[job.target]
  return assemble.recipe_key(job.name, opened.model(job.target),
                             fed.num_clients, opened.cfg, data=fed)


def _values(cells, job: Job):
  """Job's recipe values (its model's normalization, learning rate, traced
  hyperparameters, data-built arrays), its stand-in warnings noted in its
  cell."""
  opened = cells[job.cell]
  values, said = stand_ins(lambda: assemble.recipe_values(
      job.name, opened.model(job.target), opened.cfg,
      data=opened.feds[job.target]), job.name, opened.echo)
  opened.note(said)
  return values


def batch_key(opened, job: Job, alg) -> tuple:
  """What must be equal for runs to share one program (`KEY_PARTS`)."""
  fed = opened.feds[job.target]
  train = (fed.pooled() if alg.client.pooled else fed).packed_train
  shapes = (train.num_clients, train.width, tuple(np.shape(train.x)[1:]),
            np.dtype(train.x.dtype).str)
  return _recipe_key(opened, job) + (
      dataclasses.replace(opened.ecfg, seed=0),
      bool(opened.cfg.train.keep_checkpoints), shapes)


def auto_cap(bytes_each: int) -> int:
  """Replicas that fit in AUTO_DEVICE_SHARE of one device's memory."""
  return max(1, int(AUTO_DEVICE_SHARE * device_capacity()) // max(bytes_each, 1))


def plan(cells: list, max_replicas: int = 0
         ) -> tuple[list[Batch], dict]:
  """The batches of every pending run of the open `cells` (at most
  `max_replicas` each; 0: `auto_cap`), in the order of their first cell;
  and the (Recipe, its stand-in warnings) built for each batch key (one
  per key: every batch of a key reuses its compiled programs)."""
  groups: dict = {}
  recipes: dict = {}
  alone = []
  for c, opened in enumerate(cells):
    for i, name in opened.pending():
      job = Job(c, i, name)
      if not assemble.batchable(name, opened.cfg):
        alone.append(Batch([job], None, "it is built from its run's data "
                           "(a server split, or parts without a prepare)", 0))
        continue
      probe = _recipe_key(opened, job)
      if probe not in recipes:  # (Recipe, its stand-in warnings)
        recipes[probe] = stand_ins(
            lambda: assemble.recipe(name, opened.model(i),
                                    opened.feds[i].num_clients, opened.cfg,
                                    data=opened.feds[i]), name)
      key = batch_key(opened, job, recipes[probe][0].alg)
      groups.setdefault(key, (recipes[probe], []))[1].append(job)
  batches = []
  built = {}
  for key, ((rec, said), jobs) in groups.items():
    first = cells[jobs[0].cell]
    each = replica_bytes(rec.alg, first.feds[jobs[0].target])
    cap = max_replicas or auto_cap(each)
    built[key] = (rec, said)
    for k in range(0, len(jobs), cap):
      batches.append(Batch(jobs[k:k + cap], key, None, each))
  batches += alone
  batches.sort(key=lambda b: min((j.cell, j.target) for j in b.jobs))
  return batches, built


def _differs(a: tuple, b: tuple) -> str:
  """The first part (`KEY_PARTS`) in which two batch keys differ."""
  return next(part for part, x, y in zip(KEY_PARTS, a, b) if x != y)


def explain(batches: list[Batch], cells: list) -> list[str]:
  """Lines: per algorithm, its runs, its batches and their sizes, and why
  its runs are not all in one batch."""
  lines = []
  names = list(dict.fromkeys(j.name for b in batches for j in b.jobs))
  for name in names:
    mine = [b for b in batches if b.jobs[0].name == name]
    runs = sum(len(b.jobs) for b in mine)
    sizes = sorted({len(b.jobs) for b in mine})
    line = (f"  {name}: {runs} runs in {len(mine)} batch"
            f"{'es' if len(mine) > 1 else ''} of {'/'.join(map(str, sizes))}")
    if mine[0].key is None:
      line += f"; each run alone: {mine[0].alone}"
    elif len(mine) > 1:
      keys = list(dict.fromkeys(b.key for b in mine))
      why = list(dict.fromkeys(_differs(keys[0], k) for k in keys[1:]))
      if len(keys) < len(mine):
        why.append("the batch cap (--replicas or the memory estimate)")
      line += f"; apart because of {' and '.join(why)}"
      shared = _shared(mine, cells)
      if shared:
        line += f"; a batch spans {shared}"
    else:
      shared = _shared(mine, cells)
      if shared:
        line += f"; it spans {shared}"
    if mine[0].bytes_each:
      largest = max(len(b.jobs) for b in mine)
      line += (f"; device memory ~{_mb(mine[0].bytes_each * largest)} per "
               f"batch of {largest} (data + state; activations extra)")
    lines.append(line)
  return lines


def _mb(n: int) -> str:
  return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _shared(batches: list[Batch], cells) -> str:
  b = max(batches, key=lambda b: len(b.jobs))
  seeds = sorted({int(cells[j.cell].cfg.seed) for j in b.jobs})
  targets = list(dict.fromkeys(str(cells[j.cell].targets[j.target])
                               for j in b.jobs))
  cell_names = {j.cell for j in b.jobs}
  parts = []
  if len(seeds) > 1:
    parts.append(f"seeds {','.join(map(str, seeds))}")
  if len(targets) > 1:
    parts.append(f"targets {','.join(targets)}")
  if len(cell_names) > len(seeds):
    parts.append(f"{len(cell_names)} cells")
  return " x ".join(parts)


def run(batches: list[Batch], built: dict, cells: list,
        *, echo=print, on_cell_done: Callable[[int, list], None],
        mapping: str = "auto", prefix: str = "") -> None:
  """Trains every batch and records each run in its cell; a cell whose last
  run is recorded (or failed) is handed to `on_cell_done(cell, errors)`,
  `errors` a list of (message, exception). Each batch's wall time is
  charged to its cells, shared evenly among its runs (`OpenRun.charged`: a
  cell's `seconds` is its own share). A run that went non-finite, or a
  batch that failed, is an error of its cells; the other runs and batches
  go on. Ctrl-C and a full disk stop them. A checkpoint that could not be
  read (`CheckpointWarning`: that run resumed from an older one or started
  over) is echoed and noted in its cell's results.json. `prefix` starts
  every line about a batch (a sweep's "[sweep] ")."""
  for opened in cells:
    opened.charged = 0.0
  left = {c: sum(1 for b in batches for j in b.jobs if j.cell == c)
          for c in range(len(cells))}
  errors: dict[int, list] = {c: [] for c in range(len(cells))}
  for c, n in left.items():
    if n == 0:
      on_cell_done(c, errors[c])
  total = sum(len(b.jobs) for b in batches)
  done, t_start = 0, time.perf_counter()

  def finished(job: Job, error: tuple | None):
    if error is not None:
      errors[job.cell].append(error)
    left[job.cell] -= 1
    if left[job.cell] == 0:
      on_cell_done(job.cell, errors[job.cell])

  last = {b.key: k for k, b in enumerate(batches, 1) if b.key is not None}
  several = len(batches) > 1 or len(cells) > 1
  for k, b in enumerate(batches, 1):
    if several:
      elapsed = time.perf_counter() - t_start
      eta = (f"ETA {hms(elapsed / done * (total - done))}" if done
             else "ETA after the first batch")
      where = "; ".join(dict.fromkeys(
          f"{cells[j.cell].run_dir.rsplit('/', 1)[-1]}" for j in b.jobs))
      echo(f"{prefix}batch {k}/{len(batches)}: {b.jobs[0].name} "
           f"x{len(b.jobs)} ({where}); runs {done}/{total} done, elapsed "
           f"{hms(elapsed)}, {eta}")
    t_batch = time.perf_counter()
    try:
      results, said = stand_ins(
          lambda: _train(b, built, cells, mapping,
                         forget=last.get(b.key) == k), "", echo,
          kinds=(CheckpointWarning,))
      for c in {j.cell for j in b.jobs}:
        cells[c].note([w for w in said if cells[c].run_dir in w])
    except (KeyboardInterrupt, DiskFull):
      raise
    except Exception as e:  # noqa: BLE001 -- recorded; the next batch runs
      if is_disk_full(e):  # every later batch would fail the same way
        raise DiskFull(f"batch {k}/{len(batches)} ({b.jobs[0].name}) failed: "
                       f"no space left on device ({type(e).__name__}). Free "
                       "space on that disk") from None
      message = f"{type(e).__name__}: {e}"
      echo(f"{prefix}batch {k}/{len(batches)}: FAILED: {message}")
      for j in b.jobs:
        finished(j, (f"{j.name} / {cells[j.cell].targets[j.target]}: "
                     f"{message}", e))
      done += len(b.jobs)
      continue
    finally:
      share = (time.perf_counter() - t_batch) / len(b.jobs)
      for j in b.jobs:
        cells[j.cell].charged += share
    for j, res in zip(b.jobs, results):
      opened = cells[j.cell]
      if isinstance(res, NonFiniteError):  # said when it stopped (on_stop)
        with opened.guard():
          opened.record_stopped(j.name, j.target, res)
        finished(j, (f"{j.name} / {opened.targets[j.target]}: "
                     f"NonFiniteError: {res}", res))
        continue
      with opened.guard():
        opened.record(j.name, j.target, res, replicas=len(b.jobs))
      finished(j, None)
    done += len(b.jobs)


def _train(b: Batch, built: dict, cells, mapping: str, forget: bool) -> list:
  """One batch's results (RunResult or NonFiniteError, in job order). The
  batch's recipe and its compiled programs are dropped after it when no
  later batch uses them (`forget`, or a batch built from its own data), so a
  long sweep holds only the programs still to run."""
  first, j0 = cells[b.jobs[0].cell], b.jobs[0]
  if b.key is None:  # alone: built from its own data
    rec = build_alone(first, j0.name, j0.target)
    forget = True
  else:
    rec, said = built.pop(b.key) if forget else built[b.key]
    for c in {j.cell for j in b.jobs}:
      cells[c].note(said)
    # The batch's cells share one disk.
    disk.check_disk(j0.name, rec.alg, first.run_dir, first.echo,
                    keep=first.ecfg.checkpoints_to_keep, runs=len(b.jobs))
  at = lambda j: (cells[j.cell], cells[j.cell].targets[j.target])
  try:
    return engine.run_batch(
        rec, [cells[j.cell].feds[j.target] for j in b.jobs], None,
        first.ecfg, [int(cells[j.cell].cfg.seed) for j in b.jobs],
        values=[rec.values if b.key is None else _values(cells, j)
                for j in b.jobs],
        checkpoint_dirs=[at(j)[0].checkpoint_dir(j.name, at(j)[1])
                         for j in b.jobs],
        on_eval=[at(j)[0].log.callback(j.name, at(j)[1]) for j in b.jobs],
        on_stop=[lambda e, o=at(j)[0]: o.echo(f"{o.run_dir}: {e}")
                 for j in b.jobs],
        mapping=mapping)
  finally:
    if forget:
      engine.forget_programs(rec)


def build_alone(opened, name: str, i: int):
  """The recipe of algorithm `name` built from target `i`'s data (its
  stand-in warnings echoed and noted), after the disk check."""
  fed = opened.feds[i]
  rec, said = stand_ins(
      lambda: assemble.recipe(name, opened.model(i), fed.num_clients,
                              opened.cfg, data=fed), name, opened.echo)
  opened.note(said)
  disk.check_disk(name, rec.alg, opened.run_dir, opened.echo,
                  keep=opened.ecfg.checkpoints_to_keep, runs=1)
  return rec


def hms(seconds: float) -> str:
  s = int(round(seconds))
  if s >= 3600:
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
  if s >= 60:
    return f"{s // 60}m{s % 60:02d}s"
  return f"{s}s"
