"""The hFedF paper's baselines: FedProx, pFedHN, FedSR, FedGMA.

(`tests/test_algorithms.py` checks that each one learns above chance.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_dg import algorithms, engine, models, tree
from fedjax_dg.algorithms.base import ClientResult, ServerState
from fedjax_dg.algorithms.fedsr import Reference
from fedjax_dg.client import objectives
from fedjax_dg.client.update import Batch, ClientContext, local_update
from fedjax_dg.run.config import base_config
from fedjax_dg.engine.round import make_round
from fedjax_dg.models.fedsr import ProbabilisticModel
from fedjax_dg.server.gma import (GmaState, agreement_mask,
                                  gradient_masked_averaging)
from fedjax_dg.run import assemble


def mlp(fed, **kw):
  return models.get_model("mlp", input_shape=fed.image_shape,
                          num_classes=fed.num_classes, mean=fed.mean, std=fed.std,
                          **kw)


# ----------------------------------------------------------------------------
# FedSR.


def _softplus(x):
  return np.log1p(np.exp(x))


def _reference_regularizers(z, z_mu, z_sigma, y, r_mu, r_sigma, c):
  """A numpy transcription of atuannguyen/FedSR src/methods/FedSR.py."""
  reg_l2r = np.linalg.norm(z, axis=1).mean()               # z.norm(dim=1).mean()
  r_sigma_softplus = _softplus(r_sigma)
  r_mu, r_sigma = r_mu[y], r_sigma_softplus[y]
  z_mu_scaled, z_sigma_scaled = z_mu * c, z_sigma * c
  reg_cmi = (np.log(r_sigma) - np.log(z_sigma_scaled)
             + (z_sigma_scaled**2 + (z_mu_scaled - r_mu)**2) / (2 * r_sigma**2)
             - 0.5)
  return reg_l2r, reg_cmi.sum(1).mean()


def test_fedsr_regularizers_match_reference_transcription():
  rng = np.random.default_rng(0)
  b, zdim, classes = 6, 5, 3
  mu = rng.normal(size=(b, zdim)).astype(np.float32)
  sigma = _softplus(rng.normal(size=(b, zdim))).astype(np.float32)
  z = (mu + sigma * rng.normal(size=(b, zdim))).astype(np.float32)
  y = rng.integers(0, classes, b).astype(np.int32)
  r_mu = rng.normal(size=(classes, zdim)).astype(np.float32)
  r_sigma = rng.normal(size=(classes, zdim)).astype(np.float32)
  c = np.float32(1.3)
  want_l2r, want_cmi = _reference_regularizers(z, mu, sigma, y, r_mu, r_sigma, c)
  ones = np.ones((b,), np.float32)
  # Padding rows (mask 0) do not count.
  pad = lambda a: np.concatenate([a, a[:2] * 7 + 1])
  mask = np.concatenate([ones, np.zeros((2,), np.float32)])

  @jax.jit   # one program (eagerly: ~50)
  def run():
    return dict(
        l2r=objectives.fedsr_l2r(z, ones),
        cmi=objectives.fedsr_cmi(mu, sigma, y, r_mu, r_sigma, c, ones),
        l2r_pad=objectives.fedsr_l2r(pad(z), mask),
        cmi_pad=objectives.fedsr_cmi(pad(mu), pad(sigma), pad(y) % classes,
                                     r_mu, r_sigma, c, mask),
        # The unsquared norm has a finite gradient at z = 0.
        grad_at_0=jax.grad(lambda z: objectives.fedsr_l2r(z, jnp.ones((2,))))(
            jnp.zeros((2, 3))))

  out = run()
  np.testing.assert_allclose(out["l2r"], want_l2r, rtol=1e-5)
  np.testing.assert_allclose(out["cmi"], want_cmi, rtol=1e-5)
  np.testing.assert_allclose(out["l2r_pad"], want_l2r, rtol=1e-5)
  np.testing.assert_allclose(out["cmi_pad"], want_cmi, rtol=1e-5)
  assert np.all(np.isfinite(np.asarray(out["grad_at_0"])))


def test_fedsr_objective_is_ce_plus_weighted_regularizers(fed3):
  model = mlp(fed3)
  prob = ProbabilisticModel(model, z_dim=4)
  params = {"model": prob.init(jax.random.key(0)),
            "ref": Reference(r_mu=jax.random.normal(jax.random.key(1), (3, 4)),
                             r_sigma=jnp.ones((3, 4)), c=jnp.float32(0.8))}
  x, y = fed3.train.x[0, :5], fed3.train.y[0, :5]
  batch = Batch(jnp.asarray(x), jnp.asarray(y), jnp.ones((5,)))
  key = jax.random.key(2)
  got = jax.jit(objectives.fedsr(prob, 0.1, 0.01))(params, batch, key, None)
  # The same sample: the loss splits its key into (body dropout, z noise).
  _, k_z = jax.random.split(key)

  @jax.jit
  def sample(p):
    mu, sigma = prob.distribution(p, x, train=True)
    z = mu + sigma * jax.random.normal(k_z, mu.shape)
    return mu, sigma, z, prob.classify(p, z)

  mu, sigma, z, logits = sample(params["model"])
  logits = np.asarray(logits, np.float64)
  logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
  ce = -logp[np.arange(5), np.asarray(y)].mean()
  ref = jax.tree.map(np.asarray, params["ref"])
  l2r, cmi = _reference_regularizers(np.asarray(z), np.asarray(mu),
                                     np.asarray(sigma), np.asarray(y),
                                     ref.r_mu, ref.r_sigma, ref.c)
  np.testing.assert_allclose(got, ce + 0.1 * l2r + 0.01 * cmi, rtol=1e-5)


def test_fedsr_evaluates_the_mean_with_the_plain_client_model(fed3):
  model = mlp(fed3)
  prob = ProbabilisticModel(model)  # z_dim 0: the MLP's feature width
  assert prob.z_dim == prob.feature_width == 32
  params = prob.init(jax.random.key(0))
  assert "fc2" not in params["body"]
  assert params["rep"]["kernel"].shape == (32, 64)
  x = fed3.train.x[0, :7]
  folded, at_mu, sampled = jax.jit(lambda p: (
      model.apply(prob.to_model_params(p), x), prob.apply(p, x),
      prob.apply(p, x, train=True, rng=jax.random.key(1))))(params)
  np.testing.assert_allclose(folded, at_mu, rtol=1e-5, atol=1e-6)
  # Training logits are of a sampled z, not of mu.
  assert not np.allclose(sampled, at_mu)


def test_fedsr_and_fedadg_take_a_vit_through_its_head(fed3):
  """A ViT's last layer is `head`, not `fc2` (Model.head_name): FedSR folds
  its mean into that layer (the folded ViT gives cls(mu)) and FedADG's
  generator works in its feature width (both crashed with KeyError 'fc2')."""
  from conftest import TINY_VIT
  vit = models.get_model("vit_tiny", input_shape=fed3.image_shape,
                         num_classes=fed3.num_classes, mean=fed3.mean,
                         std=fed3.std, **TINY_VIT)
  prob = ProbabilisticModel(vit)
  assert prob.feature_width == TINY_VIT["dim"]
  params = prob.init(jax.random.key(0))
  assert "head" not in params["body"] and set(params["body"]) < set(
      jax.eval_shape(vit.init, jax.random.key(0)))
  x = fed3.train.x[0, :5]
  folded, at_mu = jax.jit(lambda p: (
      vit.apply(prob.to_model_params(p), x), prob.apply(p, x)))(params)
  np.testing.assert_allclose(folded, at_mu, rtol=1e-5, atol=1e-5)
  from fedjax_dg.models.fedadg import FedADGNets
  nets = FedADGNets(vit)
  assert nets.feature_width == nets.noise_dim == TINY_VIT["dim"]


def test_fedsr_reference_parameters_stay_local(fed3):
  model = mlp(fed3)
  cfg = base_config()
  alg = assemble.algorithm("fedsr", model, fed3.num_clients, cfg)
  round_fn = make_round(alg, engine.EngineConfig(
      rounds=1, epochs=1, batch_size=16, client_mapping="map"), 3)

  @jax.jit  # one program: init, then one round of the engine
  def first_round(key, train):
    server, ref0 = alg.init(key)
    # Checked while tracing (the structure, not the values).
    assert set(server.params) == {"body", "rep", "cls"}  # no reference here
    start = alg.client.start(server, ref0, jnp.arange(3))
    assert start["ref"] is ref0  # each client starts from its own reference
    return round_fn((server, ref0), jnp.int32(0), train, jax.random.key(1),
                    None)

  (server, ref), _ = first_round(jax.random.key(0),
                                 jax.tree.map(jnp.asarray, fed3.train))
  assert ref.r_mu.shape == (3, fed3.num_classes, 32)
  assert ref.c.shape == (3,)
  for leaf in (ref.r_mu, ref.r_sigma):
    leaf = np.asarray(leaf).reshape(3, -1)
    for i in range(3):
      for j in range(i):
        assert np.abs(leaf[i] - leaf[j]).max() > 1e-4  # not averaged
  assert np.all(np.abs(np.asarray(ref.r_mu)).max((1, 2)) > 0)  # trained
  assert np.all(np.asarray(ref.c) != 1.0)


# ----------------------------------------------------------------------------
# FedGMA.


def _gma_example():
  # 4 clients x 4 parameters (new minus old) and a scalar leaf.
  d = np.array([[1., 2., 1., 4.],
                [3., -2., 1., -4.],
                [1., 2., 2., 0.],
                [3., -2., -2., 4.]], np.float32)
  deltas = {"w": d, "b": np.array([1., 1., -1., -1.], np.float32)}
  weights = np.array([2., 1., 1., 0.], np.float32)  # the 4th: in A, not the mean
  return deltas, weights


def test_gma_mask_and_update_on_a_constructed_example():
  deltas, weights = _gma_example()
  # A = |mean sign| = [1, 0, 1/2, 1/4]; b: 0. tau = 0.5 keeps A = 1/2 undamped.
  mask = jax.jit(agreement_mask, static_argnums=1)(deltas, 0.5)
  np.testing.assert_allclose(mask["w"], [1.0, 0.0, 1.0, 0.25])
  np.testing.assert_allclose(mask["b"], 0.0)
  # Weighted mean with p = [1/2, 1/4, 1/4, 0]: [1.5, 1.0, 1.25, 1.0]; b: 0.25.
  # The aggregator adds the masked step to the server model (zeros here).
  zero = jax.tree.map(lambda d: np.zeros_like(d[0]), deltas)
  # tau = 0.6 damps A = 1/2 to 1/2. One program (eagerly: ~30).
  out = jax.jit(lambda: [t.update(deltas, t.init(zero), zero, weights=weights)
                         for t in (gradient_masked_averaging(0.5, 0.5),
                                   gradient_masked_averaging(0.6, 0.5))])()
  (new, state), (new6, state6) = out
  np.testing.assert_allclose(new["w"], [0.75, 0.0, 0.625, 0.125])
  np.testing.assert_allclose(new["b"], 0.0)
  np.testing.assert_allclose(state.unmasked, 2 / 5)  # w[0], w[2] of 5 entries
  np.testing.assert_allclose(new6["w"], [0.75, 0.0, 0.3125, 0.125])
  np.testing.assert_allclose(state6.unmasked, 1 / 5)


def test_fedgma_server_adds_the_masked_step(fed3):
  deltas, weights = _gma_example()
  cfg = base_config()
  cfg.fedgma.threshold, cfg.fedgma.step_size = 0.5, 0.5
  alg = assemble.algorithm("fedgma", mlp(fed3), fed3.num_clients, cfg)
  old = {"w": np.full((4,), 10.0, np.float32), "b": np.float32(3.0)}
  start = tree.broadcast(old, 4)
  result = ClientResult(ids=jnp.arange(4), round=0, start=start,
                        params=optax.tree.add(start, deltas),
                        num_examples=jnp.asarray(weights),
                        loss=jnp.zeros((4,)))
  server = ServerState(old, GmaState(jnp.float32(1.0)))
  server, metrics = jax.jit(alg.server.update)(server, result,
                                               jax.random.key(0))
  np.testing.assert_allclose(server.params["w"],
                             [10.75, 10.0, 10.625, 10.125], rtol=1e-6)
  np.testing.assert_allclose(server.params["b"], 3.0)
  np.testing.assert_allclose(metrics["gma_unmasked"], 2 / 5)


# ----------------------------------------------------------------------------
# pFedHN.


def test_pfedhn_server_step_moves_generated_models_toward_trained(fed3):
  cfg = base_config()
  cfg.pfedhn.server_lr = 0.1
  alg = assemble.algorithm("pfedhn", mlp(fed3), fed3.num_clients, cfg)
  assert alg.server.personalized and alg.client.local_steps == 0  # the engine's epochs
  ids = jnp.array([0, 2])

  @jax.jit   # one program (eagerly: a program per leaf shape and op)
  def step(key):
    server, _ = alg.init(key)
    start = alg.client.start(server, None, ids)
    direction = jax.tree.map(
        lambda p: jax.random.normal(jax.random.key(p.size), p.shape), start)
    trained = optax.tree.add(start, optax.tree.scale(0.05, direction))
    result = ClientResult(ids=ids, round=0, start=start, params=trained,
                          num_examples=jnp.array([10, 10]),
                          loss=jnp.zeros((2,)))
    new_server, _ = alg.server.update(server, result, jax.random.key(1))
    after = alg.client.start(new_server, None, ids)
    return (server, new_server,
            tree.rowwise_sq_norm(optax.tree.sub(start, trained)),
            tree.rowwise_sq_norm(optax.tree.sub(after, trained)))

  server, new_server, before_d, after_d = step(jax.random.key(0))
  assert server.hp.embeddings.shape == (3, 1)  # floor(1 + 3/4)
  assert np.all(np.asarray(after_d) < np.asarray(before_d)), (before_d, after_d)
  # The client outside the cohort keeps its embedding.
  np.testing.assert_array_equal(new_server.hp.embeddings[1],
                                server.hp.embeddings[1])


def test_pfedhn_reference_code_settings(fed3):
  cfg = base_config()
  assert (cfg.pfedhn.hidden, cfg.pfedhn.n_hidden) == (100, 3)
  assert (cfg.pfedhn.server_optimizer, cfg.pfedhn.server_lr,
          cfg.pfedhn.server_momentum, cfg.pfedhn.server_weight_decay,
          cfg.pfedhn.server_clip_norm) == ("sgd", 1e-2, 0.9, 1e-3, 50.0)
  cfg.pfedhn.local_steps = 50
  cfg.pfedhn.client_clip_norm = 50.0
  alg = assemble.algorithm("pfedhn", mlp(fed3), fed3.num_clients, cfg)
  assert alg.client.local_steps == 50


# ----------------------------------------------------------------------------
# FedProx.


def test_fedprox_with_huge_mu_stays_near_the_start(fed3):
  model = mlp(fed3)
  cfg = base_config()
  cfg.client.optimizer, cfg.client.lr, cfg.client.weight_decay = "sgd", 1e-2, 0.0
  cfg.fedprox.client.lr, cfg.fedprox.client.weight_decay = 1e-2, 0.0
  cfg.fedprox.mu = 100.0  # lr * mu = 1: every step is pulled back to the start
  prox = assemble.algorithm("fedprox", model, 3, cfg)
  avg = assemble.algorithm("fedavg", model, 3, cfg)
  start = model.init(jax.random.key(0))
  data = (fed3.train.x[0], fed3.train.y[0], fed3.train.n[0], jax.random.key(1))

  def moved(alg):
    @jax.jit
    def distance(start, data):
      ctx = ClientContext(id=0, round=0, start=start)
      p, _ = local_update(alg.client.loss, alg.client.optimizer, start, *data, ctx,
                          batch_size=16, epochs=2)
      return optax.tree.norm(optax.tree.sub(p, start))
    return float(distance(start, data))

  d_prox, d_avg = moved(prox), moved(avg)
  assert d_prox < 0.2 * d_avg, (d_prox, d_avg)
  assert prox.name == "fedprox" and not prox.server.personalized


@pytest.mark.parametrize("name", ["fedprox", "pfedhn", "fedsr", "fedgma"])
def test_baselines_are_registered_with_config_sections(name):
  cfg = base_config()
  assert name in algorithms.available()
  assert "client" in cfg[name]
