"""One contract over every server transform (optax's shape, `server.aggregate`).

Each transform, built on a tiny model with example inputs of its role, must

* be an `optax.GradientTransformationExtraArgs` (so `optax.chain` composes it);
* `init(params)` a typed state: a NamedTuple (or optax.EmptyState), never a dict;
* `update(updates, state, params, **extra)` return exactly `(out, state)`, also
  when given extras it does not use (a chain passes every extra to every link);
* keep the state's structure, shapes and dtypes (it is a `lax.scan` carry), and
  give an `out` of the documented role's shape;
* trace once under `jax.jit` for repeated calls (no recompiles);
* carry its round counter in the state where it has one (EMA).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import synthetic_domains
from fedjax_dg import models, server, tree
from fedjax_dg.data import federated, partition
from fedjax_dg.algorithms import fedbe, feddf, fedlaw
from fedjax_dg.models.hypergenfl import AttentionScores, init_attention_scores
from fedjax_dg.models.hypernetwork import hypernetwork_module, init_hypernetwork
from fedjax_dg.server import distill, ga, gma
from fedjax_dg.server import hypergenfl as hg
from fedjax_dg.server.hypernetwork import HyperParams

M, N = 3, 5  # cohort size, clients


@pytest.fixture(scope="module")
def setup():
  # A server split, for the distillation aggregators.
  fed = federated.build(synthetic_domains(per_domain=30),
                        partition.PartitionSpec(num_clients=3, seed=0),
                        target_domain=0, server_fraction=0.2)
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean,
                           std=fed.std, hidden=8)
  params = model.init(jax.random.key(0))
  trained = jax.tree.map(
      lambda p: p[None] + 0.1 * jax.random.normal(jax.random.key(1),
                                                  (M,) + p.shape), params)
  return fed, model, params, trained


def _extras(params):
  return dict(weights=jnp.array([3.0, 1.0, 2.0]), ids=jnp.array([4, 0, 2]),
              key=jax.random.key(3), start=params, unused=jnp.ones(()),
              # GA's per-client metrics and the run's progress r / R.
              received=jnp.array([0.9, 0.5, 0.7]),
              trained=jnp.array([0.2, 0.3, 0.1]),
              progress=jnp.float32(0.25))


def _hypernetwork(model):
  module = hypernetwork_module(model, hidden=4, n_hidden=1)
  h = lambda theta, v: module.apply({"params": theta}, v)
  hp = HyperParams(init_hypernetwork(module, model, jax.random.key(4), 2),
                   jax.random.normal(jax.random.key(5), (N, 2)))
  return h, hp


def _weight_net(model):
  layer_of, _ = hg.layer_groups(jax.eval_shape(model.init, jax.random.key(0)))
  module = AttentionScores(embed_dim=8, num_layers=max(layer_of) + 1,
                           num_heads=2)
  hp = HyperParams(init_attention_scores(module, jax.random.key(6), 8),
                   jnp.ones((N, 8)))
  return (lambda phi, s: module.apply({"params": phi}, s)), layer_of, hp


def transforms(fed, model, params, trained):
  """name -> (transform, updates, params, expected out-like pytree)."""
  h, hp = _hypernetwork(model)
  generated = jax.vmap(h, in_axes=(None, 0))(hp.theta, hp.embeddings[:M])
  deltas = optax.tree.scale(0.01, generated)
  hn, layer_of, hg_hp = _weight_net(model)
  sx, sy = jnp.asarray(fed.server_x), jnp.asarray(fed.server_y)
  out = {
      "weighted_mean": (server.weighted_mean(), trained, params, params),
      "gma": (gma.gradient_masked_averaging(0.5, 1.0), trained, params, params),
      "ga": (ga.ga_aggregation(N), trained, params, params),
      "ema": (server.ema(0.9, 1), params, None, params),
      "hypernetwork_step": (server.hypernetwork_step(h, optax.adam(1e-2)),
                            deltas, hp, hp),
      "hypernetwork_step_tensor": (server.hypernetwork_step(
          h, optax.adam(1e-2), granularity="tensor"), deltas, hp, hp),
      "hypergenfl_step": (hg.hypergenfl_step(hn, layer_of, optax.adamw(1e-2)),
                          trained, hg_hp, hg_hp),
      "feddf": (feddf.ensemble_distillation(model, sx, optax.adam(1e-3),
                                            steps=2, batch_size=4),
                trained, params, params),
      "fedbe": (fedbe.bayesian_ensemble_distillation(
          model, sx, optax.sgd(1e-2), steps=2, batch_size=4, swa_start=0,
          swa_freq=1, sharpen_temperature=1.0, eval_chunk=8, num_samples=2),
                trained, params, params),
      "fedlaw": (fedlaw.learned_aggregation(model, sx, sy, optax.adam(1e-2),
                                            num_clients=N, steps=2,
                                            batch_size=4),
                 trained, params, params),
      # Transforms chain: FedAvg with a server-side EMA of the global model.
      "chain(weighted_mean, ema)": (optax.chain(server.weighted_mean(),
                                                server.ema(0.5, 0)),
                                    trained, params, params),
  }
  return out


@pytest.fixture(scope="module")
def built(setup):
  """`transforms` once per module (building them initializes and runs the
  hypernetworks: compiled again on every call)."""
  return transforms(*setup)


NAMES = ["weighted_mean", "gma", "ga", "ema", "hypernetwork_step",
         "hypernetwork_step_tensor", "hypergenfl_step", "feddf", "fedbe",
         "fedlaw", "chain(weighted_mean, ema)"]


def _is_typed(state) -> bool:
  """A NamedTuple (optax.EmptyState is one), or optax.chain's tuple of them."""
  if isinstance(state, tuple) and not hasattr(state, "_fields"):
    return all(_is_typed(s) for s in state)
  return hasattr(state, "_fields")


def test_every_server_transform_is_listed_here(built):
  assert sorted(built) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_server_transform_contract(setup, built, name):
  t, updates, params, out_like = built[name]
  assert isinstance(t, optax.GradientTransformationExtraArgs), type(t)
  state = t.init(params if params is not None else updates)
  assert _is_typed(state), state
  chex.clear_trace_counter()  # counted per test

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(updates, state, params):
    return t.update(updates, state, params, **_extras(setup[2]))

  result = step(updates, state, params)
  assert isinstance(result, tuple) and len(result) == 2
  out, new_state = result
  chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  chex.assert_trees_all_equal_shapes(out, out_like)
  assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(out))
  # A second call with the new state: the same compiled program.
  step(updates, new_state, params)


def test_ema_counts_rounds_in_its_state():
  t = server.ema(0.5, 1)
  state = t.init(jnp.zeros(2))
  outs = []
  for r in range(4):
    out, state = t.update(jnp.full(2, float(r + 1)), state)
    outs.append(float(out[0]))
  assert int(state.count) == 4
  # r=0: pass; r=1: EMA := 2 (warm-up); r=2: 0.5*3 + 0.5*2; r=3: 0.5*4 + 0.5*2.5
  np.testing.assert_allclose(outs, [1.0, 2.0, 2.5, 3.25])


def test_chain_of_aggregator_and_ema_is_the_smoothed_mean(setup):
  _, _, params, trained = setup
  weights = jnp.array([3.0, 1.0, 2.0])
  chained = optax.chain(server.weighted_mean(), server.ema(0.5, 0))
  state = chained.init(params)
  out, state = chained.update(trained, state, params, weights=weights)
  mean = tree.weighted_mean(trained, weights)
  chex.assert_trees_all_close(out, mean)  # round 0 = the warm-up: unchanged
  out, _ = chained.update(trained, state, params, weights=weights)
  chex.assert_trees_all_close(out, mean)  # EMA of the same mean is the mean
  shifted = jax.tree.map(lambda x: x + 1.0, trained)
  out, _ = chained.update(shifted, state, params, weights=weights)
  chex.assert_trees_all_close(out, jax.tree.map(lambda m: m + 0.5, mean),
                              rtol=1e-5)


def test_distill_state_reports_losses(setup):
  fed, model, params, trained = setup
  t = feddf.ensemble_distillation(model, jnp.asarray(fed.server_x),
                                  optax.adam(1e-2), steps=3, batch_size=4)
  _, state = jax.jit(lambda u, s, p: t.update(u, s, p, **_extras(p)))(
      trained, t.init(params), params)
  assert isinstance(state, distill.DistillState)
  assert float(state.loss_first) > 0 and np.isfinite(float(state.loss_last))


def test_hfedf_ema_is_alpha_times_the_step():
  """Algorithm 4 as written: after the warm-up, feeding theta + u (the
  optimizer's step from the previous output) returns theta + alpha u."""
  alpha, warmup = 0.3, 1
  t = server.ema(alpha, warmup)
  rng = np.random.default_rng(0)
  theta = jnp.asarray(rng.normal(size=4))
  state = t.init(theta)
  for r in range(5):
    u = jnp.asarray(rng.normal(size=4))
    out, state = t.update(theta + u, state)
    want = theta + u if r <= warmup else theta + alpha * u
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-7)
    theta = out
