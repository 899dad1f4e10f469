"""What a runner's chunk loop drives (`runner.run_batch`): a feed holds a
group of replicas' states, data, keys and frozen parameters where their
programs read them, and makes each step one call for the whole group.

    SingleFeed    one replica: a single run's own programs, either placement
    ReplicaFeed   R > 1 replicas ("device" placement): everything stacked on
                  a leading [R] axis (`programs.ReplicaPrograms`)

Both take `runner._Replica`s (each run's seed, keys, data, values and the
state it resumes from) and give the same answers: `step`, `evaluate`,
`host_states`, `finals`, `features`, one list entry per replica.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_dg.algorithms.base import Recipe
from fedjax_dg.engine.evaluation import (divergence_ids, feature_pick,
                                         summary, target_features)
from fedjax_dg.engine.placement import DeviceStore, HostStore, pad_clients
from fedjax_dg.engine.programs import (finite_leaves, programs,
                                       replica_mapping, replica_programs)
from fedjax_dg.engine.settings import EngineConfig, eval_batch
from fedjax_dg.errors import ConfigError


def _stack(trees: list, padded: int):
  """[R', ...] of R trees on the host (numpy; PRNG keys as their key data),
  padded to R' with copies of the first: placed by one transfer, with no
  compiled stacking per leaf shape."""
  trees = trees + [trees[0]] * (padded - len(trees))

  def stack(*leaves):
    if jax.dtypes.issubdtype(leaves[0].dtype, jax.dtypes.prng_key):
      return jax.random.wrap_key_data(np.stack([np.asarray(
          jax.random.key_data(k)) for k in leaves]))
    return np.stack([np.asarray(a) for a in leaves])
  return jax.tree.map(stack, *trees)


def _padded_blocks(blocks: list, batch: int) -> list:
  """(x, y, mask) blocks of R replicas, each padded (mask 0) to the
  longest, a multiple of `batch`."""
  longest = max(b[0].shape[0] for b in blocks)
  total = max(batch, -(-longest // batch) * batch)
  pad = lambda a: np.pad(np.asarray(a), [(0, total - a.shape[0])]
                         + [(0, 0)] * (a.ndim - 1))
  return [tuple(pad(a) for a in b) for b in blocks]


class SingleFeed:
  """The feed of a group of one replica: a single run's own programs
  (`programs.programs`; its clients mapped or sharded as configured), on
  either placement."""

  def __init__(self, recipe: Recipe, cfg: EngineConfig, rep,
               placement: str):
    alg, model = recipe.template
    self.recipe = recipe
    data = rep.data
    pooled = alg.client.pooled
    train = data.pooled().packed_train if pooled else data.packed_train
    self.alg, self.model, self.cfg, self.rep = alg, model, cfg, rep
    self.progs = programs(recipe, None, cfg, train.num_clients)
    self.frozen = self.progs.frozen(rep.init_key, rep.values)
    if placement == "host":
      self.store = HostStore(self.progs, train, data.packed_val, cfg, rep.root,
                             rep.round, rep.values)
    else:
      self.store = DeviceStore(self.progs,
                               data.pooled().train if pooled else data.train,
                               data.val, cfg, rep.values)
    self.state = (self.store.initial(rep.init_key) if rep.restored is None
                  else self.store.placed(rep.restored))
    rep.restored = None

  def step(self, r0: int, length: int):
    """One chunk: ({key: [1, length, ...]} host metrics, [1, leaves] flags)."""
    carry, inputs = self.store.begin(self.state, r0, length)
    carry, metrics = self.progs.chunk(carry, jnp.int32(r0), inputs,
                                      self.rep.root, self.frozen, length,
                                      jnp.int32(self.cfg.rounds),
                                      self.rep.values)
    self.store.prefetch(r0 + length,
                        min(self.cfg.eval_every, self.cfg.rounds - r0 - length))
    metrics = jax.device_get(metrics)
    flags = np.asarray(finite_leaves(carry))
    self.state = self.store.end(self.state, carry)
    return ({k: np.asarray(v)[None] for k, v in metrics.items()},
            flags[None])

  def evaluate(self, which: int, details: bool = False) -> list[dict]:
    return [self.store.evaluate(self.state, self.frozen, self.rep.ood[which],
                                details=details)]

  def host_states(self) -> list:
    return [self.state]  # the checkpointer copies its leaves to the host

  def finals(self) -> list:
    return [self.state]

  def features(self) -> list:
    layout = self.progs.layout
    return [target_features(self.recipe, layout.to_one_device(
        self.store.on_device(self.state)), layout.to_one_device(self.frozen),
                            self.rep.data, self.rep.cfg, self.rep.values)]


class ReplicaFeed:
  """The feed of a group of R > 1 replicas ("device" placement): every
  state, key, frozen parameter and example set stacked on a leading [R]
  axis (`programs.ReplicaPrograms`), each step one call for all of them."""

  def __init__(self, recipe: Recipe, cfg: EngineConfig, reps: list,
               mapping: str, size: int | None = None):
    """`size`: the program's replicas (default len(reps)); more are copies
    of the first, whose results are dropped."""
    alg, model = recipe.template
    self.recipe = recipe
    R = max(len(reps), size or 0)
    pooled = alg.client.pooled
    trains = [r.data.pooled().packed_train if pooled else r.data.packed_train
              for r in reps]
    num_clients = trains[0].num_clients
    self.alg, self.model, self.cfg, self.reps = alg, model, cfg, reps
    self.progs = replica_programs(recipe, None, cfg, num_clients, R,
                                  replica_mapping(mapping, R))
    single = programs(recipe, None, cfg, num_clients)  # init and frozen
    one = single.layout.to_one_device
    frozen = [one(single.frozen(r.init_key, r.values)) for r in reps]
    states = [one(single.init(r.init_key, r.values)) if r.restored is None
              else r.restored for r in reps]
    for r in reps:
      r.restored = None
    put, padded = self.progs.put, self.progs.padded
    self.carry = put(_stack(states, padded))
    del states  # the batch's carry holds them now (memory: `replica_bytes`)
    self.train = put(_stack([r.data.pooled().train if pooled else r.data.train
                             for r in reps], padded))
    self.keys = put(_stack([r.root for r in reps], padded))
    self.frozen = put(_stack(frozen, padded)) if frozen[0] is not None else None
    self.values = (None if recipe.values is None else
                   put(_stack([r.values for r in reps], padded)))
    # Id-validation examples: [R, N, V, ...], V padded to the widest.
    vals = [r.data.val for r in reps]
    if any(np.any(v.n) for v in vals):
      width = max(v.x.shape[1] for v in vals)
      self.bs_val = eval_batch(cfg, width)
      padded_vals = [pad_clients(v, self.bs_val) for v in vals]
      total = max(p[0].shape[1] for p in padded_vals)
      grow = lambda a: np.pad(a, [(0, 0), (0, total - a.shape[1])]
                              + [(0, 0)] * (a.ndim - 2))
      self.val = put(_stack([tuple(grow(a) for a in p) for p in padded_vals],
                            padded))
      self.has_val = [bool(np.any(v.n)) for v in vals]
    else:
      self.val, self.bs_val, self.has_val = None, None, [False] * R
    self.oods = [self._oods([r.ood[k] for r in reps]) for k in (0, 1)]

  def _oods(self, sets):
    """The replicas' target sets stacked (one block each), or None."""
    if sets[0] is None:
      return None
    if any(s.host is None for s in sets):
      raise ConfigError(
          "a streamed target split (data.streaming) is scored in blocks read "
          "at each evaluation; a batch of replicas holds each replica's "
          "target examples on the device: run these runs one at a time "
          "(--replicas 1)")
    batch = max(s.batch for s in sets)
    blocks = _padded_blocks([s.host for s in sets], batch)
    return self.progs.put(_stack(blocks, self.progs.padded)), batch

  def step(self, r0: int, length: int):
    self.carry, metrics, flags = self.progs.chunk(
        self.carry, jnp.int32(r0), self.train, self.keys, self.frozen,
        self.values, length, jnp.int32(self.cfg.rounds))
    R = len(self.reps)
    metrics, flags = jax.device_get((metrics, flags))
    return ({k: np.asarray(v)[:R] for k, v in metrics.items()},
            np.asarray(flags)[:R])

  def evaluate(self, which: int, details: bool = False) -> list[dict]:
    ood, bs_ood = self.oods[which] if self.oods[which] else (None, None)
    s = jax.device_get(self.progs.scores(self.carry, self.frozen,
                                         (self.val, ood), self.values,
                                         self.bs_val, bs_ood))
    extras = models = None
    if details:
      extras = jax.device_get(self.progs.extras(self.carry, self.values))
      if self.alg.server.personalized:
        models = jax.device_get(self.progs.eval_params(self.carry,
                                                       self.values))
    out = []
    for r in range(len(self.reps)):
      s_r = jax.tree.map(lambda a: a[r], s)
      if not self.has_val[r]:
        s_r.pop("id", None)

      def personal(r=r):
        mine = jax.tree.map(lambda a: a[r], models)
        pick = divergence_ids(jax.tree.leaves(mine)[0].shape[0])
        return jax.tree.map(lambda a: a[pick], mine)

      out.append(summary(self.alg, s_r, details, personal,
                         lambda r=r: jax.tree.map(lambda a: a[r], extras)))
    return out

  def host_states(self) -> list:
    host = jax.device_get(self.carry)
    return [jax.tree.map(lambda a, r=r: a[r], host)
            for r in range(len(self.reps))]

  finals = host_states

  def features(self) -> list:
    picks = [None if self.alg.server.personalized else feature_pick(r.data,
                                                                     r.cfg)
             for r in self.reps]
    if picks[0] is None:
      return [None] * len(self.reps)
    shapes = {(p[0].shape, p[3]) for p in picks}
    if len(shapes) > 1:  # targets of other sizes: one call each
      return [target_features(self.recipe, state, f, r.data, r.cfg, r.values)
              for state, f, r in zip(self.finals(), self._frozen_each(),
                                     self.reps)]
    batch = picks[0][3]
    x = self.progs.put(_stack([p[0] for p in picks], self.progs.padded))
    feats = np.asarray(jax.device_get(self.progs.features(
        self.carry, self.frozen, x, self.values, batch)))
    return [dict(features=feats[r, :p[2]].astype(np.float32),
                 labels=np.asarray(p[1][:p[2]])) for r, p in enumerate(picks)]

  def _frozen_each(self):
    if self.frozen is None:
      return [None] * len(self.reps)
    host = jax.device_get(self.frozen)
    return [jax.tree.map(lambda a, r=r: a[r], host)
            for r in range(len(self.reps))]
