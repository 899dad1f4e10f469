"""The centralized DG objectives adapted to clients, and the domain labels
they read: each example's domain reaches its batch (`Batch.d`) on both
placements, only for an algorithm that asks for it, and each objective
matches an independent computation (a numpy loop over the domains, or
autodiff of a separately written loss) on a tiny input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import synthetic_federation
from fedjax_dg import algorithms, engine, models
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client import objectives
from fedjax_dg.client.update import Batch, ClientContext
from fedjax_dg.errors import ConfigError
from fedjax_dg.optim import make_optimizer

N, B = 3, 8
CFG = engine.EngineConfig(checkpoint_every=0.0, rounds=2, eval_every=1,
                          epochs=1, batch_size=B, client_mapping="map",
                          progress=False, eval_batch_size=16)


@pytest.fixture(scope="module")
def fed():
  # Each client holds two of the three source domains.
  return synthetic_federation(num_clients=N, d=2, num_domains=4,
                              per_domain=20)


def domain_statistic(params, batch: Batch, rng, ctx=None):
  """sum_b mask_b * (d_b + 1) * mean(x_b): the batch's domains tied to its
  images (a d that is not its example's changes the sum); params enter
  with weight 0 (a gradient of zeros, the model stays)."""
  del rng, ctx
  pixels = jnp.mean(batch.x.astype(jnp.float32), axis=(1, 2, 3))
  stat = jnp.sum(batch.mask * (batch.d + 1).astype(jnp.float32) * pixels)
  return stat + 0.0 * sum(jnp.sum(p) for p in jax.tree.leaves(params))


def expected_client_losses(fed) -> np.ndarray:
  """[N] each client's mean loss over one epoch of `domain_statistic`: the
  sum over its examples (each read once) over its ceil(n / B) steps."""
  t = fed.packed_train
  out = []
  for c in range(fed.num_clients):
    rows = slice(t.offsets[c], t.offsets[c + 1])
    pixels = t.x[rows].astype(np.float64).mean(axis=(1, 2, 3))
    total = np.sum((fed.train_domains[rows] + 1) * pixels)
    out.append(total / -(-int(t.n[c]) // B))
  return np.asarray(out)


def reading_domains(model):
  alg = fedavg(model, make_optimizer("sgd", 0.1), domain_statistic,
               metrics=lambda opt, result: {"client_loss": result.loss})
  return alg.replace(domains=True)


def mlp(fed):
  return models.get_model("mlp", input_shape=fed.image_shape,
                          num_classes=fed.num_classes, mean=fed.mean,
                          std=fed.std, hidden=4)


def test_the_federation_knows_each_training_examples_domain(fed):
  names = fed.domain_names
  t = fed.packed_train
  for c in range(fed.num_clients):
    held = {names[k] for k in fed.train_domains[t.offsets[c]:t.offsets[c + 1]]}
    assert held == set(fed.client_domains[c])
  assert len(fed.client_domains[0]) == 2  # the statistic sees two domains
  assert fed.train.d is None and fed.packed_train.d is None
  padded = fed.with_domains().train
  keep = np.arange(padded.x.shape[1])[None, :] < padded.n[:, None]
  np.testing.assert_array_equal(padded.d[keep], fed.train_domains)
  np.testing.assert_array_equal(padded.d[~keep], 0)
  pooled = fed.with_domains().pooled().train
  np.testing.assert_array_equal(pooled.d[0, :pooled.n[0]], fed.train_domains)


@pytest.mark.parametrize("placement,mapping", [("device", "map"),
                                               ("device", "vmap"),
                                               ("host", "map")])
def test_a_clients_batches_see_the_domains_of_their_examples(fed, placement,
                                                             mapping):
  model = mlp(fed)
  cfg = dataclasses.replace(CFG, placement=placement, client_mapping=mapping)
  result = engine.run(reading_domains(model), fed, model, cfg)
  got = np.asarray(result.round_metrics["client_loss"])
  want = expected_client_losses(fed)
  for r in range(cfg.rounds):
    np.testing.assert_allclose(got[r], want, rtol=1e-5)


def test_the_host_gathers_the_domains_of_the_rows_its_steps_read(fed):
  """Fixed local steps on the host gather only the rows the steps read
  (host_gather='rows'): the same statistic as the device's whole clients."""
  model = mlp(fed)
  cfg = dataclasses.replace(CFG, local_steps=2)
  alg = reading_domains(model)
  device = engine.run(alg, fed, model, dataclasses.replace(
      cfg, placement="device"))
  host = engine.run(alg, fed, model, dataclasses.replace(
      cfg, placement="host", host_gather="rows"))
  np.testing.assert_array_equal(np.asarray(host.round_metrics["client_loss"]),
                                np.asarray(device.round_metrics["client_loss"]))


def test_only_an_algorithm_that_asks_gets_the_domains(fed):
  client = dict(optimizer="sgd", lr=0.1, weight_decay=0.0, momentum=0.0,
                schedule="constant")
  model = mlp(fed)
  asking = {n for n in algorithms.available()
            if algorithms.spec(n).needs_domains}
  assert asking == {"irm", "vrex", "mmd", "coral", "groupdro", "afl", "fish"}
  for name in ("fedavg", "fedprox", "fedsr", *sorted(asking)):
    alg = algorithms.build(name, model, hyperparameters={}, client=client,
                           num_clients=N, data=fed)
    assert alg.client.domains == (name in asking), name
  hand_built = dataclasses.replace(fed, train_domains=None)
  with pytest.raises(ConfigError, match="train_domains"):
    hand_built.with_domains()


# A tiny batch: 7 examples of domains 2, 0, 5 and a padded row (mask 0) of
# domain 1, which is absent from the batch.
D = np.array([2, 0, 2, 2, 5, 0, 1], np.int32)
MASK = np.array([1, 1, 1, 1, 1, 1, 0], np.float32)
Y = np.array([0, 2, 1, 1, 0, 2, 1], np.int32)
LOGITS = np.random.default_rng(0).normal(size=(7, 3)).astype(np.float32)


def np_ce(logits, y):
  z = logits - logits.max(axis=1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
  return -logp[np.arange(len(y)), y]


def present():
  """Each domain present in the batch: the indices of its real examples,
  in batch order."""
  valid = MASK > 0
  return [np.where(valid & (D == e))[0] for e in np.unique(D[valid])]


def terms(fn):
  members, first = objectives.domain_groups(jnp.asarray(D), jnp.asarray(MASK))
  return [float(v) for v in fn(jnp.asarray(LOGITS), jnp.asarray(Y), members,
                               first)]


def test_domain_groups_are_the_domains_present():
  members, first = objectives.domain_groups(jnp.asarray(D), jnp.asarray(MASK))
  assert np.asarray(first).tolist() == [1, 1, 0, 0, 1, 0, 0]
  for idx in present():
    for k in idx:
      np.testing.assert_array_equal(np.nonzero(np.asarray(members[k]))[0], idx)
  np.testing.assert_array_equal(np.asarray(members[6]), 0)  # the padded row


def test_vrex_is_the_variance_of_the_domains_mean_risks():
  ce = np_ce(LOGITS.astype(np.float64), Y)
  risks = np.array([ce[idx].mean() for idx in present()])
  mean, var = terms(objectives.vrex_terms)
  np.testing.assert_allclose(mean, risks.mean(), rtol=1e-5)
  np.testing.assert_allclose(var, risks.var(), rtol=1e-5)


def irm_penalty_by_autodiff(logits, y):
  """The released code's loop: per domain, grad of the even / odd halves'
  mean loss w.r.t. a scale on the logits, their product, the mean over the
  domains (an empty half: 0)."""
  def half_grad(idx):
    if len(idx) == 0:
      return 0.0
    f = lambda s: jnp.mean(optax_ce(logits[idx] * s, y[idx]))
    return float(jax.grad(f)(1.0))
  return np.mean([half_grad(idx[0::2]) * half_grad(idx[1::2])
                  for idx in present()])


def optax_ce(logits, y):
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.take_along_axis(logp, y[:, None], axis=1)[:, 0]


def test_irm_penalty_is_the_product_of_the_halves_scale_gradients():
  ce = np_ce(LOGITS.astype(np.float64), Y)
  mean, penalty = terms(objectives.irm_terms)
  np.testing.assert_allclose(mean, np.mean([ce[i].mean() for i in present()]),
                             rtol=1e-5)
  # Domain 5 has one example: its odd half is empty and contributes 0.
  want = irm_penalty_by_autodiff(jnp.asarray(LOGITS), jnp.asarray(Y))
  np.testing.assert_allclose(penalty, want, rtol=1e-4)


class Linear:
  """A stand-in model: logits = flattened x @ params["w"]."""

  def apply(self, params, x, *, train=False, rng=None):
    del train, rng
    return x.reshape(x.shape[0], -1).astype(jnp.float32) @ params["w"]


@pytest.mark.parametrize("steps_before,step,weight", [(0, 0, 0.0),
                                                      (30, 10, 0.4),
                                                      (95, 5, 1000.0),
                                                      (400, 3, 1000.0)])
def test_the_irm_objective_anneals_its_weight_and_differentiates(
    steps_before, step, weight):
  """The objective's value and gradient are autodiff's of a separately
  written loss (mean domain risk + the released schedule's weight times
  the loop's penalty), at the client's count = earlier rounds' steps +
  this round's step."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(7, 2, 2, 1)).astype(np.float32))
  params = {"w": jnp.asarray(rng.normal(size=(4, 3)).astype(np.float32))}
  loss = objectives.domain_penalty(Linear(), objectives.irm_terms, 1000.0, 100)
  ctx = ClientContext(id=0, round=0, start=params,
                      state=jnp.int32(steps_before), step=jnp.int32(step))
  batch = Batch(x, jnp.asarray(Y), jnp.asarray(MASK), jnp.asarray(D))

  def reference(p):
    logits = Linear().apply(p, x)
    ys = jnp.asarray(Y)
    risk = jnp.mean(jnp.stack([jnp.mean(optax_ce(logits[i], ys[i]))
                               for i in present()]))

    def half(idx, s):
      return jnp.mean(optax_ce(logits[idx] * s, ys[idx]))
    pens = []
    for idx in present():
      even, odd = idx[0::2], idx[1::2]
      if len(odd) == 0:
        pens.append(0.0)
        continue
      pens.append(jax.grad(lambda s: half(even, s))(1.0)
                  * jax.grad(lambda s: half(odd, s))(1.0))
    return risk + weight * jnp.mean(jnp.stack([jnp.asarray(p) for p in pens]))

  value, grad = jax.value_and_grad(loss)(params, batch, None, ctx)
  want, want_grad = jax.value_and_grad(reference)(params)
  np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad["w"]), np.asarray(want_grad["w"]),
                             rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["irm", "vrex"])
def test_clients_count_their_local_steps_over_the_rounds(fed, name):
  model = mlp(fed)
  client = dict(optimizer="sgd", lr=0.05, weight_decay=0.0, momentum=0.0,
                schedule="constant")
  alg = algorithms.build(name, model, hyperparameters={}, client=client,
                         num_clients=N)
  assert alg.client.domains
  result = engine.run(alg, fed, model, CFG)
  steps = -(-fed.packed_train.n // B)
  np.testing.assert_array_equal(np.asarray(result.clients),
                                CFG.rounds * steps)
  assert np.all(np.isfinite(result.round_metrics["loss"]))


FEATS = np.random.default_rng(2).normal(size=(7, 3)).astype(np.float32) * 0.5


def np_mmd(x, y, gammas=(0.001, 0.01, 0.1, 1, 10, 100, 1000)):
  """The released code's `MMD.penalty`, in numpy."""
  def kernel(a, b):
    d = ((a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T)
    d = np.maximum(d, 1e-30)
    return sum(np.exp(-g * d) for g in gammas)
  return kernel(x, x).mean() + kernel(y, y).mean() - 2 * kernel(x, y).mean()


def np_coral(x, y):
  """The released code's `Coral.penalty`, in numpy (a one-example domain's
  covariance 0)."""
  mx, my = x.mean(0, keepdims=True), y.mean(0, keepdims=True)
  cx = (x - mx).T @ (x - mx) / max(len(x) - 1, 1)
  cy = (y - my).T @ (y - my) / max(len(y) - 1, 1)
  return ((mx - my) ** 2).mean() + ((cx - cy) ** 2).mean()


def pairs_mean(fn, h):
  groups = present()
  vals = [fn(h[a], h[b]) for i, a in enumerate(groups) for b in groups[i + 1:]]
  return np.mean(vals)


@pytest.mark.parametrize("penalty,reference", [
    (objectives.mmd_penalty, np_mmd), (objectives.coral_penalty, np_coral)])
def test_feature_penalties_are_the_mean_over_pairs_of_domains(penalty,
                                                              reference):
  members, first = objectives.domain_groups(jnp.asarray(D), jnp.asarray(MASK))
  got = float(penalty(jnp.asarray(FEATS), members, first))
  want = pairs_mean(reference, FEATS.astype(np.float64))
  np.testing.assert_allclose(got, want, rtol=1e-4)
  # One domain present: no pair, no penalty.
  one = jnp.asarray(np.where(MASK > 0, 2, 1).astype(np.int32))
  members, first = objectives.domain_groups(one, jnp.asarray(MASK))
  assert float(penalty(jnp.asarray(FEATS), members, first)) == 0.0


class Features(Linear):
  """A stand-in model with features h = x @ w1 and head logits = h @ w2."""

  def features(self, params, x, *, train=False, rng=None):
    del train, rng
    return x.reshape(x.shape[0], -1).astype(jnp.float32) @ params["w1"]

  def head(self, params, h):
    return h @ params["w2"]


@pytest.mark.parametrize("penalty,reference", [
    (objectives.mmd_penalty, np_mmd), (objectives.coral_penalty, np_coral)])
def test_the_feature_alignment_objective_is_ce_plus_the_weighted_penalty(
    penalty, reference):
  rng = np.random.default_rng(3)
  x = rng.normal(size=(7, 2, 2, 1)).astype(np.float32)
  params = {"w1": jnp.asarray(rng.normal(size=(4, 3)).astype(np.float32)),
            "w2": jnp.asarray(rng.normal(size=(3, 3)).astype(np.float32))}
  loss = objectives.feature_alignment(Features(), penalty, 0.7)
  got = float(loss(params, Batch(jnp.asarray(x), jnp.asarray(Y),
                                 jnp.asarray(MASK), jnp.asarray(D)), None))
  h = x.reshape(7, -1).astype(np.float64) @ np.asarray(params["w1"], np.float64)
  ce = np_ce(h @ np.asarray(params["w2"], np.float64), Y)
  want = ce[MASK > 0].mean() + 0.7 * pairs_mean(reference, h)
  np.testing.assert_allclose(got, want, rtol=1e-4)


def test_group_dro_steps_are_the_released_codes_exponentiated_weights():
  """Three local steps of groupdro's objective and optimizer (the model's
  learning rate 0: fixed logits) against the released `GroupDRO.step` in
  numpy: weights 1 on the client's domains (all in the first batch; domain
  1 only ever at padding), q <- q exp(eta L) with L_g the batch's mean loss
  of domain g (0 where absent: domain 0 in the last batch), normalized, the
  objective q @ L; the same weights after."""
  import optax
  from fedjax_dg.algorithms import groupdro
  eta, num_domains = 0.5, 6
  rng = np.random.default_rng(4)
  alg = groupdro.build(Linear(), optax.sgd(0.0), num_clients=1, eta=eta,
                       num_domains=num_domains)
  params = {"model": {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)},
            "weights": objectives.GroupWeights(jnp.zeros(num_domains),
                                               jnp.zeros(num_domains))}
  batches = [(D, MASK), (np.array([2, 2, 0, 0, 0, 5, 1], np.int32), MASK),
             (np.array([5, 5, 5, 2, 2, 2, 0], np.int32), MASK)]  # 0 absent
  opt = alg.client.optimizer
  state = opt.init(params)
  q = np.zeros(num_domains)
  q[[0, 2, 5]] = 1.0 / 3  # the client's domains (the first batch's)
  for d, mask in batches:
    x = rng.normal(size=(7, 2, 2, 1)).astype(np.float32)
    batch = Batch(jnp.asarray(x), jnp.asarray(Y), jnp.asarray(mask),
                  jnp.asarray(d))
    value, grads = jax.value_and_grad(alg.client.loss)(params, batch, None)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    ce = np_ce(x.reshape(7, -1).astype(np.float64)
               @ np.asarray(params["model"]["w"], np.float64), Y)
    losses = np.zeros(num_domains)
    for g in np.unique(d[mask > 0]):
      losses[g] = ce[(d == g) & (mask > 0)].mean()
    q = q * np.exp(eta * losses)
    q = q / q.sum()
    np.testing.assert_allclose(float(value), q @ losses, rtol=1e-5)
  np.testing.assert_allclose(
      np.asarray(objectives.normalized_weights(params["weights"])), q,
      rtol=1e-5, atol=1e-7)


def test_out_of_range_settings_are_refused_with_the_field(fed):
  from fedjax_dg.algorithms import coral, groupdro, irm, mmd, vrex
  model, opt = mlp(fed), make_optimizer("sgd", 0.1)
  with pytest.raises(ConfigError, match="groupdro.num_domains=2"):
    groupdro.build(model, opt, num_clients=N, data=fed, num_domains=2)
  for module in (irm, vrex):
    with pytest.raises(ConfigError, match="penalty_weight=-1"):
      module.build(model, opt, num_clients=N, penalty_weight=-1.0)
    with pytest.raises(ConfigError, match="anneal_steps=-1"):
      module.build(model, opt, num_clients=N, anneal_steps=-1)
  for module in (mmd, coral):
    with pytest.raises(ConfigError, match="penalty_weight=-1"):
      module.build(model, opt, penalty_weight=-1.0)
  with pytest.raises(ConfigError, match="eta=-1"):
    groupdro.build(model, opt, num_clients=N, eta=-1.0)
