"""HyperGenFL: the weights of Eq. 4-8, the server gradient of Eq. 10-11 against
brute-force autodiff and finite differences, the update direction, partial
participation, and a small label-skewed run."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import synthetic_domains
from fedjax_dg import algorithms, engine, models, tree
from fedjax_dg.algorithms.base import ClientResult
from fedjax_dg.algorithms import hypergenfl
from fedjax_dg.run.config import base_config
from fedjax_dg.data import federated, partition
from fedjax_dg.engine.round import make_round
from fedjax_dg.models.hypergenfl import AttentionScores, init_attention_scores
from fedjax_dg.server import hypergenfl as hg
from fedjax_dg.server.hypernetwork import HyperParams
from fedjax_dg.run import assemble


@functools.lru_cache(maxsize=None)
def tiny_model(hidden=3, classes=2, shape=(2, 2, 1)):
  return models.get_model("mlp", input_shape=shape, num_classes=classes,
                          hidden=hidden)


@functools.lru_cache(maxsize=None)
def weight_net(model, d=8, heads=2, granularity="module", lam=1e-3, key=0):
  """(module, jitted HN(phi, sigma), phi, layer map) for `model`."""
  layer_of, _ = hg.layer_groups(jax.eval_shape(model.init, jax.random.key(0)),
                                granularity)
  module = AttentionScores(embed_dim=d, num_layers=max(layer_of) + 1,
                           num_heads=heads, lam=lam)
  phi = init_attention_scores(module, jax.random.key(key), d)
  return module, jax.jit(lambda p, s: module.apply({"params": p}, s)), phi, layer_of


def cohort(model, m, key=1, scale=0.3):
  """A start model and m trained models scattered around it (numpy noise)."""
  start = jax.tree.map(np.asarray, model.init(jax.random.key(key)))
  rng = np.random.default_rng(key)
  trained = jax.tree.map(
      lambda x: (x[None] + scale * rng.normal(size=(m,) + x.shape)).astype(
          np.float32), start)
  return start, trained


def normal(seed, shape, scale=1.0):
  """N(0, scale^2) float32 draws from numpy (jax.random compiles a program
  per shape when called outside jit)."""
  return (scale * np.random.default_rng(seed).normal(size=shape)).astype(
      np.float32)


def flat(t):
  return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(t)])


# ----------------------------------------------------------------------------
# The written-out server losses of Table 9 (per client, with a Python loop).


def loop_aggregate(trained, weights, layer_of):
  m = tree.leading_size(trained)
  leaves, treedef = jax.tree.flatten(trained)
  out = []
  for x, l in zip(leaves, layer_of):
    acc = 0.0
    for c in range(m):
      acc = acc + weights[c, l] * x[c]
    out.append(acc)
  return jax.tree.unflatten(treedef, out)


def client_loss(kind, theta_g, start, theta_c):
  g, s, t = flat_j(theta_g), flat_j(start), flat_j(theta_c)
  if kind == "default":   # <theta_g, theta_start - theta_c>: Eq. 15-17
    return jnp.vdot(g, jax.lax.stop_gradient(s - t))
  if kind == "mse":
    return jnp.mean((g - t) ** 2)
  return jnp.mean(jnp.log(jnp.cosh(g - t)))


def flat_j(t):
  return jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(t)])


def brute_loss(kind, hn, layer_of, phi, sigma, start, trained):
  theta_g = loop_aggregate(trained, hn(phi, sigma), layer_of)
  m = tree.leading_size(trained)
  return sum(client_loss(kind, theta_g, start,
                         jax.tree.map(lambda x, c=c: x[c], trained))
             for c in range(m)) / m


# ----------------------------------------------------------------------------
# Weights (Eq. 4-8).


def test_module_vs_tensor_granularity_counts():
  mlp = jax.eval_shape(tiny_model().init, jax.random.key(0))
  assert hg.layer_groups(mlp, "module") == ((0, 0, 1, 1), ("fc1", "fc2"))
  assert hg.layer_groups(mlp, "tensor")[1] == (
      "fc1/bias", "fc1/kernel", "fc2/bias", "fc2/kernel")
  cnn = models.get_model("small_cnn", input_shape=(8, 8, 3), num_classes=4)
  for granularity, L in (("module", 4), ("tensor", 8)):
    alg = hypergenfl.build(cnn, optax.sgd(0.1), None, num_clients=5, embed_dim=8,
                           granularity=granularity)
    server, _ = jax.eval_shape(alg.init, jax.random.key(0))
    assert server.weights.shape == (5, L)
    assert server.hp.theta["decode"]["kernel"].shape == (8, L)
  with pytest.raises(ValueError, match="granularity"):
    hg.layer_groups(mlp, "block")


def test_resnet50_layers_groupnorm_is_one_module():
  """ResNet-50: 53 convs (stem, 16 x 3 in blocks, 4 shortcuts; no bias), each
  followed by a GroupNorm (scale, bias), and the head: 107 modules, 161 tensors.
  Under "module" a GroupNorm's scale and bias share one weight."""
  model = models.get_model("resnet50", input_shape=(28, 28, 1), num_classes=10)
  params = jax.eval_shape(model.init, jax.random.key(0))
  layer_of, names = hg.layer_groups(params, "module")
  assert len(names) == 53 + 53 + 1
  assert len(hg.layer_groups(params, "tensor")[1]) == len(layer_of) == 53 + 2 * 53 + 2
  size = {n: layer_of.count(i) for i, n in enumerate(names)}
  gn = [n for n in names if "gn" in n.split("/")[-1]]
  assert len(gn) == 53 and all(size[n] == 2 for n in gn)
  assert all(size[n] == 1 for n in names if "conv" in n.split("/")[-1])


@pytest.mark.parametrize("granularity", ["module", "tensor"])
def test_weights_are_positive_and_sum_to_one_per_layer(granularity):
  _, hn, phi, layer_of = weight_net(tiny_model(), granularity=granularity)
  sigma = normal(3, (5, 8))
  w = np.asarray(hn(phi, sigma))
  assert w.shape == (5, max(layer_of) + 1)
  assert np.all(w > 0)
  np.testing.assert_allclose(w.sum(0), 1.0, rtol=1e-6)
  # Attention couples the cohort: changing one client's embedding moves the
  # other clients' weights too.
  moved = sigma.copy()
  moved[0] += 1.0
  w2 = np.asarray(hn(phi, moved))
  assert np.abs(w2[1:] - w[1:]).max() > 0


def test_eq4_softmax_is_over_each_clients_features():
  """z = softmax(MHA(sigma) + sigma) over the d features of each client: every
  row of the latent sums to one (a softmax over clients would make columns)."""
  module, _, phi, _ = weight_net(tiny_model())
  sigma = normal(11, (5, 8))
  z = np.asarray(module.apply({"params": phi}, sigma,
                              method=AttentionScores.latent))
  np.testing.assert_allclose(z.sum(1), 1.0, rtol=1e-6)
  assert np.abs(z.sum(0) - 1.0).max() > 1e-2


def test_identical_embeddings_give_uniform_weights_and_the_plain_mean():
  model = tiny_model()
  _, hn, phi, layer_of = weight_net(model)
  w = np.asarray(hn(phi, jnp.ones((4, 8))))
  np.testing.assert_allclose(w, 0.25, rtol=1e-6)
  # Round 0 with all-ones embeddings (Alg. 1 line 3) is the *unweighted* mean,
  # whatever the clients' data sizes.
  alg = hypergenfl.build(model, optax.sgd(0.1), None, num_clients=6, embed_dim=8,
                         num_heads=2, order="aggregate_first")
  server, _ = jax.jit(alg.init)(jax.random.key(0))
  start, trained = cohort(model, 4)
  ids = jnp.array([5, 0, 3, 2])
  result = ClientResult(ids, 0, tree.broadcast(server.params, 4), trained,
                        jnp.array([1, 50, 7, 3]), jnp.ones(4))
  new, metrics = jax.jit(alg.server.update)(server, result, None)
  np.testing.assert_allclose(flat(new.params),
                             flat(tree.weighted_mean(trained, jnp.ones(4))),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics["hg_entropy"], np.log(4), rtol=1e-5)
  np.testing.assert_allclose(metrics["hg_client_weight"], 0.25, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(new.weights)[np.asarray(ids)], 0.25,
                             rtol=1e-5)
  assert np.all(np.asarray(new.weights)[[1, 4]] == 0)  # not in the cohort


def test_lambda_keeps_all_off_layers_uniform():
  # A decoder bias far below zero switches every ReLU off (Eq. 5): the layer's
  # scores are all lambda, so its weights are uniform (and get no gradient).
  module, hn, phi, layer_of = weight_net(tiny_model())
  phi = jax.tree.map(lambda x: x, phi)
  phi["decode"]["bias"] = phi["decode"]["bias"].at[1].set(-10.0)
  w = np.asarray(hn(phi, normal(4, (3, 8))))
  np.testing.assert_allclose(w[:, 1], 1 / 3, rtol=1e-6)


# ----------------------------------------------------------------------------
# The server gradient (Eq. 10-11) and the losses of Table 9.


@pytest.mark.parametrize("kind", hg.LOSSES)
def test_cotangents_are_gradients_of_the_written_out_losses(kind):
  model = tiny_model()
  start, trained = cohort(model, 3)
  agg = jax.tree.map(lambda x: x + 0.1, tree.weighted_mean(trained, jnp.ones(3)))
  got = hg.cotangent(kind, agg, start, trained)
  want = jax.jit(jax.grad(lambda g: sum(
      client_loss(kind, g, start, jax.tree.map(lambda x, c=c: x[c], trained))
      for c in range(3)) / 3))(agg)
  np.testing.assert_allclose(flat(got), flat(want), rtol=1e-5, atol=1e-7)



def test_aggregate_refuses_a_layer_map_of_another_length():
  stacked = {"a": jnp.ones((2, 3)), "b": jnp.ones((2, 4)), "c": jnp.ones((2,))}
  with pytest.raises(ValueError,
                     match="^3 parameter tensors, layer map has 2$"):
    hg.aggregate(stacked, jnp.full((2, 2), 0.5), (0, 1))

@pytest.mark.parametrize("kind,granularity", [
    ("default", "module"), ("mse", "module"), ("logcosh", "module"),
    ("default", "tensor")])
def test_vjp_server_gradient_matches_brute_force_autodiff(kind, granularity):
  model = tiny_model()
  _, hn, phi, layer_of = weight_net(model, granularity=granularity)
  sigma = 1.0 + normal(5, (4, 8), 0.3)
  start, trained = cohort(model, 4)
  brute = jax.grad(
      lambda p, s: brute_loss(kind, hn, layer_of, p, s, start, trained),
      argnums=(0, 1))
  (agg, w, g_phi, g_sigma), (want_phi, want_sigma) = jax.jit(  # one program
      lambda p, s: (hg.server_grads(hn, layer_of, p, s, start, trained, kind),
                    brute(p, s)))(phi, sigma)
  np.testing.assert_allclose(flat(agg), flat(loop_aggregate(trained, w, layer_of)),
                             rtol=1e-5, atol=1e-6)
  scale = np.abs(flat(want_phi)).max()
  np.testing.assert_allclose(flat(g_phi), flat(want_phi), rtol=1e-4,
                             atol=1e-5 * scale)
  np.testing.assert_allclose(g_sigma, want_sigma, rtol=1e-4,
                             atol=1e-5 * np.abs(want_sigma).max())


def test_vjp_server_gradient_matches_finite_differences():
  model = tiny_model()
  _, hn, phi, layer_of = weight_net(model, lam=0.05)
  sigma = 1.0 + normal(6, (3, 8))
  start, trained = cohort(model, 3, scale=1.0)
  _, _, g_phi, g_sigma = jax.jit(
      lambda p, s: hg.server_grads(hn, layer_of, p, s, start, trained))(phi, sigma)
  f = jax.jit(lambda p, s: brute_loss("default", hn, layer_of, p, s, start,
                                      trained))
  # Central differences of the written-out loss along random directions.
  for k in range(3):
    rng = np.random.default_rng(100 + k)  # numpy: no compile per leaf shape
    v_phi = jax.tree.map(
        lambda x: rng.normal(size=x.shape).astype(np.float32), phi)
    v_sigma = rng.normal(size=sigma.shape).astype(np.float32)
    eps = 1e-3
    at = lambda t: (jax.tree.map(lambda p, v: np.asarray(p) + t * v, phi,
                                 v_phi), np.asarray(sigma) + t * v_sigma)
    fd = float(f(*at(eps)) - f(*at(-eps))) / (2 * eps)
    ad = float(flat(g_phi) @ flat(v_phi)
               + np.vdot(np.asarray(g_sigma), v_sigma))
    assert abs(fd - ad) <= 2e-2 * abs(ad) + 1e-4, (k, fd, ad)


# ----------------------------------------------------------------------------
# Direction of one server step.


def _one_step(kind, opt, model, m=4, n=6):
  """(start, trained, aggregate before, aggregate after) of one server step."""
  _, hn, phi, layer_of = weight_net(model)
  hp = HyperParams(theta=phi, embeddings=1.0 + normal(7, (n, 8), 0.5))
  step = hg.hypergenfl_step(hn, layer_of, opt, loss=kind)
  ids = jnp.array([4, 0, 5, 2])[:m]
  start, trained = cohort(model, m)
  updates, state = jax.jit(step.update)(trained, step.init(hp), hp, ids=ids,
                                        start=start)
  hp2 = optax.apply_updates(hp, updates)
  agg = lambda h: hg.aggregate(trained, hn(h.theta, jnp.take(h.embeddings, ids, 0)),
                               layer_of)
  # The state holds the weights of the gradient point (the old hypernetwork),
  # in the cohort's rows.
  np.testing.assert_allclose(jnp.take(state.weights, ids, 0),
                             hn(hp.theta, jnp.take(hp.embeddings, ids, 0)),
                             rtol=1e-6)
  assert np.all(np.delete(np.asarray(state.weights), np.asarray(ids), 0) == 0)
  return start, trained, agg(hp), agg(hp2)


@pytest.mark.parametrize("opt", [optax.sgd(1e-2), optax.adamw(1e-3, weight_decay=1e-5)],
                         ids=["sgd", "adamw"])
def test_default_step_moves_the_aggregate_along_the_clients_mean_update(opt):
  # The default loss L = <theta_g, theta_start - mean_c theta_c> decreases: the
  # new aggregate lies further along the mean client update theta_c - start.
  # (Eq. 15's new-minus-old delta with Alg. 1's descent step would move it back.)
  model = tiny_model()
  start, trained, before, after = _one_step("default", opt, model)
  mean_delta = flat(tree.weighted_mean(trained, jnp.ones(4))) - flat(start)
  moved = flat(after) - flat(before)
  assert np.abs(moved).max() > 0
  assert float(moved @ mean_delta) > 0


@pytest.mark.parametrize("kind", ["mse", "logcosh"])
def test_mse_and_logcosh_steps_bring_the_aggregate_closer_to_the_clients(kind):
  model = tiny_model()
  _, trained, before, after = _one_step(kind, optax.sgd(1e3), model)
  dist = lambda g: float(np.mean((np.asarray(jax.vmap(flat_j)(trained))
                                  - flat(g)[None]) ** 2))
  assert dist(after) < dist(before), (dist(before), dist(after))


def ordered(order):
  return hypergenfl.build(tiny_model(), optax.sgd(0.1), None, num_clients=5,
                          embed_dim=8, num_heads=2, embeddings="random", order=order,
                          server_optimizer="sgd", server_lr=1.0)


@functools.lru_cache(maxsize=None)
def ordered_init():
  """`ordered`'s initial server state (`init` does not read `order`: one
  compile for both orders)."""
  return jax.jit(ordered("update_first").init)(jax.random.key(8))[0]


@pytest.mark.parametrize("order", ["update_first", "aggregate_first"])
def test_order_picks_the_hypernetwork_the_aggregate_is_taken_with(order):
  model = tiny_model()
  module, hn, _, layer_of = weight_net(model)  # the algorithm's HN shape
  alg = ordered(order)
  server = ordered_init()
  start, trained = cohort(model, 3)
  ids = jnp.array([1, 3, 4])
  result = ClientResult(ids, 0, tree.broadcast(start, 3), trained,
                        jnp.ones(3, jnp.int32), jnp.ones(3))
  new, metrics = jax.jit(alg.server.update)(server, result, None)
  w = lambda hp: hn(hp.theta, jnp.take(hp.embeddings, ids, 0))
  used = w(new.hp) if order == "update_first" else w(server.hp)
  np.testing.assert_allclose(jnp.take(new.weights, ids, 0), used, rtol=1e-6)
  np.testing.assert_allclose(flat(new.params),
                             flat(hg.aggregate(trained, used, layer_of)),
                             rtol=1e-6)
  np.testing.assert_allclose(metrics["hg_client_weight"], jnp.mean(used, 1),
                             rtol=1e-6)
  # The hypernetwork moved, so the two orders really differ here.
  assert np.abs(np.asarray(w(new.hp) - w(server.hp))).max() > 1e-4


# ----------------------------------------------------------------------------
# Partial participation.


def test_only_the_active_clients_embedding_rows_change():
  model = tiny_model()
  _, hn, phi, layer_of = weight_net(model)
  n = 7
  emb = 1.0 + normal(9, (n, 8), 0.5)
  hp = HyperParams(theta=phi, embeddings=emb)
  step = hg.hypergenfl_step(hn, layer_of, optax.adamw(1e-2, weight_decay=0.1))
  update = jax.jit(step.update)
  opt = step.init(hp)
  for r, ids in enumerate(([6, 1, 2], [0, 3, 1], [5, 4, 6])):
    ids = jnp.array(ids)
    start, trained = cohort(model, 3, key=10 + r)
    updates, opt = update(trained, opt, hp, ids=ids, start=start)
    new = optax.apply_updates(hp, updates)
    changed = np.abs(np.asarray(new.embeddings - hp.embeddings)).max(1) > 0
    # Momentum and weight decay of earlier cohorts do not move idle rows.
    assert set(np.flatnonzero(changed)) == set(np.asarray(ids).tolist()), r
    hp = new
  # One-hot embeddings (Table 6) never move.
  step = hg.hypergenfl_step(hn, layer_of, optax.adamw(1e-2),
                            learn_embeddings=False)
  start, trained = cohort(model, 3)
  updates, _ = jax.jit(step.update)(trained, step.init(hp), hp,
                                    ids=jnp.array([0, 2, 5]), start=start)
  np.testing.assert_array_equal(optax.apply_updates(hp, updates).embeddings,
                                hp.embeddings)


# Slow: the server step touching only the cohort's embedding rows is
# test_only_the_active_clients_embedding_rows_change; the engine handing the
# server step its cohort's ids is tests/test_pinned.py::
# test_learns_above_chance_and_reproduces_pinned_numbers[hypergenfl] (a cohort
# of 3 of 4 clients: the rows 0..m-1 in place of the cohort's are off its
# pinned numbers).
@pytest.mark.slow
def test_engine_rounds_with_a_cohort_touch_only_its_rows():
  ds = synthetic_domains(num_domains=1, per_domain=60, classes=3, size=4)
  fed = federated.build(ds, partition.PartitionSpec(
      name="dirichlet", num_clients=6, alpha=1.0, min_partition_size=4),
                        target_domain=None)
  model = tiny_model(hidden=8, classes=3, shape=fed.image_shape)
  cfg = base_config()
  cfg.hypergenfl.embed_dim = 8
  alg = assemble.algorithm("hypergenfl", model, 6, cfg)
  round_fn = jax.jit(make_round(alg, engine.EngineConfig(
      rounds=1, epochs=1, batch_size=8, cohort_size=3, client_mapping="map"), 6))
  train = jax.tree.map(jnp.asarray, fed.train)
  carry = jax.jit(alg.init)(jax.random.key(0))
  for r in range(2):
    before = carry[0].hp.embeddings
    carry, metrics = round_fn(carry, jnp.int32(r), train, jax.random.key(1), None)
    changed = np.abs(np.asarray(carry[0].hp.embeddings - before)).max(1) > 0
    assert set(np.flatnonzero(changed)) == set(np.asarray(metrics["cohort"]).tolist())
    assert metrics["hg_client_weight"].shape == (3,)
    w = np.asarray(carry[0].weights)
    np.testing.assert_allclose(w[np.asarray(metrics["cohort"])].sum(0), 1.0,
                               rtol=1e-5)


# ----------------------------------------------------------------------------
# Config, switches, a small label-skewed run.


def test_config_defaults_and_switches():
  cfg = base_config()
  h = cfg.hypergenfl
  assert (h.embed_dim, h.embeddings, h.attention_layers, h.granularity,
          h.server_loss,
          h.server_optimizer, h.server_lr, h.server_weight_decay) == (
              128, "ones", 1, "module", "default", "adamw", 1e-2, 1e-5)
  model = tiny_model()
  # The initial embedding table alone (the rest of init is not compiled).
  table = lambda alg: jax.jit(lambda k: alg.init(k)[0].hp.embeddings)(
      jax.random.key(0))
  cfg.hypergenfl.embeddings = "onehot"
  cfg.hypergenfl.num_heads = 1
  alg = assemble.algorithm("hypergenfl", model, 5, cfg)
  np.testing.assert_array_equal(table(alg), np.eye(5))
  cfg.hypergenfl.embeddings = "random"
  cfg.hypergenfl.num_heads = 4
  alg = assemble.algorithm("hypergenfl", model, 5, cfg)
  embeddings = table(alg)
  assert embeddings.shape == (5, 128)
  assert float(np.std(embeddings)) > 0.5
  for key, bad in (("embeddings", "zeros"), ("server_loss", "l1"), ("order", "x"),
                   ("granularity", "block")):
    c = base_config()
    c.hypergenfl[key] = bad
    with pytest.raises(ValueError, match=key):
      assemble.algorithm("hypergenfl", model, 5, c)


# Slow: learning above chance with a cohort is tests/test_pinned.py::
# test_learns_above_chance_and_reproduces_pinned_numbers[hypergenfl] (which
# also pins the engine handing the server step its cohort); a cohort's rows
# and weights are test_only_the_active_clients_embedding_rows_change and
# test_identical_embeddings_give_uniform_weights_and_the_plain_mean (and,
# with -m slow, test_engine_rounds_with_a_cohort_touch_only_its_rows); the
# reported metrics and extras are
# test_a_run_whose_hypernetwork_dies_is_warned_about.
@pytest.mark.slow
def test_learns_above_chance_on_label_skewed_clients_with_partial_participation():
  ds = synthetic_domains(num_domains=1, per_domain=480, classes=4, size=8,
                         noise=60)
  fed = federated.build(ds, partition.PartitionSpec(
      name="dirichlet", num_clients=8, alpha=0.3, min_partition_size=10),
                        target_domain=None)
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean, std=fed.std)
  cfg = base_config()
  cfg.hypergenfl.embed_dim = 16
  alg = assemble.algorithm("hypergenfl", model, fed.num_clients, cfg)
  res = engine.run(alg, fed, model, engine.EngineConfig(
      rounds=8, eval_every=4, epochs=1, batch_size=16, cohort_size=4,
      progress=False, eval_batch_size=32))
  assert res.final["id_acc"] > 0.25 + 0.3, res.final
  assert res.history[-1]["train_loss"] < res.history[0]["train_loss"]
  w_min = np.asarray(res.round_metrics["hg_weight_min"])
  w_max = np.asarray(res.round_metrics["hg_weight_max"])
  assert w_min.shape == (8,) and np.all(w_min > 0) and np.all(w_max < 1)
  assert np.all(np.asarray(res.round_metrics["hg_client_weight"]).shape == (8, 4))
  extras = res.final["extras"]
  assert np.asarray(extras["embeddings"]).shape == (8, 16)
  w = np.asarray(extras["weights"])
  assert w.shape == (8, 2) and (w.sum(1) > 0).sum() == 4
  np.testing.assert_allclose(w.sum(0), 1.0, rtol=1e-5)


@functools.lru_cache(maxsize=None)
def cifar_cnn_hypergenfl():
  """HyperGenFL for 10 clients on the 5-layer CIFAR CNN: (its attention
  module, jitted: its init, a draw of phi from a key, the largest decoder
  preactivation of (phi, embeddings)); one compile each for every seed."""
  from fedjax_dg.models.hypergenfl import decoder_preactivations
  model = models.get_model("cifar_cnn", input_shape=(32, 32, 3), num_classes=10)
  alg = hypergenfl.build(model, optax.sgd(0.1), None, num_clients=10)
  layer_of, _ = hg.layer_groups(jax.eval_shape(model.init, jax.random.key(0)))
  module = AttentionScores(embed_dim=128, num_layers=max(layer_of) + 1)
  draw = jax.jit(lambda key: init_attention_scores(module, key, 128))
  top = jax.jit(lambda phi, emb: jnp.max(decoder_preactivations(module, phi,
                                                                emb)))
  # Only the hypernetwork of the server state (the CNN's init, which XLA
  # drops as an unused output, is not compiled).
  init_hp = jax.jit(lambda key: alg.init(key)[0].hp)
  return module, init_hp, draw, top


@pytest.mark.parametrize("seed", [3, 55])
def test_an_initialization_cannot_start_dead(seed):
  """With the 5-layer CIFAR CNN, seeds 3 and 55 (as the engine derives the init
  key) draw a hypernetwork whose every decoder ReLU is off: zero gradients,
  weights 1/m forever. The algorithm re-draws phi until one is on."""
  _, init, draw, top = cifar_cnn_hypergenfl()
  init_key = jax.random.fold_in(jax.random.key(seed), 2**31 - 1)
  hp = init(init_key)
  emb = hp.embeddings
  assert float(top(hp.theta, emb)) > 0
  # The plain draw from the same key was dead (what the re-draw fixes) ...
  _, k_phi, _ = jax.random.split(init_key, 3)
  assert float(top(draw(k_phi), emb)) <= 0
  # ... and the kept phi is the first alive draw from fold_in(k_phi, t),
  # t = 1, 2, ... (a plain loop).
  t = 1
  while float(top(draw(jax.random.fold_in(k_phi, t)), emb)) <= 0:
    t += 1
  chex.assert_trees_all_equal(hp.theta, draw(jax.random.fold_in(k_phi, t)))


def test_an_initialization_that_starts_alive_keeps_its_draw():
  from fedjax_dg.algorithms import hypergenfl as hg_alg
  module, _, draw, _ = cifar_cnn_hypergenfl()
  alive_key = jax.random.fold_in(jax.random.key(0), 2**31 - 1)
  _, k0, _ = jax.random.split(alive_key, 3)
  kept = jax.jit(lambda k: hg_alg.init_alive(module, k, 128,
                                             jnp.ones((10, 128))))(k0)
  chex.assert_trees_all_equal(kept, draw(k0))


def test_diagnose_names_the_round_the_hypernetwork_died():
  """`diagnose` warns when hg_dead is 1 at the end, naming the first round of
  that dead stretch; a hypernetwork alive at the end (or one dead only for a
  while) gives no warning."""
  from fedjax_dg.algorithms import hypergenfl as hg_alg
  assert hg_alg.diagnose({"hg_dead": [0.5, 1.0, 0.5, 0.5]}) == []
  assert hg_alg.diagnose({}) == []
  (w,) = hg_alg.diagnose({"hg_dead": [0.5, 1.0, 0.4, 1.0, 1.0]})
  assert "dead at round 3" in w and "2 of 5 rounds" in w
  (w,) = hg_alg.diagnose({"hg_dead": [1.0, 1.0]})
  assert "dead at round 0" in w and "unweighted FedAvg" in w


def test_a_run_whose_hypernetwork_dies_is_warned_about(fed3, monkeypatch):
  """A hypernetwork whose every decoder ReLU (Eq. 5) is off never trains:
  its gradients are exactly zero, every weight is 1/m, and the run is
  unweighted FedAvg. The registry's diagnose names the round the dead streak
  began (here 0, to the end) and the run's report prints it.

  The run starts dead by construction (decoder kernel 0, bias -1: every
  pre-activation is -1 for any embedding), so the outcome is the same on
  every CPU. An earlier version killed the hypernetwork with a server
  learning rate of 1 and read the round from the run; whether it died
  depended on the float summation order (its gradients are ~1e-9 and Adam
  rescales them to ~lr): on an AMD EPYC (AVX2) it stayed half alive. The
  round a streak begins in mid-run is checked on given metrics above."""
  from fedjax_dg.report import run_summary
  model = models.get_model("mlp", input_shape=fed3.image_shape,
                           num_classes=fed3.num_classes, mean=fed3.mean,
                           std=fed3.std, hidden=6)

  def dead_init(module, key, dim, embeddings, max_tries=64):
    del embeddings, max_tries
    phi = hypergenfl.init_attention_scores(module, key, dim)
    decode = dict(kernel=jnp.zeros_like(phi["decode"]["kernel"]),
                  bias=-jnp.ones_like(phi["decode"]["bias"]))
    return {**phi, "decode": decode}

  monkeypatch.setattr(hypergenfl, "init_alive", dead_init)
  alg = assemble.algorithm("hypergenfl", model, fed3.num_clients,
                           base_config())
  res = engine.run(alg, fed3, model, engine.EngineConfig(
      rounds=4, eval_every=4, epochs=1, batch_size=16, progress=False))
  np.testing.assert_array_equal(res.round_metrics["hg_dead"], [1.0] * 4)
  (w,) = algorithms.spec("hypergenfl").diagnose(res.round_metrics)
  assert w.startswith("hypergenfl: the attention hypernetwork went dead at "
                      "round 0 and stayed dead to the end (4 of 4 rounds)")
  results = dict(runs=[dict(target="0", warnings=[w]),
                       dict(target="1", warnings=[])])
  assert run_summary.warnings_text(results) == f"WARNING (0): {w}"
  # The run's reported metrics (dead: every weight is 1/m, m = 3 clients, in
  # every round) and extras: the server's embedding table and its [N, L]
  # weights table (every client in every cohort here).
  np.testing.assert_allclose(res.round_metrics["hg_weight_min"], [1 / 3] * 4,
                             rtol=1e-6)
  np.testing.assert_allclose(res.round_metrics["hg_weight_max"], [1 / 3] * 4,
                             rtol=1e-6)
  assert np.asarray(res.round_metrics["hg_client_weight"]).shape == (4, 3)
  extras = res.final["extras"]
  np.testing.assert_array_equal(extras["embeddings"], res.server.hp.embeddings)
  assert np.asarray(extras["embeddings"]).shape == (3, 128)
  np.testing.assert_array_equal(extras["weights"], res.server.weights)
  assert np.asarray(extras["weights"]).shape == (3, 2)
  np.testing.assert_allclose(np.sum(extras["weights"], 0), 1.0, rtol=1e-5)
