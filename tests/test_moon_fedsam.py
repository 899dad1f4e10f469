"""HyperGenFL's baselines MOON (model-contrastive) and FedSAM (SAM local steps)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import synthetic_domains
from fedjax_dg import algorithms, engine, models, tree
from fedjax_dg.algorithms import moon
from fedjax_dg.algorithms.moon import (Negative, model_contrastive_loss,
                                       objective)
from fedjax_dg.client.sam import ascent, sam
from fedjax_dg.client.update import Batch, ClientContext, local_update
from fedjax_dg.run.config import base_config
from fedjax_dg.data import federated, partition
from fedjax_dg.engine.round import make_round
from fedjax_dg.models.moon import ContrastiveModel
from fedjax_dg.optim import make_optimizer
from fedjax_dg.run import assemble


def mlp(fed, **kw):
  return models.get_model("mlp", input_shape=fed.image_shape,
                          num_classes=fed.num_classes, mean=fed.mean, std=fed.std,
                          **kw)


def run_rounds(alg, fed, rounds, key=0, carry=None):
  """[(server, client_state, metrics)] after each of `rounds` engine rounds
  (from `carry`: alg.init(key) of a variant differing in a setting init does
  not read, to compile init once)."""
  cfg = engine.EngineConfig(rounds=rounds, epochs=1, batch_size=16,
                            client_mapping="map")
  round_fn = jax.jit(make_round(alg, cfg, fed.num_clients))
  if carry is None:
    carry = jax.jit(alg.init)(jax.random.key(key))
  train = jax.tree.map(jnp.asarray, fed.train)
  out = []
  for r in range(rounds):
    carry, m = round_fn(carry, jnp.int32(r), train, jax.random.key(7), None)
    out.append((carry[0], carry[1], m))
  return out


def sgd_config(lr=5e-2, momentum=0.9, weight_decay=1e-3):
  cfg = base_config()
  cfg.client.optimizer, cfg.client.lr = "sgd", lr
  cfg.client.momentum, cfg.client.weight_decay = momentum, weight_decay
  return cfg


@pytest.fixture(scope="module")
def fedavg_rounds(fed3):
  """FedAvg's 2 rounds with `sgd_config()`: what MOON (mu = 0, round 1) and
  FedSAM (rho = 0) must reproduce."""
  return run_rounds(assemble.algorithm("fedavg", mlp(fed3), 3, sgd_config()),
                    fed3, 2)


def _distance(a, b) -> float:
  """|a - b| over all leaves, in numpy (eagerly, optax.tree.norm of a
  difference compiles a program per op and leaf shape)."""
  return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)
                                            - np.asarray(y, np.float64)))
                           for x, y in zip(jax.tree.leaves(a),
                                           jax.tree.leaves(b)))))


def assert_trees_close(a, b, atol=1e-6):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=atol),
               a, b)


# ----------------------------------------------------------------------------
# MOON.


def _numpy_l_con(z, z_glob, z_prev, tau):
  """The MOON paper's Eq. (2), per example."""
  cos = lambda a, b: (a * b).sum(1) / (np.linalg.norm(a, axis=1)
                                       * np.linalg.norm(b, axis=1))
  pos, neg = np.exp(cos(z, z_glob) / tau), np.exp(cos(z, z_prev) / tau)
  return -np.log(pos / (pos + neg))


def test_model_contrastive_loss_matches_the_formula():
  rng = np.random.default_rng(0)
  z, z_glob, z_prev = (rng.normal(size=(6, 5)).astype(np.float32)
                       for _ in range(3))
  mask = jnp.array([1., 1., 1., 0., 0., 0.])
  f = lambda z: model_contrastive_loss(z, z_glob, z_glob, 0.5, jnp.ones((6,)))

  @jax.jit   # one program (eagerly: ~100)
  def run(z):
    return dict(
        taus=[model_contrastive_loss(z, z_glob, z_prev, tau, jnp.ones((6,)))
              for tau in (0.5, 0.1)],
        masked=model_contrastive_loss(z, z_glob, z_prev, 0.5, mask),
        same=f(z), grad_same=jax.grad(f)(z))

  out = run(z)
  for tau, got in zip((0.5, 0.1), out["taus"]):
    want = _numpy_l_con(z, z_glob, z_prev, tau).mean()
    np.testing.assert_allclose(got, want, rtol=1e-5)
  # Padding rows do not count; z_prev = z_glob gives log 2 with zero gradient
  np.testing.assert_allclose(
      out["masked"], _numpy_l_con(z[:3], z_glob[:3], z_prev[:3], 0.5).mean(),
      rtol=1e-5)
  np.testing.assert_allclose(out["same"], np.log(2.0), rtol=1e-6)
  np.testing.assert_array_equal(out["grad_same"], 0.0)


def test_moon_objective_is_ce_plus_mu_contrastive(fed3):
  model = mlp(fed3)
  cm = ContrastiveModel(model, proj_dim=8)
  params, glob, prev = (cm.init(jax.random.key(k)) for k in range(3))
  assert jax.eval_shape(cm.project, params, jnp.zeros((2, 32))).shape == (2, 8)
  assert params["proj"]["l1"]["kernel"].shape == (32, 32)  # F -> F -> proj_dim
  x, y = fed3.train.x[0, :5], fed3.train.y[0, :5]
  batch = Batch(jnp.asarray(x), jnp.asarray(y), jnp.ones((5,)))
  ctx = ClientContext(id=0, round=1, start=glob, extra=Negative(prev, 1.0))
  h = lambda p: model.features(p["model"], x)
  # One program (eagerly: ~70): the objective, the logits and projections.
  got, logits, z, zg, zp = jax.jit(lambda params, glob, prev: (
      objective(cm, 2.0, 0.5)(params, batch, jax.random.key(3), ctx),
      model.apply(params["model"], x),
      *(cm.project(p, h(p)) for p in (params, glob, prev))))(params, glob, prev)
  logits = np.asarray(logits, np.float64)
  logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
  ce = -logp[np.arange(5), np.asarray(y)].mean()
  z, zg, zp = (np.asarray(a) for a in (z, zg, zp))
  np.testing.assert_allclose(got, ce + 2.0 * _numpy_l_con(z, zg, zp, 0.5).mean(),
                             rtol=1e-5)


def test_moon_trains_its_local_pass_and_reads_the_frozen_ones_in_eval_mode(
    fed3, monkeypatch):
  """The local model's pass is in training mode (dropout, a model's batch
  statistics) with the step's key; the global and previous models' passes,
  frozen, in evaluation mode. (The MLP above has no dropout, so the
  objective's value cannot tell the modes apart: a spy records them.)"""
  cm = ContrastiveModel(mlp(fed3), proj_dim=8)
  params = cm.init(jax.random.key(0))
  calls, forward = [], ContrastiveModel.forward

  def spy(self, p, x, *, train=False, rng=None):
    calls.append((train, rng is not None))
    return forward(self, p, x, train=train, rng=rng)

  monkeypatch.setattr(ContrastiveModel, "forward", spy)
  batch = Batch(jnp.asarray(fed3.train.x[0, :5]),
                jnp.asarray(fed3.train.y[0, :5]), jnp.ones((5,)))
  ctx = ClientContext(id=0, round=1, start=params, extra=Negative(params, 1.0))
  jax.eval_shape(lambda p: objective(cm, 2.0, 0.5)(p, batch, jax.random.key(3),
                                                  ctx), params)
  assert calls == [(True, True), (False, False), (False, False)]


def test_moon_classifies_with_the_plain_client_model(fed3):
  model = mlp(fed3)
  alg = assemble.algorithm("moon", model, fed3.num_clients, base_config())
  server, prev = jax.jit(alg.init)(jax.random.key(0))
  assert set(server.params) == {"model", "proj"}
  assert server.params["proj"]["l2"]["kernel"].shape == (32, 256)
  # The client model starts as FedAvg's from the same key.
  assert_trees_close(alg.server.eval_params(server, prev), model.init(jax.random.key(0)),
                     atol=0)
  assert prev.trained.shape == (3,) and not prev.trained.any()


def test_moon_previous_models_are_the_cohorts_trained_models_and_persist(fed3):
  alg = moon.build(mlp(fed3), optax.adam(1e-2), num_clients=3, proj_dim=8)
  server0, prev0 = jax.jit(alg.init)(jax.random.key(0))
  train = jax.tree.map(jnp.asarray, fed3.train)
  cfg = engine.EngineConfig(rounds=1, epochs=1, batch_size=16, cohort_size=2,
                            client_mapping="map")
  round_fn = jax.jit(make_round(alg, cfg, 3))
  root = jax.random.key(5)
  carry, states, cohorts = (server0, prev0), [prev0], []

  @jax.jit   # the context and the local training in one program
  def train_one(start, state, i, r):
    client_key = jax.random.split(jax.random.fold_in(root, r), 3)[1]
    rows = tree.take(state, i[None])
    extra = jax.tree.map(lambda a: a[0], alg.client.extra(
        tree.broadcast(start, 1), rows, i[None]))
    ctx = ClientContext(id=i, round=r, start=start,
                        state=jax.tree.map(lambda a: a[0], rows), extra=extra)
    return local_update(alg.client.loss, alg.client.optimizer, start, train.x[i], train.y[i],
                        train.n[i], jax.random.fold_in(client_key, i), ctx,
                        batch_size=16, epochs=1)[0]

  for r in range(3):
    start_server = carry[0]
    carry, m = round_fn(carry, jnp.int32(r), train, root, None)
    states.append(carry[1])
    cohorts.append(np.asarray(m["cohort"]))
    # A cohort client's row is exactly its locally trained model.
    i = int(cohorts[-1][0])
    want = train_one(start_server.params, states[-2], jnp.int32(i),
                     jnp.int32(r))
    assert_trees_close(jax.tree.map(lambda a: np.asarray(a)[i],
                                    carry[1].params), want, atol=1e-5)
  states = [jax.tree.map(np.asarray, s) for s in states]
  kept = 0
  for r, ids in enumerate(cohorts):
    before, after = states[r], states[r + 1]
    for c in range(3):
      b, a = (jax.tree.map(lambda t: np.asarray(t[c]), s.params)
              for s in (before, after))
      same = all(np.array_equal(u, v) for u, v in zip(jax.tree.leaves(a),
                                                      jax.tree.leaves(b)))
      assert same == (c not in ids), (r, c, ids)
      kept += same
      assert bool(after.trained[c]) == (bool(before.trained[c]) or c in ids)
  assert kept == 3  # one client sat out each round and kept its previous model


def test_moon_prev_init_global_uses_the_global_model_until_trained(fed3):
  alg = moon.build(mlp(fed3), optax.sgd(1e-2), num_clients=3, proj_dim=8,
                   prev_init="global")
  _, prev = jax.tree.map(np.asarray, jax.jit(alg.init)(jax.random.key(0)))
  prev = prev._replace(trained=np.array([True, False, True]))
  start = jax.tree.map(lambda p: np.asarray(p) + np.float32(1.0), prev.params)
  ids = np.arange(3)
  initial = moon.build(mlp(fed3), optax.sgd(1e-2), num_clients=3, proj_dim=8)
  # One program (eagerly: ~50).
  extra, on_start, on_prev = jax.jit(lambda start, prev: (
      alg.client.extra(start, prev, ids), initial.client.extra(start, prev, ids).on,
      initial.client.extra(prev.params, prev, ids).on))(start, prev)
  extra = jax.tree.map(np.asarray, extra)
  for leaf_prev, leaf_start, leaf in zip(*(jax.tree.leaves(t) for t in
                                           (prev.params, start, extra.prev))):
    np.testing.assert_array_equal(leaf[0], leaf_prev[0])
    np.testing.assert_array_equal(leaf[1], leaf_start[1])
    np.testing.assert_array_equal(leaf[2], leaf_prev[2])
  np.testing.assert_array_equal(extra.on, [1.0, 0.0, 1.0])
  # "initial": the untrained buffer is the initial model, on where it differs.
  np.testing.assert_array_equal(on_start, 1.0)
  np.testing.assert_array_equal(on_prev, 0.0)


def test_moon_is_fedavg_with_mu_0_and_in_its_first_round(fed3, fedavg_rounds):
  model = mlp(fed3)
  cfg = sgd_config()
  cfg.moon.proj_dim = 8
  avg = [s.params for s, _, _ in fedavg_rounds]
  carry = None
  for mu in (0.0, 5.0):
    cfg.moon.mu = mu
    alg = assemble.algorithm("moon", model, 3, cfg)
    if carry is None:
      carry = jax.jit(alg.init)(jax.random.key(0))   # mu: not read by init
    got = [alg.server.eval_params(s, None)
           for s, _, _ in run_rounds(alg, fed3, 2, carry=carry)]
    # Round 1: the previous models are the global one, no contrastive term.
    assert_trees_close(got[0], avg[0], atol=1e-6)
    if mu == 0:
      assert_trees_close(got[1], avg[1], atol=1e-6)
    else:
      diff = _distance(got[1], avg[1])
      assert diff > 1e-4, diff


# ----------------------------------------------------------------------------
# FedSAM.


def _quadratic():
  a = np.array([[3.0, 0.5], [0.5, 1.0]], np.float32)
  b = np.array([0.3, -1.0], np.float32)
  c = np.float32(0.7)
  loss = lambda p: (0.5 * p["kernel"] @ a @ p["kernel"] + b @ p["kernel"]
                    + 2.0 * (p["bias"] - c) ** 2)
  grad = lambda w, v: (a @ w + b, 4.0 * (v - c))
  return loss, grad


def _numpy_sam_steps(w, v, steps, lr, rho, wd, momentum, adaptive=False, eta=0.0):
  """SAM around PyTorch-style SGD (weight decay, momentum), by hand."""
  _, grad = _quadratic()
  mw, mv = np.zeros_like(w), np.zeros_like(v)
  for _ in range(steps):
    gw, gv = grad(w, v)
    tw, tv = (np.abs(w) + eta, np.float32(1.0)) if adaptive else (1.0, 1.0)
    norm = np.sqrt(np.sum((tw * gw) ** 2) + (tv * gv) ** 2)
    ew, ev = rho * tw**2 * gw / norm, rho * tv**2 * gv / norm
    gw, gv = grad(w + ew, v + ev)
    gw, gv = gw + wd * w, gv + wd * v
    mw, mv = momentum * mw + gw, momentum * mv + gv
    w, v = w - lr * mw, v - lr * mv
  return w, v


@pytest.mark.parametrize("adaptive", [False, True])
def test_sam_steps_match_a_hand_computation_on_a_quadratic(adaptive):
  loss, _ = _quadratic()
  w0 = {"kernel": np.array([1.0, -2.0], np.float32), "bias": np.float32(0.2)}
  lr, rho, wd, momentum, eta = 0.1, 0.3, 0.01, 0.9, 0.05
  opt = sam(make_optimizer("sgd", lr, wd, momentum), rho, adaptive=adaptive,
            eta=eta)
  # Through local_update: 3 examples, batch 1, one epoch = 3 SAM steps.
  obj = lambda p, batch, rng, ctx: loss(p)
  x = jnp.zeros((3, 1, 1, 1), jnp.uint8)
  got, mean_loss = jax.jit(lambda p: local_update(
      obj, opt, p, x, jnp.zeros((3,), jnp.int32), jnp.int32(3),
      jax.random.key(0), batch_size=1, epochs=1))(w0)
  want_w, want_v = _numpy_sam_steps(w0["kernel"], w0["bias"], 3, lr, rho, wd,
                                    momentum, adaptive, eta)
  np.testing.assert_allclose(got["kernel"], want_w, rtol=1e-5)
  np.testing.assert_allclose(got["bias"], want_v, rtol=1e-5)
  # The reported loss is the loss at w (before the ascent), as the reference.
  w1, v1 = _numpy_sam_steps(w0["kernel"], w0["bias"], 1, lr, rho, wd, momentum,
                            adaptive, eta)
  w2, v2 = _numpy_sam_steps(w0["kernel"], w0["bias"], 2, lr, rho, wd, momentum,
                            adaptive, eta)
  losses = [loss({"kernel": a, "bias": b})
            for a, b in ((w0["kernel"], w0["bias"]), (w1, v1), (w2, v2))]
  np.testing.assert_allclose(mean_loss, np.mean(losses), rtol=1e-5)


@pytest.mark.parametrize("adaptive", [False, True])
def test_sam_with_a_zero_gradient_is_a_plain_step(adaptive):
  """At a stationary point (g = 0) the ascent e = rho g / (|g| + 1e-12) is 0,
  not 0 / 0 = NaN: SAM's gradient is then the gradient at w itself. The loss
  0.5 |q - w|^2 has gradient q - w, zero at w only, so a NaN (or any
  nonzero) perturbation shows in the step; the norm guard (`sam.EPS`) is
  what keeps it finite."""
  opt = sam(optax.sgd(0.1), 0.05, adaptive=adaptive)
  p = {"w": jnp.array([1.0, -2.0, 3.0]), "bias": jnp.array([0.5])}

  @jax.jit   # one program (eagerly: ~30)
  def run(p):
    grad_fn = lambda q, _: jax.tree.map(jnp.subtract, q, p)
    zero = grad_fn(p, 0)
    at_w, _ = opt.update(zero, opt.init(p), p, grad_fn=grad_fn)
    # The ascent alone.
    e, _ = ascent(0.05, adaptive).update(zero, None, p)
    # Away from w the same grad_fn.
    moved = jax.tree.map(lambda a: a + 1.0, p)
    away, _ = opt.update(grad_fn(moved, 0), opt.init(moved), moved,
                         grad_fn=grad_fn)
    return at_w, e, away

  updates, e, away = run(p)
  for u in jax.tree.leaves(updates):
    np.testing.assert_array_equal(u, 0.0)
  # The ascent alone: e = 0 at a zero gradient, finite.
  for v in jax.tree.leaves(e):
    np.testing.assert_array_equal(v, 0.0)
  # Away from w the same grad_fn gives SAM a nonzero step (it is read).
  assert all(np.all(np.asarray(u) < 0) for u in jax.tree.leaves(away))


def test_fedsam_with_rho_0_is_fedavg(fed3, fedavg_rounds):
  model = mlp(fed3)
  cfg = sgd_config()
  cfg.fedsam.rho = 0.0
  fsam = assemble.algorithm("fedsam", model, 3, cfg)
  assert fsam.name == "fedsam" and not fsam.server.personalized
  a, _, ma = fedavg_rounds[-1]
  carry = jax.jit(fsam.init)(jax.random.key(0))   # rho: not read by init
  s, _, ms = run_rounds(fsam, fed3, 2, carry=carry)[-1]
  assert_trees_close(s.params, a.params, atol=1e-6)
  np.testing.assert_allclose(ms["loss"], ma["loss"], rtol=1e-6)
  # With rho > 0 the trajectory differs.
  cfg.fedsam.rho = 0.05
  s, _, _ = run_rounds(assemble.algorithm("fedsam", model, 3, cfg), fed3, 2,
                       carry=carry)[-1]
  assert _distance(s.params, a.params) > 1e-4


def test_local_update_unchanged_for_optimizers_without_extra_args(fed3):
  # A plain GradientTransformation (no extra arguments) still works.
  plain = optax.GradientTransformation(optax.sgd(0.1).init,
                                       optax.sgd(0.1).update)
  assert not isinstance(plain, optax.GradientTransformationExtraArgs)
  loss, _ = _quadratic()
  w0 = {"kernel": jnp.array([1.0, -2.0]), "bias": jnp.float32(0.2)}
  # One program (eagerly: ~55).
  got, g = jax.jit(lambda w0: (local_update(
      lambda p, b, r, c: loss(p), plain, w0, jnp.zeros((2, 1, 1, 1), jnp.uint8),
      jnp.zeros((2,), jnp.int32), jnp.int32(2), jax.random.key(0),
      batch_size=2, epochs=1)[0], jax.grad(loss)(w0)))(w0)
  assert_trees_close(got, jax.tree.map(lambda w, gi: w - 0.1 * gi, w0, g))


# ----------------------------------------------------------------------------
# Both: registered, configured, and learning on a label-skewed federation.


@pytest.mark.parametrize("name", ["moon", "fedsam"])
def test_registered_with_config_sections(name):
  cfg = base_config()
  assert name in algorithms.available() and "client" in cfg[name]
  want = {"moon": dict(mu=1.0, temperature=0.5, proj_dim=256,
                       prev_init="initial"),
          "fedsam": dict(rho=0.05, adaptive=False, eta=0.01)}[name]
  assert {k: cfg[name][k] for k in want} == want


@pytest.fixture(scope="module")
def label_skewed():
  # One domain, 4 classes (chance 25 %), Dirichlet(0.3) label skew over 4 clients.
  ds = synthetic_domains(num_domains=1, per_domain=320, classes=4, noise=60)
  spec = partition.PartitionSpec(name="dirichlet", num_clients=4, alpha=0.3,
                                 min_partition_size=10, seed=0)
  return federated.build(ds, spec, target_domain=None, seed=0)


# Slow (~5 s each): test_pinned.py's
# test_learns_above_chance_and_reproduces_pinned_numbers[moon] / [fedsam] run
# each end to end by default (above chance, loss falling, pinned numbers);
# MOON's sampled cohorts and kept models are pinned above
# (test_moon_previous_models_...), FedSAM's steps too (hand computation,
# rho = 0 is FedAvg).
@pytest.mark.slow
@pytest.mark.parametrize("name", ["moon", "fedsam"])
def test_learns_on_label_skewed_clients(label_skewed, name):
  fed = label_skewed
  counts = [np.bincount(np.asarray(fed.train.y[i, :fed.train.n[i]]), minlength=4)
            for i in range(4)]
  assert max(c.max() / c.sum() for c in counts) > 0.5  # skewed
  cfg = sgd_config(lr=5e-2, momentum=0.9, weight_decay=1e-4)
  cfg.moon.proj_dim = 16
  model = mlp(fed)
  alg = assemble.algorithm(name, model, fed.num_clients, cfg)
  res = engine.run(alg, fed, model, engine.EngineConfig(
      rounds=6, eval_every=3, epochs=1, batch_size=16, cohort_size=3,
      client_mapping="map", progress=False, eval_batch_size=32))
  assert res.final["id_acc"] > 0.25 + 0.3, res.final
  assert res.history[-1]["train_loss"] < res.history[0]["train_loss"]
