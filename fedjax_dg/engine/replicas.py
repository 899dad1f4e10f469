"""Replicas: R independent runs of one algorithm as one program
(`run_replicas`).

Runs that differ only in their seed, their data (another held-out target,
another d-split of the same shapes) or nothing the program is built from
share one compiled chunk: every state, key and metric gets a leading [R]
axis. Replica r has its own root key, `jax.random.key(seeds[r])`, and from
it the same round, client and end-of-round keys as `loop.run` draws, so
replica r is the run `loop.run(alg, datas[r], model, cfg with seed
seeds[r])` would make: the same numbers up to the float summation order of
another client mapping (the tolerance `tests/test_replicas.py` states per
algorithm, as `tests/test_placement.py` does for "vmap" vs "map").

How the replica axis is mapped (`replica_mapping`):

* "map": one replica after another (`lax.map`), each replica's clients
  mapped as `loop.run` maps them (`layout.Layout.of`: sharded over the CPU
  devices by "auto"), so each replica is its separate run: bit for bit on
  the development CPU; on CI's CPU the hypernetwork algorithms' server step
  compiles in another float order inside the map (hFedF 7.5e-9);
* "shard": the replicas split over the devices (a 1-D mesh "replicas",
  `jax.shard_map`), each device running its share one after another on CPU
  (`lax.map`) or batched on accelerators (`vmap`); R is padded to a multiple
  of the devices with copies of replica 0, whose results are dropped. The
  clients of a replica then run on its device ("map" on CPU, "vmap"
  elsewhere): no collective crosses devices inside a round, and the float
  summation order is not the separate run's;
* "vmap": every replica batched (accelerators).

"auto": "map" on CPU, where batching replicas does not make a round cheaper
(one device already keeps both cores busy and vmapped convolutions are
slow; docs/xla notes) and "shard" gained ~10 % on the Table 2 shape's FedAvg
at the price of bit identity (docs/benchmarks.md, "Replica batches"), so a
batch saves what each run paid alone (compiles, set-up) and gives the same
numbers; "vmap" on GPU/TPU, where a small model fills a fraction of the chip.

Only the "device" placement runs replicas (each replica's padded federation
and carry held for the whole run, `placement.device_placement_bytes` each:
`replica_bytes`); the data of every replica must have the same shapes (the
padded width: the "sort" shuffle's draws depend on it, so padding one
replica's clients to another's would change its numbers). Between chunks the
host evaluates each replica as `loop.run` does, writes each replica's
checkpoint (its own directory; two kept, so replicas stopped between two
writes resume from the round they all reached) and applies the NaN guard per
replica: a replica that went non-finite is stopped (its entry in the result
is the `NonFiniteError`), the others go on.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.engine.checkpoint import Checkpointer, checkpoint_bytes
from fedjax_dg.engine.evaluation import ood_sets, target_features
from fedjax_dg.engine.layout import Layout, mesh_size, resolve_lanes
from fedjax_dg.engine.loop import check_finite, metrics_to_host, progress_bar
from fedjax_dg.engine.placement import (device_placement_bytes, pad_clients,
                                        resolve_gather, resolve_placement)
from fedjax_dg.engine.programs import per_algorithm_lru, program_key, programs
from fedjax_dg.engine.round import make_round
from fedjax_dg.engine.settings import EngineConfig, RunResult, eval_batch
from fedjax_dg.errors import ConfigError, NonFiniteError

REPLICA_MAPPINGS = ("auto", "map", "vmap", "shard")


def replica_mapping(mapping: str, replicas: int) -> str:
  """The replica axis' mapping ("auto": "map" on CPU, "vmap" on
  accelerators; a single replica: "map")."""
  if mapping not in REPLICA_MAPPINGS:
    raise ConfigError(f"replica mapping {mapping!r}: allowed values are "
                      f"{REPLICA_MAPPINGS}")
  if mapping != "auto":
    return mapping
  return "map" if jax.default_backend() == "cpu" or replicas == 1 else "vmap"


# Copies of a replica's carry a batch holds at its peak: the carry, the
# chunk's output while its donated input is still being read, the slices
# read for evaluation, the host copies asynchronous checkpoint writes keep
# (measured: a batch of 9 hFedF replicas, 221 MiB of carry each, added
# ~8.6 GiB to the process's peak, ~4.3 carries a replica; docs/benchmarks.md,
# "Replica batches").
CARRY_COPIES = 5


def replica_bytes(alg: Algorithm, data) -> int:
  """Bytes one replica of a batch holds for the batch's whole run: its
  padded training and id-validation examples and CARRY_COPIES of its scan
  carry (`placement.device_placement_bytes`, `checkpoint_bytes`). A batch
  of R holds R times this, plus the round's activations."""
  train = data.pooled().packed_train if alg.client.pooled else data.packed_train
  return (device_placement_bytes(alg, train, data.packed_val)
          + (CARRY_COPIES - 1) * checkpoint_bytes(alg))


def _mesh(replicas: int) -> jax.sharding.Mesh:
  size = mesh_size(replicas)
  return jax.make_mesh((size,), ("replicas",),
                       axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:size])


class ReplicaPrograms(NamedTuple):
  """The compiled chunk of a batch of replicas (`replica_programs`)."""
  chunk: Callable     # chunk(carry [R'], r0, train [R'], root_keys [R'],
                      #   frozen [R'], length, rounds) -> (carry, metrics
                      #   [R', length, ...]); R' = R padded to the mesh
  padded: int         # R': R padded to a multiple of the mesh's devices
  put: Callable       # put(stacked [R', ...]) -> on the devices


def replica_programs(alg: Algorithm, model, cfg: EngineConfig,
                     num_clients: int, replicas: int,
                     mapping: str) -> ReplicaPrograms:
  """The jitted chunk of `replicas` runs of `alg` (cached like
  `programs.programs`: per Algorithm, model, `program_key`, N, R and the
  mapping)."""
  return _replica_programs(alg, alg.model or model, program_key(cfg, alg),
                           num_clients, replicas, mapping)


@per_algorithm_lru(maxsize=16)
def _replica_programs(alg, model, cfg, num_clients, replicas, mapping):
  del model  # a key of the cache: the algorithm's closures hold it
  sharded = mapping == "shard"
  inner = ("map" if jax.default_backend() == "cpu" else "vmap")
  if sharded and cfg.client_mapping == "shard":
    raise ConfigError(
        "train.client_mapping='shard' spreads one run's clients over the "
        "devices, but the replicas of this batch are already spread over "
        "them: use train.client_mapping='auto' (or 'map' / 'vmap')")
  layout = (Layout(inner if cfg.client_mapping == "auto" else
                   cfg.client_mapping) if sharded
            else Layout.of(cfg, num_clients))
  round_fn = make_round(alg, cfg, num_clients, layout)

  def one(carry, r0, train, root_key, frozen, length, rounds):
    indices = r0 + jnp.arange(length)
    return jax.lax.scan(
        lambda c, r: round_fn(c, r, train, root_key, frozen, rounds), carry,
        indices)

  def over(how, carry, r0, train, keys, frozen, length, rounds):
    f = lambda c, t, k, fz: one(c, r0, t, k, fz, length, rounds)
    if how == "vmap":
      return jax.vmap(f)(carry, train, keys, frozen)
    return jax.lax.map(lambda a: f(*a), (carry, train, keys, frozen))

  if not sharded:
    # Each replica's clients mapped as `loop.run` maps them (sharded over a
    # "clients" mesh where there is one): the carry replicated over it, the
    # same sharding in and out (one compile for every chunk).
    placed = ({} if layout.mesh is None else
              dict(out_shardings=NamedSharding(layout.mesh, P())))

    @functools.partial(jax.jit, static_argnums=(5,), donate_argnums=(0,),
                       **placed)
    def chunk(carry, r0, train, keys, frozen, length, rounds):
      return over(mapping, carry, r0, train, keys, frozen, length,
                  jnp.asarray(rounds, jnp.int32))

    return ReplicaPrograms(chunk, replicas, layout.put_carry
                           if layout.mesh is not None else jax.device_put)

  mesh = _mesh(replicas)
  spec = NamedSharding(mesh, P("replicas"))
  padded = -(-replicas // mesh.size) * mesh.size

  @functools.partial(jax.jit, static_argnums=(5,), donate_argnums=(0,),
                     out_shardings=spec)
  def chunk(carry, r0, train, keys, frozen, length, rounds):
    rounds = jnp.asarray(rounds, jnp.int32)
    body = lambda c, r0_, t, k, fz, n: over(inner, c, r0_, t, k, fz, length, n)
    # Every value a replica differs in is sharded (its carry, data, key and
    # frozen parameters); no collective is needed, so the varying-axes
    # check is off: the algorithms' own scans start from constants (zeros)
    # that it would have to be told vary over the replicas.
    return jax.shard_map(
        body, mesh=mesh,
        in_specs=(P("replicas"), P(), P("replicas"), P("replicas"),
                  P("replicas"), P()),
        out_specs=P("replicas"), check_vma=False)(carry, r0, train, keys,
                                                   frozen, rounds)

  return ReplicaPrograms(chunk, padded,
                         lambda stacked: jax.device_put(stacked, spec))


def replica_of(stacked, r: int):
  """Replica `r` of a stacked pytree, read from the device that holds it:
  a sharded leaf is sliced in its shard (indexing the global array would
  compile a program with a collective over every device, which waits for
  the slowest device's work and can time out on a busy host)."""
  def take(a):
    if not isinstance(a, jax.Array) or len(a.sharding.device_set) == 1:
      return a[r]
    for shard in a.addressable_shards:
      rows = shard.index[0]
      start = rows.start or 0
      stop = a.shape[0] if rows.stop is None else rows.stop
      if start <= r < stop:
        return shard.data[r - start]
    raise ValueError(f"replica {r} is on no device of this process")
  return jax.tree.map(take, stacked)


def _stack(trees: list, padded: int):
  """[R, ...] of R trees, padded to `padded` with copies of the first."""
  trees = trees + [trees[0]] * (padded - len(trees))
  return jax.tree.map(lambda *a: jnp.stack(a), *trees)


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


@dataclasses.dataclass
class _Replica:
  """One replica's host side: its evaluation inputs, checkpointer, history."""
  cfg: EngineConfig
  data: object
  val: tuple | None
  ood: tuple
  ckpt: Checkpointer | None
  history: list
  round_metrics: dict
  spent: float
  error: Exception | None = None


def run_replicas(alg: Algorithm, datas: Sequence, model, cfg: EngineConfig,
                 seeds: Sequence[int], *,
                 checkpoint_dirs: Sequence[str | None] | None = None,
                 on_eval: Sequence[Callable[[dict], None] | None] | None = None,
                 mapping: str = "auto") -> list[RunResult | NonFiniteError]:
  """Runs `cfg.rounds` rounds of `alg` on each `datas[r]` with seed
  `seeds[r]` as one program; returns each replica's `RunResult` (or the
  `NonFiniteError` that stopped it).

  `checkpoint_dirs[r]` (optional): replica r's checkpoints, resumed from as
  `loop.run` does; `on_eval[r]`: called with each of its evaluations. `cfg`'s
  own seed is not used."""
  R = len(datas)
  if R != len(seeds) or R < 1:
    raise ConfigError(f"run_replicas: {R} datasets and {len(seeds)} seeds: "
                      "give one seed per replica, at least one")
  checkpoint_dirs = list(checkpoint_dirs or [None] * R)
  on_eval = list(on_eval or [None] * R)
  pooled = alg.client.pooled
  if pooled:
    cfg = dataclasses.replace(cfg, cohort_size=0)
  trains = [d.pooled().packed_train if pooled else d.packed_train
            for d in datas]
  num_clients = trains[0].num_clients
  cfg.validate(num_clients)
  _same_shapes(datas, alg)
  cfg = resolve_lanes(cfg, alg, trains[0].n)
  for r, (train, data) in enumerate(zip(trains, datas)):
    placement = resolve_placement(cfg.placement, alg, train, data.packed_val)
    if placement != "device":
      raise ConfigError(
          f"replica {r} would run on the 'host' placement "
          f"(train.placement={cfg.placement!r}); replicas run only on the "
          "'device' placement: run it alone (loop.run), or with "
          "train.placement='device' if it fits")
  cfg = resolve_gather(cfg, alg, "device", trains[0].width)
  model = alg.model or model
  how = replica_mapping(mapping, R)
  progs = replica_programs(alg, model, cfg, num_clients, R, how)
  single = programs(alg, model, cfg, num_clients)  # init and evaluation

  cfgs = [dataclasses.replace(cfg, seed=int(s)) for s in seeds]
  roots = [jax.random.key(c.seed) for c in cfgs]
  init_keys = [jax.random.fold_in(k, 2**31 - 1) for k in roots]
  frozen = [single.frozen(k) for k in init_keys]

  reps = []
  for c, data, d in zip(cfgs, datas, checkpoint_dirs):
    val = data.val
    reps.append(_Replica(
        c, data,
        (tuple(map(jnp.asarray, pad_clients(val, eval_batch(
            c, val.x.shape[1])))) if np.any(val.n) else None),
        ood_sets(data, c),
        Checkpointer(d, max(c.checkpoints_to_keep, 2)) if d else None,
        [], {}, 0.0))

  # Resume: every replica from the round they all reached (the steps after
  # it are recomputed, the same numbers, and written again).
  latest = [rep.ckpt.latest() if rep.ckpt else None for rep in reps]
  r0 = min((l or 0) for l in latest)
  like = jax.eval_shape(alg.init, init_keys[0])
  states = []
  for rep, key in zip(reps, init_keys):
    if rep.ckpt is not None:
      steps = rep.ckpt.manager.all_steps()
      if r0 and r0 not in steps:
        raise ConfigError(
            f"resuming a batch of replicas from round {r0}, but the "
            f"checkpoints of seed {rep.cfg.seed} in {rep.ckpt.manager.directory}"
            f" do not hold round {r0}: delete that folder to start this "
            "replica over")
      for step in steps:
        if step > r0:
          rep.ckpt.manager.delete(step)
    if r0 == 0:
      states.append(single.init(key))
      continue
    state, meta = rep.ckpt.restore(r0, like)
    rep.history, rep.round_metrics = meta["history"], meta["round_metrics"]
    rep.spent = float(meta.get("seconds", 0.0))
    states.append(jax.tree.map(jnp.asarray, state))
  states = [single.layout.to_one_device(s) for s in states]

  carry = progs.put(_stack(states, progs.padded))
  del states  # the batch's carry holds them now (memory: `replica_bytes`)
  train = progs.put(_stack([d.pooled().train if pooled else d.train
                            for d in datas], progs.padded))
  keys = progs.put(_stack(roots, progs.padded))
  frozen_all = progs.put(_stack([single.layout.to_one_device(f)
                                 for f in frozen], progs.padded))
  bar = progress_bar(cfg, f"{alg.name} x{R}", r0)
  t0 = time.perf_counter()
  failing = False
  try:
    while r0 < cfg.rounds:
      length = min(cfg.eval_every, cfg.rounds - r0)
      carry, metrics = progs.chunk(carry, jnp.int32(r0), train, keys,
                                   frozen_all, length, jnp.int32(cfg.rounds))
      host = metrics_to_host(metrics)
      r0 += length
      per_second = (time.perf_counter() - t0) / R
      for r, rep in enumerate(reps):
        if rep.error is not None:
          continue
        state = replica_of(carry, r)
        chunk_metrics = {k: v[r] for k, v in host.items()}
        try:
          check_finite(alg.name + (f" (replica {r}, seed {rep.cfg.seed})"
                                   if R > 1 else ""),
                       r0 - length, chunk_metrics, state,
                       rep.ckpt.latest() if rep.ckpt else None,
                       checkpoint_dirs[r])
        except NonFiniteError as e:
          rep.error = e
          continue
        for k, v in chunk_metrics.items():
          rep.round_metrics.setdefault(k, []).extend(v)
        entry = dict(round=r0, train_loss=float(np.mean(
            rep.round_metrics["loss"][-length:])), **single.eval(
                state, frozen[r], rep.val, rep.ood[1]))
        rep.history.append(entry)
        if on_eval[r] is not None:
          on_eval[r](entry)
        if rep.ckpt is not None:
          rep.ckpt.save(r0, state, dict(
              round=r0, history=rep.history, round_metrics=rep.round_metrics,
              seconds=rep.spent + per_second))
      if bar is not None:
        bar.update(length)
        bar.set_postfix(replicas=f"{sum(rep.error is None for rep in reps)}"
                        f"/{R} running")
      if all(rep.error is not None for rep in reps):
        break
  except BaseException:
    failing = True
    raise
  finally:
    if bar is not None:
      bar.close()
    for rep in reps:
      if rep.ckpt is not None:
        rep.ckpt.close(failing)
  seconds = (time.perf_counter() - t0) / R
  out = []
  for r, rep in enumerate(reps):
    if rep.error is not None:
      out.append(rep.error)
      continue
    state = replica_of(carry, r)
    final = dict(round=r0, **single.eval(state, frozen[r], rep.val,
                                         rep.ood[0], details=True))
    feats = target_features(alg, model, state, frozen[r], rep.data, rep.cfg)
    server, clients = state
    out.append(RunResult(alg.name, server, clients, rep.history,
                         rep.round_metrics, final, rep.spent + seconds, feats))
  return out

