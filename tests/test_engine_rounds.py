"""The run's length reaches what depends on it: a schedule over the run
(`RunProgress`) and a server update that decays over the rounds
(`Algorithm.uses_rounds`), while other algorithms share one compile."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_dg import engine, models
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client import objectives
from fedjax_dg.client.update import RunProgress
from fedjax_dg.engine.programs import program_key, programs

CFG = engine.EngineConfig(rounds=4, eval_every=4, epochs=1, batch_size=1000,
                          client_mapping="map", progress=False)


def _model(fed):
  return models.get_model("mlp", input_shape=fed.image_shape,
                          num_classes=fed.num_classes, mean=fed.mean,
                          std=fed.std, hidden=4)


def _progress_adder():
  """Every step adds `progress` to every parameter (gradients ignored)."""
  def update(updates, state, params=None, *, progress, **extra):
    del params, extra
    return jax.tree.map(lambda u: jnp.full_like(u, progress), updates), state
  return RunProgress(lambda params: optax.EmptyState(), update)


def test_run_progress_spans_the_whole_run(fed3):
  model = _model(fed3)
  alg = fedavg(model, _progress_adder(), objectives.cross_entropy(model))
  # One step per round (the batch holds a whole client): round r adds r / R.
  for rounds in (2, 4):
    cfg = dataclasses.replace(CFG, rounds=rounds, eval_every=rounds)
    start = alg.init(jax.random.fold_in(jax.random.key(cfg.seed), 2**31 - 1))
    got = engine.run(alg, fed3, model, cfg)
    want = sum(r / rounds for r in range(rounds))  # the bug (R = 1): sum(r)
    leaf = lambda s: jax.tree.leaves(s.params)[0]
    np.testing.assert_allclose(leaf(got.server) - leaf(start[0]), want,
                               rtol=1e-5)


def test_server_sees_the_rounds_only_where_asked(fed3):
  model = _model(fed3)
  base = fedavg(model, optax.sgd(0.0), objectives.cross_entropy(model))
  seen = {}

  def server_update(server, result, key):
    seen[base.name if result.rounds is None else result.rounds] = True
    return base.server_update(server, result, key)

  asks = dataclasses.replace(base, server_update=server_update,
                             uses_rounds=True)
  assert asks.needs_rounds and not base.needs_rounds

  def trace(alg, cfg):
    """Lowers (traces, never compiles) the chunk program `engine.run` runs
    for `cfg` (`engine.programs.programs`): the server update records what it
    sees at trace time."""
    progs = programs(alg, model, cfg, fed3.num_clients)
    progs.chunk.lower(jax.eval_shape(alg.init, jax.random.key(0)),
                      jnp.int32(0), jax.tree.map(jnp.asarray, fed3.train),
                      jax.random.key(cfg.seed), None, cfg.eval_every)

  trace(asks, dataclasses.replace(CFG, rounds=3, eval_every=3))
  trace(asks, dataclasses.replace(CFG, rounds=5, eval_every=5))
  plain = dataclasses.replace(base, server_update=server_update)
  trace(plain, CFG)
  assert seen == {3: True, 5: True, base.name: True}
  # Programs are compiled per run length only where the length matters.
  key = lambda a, r: program_key(dataclasses.replace(CFG, rounds=r), a)
  assert key(plain, 3) == key(plain, 7)
  assert key(asks, 3) != key(asks, 7)
