"""What is compiled for a run, and keyed by what: the jitted init, chunk (a
`lax.scan` of `round.make_round` over `eval_every` rounds) and evaluation of
one algorithm and model (`Programs`), cached per (Algorithm, model, the
settings that shape a program: `program_key`, number of clients), so other
target domains with equal shapes, other seeds and resumed runs reuse the
traced and compiled programs; and the same over a leading replica axis [R]
(`ReplicaPrograms`: R runs of equal shapes as one program, chunk,
finiteness flags, evaluation and features each one call for all of them).

How the replica axis is mapped (`replica_mapping`):

* "map": one replica after another (`lax.map`), each replica's clients
  mapped as a single run maps them (`layout.Layout.of`: sharded over the CPU
  devices by "auto"), so each replica is its separate run: bit for bit where
  XLA compiles the mapped body as it compiles the run's (tests/test_replicas.py
  states the tolerance);
* "shard": the replicas split over the devices (a 1-D mesh "replicas",
  `jax.shard_map`), each device running its share one after another on CPU
  (`lax.map`) or batched on accelerators (`vmap`); R is padded to a multiple
  of the devices with copies of replica 0, whose results are dropped. The
  clients of a replica then run on its device ("map" on CPU, "vmap"
  elsewhere): no collective crosses devices inside a round, and the float
  summation order is not the separate run's;
* "vmap": every replica batched (accelerators).

"auto": "map" on CPU, where batching replicas does not make a round cheaper
(one device already keeps both cores busy and vmapped convolutions are slow:
docs/architecture.md), so a batch saves what each run pays alone (compiles,
set-up, host work) and gives the same numbers; "vmap" on GPU/TPU, where a
small model fills a fraction of the chip.
"""

from __future__ import annotations

import collections
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from fedjax_dg.algorithms.base import Algorithm, Recipe
from fedjax_dg.client.update import RunProgress
from fedjax_dg.engine.evaluation import carry_scores, features_of, make_eval
from fedjax_dg.engine.layout import Layout, mesh_size
from fedjax_dg.engine.round import Cohort, make_round, step_rows
from fedjax_dg.engine.settings import EngineConfig
from fedjax_dg.errors import ConfigError

REPLICA_MAPPINGS = ("auto", "map", "vmap", "shard")


def program_key(cfg: EngineConfig, alg: Algorithm) -> EngineConfig:
  """The fields of `cfg` that shape the compiled programs (not the seed, ...;
  the rounds only where the clients' optimizer is a `RunProgress`, a
  schedule over the run: the server sees the run's length as a traced
  argument of the chunk)."""
  scheduled = isinstance(alg.client.optimizer, RunProgress)
  return EngineConfig(rounds=cfg.rounds if scheduled else 1,
                      epochs=cfg.epochs, local_steps=cfg.local_steps,
                      batch_size=cfg.batch_size,
                      cohort_size=cfg.cohort_size, client_mapping=cfg.client_mapping,
                      map_batch_size=cfg.map_batch_size,
                      skip_idle_steps=cfg.skip_idle_steps,
                      vmap_lanes=cfg.vmap_lanes,
                      # only the row gather changes a program
                      host_gather=("rows" if cfg.host_gather == "rows"
                                   else "clients"),
                      shuffle=cfg.shuffle,
                      eval_batch_size=cfg.eval_batch_size)


class Programs(NamedTuple):
  """The compiled pieces of a run (`programs`)."""
  layout: Layout
  init: Callable      # init(key) -> carry, placed on the layout
  frozen: Callable    # frozen(key) -> the shared-frozen parameters (or None)
  chunk: Callable     # chunk(carry, r0, train, root_key, frozen, length,
                      #   rounds) -> (carry, metrics); `rounds`: the run's
                      #   length; `train`: ClientArrays [N, ...]
                      #   or Cohort [length, m, ...] (`round.make_round`)
  eval: Callable      # eval(carry, frozen, val, ood, details=False) -> dict
  # The "host" placement's pieces (`placement.HostStore`):
  server_init: Callable  # server_init(key) -> the server state, placed
  init_rows: Callable    # init_rows(key, ids) -> initial client-state rows
  step_rows: Callable    # step_rows(root_key, rounds, ids, n, n_max) -> the
                         #   rows the cohorts' steps read (`round.step_rows`)
  eval_blocks: Callable  # eval_blocks((server, host client state), frozen,
                         #   placement.EvalBlocks, ood, details=False) -> dict


def per_algorithm_lru(maxsize: int):
  """`functools.lru_cache(maxsize)` over calls whose first argument is a
  `Recipe`, which can also drop every entry of one Algorithm or recipe
  (`forget_programs`): a sweep forgets an algorithm's compiled programs, and
  what their closures hold (its model; its data, where it is built from its
  data), once its last batch has run, instead of keeping up to `maxsize` of
  them for the rest of the sweep."""
  def wrap(fn):
    entries: collections.OrderedDict = collections.OrderedDict()

    @functools.wraps(fn)
    def cached(*args):
      if args in entries:
        entries.move_to_end(args)
        return entries[args]
      value = entries[args] = fn(*args)
      if len(entries) > maxsize:
        entries.popitem(last=False)
      return value

    def forget(alg) -> int:
      gone = [k for k in entries if k[0].owner is alg or k[0] == alg]
      for k in gone:
        del entries[k]
      return len(gone)

    cached.forget = forget
    cached.entries = lambda: len(entries)
    _CACHES.append(cached)
    return cached
  return wrap


_CACHES: list = []


def forget_programs(alg) -> int:
  """Drops every compiled program of `alg` (an Algorithm, or a Recipe and
  every recipe of equal key; single runs' and replica batches'); the number
  of entries dropped. A later run of `alg` compiles again (from the
  persistent compilation cache, where it is on)."""
  return sum(cache.forget(alg) for cache in _CACHES)


def programs(alg, model, cfg: EngineConfig, num_clients: int) -> Programs:
  """The jitted programs a single run (`runner.run`) uses for `alg` (an
  Algorithm, or a `Recipe` whose programs take the run's values as their
  last argument, `values=`), for benchmarks and tools that drive the chunks
  themselves; place training data with `layout.put_clients`. `run`
  resolves `vmap_lanes` = 0 from the clients' sizes first
  (`layout.resolve_lanes`); here 0 is one lane per client. The same for
  `host_gather` (`placement.resolve_gather`): here only "rows" is the row
  gather."""
  recipe = Recipe.of(alg, model)
  return _programs(recipe, program_key(cfg, recipe.alg), num_clients)


@per_algorithm_lru(maxsize=32)
def _programs(recipe: Recipe, cfg: EngineConfig, num_clients: int) -> Programs:
  """Jitted (init, chunk, eval) of one recipe, shared by every run of an
  equal recipe: other target domains with equal shapes, other seeds (and,
  for a registry recipe, other normalizations and learning rates: its
  values) and resumed runs reuse the traced and compiled programs."""
  layout = Layout.of(cfg, num_clients)
  alg, make = recipe.alg, recipe.make

  # Sharded: the carry stays replicated (the same sharding in and out, so the
  # second chunk reuses the first chunk's compiled program).
  placed = ({} if layout.mesh is None
            else dict(out_shardings=NamedSharding(layout.mesh, P())))

  @functools.partial(jax.jit, static_argnums=(5,), donate_argnums=(0,), **placed)
  def run_chunk(carry, r0, train, root_key, frozen, length, rounds,
                values=None):
    round_fn = make_round(make(values)[0], cfg, num_clients, layout)
    indices = r0 + jnp.arange(length)
    rounds = jnp.asarray(rounds, jnp.int32)
    if isinstance(train, Cohort):  # one cohort per round: the scan's input
      return jax.lax.scan(
          lambda c, xs: round_fn(c, xs[0], xs[1], root_key, frozen, rounds),
          carry, (indices, train))
    return jax.lax.scan(
        lambda c, r: round_fn(c, r, train, root_key, frozen, rounds), carry,
        indices)

  # One compiled program (not dozens of eager ops), and distinct output buffers
  # even where init aliases (EMA copy = params): the chunk donates its carry.
  init = jax.jit(lambda key, values=None: make(values)[0].init(key))
  # Held once, outside the carry; replicated over the mesh like the carry.
  # Not jitted here: a pretrained file read inside a trace would become a
  # constant of the program (`Model.init` jits its own sampling).
  def frozen(key, values=None):
    """Eagerly, with a run's concrete values: its algorithm's (a recipe's
    data-built parts may hold them, CCST's AdaIN network)."""
    own = alg if values is None else make(values)[0]
    return None if own.frozen is None else own.frozen(key)
  evaluate_, eval_blocks = make_eval(recipe, cfg.eval_batch_size)
  # Compiled without the client state (XLA drops what the output does not use).
  server_init = jax.jit(lambda key, values=None: make(values)[0].init(key)[0])
  init_rows = jax.jit(lambda key, ids, values=None:
                      make(values)[0].initial_rows(key, ids))
  return Programs(
      layout=layout,
      init=lambda key, values=None: layout.put_carry(init(key, values)),
      frozen=lambda key, values=None: layout.put_carry(frozen(key, values)),
      chunk=run_chunk,
      eval=lambda carry, frozen, *a, **kw: evaluate_(
          layout.to_one_device(carry), layout.to_one_device(frozen), *a, **kw),
      server_init=lambda key, values=None: layout.put_carry(
          server_init(key, values)),
      init_rows=init_rows, step_rows=step_rows(alg, cfg),
      eval_blocks=lambda state, frozen, *a, **kw: eval_blocks(
          (layout.to_one_device(state[0]), state[1]),
          layout.to_one_device(frozen), *a, **kw))


@jax.jit
def finite_leaves(tree_) -> jax.Array:
  """[leaves] bool: every value of the leaf is finite (integer leaves are)."""
  return jnp.stack([jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
                    else jnp.bool_(True) for x in jax.tree.leaves(tree_)])


def replica_mapping(mapping: str, replicas: int) -> str:
  """The replica axis' mapping ("auto": "map" on CPU, "vmap" on
  accelerators; a single replica: "map")."""
  if mapping not in REPLICA_MAPPINGS:
    raise ConfigError(f"replica mapping {mapping!r}: allowed values are "
                      f"{REPLICA_MAPPINGS}")
  if mapping != "auto":
    return mapping
  return "map" if jax.default_backend() == "cpu" or replicas == 1 else "vmap"


def _replica_mesh(replicas: int) -> jax.sharding.Mesh:
  size = mesh_size(replicas)
  return jax.make_mesh((size,), ("replicas",),
                       axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:size])


def _over(how: str, fn: Callable, *stacked):
  """fn(*one replica's args) over the leading replica axis of `stacked`:
  batched ("vmap") or one replica after another ("map")."""
  if how == "vmap":
    return jax.vmap(fn)(*stacked)
  return jax.lax.map(lambda a: fn(*a), stacked)


class ReplicaPrograms(NamedTuple):
  """The compiled programs of a batch of R replicas (`replica_programs`),
  each one call for all of them; R' = R padded to the mesh ("shard")."""
  chunk: Callable     # chunk(carry [R'], r0, train [R'], root_keys [R'],
                      #   frozen [R'], values [R'], length, rounds) ->
                      #   (carry, metrics [R', length, ...], finite flags
                      #   [R', leaves]: one program, one transfer)
  padded: int         # R'
  put: Callable       # put(stacked [R', ...]) -> on the devices
  finite: Callable    # finite(carry [R']) -> bool [R', leaves]
  scores: Callable    # scores(carry, frozen, (val, ood), values, bs_val,
                      #   bs_ood) -> device scores [R', ...] (`carry_scores`)
  features: Callable  # features(carry, frozen, x [R', n, ...], values,
                      #   batch) -> [R', n, F]
  eval_params: Callable  # eval_params(carry, values) -> [R', ...]
  extras: Callable    # extras(carry, values) -> the algorithm's extras


def replica_programs(alg, model, cfg: EngineConfig, num_clients: int,
                     replicas: int, mapping: str) -> ReplicaPrograms:
  """The jitted programs of `replicas` runs of `alg` (an Algorithm or a
  `Recipe`; cached like `programs`: per recipe, `program_key`, N, R and
  the mapping)."""
  recipe = Recipe.of(alg, model)
  return _replica_programs(recipe, program_key(cfg, recipe.alg), num_clients,
                           replicas, mapping)


@per_algorithm_lru(maxsize=16)
def _replica_programs(recipe, cfg, num_clients, replicas, mapping):
  make = recipe.make
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

  def one(carry, r0, train, root_key, frozen, values, length, rounds):
    round_fn = make_round(make(values)[0], cfg, num_clients, layout)
    indices = r0 + jnp.arange(length)
    return jax.lax.scan(
        lambda c, r: round_fn(c, r, train, root_key, frozen, rounds), carry,
        indices)

  def chunk_over(how, carry, r0, train, keys, frozen, values, length, rounds):
    return _over(how, lambda c, t, k, fz, v: one(c, r0, t, k, fz, v, length,
                                                 rounds),
                 carry, train, keys, frozen, values)

  def finite(carry):
    return jnp.stack([
        jnp.all(jnp.isfinite(x).reshape(x.shape[0], -1), axis=1)
        if jnp.issubdtype(x.dtype, jnp.inexact)
        else jnp.ones(x.shape[:1], bool) for x in jax.tree.leaves(carry)],
                     axis=1)

  scores_one = lambda c, f, a, v, bs_val, bs_ood: carry_scores(
      *make(v), c, f, a, bs_val, bs_ood)
  features_one = lambda c, f, x, v, batch: features_of(*make(v), c, f, x,
                                                       batch)
  eval_params_one = lambda c, v: make(v)[0].server.eval_params(*c)
  extras_one = lambda c, v: make(v)[0].server.extras(*c)

  if not sharded:
    # Each replica's clients mapped as a single run maps them (sharded over
    # a "clients" mesh where there is one): the carry replicated over it,
    # the same sharding in and out (one compile for every chunk).
    placed = ({} if layout.mesh is None else
              dict(out_shardings=NamedSharding(layout.mesh, P())))

    @functools.partial(jax.jit, static_argnums=(6,), donate_argnums=(0,),
                       **placed)
    def replica_chunk(carry, r0, train, keys, frozen, values, length, rounds):
      carry, metrics = chunk_over(mapping, carry, r0, train, keys, frozen,
                                  values, length, jnp.asarray(rounds, jnp.int32))
      return carry, metrics, finite(carry)

    over = lambda fn: lambda *a: _over(mapping, fn, *a)
    # Committed to one device, as the chunk's outputs are: the second chunk
    # reuses the first one's compiled program.
    put = (layout.put_carry if layout.mesh is not None else
           lambda stacked: jax.device_put(stacked, jax.devices()[0]))
    padded = replicas
  else:
    mesh = _replica_mesh(replicas)
    spec = NamedSharding(mesh, P("replicas"))
    padded = -(-replicas // mesh.size) * mesh.size

    @functools.partial(jax.jit, static_argnums=(6,), donate_argnums=(0,),
                       out_shardings=spec)
    def replica_chunk(carry, r0, train, keys, frozen, values, length, rounds):
      rounds = jnp.asarray(rounds, jnp.int32)
      body = lambda c, r0_, t, k, fz, v, n: chunk_over(inner, c, r0_, t, k, fz,
                                                       v, length, n)
      # Every value a replica differs in is sharded (its carry, data, key and
      # frozen parameters); no collective is needed, so the varying-axes
      # check is off: the algorithms' own scans start from constants (zeros)
      # that it would have to be told vary over the replicas.
      carry, metrics = jax.shard_map(
          body, mesh=mesh,
          in_specs=(P("replicas"), P(), P("replicas"), P("replicas"),
                    P("replicas"), P("replicas"), P()),
          out_specs=P("replicas"), check_vma=False)(carry, r0, train, keys,
                                                     frozen, values, rounds)
      return carry, metrics, finite(carry)

    def over(fn):
      # Each device maps its own replicas: no collective, no gather.
      return lambda *a: jax.shard_map(
          lambda *local: _over(inner, fn, *local), mesh=mesh,
          in_specs=(P("replicas"),) * len(a), out_specs=P("replicas"),
          check_vma=False)(*a)

    put = lambda stacked: jax.device_put(stacked, spec)

  def replica_scores(carry, frozen, arrays, values, bs_val, bs_ood):
    return over(lambda c, f, a, v: scores_one(c, f, a, v, bs_val, bs_ood))(
        carry, frozen, arrays, values)

  def replica_features(carry, frozen, x, values, batch):
    return over(lambda c, f, xs, v: features_one(c, f, xs, v, batch))(
        carry, frozen, x, values)

  return ReplicaPrograms(
      chunk=replica_chunk, padded=padded, put=put, finite=jax.jit(finite),
      scores=jax.jit(replica_scores, static_argnums=(4, 5)),
      features=jax.jit(replica_features, static_argnums=(4,)),
      eval_params=jax.jit(over(eval_params_one)),
      extras=jax.jit(over(extras_one)))
