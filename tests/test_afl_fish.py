"""AFL and Fish against independent computations: the released code's
simplex projection and lambda step transcribed in numpy, the clients'
objectives against loops over the domains, Fish's meta step against a
numpy Adam over the batch's domains and, at meta_lr 1 on one domain, FedAvg,
and a run whose lambda is recomputed from the model's per-domain losses."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import synthetic_federation
from fedjax_dg import engine, models
from fedjax_dg.algorithms import afl, fish
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client import objectives
from fedjax_dg.client.update import Batch, ClientContext
from fedjax_dg.errors import ConfigError
from fedjax_dg.optim import make_optimizer

N, B = 3, 8
CFG = engine.EngineConfig(checkpoint_every=0.0, rounds=2, eval_every=1,
                          epochs=1, batch_size=B, client_mapping="map",
                          progress=False, eval_batch_size=16)
# A tiny batch: 7 examples of domains 2, 0, 5 and a padded row (mask 0) of
# domain 1, which is absent from the batch.
D = np.array([2, 0, 2, 2, 5, 0, 1], np.int32)
MASK = np.array([1, 1, 1, 1, 1, 1, 0], np.float32)
Y = np.array([0, 2, 1, 1, 0, 2, 1], np.int32)


class Linear:
  """A stand-in model: logits = flattened x @ params["w"]."""

  def apply(self, params, x, *, train=False, rng=None):
    del train, rng
    return x.reshape(x.shape[0], -1).astype(jnp.float32) @ params["w"]


def np_softmax(z):
  z = z - z.max(axis=1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(axis=1, keepdims=True)


def np_ce(logits, y):
  return -np.log(np_softmax(logits)[np.arange(len(y)), y])


def np_proj_simplex(v):
  """The released code's `euclidean_proj_simplex` (s = 1), in numpy."""
  if np.isclose(v.sum(), 1.0) and (v >= 0).all():
    return v
  u = np.sort(v)[::-1]
  cssv = np.cumsum(u)
  rho = np.nonzero(u * np.arange(1, len(v) + 1) > (cssv - 1.0))[0][-1]
  theta = (cssv[rho] - 1.0) / (rho + 1.0)
  return np.clip(v - theta, 0.0, None)


def batch_of(x):
  return Batch(jnp.asarray(x), jnp.asarray(Y), jnp.asarray(MASK),
               jnp.asarray(D))


@pytest.mark.parametrize("seed", range(4))
def test_the_projection_is_the_released_codes_on_the_support(seed):
  rng = np.random.default_rng(seed)
  v = rng.normal(size=9) * (0.3 + seed)
  support = (rng.uniform(size=9) < 0.6).astype(np.float32)
  support[seed] = 1.0
  got = np.asarray(afl.simplex_projection(jnp.asarray(v, jnp.float32),
                                          jnp.asarray(support)))
  want = np.zeros(9)
  want[support > 0] = np_proj_simplex(v[support > 0])
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.isclose(got.sum(), 1.0, atol=1e-5)
  empty = afl.simplex_projection(jnp.asarray(v, jnp.float32), jnp.zeros(9))
  assert not np.asarray(empty).any()


def test_the_lambda_step_adds_new_domains_uniformly_then_ascends():
  """The released `update_lambda`: lambda + lr * (summed losses / counts),
  0 where the cohort has no example, projected; domains the cohort brings
  for the first time enter at 1 / |seen|."""
  loss = np.array([0.0, 6.0, 0.0, 2.0, 1.5, 0.0])
  count = np.array([0.0, 4.0, 0.0, 2.0, 3.0, 0.0])
  stats = afl.DomainLosses(jnp.asarray(loss, jnp.float32),
                           jnp.asarray(count, jnp.float32))
  lam, seen = np.zeros(6), np.zeros(6)
  lr = 0.3
  got_lam, got_seen, got_mean = afl.ascent_step(
      jnp.asarray(lam, jnp.float32), jnp.asarray(seen, jnp.float32), stats,
      lr)
  mean = np.where(count > 0, loss / np.maximum(count, 1), 0.0)
  np.testing.assert_allclose(np.asarray(got_mean), mean, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(got_seen), count > 0)
  on = count > 0
  want = np.zeros(6)
  want[on] = np_proj_simplex(1.0 / 3 + lr * mean[on])
  np.testing.assert_allclose(np.asarray(got_lam), want, rtol=1e-5, atol=1e-6)
  # A second cohort with domain 5 too: it joins at 1/4, the others keep
  # theirs.
  count2 = np.array([0.0, 1.0, 0.0, 0.0, 0.0, 2.0])
  loss2 = np.array([0.0, 0.5, 0.0, 0.0, 0.0, 3.0])
  lam2, seen2, _ = afl.ascent_step(
      got_lam, got_seen, afl.DomainLosses(jnp.asarray(loss2, jnp.float32),
                                          jnp.asarray(count2, jnp.float32)),
      lr)
  on2 = on | (count2 > 0)
  start = np.where(on, want, np.where(on2, 0.25, 0.0))
  mean2 = np.where(count2 > 0, loss2 / np.maximum(count2, 1), 0.0)
  want2 = np.zeros(6)
  want2[on2] = np_proj_simplex((start + lr * mean2)[on2])
  np.testing.assert_allclose(np.asarray(lam2), want2, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(seen2), on2)


def test_the_afl_objective_weighs_the_domains_and_sums_the_received_loss():
  """Value and gradient against a loop over the domains present
  (sum_g lambda_g * mean CE_g, the released `AFLClient.step`); one step of
  its optimizer leaves the model's update to the client optimizer and sets
  the statistics to the received model's per-domain summed loss and
  count."""
  rng = np.random.default_rng(1)
  num_domains = 6
  alg = afl.build(Linear(), optax.sgd(0.1), num_domains=num_domains)
  x = rng.normal(size=(7, 2, 2, 1)).astype(np.float32)
  w = rng.normal(size=(4, 3)).astype(np.float32)
  w0 = rng.normal(size=(4, 3)).astype(np.float32)
  lam = np.array([0.1, 0.0, 0.5, 0.0, 0.0, 0.4], np.float32)
  zeros = jnp.zeros(num_domains)
  stats = afl.DomainLosses(zeros + 1.0, zeros + 2.0)  # earlier steps' sums
  params = {"model": {"w": jnp.asarray(w)}, "stats": stats}
  start = {"model": {"w": jnp.asarray(w0)},
           "stats": afl.DomainLosses(zeros, zeros)}
  ctx = ClientContext(id=0, round=0, start=start, shared=jnp.asarray(lam))
  value, grads = jax.value_and_grad(alg.client.loss)(params, batch_of(x),
                                                     None, ctx)
  flat = x.reshape(7, -1).astype(np.float64)

  def by_loop(wm):
    logits = jnp.asarray(flat, jnp.float32) @ wm
    logp = jax.nn.log_softmax(logits)
    total = 0.0
    for g in np.unique(D[MASK > 0]):
      idx = np.where((D == g) & (MASK > 0))[0]
      total = total + lam[g] * -jnp.mean(logp[idx, Y[idx]])
    return total

  want, want_grad = jax.value_and_grad(by_loop)(jnp.asarray(w))
  np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grads["model"]["w"]),
                             np.asarray(want_grad), rtol=1e-5, atol=1e-7)
  opt = alg.client.optimizer
  updates, _ = opt.update(grads, opt.init(params), params)
  new = optax.apply_updates(params, updates)
  ce0 = np_ce(flat @ w0.astype(np.float64), Y)
  want_loss = np.ones(num_domains)
  want_count = np.full(num_domains, 2.0)
  for g in range(num_domains):
    idx = (D == g) & (MASK > 0)
    want_loss[g] += ce0[idx].sum()
    want_count[g] += idx.sum()
  np.testing.assert_allclose(np.asarray(new["stats"].loss), want_loss,
                             rtol=1e-5)
  np.testing.assert_allclose(np.asarray(new["stats"].count), want_count)
  np.testing.assert_allclose(np.asarray(new["model"]["w"]),
                             w - 0.1 * np.asarray(want_grad), rtol=1e-5,
                             atol=1e-6)


def test_unmet_domains_weigh_one_over_the_met():
  lam = jnp.asarray([0.0, 0.7, 0.3, 0.0])
  seen = jnp.asarray([0.0, 1.0, 1.0, 0.0])
  np.testing.assert_allclose(np.asarray(afl.client_weights(lam, seen)),
                             [0.5, 0.7, 0.3, 0.5])
  np.testing.assert_allclose(
      np.asarray(afl.client_weights(jnp.zeros(4), jnp.zeros(4))), 1.0)


@pytest.fixture(scope="module")
def fed():
  # Each client holds two of the three source domains.
  return synthetic_federation(num_clients=N, d=2, num_domains=4,
                              per_domain=20)


@pytest.mark.parametrize("placement", ["device", "host"])
def test_a_run_moves_lambda_by_the_models_per_domain_losses(fed, placement):
  """A model that stays (learning rate 0): every round measures the same
  per-domain mean loss M over every client's examples (one epoch reads each
  once), and lambda follows proj(uniform over the source domains + lr M),
  then proj(lambda + lr M)."""
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean,
                           std=fed.std, hidden=4)
  lr = 0.5
  alg = afl.build(model, optax.sgd(0.0), lambda_lr=lr,
                  num_domains=6).replace(domains=True)
  result = engine.run(alg, fed, model,
                      dataclasses.replace(CFG, placement=placement))
  params = result.server.params
  t = fed.packed_train
  logits = np.asarray(model.apply(params, jnp.asarray(t.x)), np.float64)
  ce = np_ce(logits, t.y)
  mean = np.zeros(6)
  for g in np.unique(fed.train_domains):
    mean[g] = ce[fed.train_domains == g].mean()
  on = np.zeros(6, bool)
  on[np.unique(fed.train_domains)] = True
  assert on.sum() == 3
  got_mean = np.asarray(result.round_metrics["afl_domain_loss"])
  got_lam = np.asarray(result.round_metrics["afl_lambda"])
  lam = np.zeros(6)
  lam[on] = 1.0 / 3
  for r in range(CFG.rounds):
    np.testing.assert_allclose(got_mean[r], mean, rtol=1e-4)
    nxt = np.zeros(6)
    nxt[on] = np_proj_simplex((lam + lr * mean)[on])
    lam = nxt
    np.testing.assert_allclose(got_lam[r], lam, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(np.asarray(result.server.lam), lam, rtol=1e-4,
                             atol=1e-6)


def test_present_domains_are_sorted_and_capped():
  d, mask = jnp.asarray(D), jnp.asarray(MASK)
  assert np.asarray(fish.present_domains(d, mask, 4)).tolist() == [0, 2, 5,
                                                                    -1]
  assert np.asarray(fish.present_domains(d, mask, 2)).tolist() == [0, 2]


def np_adam_steps(w, x, groups, lr, b1=0.9, b2=0.999, eps=1e-8):
  """Fresh Adam, one step per group on the group's mean cross-entropy of
  the linear model (its gradient in closed form), in numpy."""
  m, v = np.zeros_like(w), np.zeros_like(w)
  losses = []
  for t, idx in enumerate(groups, 1):
    xs, ys = x[idx], Y[idx]
    p = np_softmax(xs @ w)
    losses.append(np_ce(xs @ w, ys).mean())
    onehot = np.eye(w.shape[1])[ys]
    g = xs.T @ (p - onehot) / len(idx)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    w = w - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
  return w, np.mean(losses)


def test_a_fish_step_is_the_meta_update_of_sequential_domain_steps():
  """One step of fish's objective and optimizer: theta + meta_lr (theta~ -
  theta), theta~ after one fresh-Adam step per domain present, in
  increasing domain index (the released `Fish.step`'s loop), in numpy."""
  rng = np.random.default_rng(2)
  meta_lr, lr = 0.3, 0.05
  alg = fish.build(Linear(), optax.adam(lr), meta_lr=meta_lr, max_groups=4)
  x = rng.normal(size=(7, 2, 2, 1)).astype(np.float32)
  w = rng.normal(size=(4, 3)).astype(np.float32)
  params = {"w": jnp.asarray(w)}
  value, grads = jax.value_and_grad(alg.client.loss)(
      params, batch_of(x), jax.random.key(0))
  opt = alg.client.optimizer
  updates, _ = opt.update(grads, opt.init(params), params)
  new = optax.apply_updates(params, updates)
  flat = x.reshape(7, -1).astype(np.float64)
  groups = [np.where((D == g) & (MASK > 0))[0]
            for g in np.unique(D[MASK > 0])]
  inner, mean_loss = np_adam_steps(w.astype(np.float64), flat, groups, lr)
  want = w + meta_lr * (inner - w)
  np.testing.assert_allclose(np.asarray(new["w"]), want, rtol=1e-4,
                             atol=1e-6)
  np.testing.assert_allclose(float(value), mean_loss, rtol=1e-5)


def test_out_of_range_settings_are_refused_with_the_field(fed):
  model, opt = Linear(), make_optimizer("sgd", 0.1)
  with pytest.raises(ConfigError, match="afl.lambda_lr=-1"):
    afl.build(model, opt, lambda_lr=-1.0)
  with pytest.raises(ConfigError, match="afl.num_domains=2"):
    afl.build(model, opt, data=fed, num_domains=2)
  with pytest.raises(ConfigError, match="fish.meta_lr=-1"):
    fish.build(model, opt, meta_lr=-1.0)
  with pytest.raises(ConfigError, match="fish.max_groups=1: a client holds 2"):
    fish.build(model, opt, data=fed, max_groups=1)
  with pytest.raises(ConfigError, match="fish.max_groups=0"):
    fish.build(model, opt, max_groups=0)


def test_fish_of_one_domain_per_batch_and_meta_lr_1_is_fedavg():
  """With SGD (stateless) and clients of one domain, a Fish step at
  meta_lr 1 is one SGD step on the batch's mean loss: FedAvg's run; at
  meta_lr 0 the model stays as initialized."""
  one = synthetic_federation(num_clients=N, d=1, num_domains=4,
                             per_domain=20)
  model = models.get_model("mlp", input_shape=one.image_shape,
                           num_classes=one.num_classes, mean=one.mean,
                           std=one.std, hidden=4)
  sgd = optax.sgd(0.1)
  fish_run = engine.run(
      fish.build(model, sgd, meta_lr=1.0).replace(domains=True), one, model,
      CFG)
  plain = engine.run(fedavg(model, sgd, objectives.cross_entropy(model)),
                     one, model, CFG)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-6),
               fish_run.server.params, plain.server.params)
  still = engine.run(
      fish.build(model, sgd, meta_lr=0.0).replace(domains=True), one, model,
      CFG)
  init = engine.run(fedavg(model, optax.sgd(0.0),
                           objectives.cross_entropy(model)), one, model, CFG)
  jax.tree.map(np.testing.assert_array_equal, still.server.params,
               init.server.params)
