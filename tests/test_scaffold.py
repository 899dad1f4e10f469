"""SCAFFOLD: rounds of the engine against a plain numpy SCAFFOLD (Algorithm 1,
both options, a cohort smaller than N, clients of unequal size); the gradient
correction, option I's full-data gradient and option II's step size each
against an independent computation."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import TINY_VIT
from fedjax_dg import engine, models, optim
from fedjax_dg.models import vit_adapters
from fedjax_dg.algorithms import scaffold
from fedjax_dg.client import objectives
from fedjax_dg.client.update import (Batch, ClientContext, ClientData,
                                     RunProgress,
                                     batch_at, epoch_permutations, local_steps,
                                     num_steps)
from fedjax_dg.data import federated
from fedjax_dg.engine.round import make_round
from fedjax_dg.errors import ConfigError
from fedjax_dg.optim import make_optimizer

SIZES = (54, 37, 21)  # unequal clients: 2 epochs of batch 8 = 14, 10, 6 steps
CFG = engine.EngineConfig(rounds=3, epochs=2, batch_size=8, cohort_size=2,
                          client_mapping="map", seed=5, progress=False)
LR = 0.1


@pytest.fixture(scope="module")
def setup(fed3):
  fed = dataclasses.replace(fed3, packed_train=federated.pack_padded(
      fed3.train.replace(n=np.asarray(SIZES, np.int32))))
  assert fed.train.x.shape[1] >= max(SIZES)
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean,
                           std=fed.std, hidden=6)
  return fed, model


def _build(model, variant="II", **kw):
  return scaffold.build(model, make_optimizer("sgd", LR),
                        objectives.cross_entropy(model), num_clients=len(SIZES),
                        variant=variant, **kw)


# --- a plain numpy SCAFFOLD -------------------------------------------------

def _np(params):
  return jax.tree.map(lambda a: np.asarray(a, np.float64), params)


def _features(fed, x):
  x = x.astype(np.float64) / 255.0
  x = (x - np.asarray(fed.mean)) / np.asarray(fed.std)
  return x.reshape(x.shape[0], -1)


def _grad(fed, p, x, y):
  """The gradient of the mean cross-entropy of flatten -> fc1 -> relu -> fc2,
  by hand (backpropagation in numpy)."""
  a0 = _features(fed, x)
  z1 = a0 @ p["fc1"]["kernel"] + p["fc1"]["bias"]
  h = np.maximum(z1, 0.0)
  logits = h @ p["fc2"]["kernel"] + p["fc2"]["bias"]
  e = np.exp(logits - logits.max(1, keepdims=True))
  d = e / e.sum(1, keepdims=True)
  d[np.arange(len(y)), y] -= 1.0
  d /= len(y)
  dz1 = (d @ p["fc2"]["kernel"].T) * (z1 > 0)
  return {"fc1": {"kernel": a0.T @ dz1, "bias": dz1.sum(0)},
          "fc2": {"kernel": h.T @ d, "bias": d.sum(0)}}


def _map(f, *trees):
  return jax.tree.map(f, *trees)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _batches(client_key, n, n_max, batch_size, epochs):
  """The engine's batch order for one client: (indices, valid, active) of
  every scanned local step (`client.update.local_update`)."""
  perm_key, _ = jax.random.split(client_key)
  perms = epoch_permutations(perm_key, n, n_max, epochs)
  return jax.vmap(lambda s: batch_at(s, perms, n, batch_size))(
      jnp.arange(num_steps(n_max, batch_size, epochs)))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _cohort_and_keys(root, r, n_clients, m):
  """The engine's cohort of round r and every client's key (its round key
  schedule: `engine.round.round_keys`, `cohort_ids`, `client_keys`), one program."""
  cohort_key, client_key, _ = jax.random.split(jax.random.fold_in(root, r), 3)
  ids = jax.random.choice(cohort_key, n_clients, (m,), replace=False)
  keys = jax.vmap(jax.random.fold_in, (None, 0))(client_key,
                                                 jnp.arange(n_clients))
  return ids, keys


def numpy_scaffold(fed, x, variant, rounds, cfg, server_lr, weighting,
                   grad=None, sizes=SIZES):
  """Algorithm 1 as a Python loop, with the engine's key schedule (cohort and
  batch order); returns per round (x, c, [c_i]). `grad(p, x, y)`: the mean
  gradient of the loss at parameters p (default the MLP's, by hand)."""
  grad = grad or functools.partial(_grad, fed)
  n_clients, m = len(sizes), cfg.cohort_size
  c = _map(np.zeros_like, x)
  ci = [c] * n_clients
  root = jax.random.key(cfg.seed)
  out = []
  for r in range(rounds):
    ids, client_keys = _cohort_and_keys(root, r, n_clients, m)
    ids = [int(i) for i in ids]
    steps, deltas, weights = [], [], []
    new_ci = list(ci)
    for i in ids:
      n = sizes[i]
      xi, yi = np.asarray(fed.train.x[i]), np.asarray(fed.train.y[i])
      batches = _batches(client_keys[i], n, xi.shape[0], cfg.batch_size,
                         cfg.epochs)
      y, k = x, 0
      for idx, valid, active in zip(*map(np.asarray, batches)):
        if not active:
          continue
        g = grad(y, xi[idx[valid]], yi[idx[valid]])
        y = _map(lambda w, g_, a, b: w - LR * (g_ + a - b), y, g, c, ci[i])
        k += 1
      assert k == cfg.epochs * -(-n // cfg.batch_size)
      if variant == "I":
        c_plus = grad(x, xi[:n], yi[:n])
      else:
        c_plus = _map(lambda a, b, x0, y0: a - b + (x0 - y0) / (k * LR),
                      ci[i], c, x, y)
      new_ci[i] = c_plus
      steps.append(_map(lambda y0, x0: y0 - x0, y, x))
      deltas.append(_map(lambda a, b: a - b, c_plus, ci[i]))
      weights.append(n if weighting == "examples" else 1.0)
    w = np.asarray(weights) / np.sum(weights)
    x = _map(lambda x0, *d: x0 + server_lr * sum(wj * dj for wj, dj in
                                                 zip(w, d)), x, *steps)
    c = _map(lambda c0, *d: c0 + len(ids) / n_clients * np.mean(d, axis=0),
             c, *deltas)
    ci = new_ci
    out.append((ids, x, c, ci))
  return out


def _close(got, want, what, rtol=2e-4, atol=2e-6):
  got = jax.tree.leaves(got)
  want = jax.tree_util.tree_flatten_with_path(want)[0]
  assert len(got) == len(want), what
  for g, (path, w) in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), w, rtol=rtol, atol=atol,
                               err_msg=f"{what} {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("variant,server_lr,weighting,correction", [
    ("II", 1.0, "uniform", "gradient"),  # the paper's default (and this module's)
    ("I", 0.5, "examples", "gradient"),  # the other option, eta_g, weighting
    ("II", 1.0, "uniform", "step"),      # c - c_i after the step: with plain
                                         # SGD Algorithm 1's step all the same
])
def test_rounds_equal_a_numpy_scaffold(setup, variant, server_lr, weighting,
                                       correction):
  fed, model = setup
  alg = _build(model, variant, server_lr=server_lr, weighting=weighting,
               correction=correction)
  _engine_equals_numpy(alg, fed, variant, server_lr, weighting)


def _engine_equals_numpy(alg, fed, variant, server_lr, weighting, frozen=None,
                         grad=None):
  """CFG.rounds rounds of `alg` in the engine against `numpy_scaffold` from
  the same initial x: x, c and every c_i after every round."""
  sizes = tuple(int(n) for n in np.asarray(fed.train.n))
  round_fn = jax.jit(make_round(alg, CFG, len(sizes)))
  root = jax.random.key(CFG.seed)
  carry = jax.jit(alg.init)(jax.random.fold_in(root, 2**31 - 1))
  train = jax.tree.map(jnp.asarray, fed.train)
  want = numpy_scaffold(fed, _np(carry[0].params), variant, CFG.rounds, CFG,
                        server_lr, weighting, grad=grad, sizes=sizes)
  for r, (ids, x, c, ci) in enumerate(want):
    before = carry[1]
    carry, metrics = round_fn(carry, jnp.int32(r), train, root, frozen)
    server, clients = carry
    assert sorted(np.asarray(metrics["cohort"]).tolist()) == sorted(ids)
    _close(server.params, x, f"round {r} x")
    _close(server.control, c, f"round {r} c", atol=2e-5)
    for i in range(len(sizes)):
      row = _map(lambda a: np.asarray(a)[i:i + 1], clients)
      if i in ids:
        _close(row, _map(lambda a: a[None], ci[i]), f"round {r} c_{i}",
               atol=2e-5)
      else:  # absent from the cohort: its control variate is untouched
        assert all(np.array_equal(a, np.asarray(b)[i:i + 1]) for a, b in zip(
            jax.tree.leaves(row), jax.tree.leaves(before)))
    # c is the mean of all N client controls (|S|/N times the cohort mean).
    _close(server.control, _map(lambda a: np.mean(np.asarray(a), 0), clients),
           f"round {r} c = mean c_i", atol=1e-6)
  assert float(optax.tree.norm(server.control)) > 1e-3


# --- the pieces -------------------------------------------------------------

def _rand_like(params, seed, scale=0.1):
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda a: jnp.asarray(scale * rng.normal(size=a.shape),
                                            jnp.float32), params)


def test_correction_keeps_the_loss_and_adds_c_minus_ci_to_the_gradient(setup):
  fed, model = setup
  params = model.init(jax.random.key(1))
  c, ci = _rand_like(params, 0), _rand_like(params, 1)
  ctx = ClientContext(id=0, round=0, start=params, state=ci, shared=c)
  batch = Batch(jnp.asarray(fed.train.x[0, :10]), jnp.asarray(fed.train.y[0, :10]),
                jnp.ones(10))
  base = objectives.cross_entropy(model)
  obj = scaffold.corrected(base)
  key = jax.random.key(0)
  both = jax.jit(lambda p: (jax.value_and_grad(obj)(p, batch, key, ctx),
                            jax.value_and_grad(base)(p, batch, key, ctx)))
  (v, g), (v0, g0) = both(params)
  np.testing.assert_allclose(v, v0, rtol=1e-6)
  _close(g, _map(lambda a, b, d: np.asarray(a) + np.asarray(b) - np.asarray(d),
                 g0, c, ci), "gradient", rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheduled", [False, True])
def test_step_correction_adds_minus_lr_times_c_minus_ci_to_adams_step(
    setup, scheduled):
  """correction="step": Adam's own step on the plain gradient, then -lr (c -
  c_i), unscaled by Adam (what the gradient correction is not); a run-long
  schedule still reaches the inner optimizer (its progress argument)."""
  _, model = setup
  params = model.init(jax.random.key(1))
  c, ci = _rand_like(params, 0), _rand_like(params, 1)
  grads = _rand_like(params, 2, scale=1e-2)
  ctx = ClientContext(id=0, round=0, start=params, state=ci, shared=c)
  adam = make_optimizer("adam", 1e-3)
  if scheduled:
    adam = optim.cosine_over_run(adam)
  opt = scaffold.corrected_step(adam, 1e-3)
  assert isinstance(opt, scaffold.SeesContext)
  assert isinstance(opt, RunProgress) == scheduled
  extra = dict(progress=0.5) if scheduled else {}
  state = opt.init(params)
  for _ in range(2):  # the second step reads the moments the first kept
    got, state = opt.update(grads, state, params, ctx=ctx, **extra)
  ref_state = adam.init(params)
  for _ in range(2):
    plain, ref_state = adam.update(grads, ref_state, params, **extra)
  _close(got, _map(lambda u, a, b: np.asarray(u) - 1e-3 * (np.asarray(a)
                                                           - np.asarray(b)),
                   plain, c, ci), "step", rtol=1e-5, atol=1e-9)
  if not scheduled:  # the gradient correction is Adam's step of g + c - c_i
    inside, _ = adam.update(optax.tree.add(grads, optax.tree.sub(c, ci)),
                            adam.init(params), params)
    assert float(optax.tree.norm(optax.tree.sub(inside, got))) > 1e-4


def test_option_one_is_the_mean_gradient_over_real_examples(setup):
  fed, model = setup
  params = model.init(jax.random.key(2))
  n = SIZES[1]
  assert n % 5  # chunks of 5 do not divide n; rows past n are padding
  x, y = jnp.asarray(fed.train.x[1]), jnp.asarray(fed.train.y[1])
  got = jax.jit(lambda p: scaffold.full_gradient(
      objectives.cross_entropy(model), p, x, y, n, jax.random.key(0), None,
      5))(params)
  want = _grad(fed, _np(params), np.asarray(x[:n]), np.asarray(y[:n]))
  _close(got, want, "g_i(x)", rtol=1e-4, atol=1e-6)


def test_step_size_is_the_client_learning_rate():
  assert scaffold.step_size(make_optimizer("sgd", 0.03)) == pytest.approx(0.03)
  assert scaffold.step_size(make_optimizer("sgd", 0.03, weight_decay=0.1,
                                           momentum=0.9)) == pytest.approx(0.03)
  assert scaffold.step_size(make_optimizer("adam", 1e-3)) == pytest.approx(1e-3, rel=1e-4)


def test_local_steps_counts_the_steps_a_client_takes():
  """K of option II (`ClientData.steps`): epochs x its own batches, the fixed
  count with `local_steps`, 0 without examples (checked against the engine's
  step mask in `numpy_scaffold`)."""
  got = [int(local_steps(n, 8, 2)) for n in (0, 1, 8, 9, 54)]
  assert got == [0, 2, 2, 4, 14]
  assert [int(local_steps(n, 8, 2, steps=5)) for n in (0, 3, 54)] == [0, 5, 5]


def test_a_client_without_examples_keeps_its_control(setup):
  fed, model = setup
  alg = _build(model)
  params = model.init(jax.random.key(3))
  c, ci = _rand_like(params, 4), _rand_like(params, 5)
  ctx = ClientContext(id=0, round=0, start=params, state=ci, shared=c)
  x, y = jnp.asarray(fed.train.x[0]), jnp.asarray(fed.train.y[0])
  row, delta = alg.client.end.fn(ctx, params, ClientData(x, y, 0, jnp.int32(0)),
                                 jax.random.key(0))
  assert all(float(jnp.max(jnp.abs(d))) == 0 for d in jax.tree.leaves(delta))
  _close(row, _np(ci), "c_i")
  # ... while one with examples and steps does move it (option II: -c + 0).
  row, delta = alg.client.end.fn(ctx, params, ClientData(x, y, 5, jnp.int32(1)),
                                 jax.random.key(0))
  _close(delta, _map(lambda a: -np.asarray(a), c), "c_i+ - c_i")
  _close(row, _map(lambda a, b: np.asarray(a) - np.asarray(b), ci, c),
         "c_i + (c_i+ - c_i)")


@pytest.mark.parametrize("hp,needle", [
    (dict(variant="III"), "scaffold.variant"),
    (dict(server_lr=0.0), "scaffold.server_lr"),
    (dict(weighting="median"), "scaffold.weighting"),
    (dict(grad_chunk=0), "scaffold.grad_chunk"),
    (dict(correction="inside"), "scaffold.correction")])
def test_bad_settings_name_the_field(setup, hp, needle):
  _, model = setup
  with pytest.raises(ConfigError, match=needle):
    scaffold.build(model, optax.sgd(0.1), objectives.cross_entropy(model),
                   num_clients=3, **hp)


# ------------------------------------------------- on FedSDAF's adapter setting

# A one-block tiny ViT: the adapter and head on a frozen backbone at half the
# compile time of two blocks (tests/test_vit.py chains blocks).
VIT = dict(TINY_VIT, depth=1)


def _adapter_loss(vit):
  """The adapter setting's plain cross-entropy (FedAvg (Adapter)'s ViT, the
  frozen backbone merged in), uncorrected."""
  vmodel, _, _ = vit_adapters.adapter_setting(vit, who="test")
  return scaffold.on_frozen(objectives.cross_entropy(vmodel))


def test_adapters_train_only_adi_and_head_on_the_frozen_backbone(fed3):
  """scaffold.adapters=True: the state holds the adapter and the head only
  (controls shaped alike), the backbone is held frozen, and round 0 (c = c_i
  = 0) is FedAvg (Adapter)'s round with the same SGD and weights."""
  from fedjax_dg import algorithms
  vit = models.get_model("vit_tiny", input_shape=fed3.image_shape,
                         num_classes=fed3.num_classes, mean=fed3.mean,
                         std=fed3.std, **VIT)
  n = fed3.num_clients
  sgd = optax.sgd(0.1)
  alg = algorithms.create("scaffold", vit, optimizer=sgd, num_clients=n,
                          hparams=dict(adapters=True, weighting="examples"))
  ref = algorithms.create("fedavg_adapter", vit, optimizer=sgd, num_clients=n,
                          hparams={})
  key = jax.random.key(0)
  state, controls = jax.jit(alg.init)(key)
  frozen = jax.jit(alg.frozen)(key)
  assert set(state.params) == set(state.control) == {"adi", "head"}
  assert set(controls) == {"adi", "head"}
  assert set(frozen) == {"backbone"} and alg.model is not None
  cfg = engine.EngineConfig(rounds=1, epochs=1, batch_size=8, cohort_size=0,
                            client_mapping="map")
  train = jax.tree.map(jnp.asarray, fed3.train)
  (got, _), _ = jax.jit(make_round(alg, cfg, n))(
      (state, controls), jnp.int32(0), train, jax.random.key(1), frozen)
  (want, _), _ = jax.jit(make_round(ref, cfg, n))(
      jax.jit(ref.init)(key), jnp.int32(0), train, jax.random.key(1),
      jax.jit(ref.frozen)(key))
  for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert not np.allclose(got.params["head"]["kernel"],
                         state.params["head"]["kernel"])
  # From round 1 on (c, c_i non-zero) the clients descend the corrected
  # objective: the adapter setting's plain cross-entropy gradient (the frozen
  # backbone's, autodiff) plus c - c_i, on the adapter and head only.
  plain = _adapter_loss(vit)
  c, ci = _rand_like(state.params, 0), _rand_like(state.params, 1)
  ctx = ClientContext(id=0, round=0, start=state.params, state=ci, shared=c,
                      frozen=frozen)
  batch = Batch(jnp.asarray(fed3.train.x[0, :6]),
                jnp.asarray(fed3.train.y[0, :6]), jnp.ones(6))
  grads = jax.jit(lambda p: [jax.grad(f)(p, batch, key, ctx)
                             for f in (alg.client.loss, plain)])
  g, g0 = grads(state.params)
  _close(g, _map(lambda a, b, d: np.asarray(a) + np.asarray(b) - np.asarray(d),
                 g0, c, ci), "corrected adapter gradient", rtol=1e-5,
         atol=1e-6)
  with pytest.raises(ConfigError, match="scaffold.adapters=True runs on a ViT"):
    algorithms.create("scaffold", models.get_model(
        "mlp", input_shape=fed3.image_shape, num_classes=fed3.num_classes),
        optimizer=sgd, num_clients=n, hparams=dict(adapters=True))


def test_adapter_init_reaches_the_adapter_and_is_never_ignored(fed3):
  """scaffold.adapter_init="zero" starts the adapter's up-projections at 0
  (FedSDAF's offline setting, so SCAFFOLD compares with FedAvg (Adapter)
  started alike); the default is PyTorch's init (not 0); set without
  adapters, or to an unknown init, it is a ConfigError naming the key."""
  from fedjax_dg import algorithms
  vit = models.get_model("vit_tiny", input_shape=fed3.image_shape,
                         num_classes=fed3.num_classes, mean=fed3.mean,
                         std=fed3.std, **VIT)
  make = lambda **hp: algorithms.create(
      "scaffold", vit, optimizer=optax.sgd(0.1), num_clients=fed3.num_clients,
      hparams=hp)
  ups = lambda alg: [np.asarray(leaf) for path, leaf in
                     jax.tree_util.tree_leaves_with_path(
                         jax.jit(alg.init)(jax.random.key(0))[0].params["adi"])
                     if "up" in jax.tree_util.keystr(path)]
  zero, torch = ups(make(adapters=True, adapter_init="zero")), ups(
      make(adapters=True))
  assert zero and all(not a.any() for a in zero)
  assert all(a.any() for a in torch if a.ndim == 2)
  with pytest.raises(ConfigError, match="scaffold.adapter_init='zero' is set "
                     "but scaffold.adapters=False"):
    make(adapter_init="zero")
  with pytest.raises(ConfigError, match="scaffold.adapter_init='ones'"):
    make(adapters=True, adapter_init="ones")


# Slow (~5 s: the ViT's round program): SCAFFOLD's rounds (controls, cohort,
# both options) are pinned on the MLP by test_rounds_equal_a_numpy_scaffold,
# the adapter setting (its state, controls, frozen backbone, round 0, the
# corrected gradient) by test_adapters_train_only_adi_and_head_on_the_
# frozen_backbone.
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["II", "I"])
def test_adapter_rounds_equal_a_numpy_scaffold(setup, variant):
  """scaffold.adapters=True over CFG.rounds rounds with a cohort (controls
  non-zero from round 1 on): the engine equals Algorithm 1 run by the numpy
  loop on the adapter and head only, its gradients those of the plain
  cross-entropy of the ViT with the frozen backbone (autodiff, no correction:
  the loop adds c - c_i itself)."""
  fed, _ = setup
  vit = models.get_model("vit_tiny", input_shape=fed.image_shape,
                         num_classes=fed.num_classes, mean=fed.mean,
                         std=fed.std, **VIT)
  alg = scaffold.build(vit, make_optimizer("sgd", LR), None,
                       num_clients=len(SIZES), variant=variant, adapters=True)
  frozen = jax.jit(alg.frozen)(jax.random.fold_in(jax.random.key(CFG.seed),
                                                  2**31 - 1))
  loss = _adapter_loss(vit)
  ctx = ClientContext(id=0, round=0, start=None, frozen=frozen)
  grad_fn = jax.jit(lambda p, x, y, mask: jax.grad(loss)(
      p, Batch(x, y, mask), jax.random.key(0), ctx))
  rows = fed.train.x.shape[1]  # every call padded to one shape: one compile

  def grad(p, x, y):
    pad = rows - len(y)
    return _np(grad_fn(jax.tree.map(jnp.float32, p),
                       jnp.asarray(np.pad(x, [(0, pad)] + [(0, 0)] * 3)),
                       jnp.asarray(np.pad(y, (0, pad))),
                       jnp.asarray(np.arange(rows) < len(y), jnp.float32)))

  _engine_equals_numpy(alg, fed, variant, 1.0, "uniform", frozen=frozen,
                       grad=grad)
