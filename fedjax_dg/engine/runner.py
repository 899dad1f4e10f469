"""The runner: R >= 1 runs of one algorithm as one batch (`run_batch`); a
single run is a batch of one (`run`).

One set-up, one chunk loop, one resume policy, one final evaluation, for
every caller (`fedjax-dg run`, `sweep`, `demo`, the Python API):

    set up      each replica's seed, keys, evaluation sets and checkpointer;
                each resumed from its own latest readable checkpoint
    group       replicas at the same round share a program (usually all of
                them; after an interruption some may be ahead)
    per chunk   one program call trains every replica `eval_every` rounds
                (`programs.Programs.chunk` for one replica,
                `programs.ReplicaPrograms.chunk` for several); then, each
                one call for the whole group: the round metrics brought to
                the host, the finiteness flags of every state leaf, the
                evaluation; per replica only host bookkeeping (its history,
                and, once `checkpoint_every` seconds have passed since the
                last write, its checkpoint, written from one host copy of
                the whole group's state)
    at the end  one evaluation call on the full target split and one
                features call

Replica r has its own root key, `jax.random.key(seeds[r])`, and from it the
same round, client and end-of-round keys as a run alone, so replica r is
the run `run(alg, datas[r], model, cfg with seed seeds[r])` makes: the same
numbers up to the float summation order of the replica mapping
(`programs.replica_mapping`; tests/test_replicas.py states the tolerances).

Checkpoints stay one per replica (its own folder, its own orbax manager),
so that a replica's progress and a damaged file are its own; what bounds
their cost is `checkpoint_every` (an orbax save costs tens of milliseconds
whatever the state's size, more than a tiny run's chunk: saved every chunk,
the saves would dominate a sweep of small runs).

Each replica's progress is its own: a replica whose state or metrics went
non-finite is stopped (its entry in the result is the `NonFiniteError`,
naming it; its last good checkpoint stays) while the others go on; resume
continues each replica from its own latest checkpoint, and one that cannot be
read (damaged) costs only that replica: the next older one is used, or it
starts over (a `CheckpointWarning` says which).

A single run may use either placement ("device", "host": `placement`) and
any client mapping; a batch of several replicas uses the "device" placement,
and the data of every replica must have the same training shapes.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
import warnings
from typing import Callable, Sequence

import jax
import numpy as np

from fedjax_dg.algorithms.base import Algorithm, Recipe
from fedjax_dg.engine.checkpoint import Checkpointer, checkpoint_bytes
from fedjax_dg.engine.evaluation import ood_sets
from fedjax_dg.engine.feeds import ReplicaFeed, SingleFeed
from fedjax_dg.engine.layout import resolve_lanes
from fedjax_dg.engine.placement import (device_placement_bytes, resolve_gather,
                                        resolve_placement)
from fedjax_dg.engine.settings import EngineConfig, RunResult
from fedjax_dg.errors import (CheckpointWarning, ConfigError, DataError,
                              NonFiniteError)

# The key of a run's init and shared-frozen parameters: fold_in(root, INIT).
INIT = 2**31 - 1

LIKELY_CAUSES = ("a learning rate too large for the model (client.lr, the "
                 "algorithm's server_lr), a temperature of 0, or an input whose "
                 "normalization divides by ~0")

# Copies of a replica's carry a batch holds at its peak: the carry, the
# chunk's output while its donated input is still being read, the host copy
# written to the checkpoints, the copies asynchronous checkpoint writes keep
# (measured: a batch of 9 hFedF replicas, 221 MiB of carry each, added
# ~8.6 GiB to the process's peak, ~4.3 carries a replica; docs/benchmarks.md).
CARRY_COPIES = 5


def replica_bytes(alg: Algorithm, data) -> int:
  """Bytes one replica of a batch holds for the batch's whole run: its
  padded training and id-validation examples and CARRY_COPIES of its scan
  carry (`placement.device_placement_bytes`, `checkpoint_bytes`). A batch
  of R holds R times this, plus the round's activations."""
  train = data.pooled().packed_train if alg.client.pooled else data.packed_train
  return (device_placement_bytes(alg, train, data.packed_val)
          + (CARRY_COPIES - 1) * checkpoint_bytes(alg))


@dataclasses.dataclass
class _Replica:
  """One replica's host side."""
  index: int
  cfg: EngineConfig           # its seed
  data: object
  root: jax.Array
  init_key: jax.Array
  ood: tuple                  # (every target example, those scored between
                              # chunks): `evaluation.OodSet` or None
  ckpt: Checkpointer | None
  on_eval: Callable[[dict], None] | None
  values: object = None       # its recipe values (`Recipe`)
  on_stop: Callable[[Exception], None] | None = None
  history: list = dataclasses.field(default_factory=list)
  round_metrics: dict = dataclasses.field(default_factory=dict)
  spent: float = 0.0          # seconds of the parts before a resume
  round: int = 0              # rounds done
  restored: object = None     # its host state, read from its checkpoint
  error: Exception | None = None


def _nonfinite(name: str, r0: int, metrics: dict, flags, paths,
               last_good: int | None, directory: str | None
               ) -> NonFiniteError | None:
  """The error that stops a run whose chunk from round `r0` went non-finite:
  the first round whose training loss or a round metric is NaN / inf, or the
  first server / client state leaf that is (`flags`: [leaves] finite); None
  when everything is finite."""
  bad = []
  for key, values in metrics.items():
    arr = np.asarray(values, np.float64)
    rows = ~np.isfinite(arr.reshape(arr.shape[0], -1)).all(axis=1)
    if rows.any():
      label = "training loss" if key == "loss" else f"round metric {key!r}"
      bad.append((r0 + int(np.argmax(rows)), label))
  where = ("server state", "client state")
  for path, ok in zip(paths, flags):
    if not ok:
      part = where[int(path.startswith("[1]"))]
      bad.append((r0 + len(metrics.get("loss", [0])) - 1,
                  f"{part} {path[3:] or '(whole)'}"))
      break
  if not bad:
    return None
  round_, what = min(bad)
  kept = (f" The last good checkpoint (round {last_good}) is kept in "
          f"{directory}." if last_good is not None else "")
  return NonFiniteError(
      f"{name}: the {what} went non-finite (NaN / inf) by round {round_}; the run "
      f"is stopped.{kept} Likely: {LIKELY_CAUSES}.")


def _resume(rep: _Replica, like) -> None:
  """Replica `rep` from its latest readable checkpoint (its state on the
  host, history, round metrics and seconds); a damaged one is deleted and
  the next older one tried, and a `CheckpointWarning` says what was lost."""
  if rep.ckpt is None or not rep.ckpt.steps():
    return
  manager = rep.ckpt.manager
  damaged = []
  for step in sorted(rep.ckpt.steps(), reverse=True):
    try:
      state, meta = rep.ckpt.restore(step, like)
    except DataError as e:
      damaged.append((step, e))
      continue
    rep.restored = state
    rep.round = int(meta["round"])
    rep.history, rep.round_metrics = meta["history"], meta["round_metrics"]
    rep.spent = float(meta.get("seconds", 0.0))
    break
  for step, _ in damaged:  # the rounds after the resumed one are rewritten
    try:
      manager.delete(step)
    except Exception:  # pylint: disable=broad-except
      shutil.rmtree(f"{manager.directory}/{step}", ignore_errors=True)
    manager.reload()
  if damaged:
    step, error = damaged[0]
    cause = error.__cause__ or error
    warnings.warn(CheckpointWarning(
        f"seed {rep.cfg.seed}: the checkpoint of round {step} in "
        f"{manager.directory} could not be read ({type(cause).__name__}: "
        f"{str(cause)[:200]}): it was damaged (a process killed while "
        "writing it, or a full disk) and is deleted; this run is "
        + (f"resumed from round {rep.round} instead" if rep.round
           else "started over from round 0")
        + "; the other runs of its batch are not affected"))


def progress_bar(cfg: EngineConfig, desc: str, initial: int):
  """A tqdm bar over the run's rounds (None without `cfg.progress`, or
  off process 0)."""
  if not cfg.progress or jax.process_index() != 0:  # one bar: process 0's
    return None
  from tqdm.auto import tqdm
  return tqdm(total=cfg.rounds, initial=initial, desc=desc, unit="round",
              dynamic_ncols=True, leave=True)


def _same_shapes(datas, alg: Algorithm) -> None:
  """Every replica's training data have the first one's shapes."""
  def shapes(data):
    train = data.pooled().train if alg.client.pooled else data.train
    return [(np.shape(a), np.asarray(a).dtype.str)
            for a in jax.tree.leaves(train)]
  first = shapes(datas[0])
  for r, data in enumerate(datas[1:], 1):
    if shapes(data) != first:
      raise ConfigError(
          f"replica {r}'s training data have other shapes than replica 0's "
          f"({shapes(data)} vs {first}: the number of clients or the largest "
          "client's examples differ); replicas share one program only with "
          "equal shapes: run them in separate batches")


def setup(alg, datas: Sequence, model, cfg: EngineConfig,
          seeds: Sequence[int], checkpoint_dirs=None, on_eval=None,
          values=None, on_stop=None):
  """What every batch is set up from, checked: (cfg resolved, placement,
  recipe, one `_Replica` per run, its checkpointer open, not yet resumed).
  `run_batch` trains them; `fedjax_dg.run.estimate` times one chunk of a
  `SingleFeed` of the first."""
  recipe = Recipe.of(alg, model)
  alg = recipe.alg
  if alg.client.domains:  # its batches read each example's domain
    datas = [d.with_domains() for d in datas]
  R = len(datas)
  if R != len(seeds) or R < 1:
    raise ConfigError(f"run_batch: {R} datasets and {len(seeds)} seeds: "
                      "give one seed per replica, at least one")
  checkpoint_dirs = list(checkpoint_dirs or [None] * R)
  on_eval = list(on_eval or [None] * R)
  on_stop = list(on_stop or [None] * R)
  values = list(values or [recipe.values] * R)
  if len(values) != R or (recipe.values is None) != all(
      v is None for v in values):
    raise ConfigError(f"run_batch: {len(values)} values for {R} replicas: "
                      "give one per replica (None for an Algorithm built by "
                      "hand, whose recipe has none)")
  pooled = alg.client.pooled
  if pooled:  # one pooled "client" trains every round
    cfg = dataclasses.replace(cfg, cohort_size=0)
  trains = [d.pooled().packed_train if pooled else d.packed_train
            for d in datas]
  num_clients = trains[0].num_clients
  cfg.validate(num_clients)
  if R > 1:
    _same_shapes(datas, alg)
  cfg = resolve_lanes(cfg, alg, trains[0].n)
  placements = {resolve_placement(cfg.placement, alg, t, d.packed_val)
                for t, d in zip(trains, datas)}
  if R > 1 and placements != {"device"}:
    raise ConfigError(
        f"a batch of {R} replicas would run on the 'host' placement "
        f"(train.placement={cfg.placement!r}); replicas run only on the "
        "'device' placement: run them one at a time (--replicas 1), or with "
        "train.placement='device' if they fit")
  placement = placements.pop()
  cfg = resolve_gather(cfg, alg, placement, trains[0].width)

  reps = []
  for r, (data, seed) in enumerate(zip(datas, seeds)):
    c = dataclasses.replace(cfg, seed=int(seed))
    root = jax.random.key(c.seed)
    d = checkpoint_dirs[r]
    reps.append(_Replica(
        r, c, data, root, jax.random.fold_in(root, INIT), ood_sets(data, c),
        Checkpointer(d, c.checkpoints_to_keep) if d else None, on_eval[r],
        values[r], on_stop[r]))
  return cfg, placement, recipe, reps


def run_batch(alg, datas: Sequence, model, cfg: EngineConfig,
              seeds: Sequence[int], *,
              checkpoint_dirs: Sequence[str | None] | None = None,
              on_eval: Sequence[Callable[[dict], None] | None] | None = None,
              mapping: str = "auto",
              values: Sequence | None = None,
              on_stop: Sequence[Callable[[Exception], None] | None] | None = None
              ) -> list[RunResult | NonFiniteError]:
  """Runs `cfg.rounds` rounds of `alg` on each `datas[r]` (a FederatedData)
  with seed `seeds[r]`, all R of them as one batch (one program call per
  chunk); returns each replica's `RunResult`, or the `NonFiniteError` that
  stopped it. `cfg`'s own seed is not used.

  Args:
    alg: the algorithm: an Algorithm (`algorithms.build`, or composed by
      hand; everything about it is a constant of its programs), or a
      `Recipe` (`algorithms.recipe`: the values its runs differ in are
      arguments of one shared program).
    datas: R federations with the same training shapes (R = 1: any).
    model: the run's `models.Model` (the algorithm's own `alg.model` wins).
    cfg: the engine settings (`EngineConfig`); with R > 1 the "device"
      placement.
    seeds: R seeds: replica r's root key is `jax.random.key(seeds[r])`.
    checkpoint_dirs: replica r's orbax checkpoints (written at the end of
      the first chunk at least `cfg.checkpoint_every` seconds after the
      last write, the latest `cfg.checkpoints_to_keep` kept), resumed from.
    on_eval: replica r's callback, called with each of its evaluations.
    mapping: how the replica axis is mapped (`programs.replica_mapping`).
    values: replica r's recipe values (default: the recipe's own; None for
      an Algorithm).
    on_stop: replica r's callback, called with its `NonFiniteError` when it
      stops (the others go on).

  Example::

      results = engine.run_batch(alg, [fed, fed], model, cfg, seeds=(0, 1))
      accs = [r.final["ood_acc"] for r in results]
  """
  cfg, placement, recipe, reps = setup(alg, datas, model, cfg, seeds,
                                       checkpoint_dirs, on_eval, values,
                                       on_stop)
  alg = recipe.alg
  R = len(reps)
  results: list = [None] * R
  failing = False
  try:
    like = jax.eval_shape(alg.init, reps[0].init_key)
    for rep in reps:
      _resume(rep, like)
    groups = [[rep for rep in reps if rep.round == start]
              for start in sorted({rep.round for rep in reps})]
    for group in groups:
      for rep, res in zip(group, _run_group(recipe, cfg, group, placement,
                                            mapping, named=R > 1)):
        results[rep.index] = res
  except BaseException:
    failing = True
    raise
  finally:  # a stopped run still leaves complete checkpoints
    errors = []
    for rep in reps:
      if rep.ckpt is not None:
        try:
          rep.ckpt.close(failing)
        except Exception as e:  # pylint: disable=broad-except
          errors.append(e)
    if errors and not failing:
      raise errors[0]
  return results


def _run_group(recipe: Recipe, cfg: EngineConfig, reps: list[_Replica],
               placement: str, mapping: str, named: bool = False) -> list:
  """The chunk loop of replicas that start at the same round (`named`:
  their errors name their replica and seed, as in a batch of several)."""
  R = len(reps)
  alg = recipe.alg
  # A batch's replicas always run in a replica program, also one resumed
  # alone (a program of two, the second a copy): a program with one
  # replica would be compiled as a run alone is, in another float order on
  # some CPUs, so its resume would not continue its batch's numbers exactly.
  feed = (ReplicaFeed(recipe, cfg, reps, mapping, size=max(R, 2)) if named
          else SingleFeed(recipe, cfg, reps[0], placement))
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(
               jax.eval_shape(alg.init, reps[0].init_key))[0]]
  r0 = reps[0].round
  bar = progress_bar(cfg, alg.name + (f" x{R}" if R > 1 else ""), r0)
  t0 = last_save = time.perf_counter()
  try:
    while r0 < cfg.rounds and any(rep.error is None for rep in reps):
      length = min(cfg.eval_every, cfg.rounds - r0)
      metrics, flags = feed.step(r0, length)
      live = []
      for k, rep in enumerate(reps):
        if rep.error is not None:
          continue
        mine = {key: v[k].tolist() for key, v in metrics.items()}
        rep.error = _nonfinite(
            alg.name + (f" (replica {rep.index}, seed {rep.cfg.seed})"
                        if named else ""), r0, mine, flags[k], paths,
            rep.ckpt.latest() if rep.ckpt else None,
            rep.ckpt.directory if rep.ckpt else None)
        if rep.error is not None and rep.on_stop is not None:
          rep.on_stop(rep.error)  # at once, while the others go on
        if rep.error is None:
          for key, v in mine.items():
            rep.round_metrics.setdefault(key, []).extend(v)
          live.append(k)
      r0 += length
      if not live:
        break
      entries = feed.evaluate(1)
      now = time.perf_counter()
      save = (any(reps[k].ckpt for k in live)
              and now - last_save >= cfg.checkpoint_every)
      host = feed.host_states() if save else None  # one transfer for all
      if save:
        last_save = now
      per_run = (now - t0) / R
      for k in live:
        rep = reps[k]
        rep.round = r0
        entry = dict(round=r0, train_loss=float(np.mean(
            rep.round_metrics["loss"][-length:])), **entries[k])
        rep.history.append(entry)
        if rep.on_eval is not None:
          rep.on_eval(entry)
        if save and rep.ckpt is not None:
          rep.ckpt.save(r0, host[k], dict(
              round=r0, history=rep.history, round_metrics=rep.round_metrics,
              seconds=rep.spent + per_run), fresh=R > 1)
      if bar is not None:
        bar.update(length)
        if R > 1:
          bar.set_postfix(replicas=f"{len(live)}/{R} running")
        else:
          entry = reps[0].history[-1]
          bar.set_postfix({short: f"{entry[key]:.3f}" for short, key in
                           (("loss", "train_loss"), ("id", "id_acc"),
                            ("ood", "ood_acc")) if key in entry})
  finally:
    if bar is not None:
      bar.close()
  out = [rep.error for rep in reps]
  if all(e is not None for e in out):
    return out
  finals = feed.evaluate(0, details=True)
  feats = feed.features()
  states = feed.finals()
  seconds = (time.perf_counter() - t0) / R
  for k, rep in enumerate(reps):
    if rep.error is None:
      server, clients = states[k]
      out[k] = RunResult(alg.name, server, clients, rep.history,
                         rep.round_metrics,
                         dict(round=rep.round, **finals[k]),
                         rep.spent + seconds, feats[k])
  return out


run_replicas = run_batch


def run(alg: Algorithm, data, model, cfg: EngineConfig, *,
        checkpoint_dir: str | None = None,
        on_eval: Callable[[dict], None] | None = None) -> RunResult:
  """Runs `cfg.rounds` rounds of `alg` on `data` (a FederatedData) with
  seed `cfg.seed`: `run_batch` of one replica; a run that went non-finite
  raises its `NonFiniteError`.

  With `checkpoint_dir`, a checkpoint is written at the end of a chunk
  once `cfg.checkpoint_every` seconds have passed since the last write (0:
  after every chunk; a run shorter than that writes none; the latest
  `cfg.checkpoints_to_keep` stay) and the latest existing one is resumed
  from (same final parameters as an uninterrupted run).
  `cfg.placement` says where client data and state live
  (`placement.DeviceStore`, `placement.HostStore`); both give the same
  numbers.

  Example::

      alg = algorithms.build("fedavg", model, hyperparameters={},
                             client=dict(optimizer="sgd", lr=0.05,
                                         weight_decay=0.0, momentum=0.0,
                                         schedule="constant"),
                             num_clients=fed.num_clients)
      result = engine.run(alg, fed, model, engine.EngineConfig(rounds=10))
      print(result.final["ood_acc"], result.history[-1])
  """
  (out,) = run_batch(alg, [data], model, cfg, [cfg.seed],
                     checkpoint_dirs=[checkpoint_dir], on_eval=[on_eval])
  if isinstance(out, NonFiniteError):
    raise out
  return out
