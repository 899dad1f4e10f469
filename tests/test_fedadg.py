"""FedADG: the local epoch in `ClientContext`, the networks, each player's
gradient against separately differentiated losses written out here, the
warm-up epochs, the per-player step sizes, the aggregation of the four
networks (or three, with a discriminator per client), and the algorithm end
to end."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import synthetic_federation
from fedjax_dg import algorithms, engine, models, optim
from fedjax_dg.algorithms import fedadg
from fedjax_dg.algorithms.base import ClientResult
from fedjax_dg.client import objectives
from fedjax_dg.client.update import (Batch, ClientContext, RunProgress,
                                     local_update)
from fedjax_dg.run.config import base_config
from fedjax_dg.engine.round import make_round
from fedjax_dg.errors import ConfigError
from fedjax_dg.models.fedadg import FedADGNets
from fedjax_dg.run import assemble

SIZES = dict(gen_hidden=12, rp_size=10, disc_hidden=9)


@pytest.fixture(scope="module")
def setup(fed3):
  model = models.get_model("mlp", input_shape=fed3.image_shape,
                           num_classes=fed3.num_classes, mean=fed3.mean,
                           std=fed3.std, hidden=16)
  return fed3, model


def _ctx(params, epoch=0):
  return ClientContext(id=jnp.int32(0), round=jnp.int32(0), start=params,
                       epoch=epoch)


def _batch(fed, b=10, padded=3):
  return Batch(jnp.asarray(fed.train.x[0, :b]), jnp.asarray(fed.train.y[0, :b]),
               jnp.asarray(np.r_[np.ones(b - padded), np.zeros(padded)],
                           jnp.float32))


# --------------------------------------------------------------------------
# ClientContext.epoch, filled by local_update.


def test_local_update_gives_the_loss_the_epoch_of_each_step():
  """Loss <w, 1> (epoch + 1) with SGD lr 1: every step moves w by -(epoch + 1).
  n = 5 real rows of 8, batch 2: 3 steps per epoch (the padded steps are
  masked)."""
  loss = lambda p, batch, rng, ctx: (jnp.sum(p["w"]) * (ctx.epoch + 1)
                                     + 0.0 * jnp.sum(batch.mask))
  x, y = jnp.zeros((8, 2, 2, 1), jnp.uint8), jnp.zeros((8,), jnp.int32)
  ctx = ClientContext(id=jnp.int32(0), round=jnp.int32(0), start=None)
  # Jitted (eagerly: ~90 small programs).
  run = lambda **kw: jax.jit(lambda: local_update(
      loss, optax.sgd(1.0), {"w": jnp.zeros(())}, x, y, jnp.int32(5),
      jax.random.key(0), ctx, batch_size=2, **kw)[0]["w"])()
  assert float(run(epochs=3)) == -3 * (1 + 2 + 3)
  # Fixed steps: 7 steps = passes 0, 0, 0, 1, 1, 1, 2.
  assert float(run(epochs=1, steps=7)) == -(3 * 1 + 3 * 2 + 1 * 3)
  # A loss without a ClientContext still runs (ctx=None is passed through).
  plain = lambda p, batch, rng, ctx: jnp.sum(p["w"]) + 0.0 * jnp.sum(batch.mask)
  w, _ = jax.jit(lambda: local_update(
      plain, optax.sgd(1.0), {"w": jnp.zeros(())}, x, y, jnp.int32(5),
      jax.random.key(0), None, batch_size=2, epochs=2))()
  assert float(w["w"]) == -6


# --------------------------------------------------------------------------
# The networks.


def test_networks_shapes_initialization_and_outputs(setup):
  fed, model = setup
  nets = FedADGNets(model, **SIZES)
  f, c = 16, fed.num_classes
  assert nets.feature_width == f and nets.noise_dim == f  # 0 -> F
  params = nets.init(jax.random.key(0))
  shapes = jax.tree.map(lambda a: a.shape, {k: params[k] for k in ("gen",
                                                                   "disc")})
  assert shapes == {
      "gen": {"fc1": {"kernel": (f + c, 12), "bias": (12,)},
              "fc2": {"kernel": (12, f), "bias": (f,)}},
      "disc": {"proj": {"kernel": (f + c, 10)},
               "fc1": {"kernel": (10, 9), "bias": (9,)},
               "fc2": {"kernel": (9, 1), "bias": (1,)}}}
  np.testing.assert_allclose(np.linalg.norm(params["disc"]["proj"]["kernel"]),
                             1.0, rtol=1e-5)
  # xavier_uniform(gain 0.5) on the generator's kernels.
  k = np.asarray(params["gen"]["fc1"]["kernel"])
  bound = 0.5 * np.sqrt(6.0 / sum(k.shape))
  assert np.abs(k).max() <= bound and np.abs(k).max() > 0.8 * bound

  y = jnp.arange(6) % c
  other = (y + 1) % c  # both networks must read the label
  linear_nets = FedADGNets(model, gen_relu=False, **SIZES)

  @jax.jit
  def outputs(p):
    u = nets.noise(jax.random.key(1), 6)
    r = nets.generate(p["gen"], u, y)
    return dict(u=u, r=r, linear=linear_nets.generate(p["gen"], u, y),
                r_other=nets.generate(p["gen"], u, other),
                d=nets.discriminate(p["disc"], r, y),
                d_other=nets.discriminate(p["disc"], r, other))

  o = jax.tree.map(np.asarray, outputs(params))
  assert o["u"].shape == (6, f) and o["u"].min() >= 0 and o["u"].max() < 1
  assert o["r"].shape == (6, f) and o["r"].min() >= 0
  np.testing.assert_allclose(o["r"], np.maximum(o["linear"], 0.0), rtol=1e-6)
  assert o["linear"].min() < 0
  assert o["d"].shape == (6,) and np.all((o["d"] > 0) & (o["d"] < 1))
  assert not np.allclose(o["r_other"], o["r"])
  assert not np.allclose(o["d_other"], o["d"])
  small = FedADGNets(model, noise_dim=5, **SIZES)
  assert jax.eval_shape(small.init, jax.random.key(0))["gen"]["fc1"][
      "kernel"].shape == (5 + c, 12)


# --------------------------------------------------------------------------
# The players' gradients.


def _separate_losses(model, params, batch, rng, alpha, label_scale=0.6):
  """The three players' losses on the real rows, each a function of its own
  player's parameters only, the networks written out independently."""
  real = int(batch.mask.sum())
  x, y = batch.x[:real], batch.y[:real]
  _, k_noise = jax.random.split(rng)
  onehot = label_scale * jax.nn.one_hot(y, model.num_classes)
  leaky = lambda h: jnp.where(h > 0, h, 0.01 * h)
  u = jax.random.uniform(k_noise, (batch.y.shape[0], 16))[:real]

  def gen(g):
    h = leaky(jnp.concatenate([u, onehot], 1) @ g["fc1"]["kernel"]
              + g["fc1"]["bias"])
    return jnp.maximum(h @ g["fc2"]["kernel"] + g["fc2"]["bias"], 0.0)

  def disc(d, v):
    h = jnp.concatenate([v, onehot], 1) @ d["proj"]["kernel"]
    h = leaky(h @ d["fc1"]["kernel"] + d["fc1"]["bias"])
    return jax.nn.sigmoid(h @ d["fc2"]["kernel"] + d["fc2"]["bias"])[:, 0]

  def task(theta):
    ce = optax.softmax_cross_entropy_with_integer_labels(
        model.apply(theta, x), y).mean()
    fool = jnp.mean((1 - disc(params["disc"], model.features(theta, x))) ** 2)
    return alpha * ce + (1 - alpha) * fool

  def discriminator(d):
    feats = model.features(params["model"], x)
    return jnp.mean((1 - disc(d, gen(params["gen"]))) ** 2
                    + disc(d, feats) ** 2)

  def generator(g):
    return jnp.mean(disc(params["disc"], gen(g)) ** 2)

  return task, discriminator, generator


def test_each_player_gets_the_gradient_of_its_own_loss(setup):
  fed, model = setup
  alpha = 0.6
  alg = fedadg.build(model, optax.sgd(0.1), alpha=alpha, **SIZES)
  params, _ = alg.init(jax.random.key(0))
  params = params.params
  # A discriminator that is not near 1/2 everywhere (its init nearly is).
  params["disc"]["fc2"]["bias"] = params["disc"]["fc2"]["bias"] + 0.8
  batch, rng = _batch(fed), jax.random.key(3)
  task, discriminator, generator = _separate_losses(model, params, batch, rng,
                                                    alpha)
  value, grads = jax.jit(jax.value_and_grad(alg.client.loss))(params, batch, rng,
                                                       _ctx(params))
  np.testing.assert_allclose(value, jax.jit(task)(params["model"]), rtol=1e-5)
  separate = jax.jit(lambda p: dict(model=jax.grad(task)(p["model"]),
                                    disc=jax.grad(discriminator)(p["disc"]),
                                    gen=jax.grad(generator)(p["gen"])))(params)
  for key in ("model", "disc", "gen"):
    for g, w in zip(jax.tree.leaves(grads[key]),
                    jax.tree.leaves(separate[key])):
      assert np.abs(w).max() > 1e-6  # every block really gets a gradient
      np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-7)
  # A generator that is not trained gets none; the others are unchanged.
  frozen = fedadg.build(model, optax.sgd(0.1), alpha=alpha,
                        train_generator=False, **SIZES)
  grads2 = jax.jit(jax.grad(frozen.client.loss))(params, batch, rng, _ctx(params))
  assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(
      grads2["gen"]))
  for a, b in zip(jax.tree.leaves({k: grads[k] for k in ("model", "disc")}),
                  jax.tree.leaves({k: grads2[k] for k in ("model", "disc")})):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)


def test_warm_up_epochs_train_the_classifier_alone(setup):
  fed, model = setup
  warm = fedadg.build(model, optax.sgd(0.1), ce_epochs=2, **SIZES)
  plain = fedadg.build(model, optax.sgd(0.1), **SIZES)
  params = warm.init(jax.random.key(0))[0].params
  batch, rng = _batch(fed), jax.random.key(4)
  ce = objectives.cross_entropy(model)
  grad = jax.jit(jax.value_and_grad(warm.client.loss))
  value, g = grad(params, batch, rng, _ctx(params, jnp.int32(1)))
  want_value, want = jax.jit(jax.value_and_grad(ce))(params["model"], batch,
                                                     rng)
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g["model"]), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
  assert all(float(jnp.abs(a).max()) == 0
             for a in jax.tree.leaves({"g": g["gen"], "d": g["disc"]}))
  # From epoch ce_epochs on: the adversarial objective.
  value, g = grad(params, batch, rng, _ctx(params, jnp.int32(2)))
  value2, g2 = jax.jit(jax.value_and_grad(plain.client.loss))(params, batch, rng,
                                                       _ctx(params))
  np.testing.assert_allclose(value, value2, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


def test_adversaries_step_at_adv_lr_scale_times_the_rate(setup):
  _, model = setup
  params = FedADGNets(model, **SIZES).init(jax.random.key(0))
  grads = jax.tree.map(jnp.ones_like, params)
  for train_generator, gen_scale in ((True, 0.3), (False, 0.0)):
    alg = fedadg.build(model, optax.sgd(0.1), adv_lr_scale=0.3,
                       train_generator=train_generator, **SIZES)
    updates, _ = alg.client.optimizer.update(grads, alg.client.optimizer.init(params), params)
    for key, scale in (("model", 1.0), ("disc", 0.3), ("gen", gen_scale)):
      for u in jax.tree.leaves(updates[key]):
        np.testing.assert_allclose(u, -0.1 * scale, rtol=1e-6)
  # The optimizer's kind is kept: a schedule over the run stays one.
  scheduled = fedadg.scale_players(optim.cosine_over_run(optax.sgd(0.1)),
                                   {"disc": 0.5})
  assert isinstance(scheduled, RunProgress)
  updates, _ = scheduled.update(grads, scheduled.init(params), params,
                                progress=0.5)
  np.testing.assert_allclose(jax.tree.leaves(updates["disc"])[0], -0.025,
                             rtol=1e-6)


def test_alpha_one_trains_the_model_like_fedavg(setup):
  """alpha = 1: the model player's gradient is the cross-entropy's, so its
  local training equals FedAvg's with the same optimizer and data order."""
  fed, model = setup
  opt = optax.sgd(0.05, momentum=0.9)
  alg = fedadg.build(model, opt, alpha=1.0, **SIZES)
  params = alg.init(jax.random.key(0))[0].params
  x, y, n = (jnp.asarray(a) for a in (fed.train.x[1], fed.train.y[1],
                                      fed.train.n[1]))
  train = lambda loss, p: local_update(loss, opt, p, x, y, n,
                                       jax.random.key(5), _ctx(p),
                                       batch_size=8, epochs=1)[0]
  got = jax.jit(lambda p: train(alg.client.loss, p))(params)
  want = jax.jit(lambda p: train(objectives.cross_entropy(model), p))(
      params["model"])
  for a, b in zip(jax.tree.leaves(got["model"]), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # ... while the discriminator and the generator still train.
  assert not np.allclose(got["disc"]["fc2"]["kernel"],
                         params["disc"]["fc2"]["kernel"])
  assert not np.allclose(got["gen"]["fc2"]["kernel"],
                         params["gen"]["fc2"]["kernel"])


# --------------------------------------------------------------------------
# The server.


def _result(params, m=3, seed=0):
  rng = np.random.default_rng(seed)
  trained = jax.tree.map(lambda a: jnp.asarray(
      rng.normal(size=(m,) + a.shape), jnp.float32), params)
  n = jnp.asarray([5, 20, 10])
  return ClientResult(ids=jnp.asarray([2, 0, 3]), round=jnp.int32(0),
                      start=trained, params=trained, num_examples=n,
                      loss=jnp.zeros(m)), np.asarray(n, np.float64)


def test_server_averages_all_four_networks(setup):
  _, model = setup
  alg = fedadg.build(model, optax.sgd(0.1), **SIZES)
  server, clients = alg.init(jax.random.key(0))
  assert clients is None and set(server.params) == {"model", "gen", "disc"}
  result, n = _result(server.params)
  new, _ = alg.server.update(server, result, jax.random.key(1))
  for got, stacked in zip(jax.tree.leaves(new.params),
                          jax.tree.leaves(result.params)):
    want = np.tensordot(n / n.sum(), np.asarray(stacked, np.float64), axes=1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  for a, b in zip(jax.tree.leaves(alg.server.eval_params(new, None)),
                  jax.tree.leaves(new.params["model"])):
    np.testing.assert_array_equal(a, b)


def test_a_local_discriminator_stays_with_its_client(setup):
  _, model = setup
  alg = fedadg.build(model, optax.sgd(0.1), local_discriminator=True,
                     num_clients=4, **SIZES)
  server, rows = jax.jit(alg.init)(jax.random.key(0))
  assert set(server.params) == {"model", "gen"}
  kernels = np.asarray(rows["fc2"]["kernel"])
  assert kernels.shape == (4, 9, 1) and not np.allclose(kernels[0], kernels[1])
  ids = jnp.asarray([2, 0, 3])
  cohort = jax.tree.map(lambda a: a[ids], rows)
  start = alg.client.start(server, cohort, ids)
  np.testing.assert_array_equal(start["disc"]["fc2"]["kernel"],
                                kernels[[2, 0, 3]])
  np.testing.assert_array_equal(start["gen"]["fc2"]["bias"][1],
                                server.params["gen"]["fc2"]["bias"])
  result, n = _result(start)
  row, message = alg.client.end.fn(
      ClientContext(id=jnp.int32(2), round=jnp.int32(0), start=None,
                    state=jax.tree.map(lambda a: a[0], cohort)),
      jax.tree.map(lambda a: a[0], result.params), None, None)
  assert message is None
  np.testing.assert_array_equal(row["fc1"]["bias"],
                                result.params["disc"]["fc1"]["bias"][0])
  new, _ = alg.server.update(server, result, jax.random.key(1))
  assert set(new.params) == {"model", "gen"}
  # One engine round keeps the carry (the rows of the cohort rewritten).
  round_fn = make_round(alg, engine.EngineConfig(
      rounds=1, epochs=1, batch_size=4, cohort_size=3), 4)
  fed = synthetic_federation(num_clients=4)
  carry = (server, rows)
  after, _ = jax.eval_shape(round_fn, carry, jnp.int32(0),
                            jax.tree.map(jnp.asarray, fed.train),
                            jax.random.key(1), None)
  chex.assert_trees_all_equal_shapes_and_dtypes(after, carry)
  want = np.tensordot(n / n.sum(), np.asarray(result.params["gen"]["fc1"][
      "kernel"], np.float64), axes=1)
  np.testing.assert_allclose(new.params["gen"]["fc1"]["kernel"], want,
                             rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------
# End to end, settings.


@pytest.mark.slow  # ~5 s of compiling; tests/test_pinned.py runs FedADG
def test_fedadg_learns(setup):  # end to end by default
  fed, model = setup
  cfg = base_config()
  cfg.fedadg.client.lr = 1e-2
  for key, value in SIZES.items():
    cfg.fedadg[key] = value
  alg = assemble.algorithm("fedadg", model, fed.num_clients, cfg, data=fed)
  res = engine.run(alg, fed, model, engine.EngineConfig(
      rounds=3, eval_every=3, epochs=1, batch_size=16, progress=False))
  assert res.final["id_acc"] > 1.0 / fed.num_classes + 0.3, res.final
  first = alg.init(jax.random.key(0))[0].params
  for k in ("gen", "disc"):  # trained and averaged like the model
    assert not np.allclose(res.server.params[k]["fc1"]["kernel"],
                           first[k]["fc1"]["kernel"])


@pytest.mark.parametrize("hp,needle", [
    (dict(alpha=1.5), "fedadg.alpha=1.5"),
    (dict(ce_epochs=-1), "fedadg.ce_epochs"),
    (dict(adv_lr_scale=0.0), "fedadg.adv_lr_scale"),
    (dict(gen_hidden=0), "fedadg.gen_hidden"),
    (dict(noise_dim=-2), "fedadg.noise_dim"),
    (dict(label_scale=0.0), "fedadg.label_scale"),
    (dict(local_discriminator=True), "fedadg.local_discriminator")])
def test_bad_settings_name_the_field(setup, hp, needle):
  _, model = setup
  with pytest.raises(ConfigError, match=needle):
    fedadg.build(model, optax.sgd(0.1), **hp)
