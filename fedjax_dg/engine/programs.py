"""What is compiled for a run, and keyed by what: the jitted init, chunk (a
`lax.scan` of `round.make_round` over `eval_every` rounds) and evaluation of
one algorithm and model (`Programs`), cached per (Algorithm, model, the
settings that shape a program: `program_key`, number of clients), so other
target domains with equal shapes, other seeds and resumed runs reuse the
traced and compiled programs.
"""

from __future__ import annotations

import collections
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.client.update import RunProgress
from fedjax_dg.engine.evaluation import make_eval
from fedjax_dg.engine.layout import Layout
from fedjax_dg.engine.round import Cohort, make_round, step_rows
from fedjax_dg.engine.settings import EngineConfig


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
  """`functools.lru_cache(maxsize)` over calls whose first argument is an
  Algorithm, which can also drop every entry of one Algorithm
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

    def forget(alg: Algorithm) -> int:
      gone = [k for k in entries if k[0] is alg]
      for k in gone:
        del entries[k]
      return len(gone)

    cached.forget = forget
    cached.entries = lambda: len(entries)
    _CACHES.append(cached)
    return cached
  return wrap


_CACHES: list = []


def forget_programs(alg: Algorithm) -> int:
  """Drops every compiled program of `alg` (single runs' and replica
  batches'); the number of entries dropped. A later run of `alg` compiles
  again (from the persistent compilation cache, where it is on)."""
  return sum(cache.forget(alg) for cache in _CACHES)


def programs(alg: Algorithm, model, cfg: EngineConfig,
             num_clients: int) -> Programs:
  """The jitted programs `loop.run` uses for `alg` (for benchmarks and tools
  that drive the chunks themselves); place training data with
  `layout.put_clients`. `run` resolves `vmap_lanes` = 0 from the clients'
  sizes first (`layout.resolve_lanes`); here 0 is one lane per client. The
  same for `host_gather` (`placement.resolve_gather`): here only "rows" is
  the row gather."""
  return _programs(alg, alg.model or model, program_key(cfg, alg),
                   num_clients)


@per_algorithm_lru(maxsize=32)
def _programs(alg: Algorithm, model, cfg: EngineConfig,
              num_clients: int) -> Programs:
  """Jitted (init, chunk, eval) of one algorithm, shared by every run that uses the
  same Algorithm and model objects: other target domains with equal shapes, other
  seeds and resumed runs reuse the traced and compiled programs."""
  layout = Layout.of(cfg, num_clients)
  round_fn = make_round(alg, cfg, num_clients, layout)

  # Sharded: the carry stays replicated (the same sharding in and out, so the
  # second chunk reuses the first chunk's compiled program).
  placed = ({} if layout.mesh is None
            else dict(out_shardings=NamedSharding(layout.mesh, P())))

  @functools.partial(jax.jit, static_argnums=(5,), donate_argnums=(0,), **placed)
  def run_chunk(carry, r0, train, root_key, frozen, length, rounds):
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
  init = jax.jit(alg.init)
  # Held once, outside the carry; replicated over the mesh like the carry.
  # Not jitted here: a pretrained file read inside a trace would become a
  # constant of the program (`Model.init` jits its own sampling).
  frozen = alg.frozen if alg.frozen is not None else lambda key: None
  evaluate_, eval_blocks = make_eval(alg, model, cfg.eval_batch_size)
  # Compiled without the client state (XLA drops what the output does not use).
  server_init = jax.jit(lambda key: alg.init(key)[0])
  return Programs(
      layout=layout, init=lambda key: layout.put_carry(init(key)),
      frozen=lambda key: layout.put_carry(frozen(key)), chunk=run_chunk,
      eval=lambda carry, frozen, *a, **kw: evaluate_(
          layout.to_one_device(carry), layout.to_one_device(frozen), *a, **kw),
      server_init=lambda key: layout.put_carry(server_init(key)),
      init_rows=jax.jit(alg.initial_rows), step_rows=step_rows(alg, cfg),
      eval_blocks=lambda state, frozen, *a, **kw: eval_blocks(
          (layout.to_one_device(state[0]), state[1]),
          layout.to_one_device(frozen), *a, **kw))
