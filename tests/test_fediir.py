"""FedIIR: the classifier gradient a client measures, the penalised local loss
and its second-order gradient, and the server's EMA of the mean gradient, each
against an independent computation; the algorithm end to end."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_dg import algorithms, engine, models
from fedjax_dg.algorithms import fediir
from fedjax_dg.algorithms.base import ClientResult
from fedjax_dg.client.update import Batch, ClientContext, ClientData
from fedjax_dg.run.config import base_config
from fedjax_dg.errors import ConfigError
from fedjax_dg.run import assemble


@pytest.fixture(scope="module")
def setup(fed3):
  model = models.get_model("mlp", input_shape=fed3.image_shape,
                           num_classes=fed3.num_classes, mean=fed3.mean,
                           std=fed3.std, hidden=16)
  return fed3, model


def _mean_ce(model, params, x, y):
  logits = model.apply(params, x)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def test_client_gradient_is_the_classifier_gradient_of_its_real_examples(setup):
  fed, model = setup
  params = model.init(jax.random.key(0))
  x, y = jnp.asarray(fed.train.x[1]), jnp.asarray(fed.train.y[1])
  n = x.shape[0] - 6  # padding rows after n, chunks of 7 do not divide n
  assert n % 7
  got, want = jax.jit(lambda p: (
      fediir.client_gradient(model, p, x, y, n, 7),
      jax.grad(_mean_ce, argnums=1)(model, p, x[:n], y[:n])["fc2"]))(params)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_client_end_measures_g_i_at_the_received_model(setup):
  """The client's message (what the server folds into g_bar) is g_i at the model the
  client RECEIVED (`ctx.start`), not at its trained model: jax.grad of the
  mean cross-entropy at the start parameters over the client's n real rows.
  Pins the measurement point; the two models' gradients differ here."""
  fed, model = setup
  alg = fediir.build(model, optax.sgd(0.1), grad_chunk=8)
  start = model.init(jax.random.key(0))
  trained = model.init(jax.random.key(1))  # another model: not measured
  x, y = jnp.asarray(fed.train.x[2]), jnp.asarray(fed.train.y[2])
  n = x.shape[0] - 5  # padding rows after n
  grad_at = lambda p: jax.grad(_mean_ce, argnums=1)(model, p, x[:n],
                                                    y[:n])["fc2"]

  @jax.jit
  def measured(start, trained):
    ctx = ClientContext(id=2, round=0, start=start)
    _, aux = alg.client.end.fn(ctx, trained, ClientData(x, y, jnp.int32(n)),
                               jax.random.key(3))
    return aux, grad_at(start), grad_at(trained)

  got, at_start, at_trained = measured(start, trained)
  chex.assert_trees_all_close(got, at_start, rtol=1e-4, atol=1e-6)
  assert float(optax.tree.norm(optax.tree.sub(at_trained, got))) > 1e-2 * float(
      optax.tree.norm(got))


def _batch(fed, b=12):
  return Batch(jnp.asarray(fed.train.x[0, :b]), jnp.asarray(fed.train.y[0, :b]),
               jnp.asarray(np.r_[np.ones(b - 3), np.zeros(3)], jnp.float32))


def test_local_loss_and_its_second_order_gradient(setup):
  fed, model = setup
  penalty = 0.7
  alg = fediir.build(model, optax.sgd(0.1), penalty=penalty)
  params = model.init(jax.random.key(1))
  batch = _batch(fed)
  gbar = jax.tree.map(lambda v: 0.01 * jnp.ones_like(v), params["fc2"])
  ctx = ClientContext(id=0, round=0, start=params, shared=gbar)
  real = int(batch.mask.sum())

  def independent(p):  # CE of the real rows; its fc2 gradient by autodiff
    ce = lambda q: _mean_ce(model, q, batch.x[:real], batch.y[:real])
    g = jax.grad(ce)(p)["fc2"]
    sq = sum(jnp.sum((a - b) ** 2) for a, b in
             zip(jax.tree.leaves(g), jax.tree.leaves(gbar)))
    return ce(p) + penalty * sq

  key = jax.random.key(0)
  hidden = [k for k in params if k != "fc2"][0]
  idx, h = (0, 0), 1e-2
  no_penalty = fediir.build(model, optax.sgd(0.1), penalty=0.0).client.loss

  @jax.jit   # one program (eagerly: ~190 small ones)
  def run(params):
    leaf = params[hidden]["kernel"]
    bump = lambda s: {**params, hidden: {**params[hidden],
                                         "kernel": leaf.at[idx].add(s * h)}}
    with jax.default_matmul_precision("highest"):
      fd = (independent(bump(1)) - independent(bump(-1))) / (2 * h)
    pick = lambda g: g[hidden]["kernel"][idx]
    return dict(loss=alg.client.loss(params, batch, key, ctx),
                independent=independent(params),
                grad=pick(jax.grad(alg.client.loss)(params, batch, key, ctx)),
                no_penalty=pick(jax.grad(no_penalty)(params, batch, key, ctx)),
                fd=fd)

  out = run(params)
  np.testing.assert_allclose(out["loss"], out["independent"], rtol=1e-5)
  # The penalty's gradient reaches the hidden layers (through the features
  # inside g_i): check one hidden weight by central differences.
  assert abs(float(out["grad"]) - float(out["no_penalty"])) > 1e-4
  np.testing.assert_allclose(out["grad"], out["fd"], rtol=2e-2, atol=1e-4)


def test_server_keeps_an_ema_of_the_example_weighted_mean_gradient(setup):
  fed, model = setup
  alg = fediir.build(model, optax.sgd(0.1), ema=0.9)
  server, _ = alg.init(jax.random.key(0))
  rng = np.random.default_rng(0)
  m = 3
  aux = jax.tree.map(lambda v: jnp.asarray(rng.normal(size=(m,) + v.shape),
                                           jnp.float32), server.params["fc2"])
  n = np.array([5, 20, 10])
  stacked = jax.tree.map(lambda v: jnp.stack([v] * m), server.params)
  result = ClientResult(ids=jnp.arange(m), round=jnp.asarray(0), start=stacked,
                        params=stacked, num_examples=jnp.asarray(n),
                        loss=jnp.zeros(m), message=aux)
  old = server.grad_mean
  for _ in range(2):
    prev = jax.tree.map(np.asarray, old)
    server, metrics = alg.server.update(server, result, jax.random.key(0))
    for k in prev:
      want = 0.9 * prev[k] + 0.1 * sum(n[i] * np.asarray(aux[k][i])
                                       for i in range(m)) / n.sum()
      np.testing.assert_allclose(server.grad_mean[k], want, rtol=1e-5,
                                 atol=1e-7)
    old = server.grad_mean
  assert float(metrics["iir_grad_mean_norm"]) > 0


def test_fediir_runs_and_penalty_zero_is_fedavg(setup):
  fed, model = setup
  cfg = base_config()
  run_cfg = engine.EngineConfig(rounds=2, eval_every=2, epochs=1, batch_size=16,
                                progress=False)
  cfg.fediir.penalty = 0.0
  zero_alg = assemble.algorithm("fediir", model, fed.num_clients, cfg)
  zero = engine.run(zero_alg, fed, model, run_cfg)
  sgd = dict(optimizer="sgd", lr=1e-3, momentum=0.9, weight_decay=0.0)
  cfg.fedavg.client.update(sgd)
  avg = engine.run(assemble.algorithm("fedavg", model, fed.num_clients, cfg),
                   fed, model, run_cfg)
  for a, b in zip(jax.tree.leaves(zero.server.params),
                  jax.tree.leaves(avg.server.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert float(np.asarray(zero.round_metrics["iir_grad_mean_norm"])[-1]) > 0
  # The setting reaches the loss the engine trains (not a third run, ~3.5 s
  # of compiling: what a penalty does to the gradient is
  # test_local_loss_and_its_second_order_gradient's).
  cfg.fediir.penalty = 1.0
  pen_alg = assemble.algorithm("fediir", model, fed.num_clients, cfg)
  params = zero.server.params
  ctx = ClientContext(id=0, round=0, start=params,
                      shared=jax.tree.map(jnp.zeros_like, params["fc2"]))
  batch = _batch(fed)
  with_penalty, without = jax.jit(lambda p: (
      pen_alg.client.loss(p, batch, jax.random.key(0), ctx),
      zero_alg.client.loss(p, batch, jax.random.key(0), ctx)))(params)
  assert float(with_penalty) > float(without) + 1e-6


@pytest.mark.parametrize("hp,needle", [(dict(penalty=-1.0), "fediir.penalty"),
                                       (dict(ema=1.0), "fediir.ema"),
                                       (dict(grad_chunk=0), "fediir.grad_chunk")])
def test_bad_settings_name_the_field(setup, hp, needle):
  _, model = setup
  with pytest.raises(ConfigError, match=needle):
    fediir.build(model, optax.sgd(0.1), **hp)
