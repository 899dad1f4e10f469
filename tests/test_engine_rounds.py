"""The run's length reaches what depends on it: a schedule over the run
(`RunProgress`: its programs are compiled per length) and every server update
(`ClientResult.rounds`, a traced scalar: one compile serves every length)."""

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


def test_every_server_sees_the_rounds_and_one_compile_serves_every_length(
    fed3):
  """The server update gets the run's length (`ClientResult.rounds`, a
  traced scalar: FedDG-GA's step decays over it): the chunk program is
  keyed alike for every length and compiled once, yet each run's server
  sees its own length."""
  model = _model(fed3)
  base = fedavg(model, optax.sgd(0.0), objectives.cross_entropy(model))

  def server_update(server, result, key):
    server, metrics = base.server.update(server, result, key)
    return server, dict(metrics, rounds=result.rounds)

  alg = base.replace(update=server_update)
  key = lambda r, a=alg: program_key(dataclasses.replace(CFG, rounds=r), a)
  assert key(3) == key(7)
  scheduled = base.replace(optimizer=_progress_adder())  # a RunProgress
  assert key(3, scheduled) != key(7, scheduled)
  for rounds in (3, 5):
    cfg = dataclasses.replace(CFG, rounds=rounds, eval_every=1)
    got = engine.run(alg, fed3, model, cfg)
    np.testing.assert_array_equal(got.round_metrics["rounds"], [rounds] * rounds)
  progs = programs(alg, model, CFG, fed3.num_clients)
  assert progs.chunk._cache_size() == 1, progs.chunk._cache_size()
