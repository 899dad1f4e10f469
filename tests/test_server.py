"""Server transforms against independent computations (brute-force autodiff, numpy)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_dg import server
from fedjax_dg.server.hypernetwork import HyperParams, hypernetwork_step

jax.config.update("jax_enable_x64", False)


def normal(seed, shape, scale=1.0):
  """N(0, scale^2) float32 draws from numpy (no compile per shape, as
  jax.random's op-by-op draws have)."""
  return (scale * np.random.default_rng(seed).normal(size=shape)).astype(
      np.float32)


def tiny_generator(seed, e=3, hidden=5):
  """h(theta, emb) -> {'w': [4, 2], 'b': [2]}: a 2-layer tanh MLP generator."""
  theta = {"l1": normal((seed, 0), (e, hidden), 0.5),
           "w": normal((seed, 1), (hidden, 8), 0.5),
           "b": normal((seed, 2), (hidden, 2), 0.5)}

  def h(th, emb):
    z = jnp.tanh(emb @ th["l1"])
    return {"w": (z @ th["w"]).reshape(4, 2), "b": z @ th["b"]}

  return h, theta


def cohort_inputs(seed, m, e=3):
  """m clients' embeddings [m, e] and deltas of tiny_generator's output."""
  return normal((seed, 0), (m, e)), {"w": normal((seed, 1), (m, 4, 2)),
                                     "b": normal((seed, 2), (m, 2))}


def brute_force(h, theta, emb, deltas, temperature=1.0):
  """Per-client gradients g_i = d/dtheta <h(theta, e_i), delta_i>, stacked."""
  m = emb.shape[0]

  @jax.jit  # one program for every client
  def grads(th, e, d_i):
    f = lambda th, e: sum(jnp.vdot(a, b) for a, b in zip(
        jax.tree.leaves(h(th, e)), jax.tree.leaves(d_i)))
    return jax.grad(f, argnums=(0, 1))(th, e)

  g_theta, g_emb = [], []
  for i in range(m):
    gt, ge = grads(theta, emb[i], jax.tree.map(lambda d: d[i], deltas))
    g_theta.append(np.concatenate([np.ravel(x) for x in jax.tree.leaves(gt)]))
    g_emb.append(np.asarray(ge))
  G = np.stack(g_theta)
  g_avg = G.mean(0)
  cos = G @ g_avg / (np.linalg.norm(G, axis=1) * np.linalg.norm(g_avg))
  w = np.exp(cos / temperature) / np.exp(cos / temperature).sum()
  # Embedding gradients as full [m, N=m, e] tables (client i only touches row i).
  E = np.zeros((m, m, emb.shape[1]))
  for i in range(m):
    E[i, i] = g_emb[i]
  Ef = E.reshape(m, -1)
  e_avg = Ef.mean(0)
  cos_e = Ef @ e_avg / (np.linalg.norm(Ef, axis=1) * np.linalg.norm(e_avg))
  w_e = np.exp(cos_e / temperature) / np.exp(cos_e / temperature).sum()
  return dict(G=G, w=w, cos=cos, g=(w[:, None] * G).sum(0),
              cos_e=cos_e, w_e=w_e, g_emb=np.stack(g_emb) * w_e[:, None])


def grads_of(h, **kw):
  """server.hypernetwork_grads(h, ..., **kw), jitted (one program; op by op
  every op compiles on its own)."""
  return jax.jit(lambda theta, emb, deltas: server.hypernetwork_grads(
      h, theta, emb, deltas, **kw))


@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_gradalign_matches_brute_force(temperature):
  h, theta = tiny_generator(0)
  m = 5
  emb, deltas = cohort_inputs(1, m)
  got = grads_of(h, align=True, temperature=temperature, norm_batch_size=2)(
      theta, emb, deltas)
  want = brute_force(h, theta, emb, deltas, temperature)
  np.testing.assert_allclose(got.cos_theta, want["cos"], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got.weights_theta, want["w"], rtol=1e-4)
  flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(got.theta)])
  np.testing.assert_allclose(flat, want["g"], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got.cos_emb, want["cos_e"], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got.weights_emb, want["w_e"], rtol=1e-4)
  np.testing.assert_allclose(got.embeddings, want["g_emb"], rtol=1e-4, atol=1e-6)


def joint_brute_force(h, theta, emb, deltas, temperature=1.0):
  """arXiv v1: one GradAlign over the concatenated (theta, embedding table)
  gradients of each client."""
  b = brute_force(h, theta, emb, deltas)
  m, e = emb.shape
  tables = np.zeros((m, m * e))  # client i's gradient of the [m, e] table
  raw = b["g_emb"] / b["w_e"][:, None]  # unweighted rows
  for i in range(m):
    tables[i, i * e:(i + 1) * e] = raw[i]
  J = np.concatenate([b["G"], tables], axis=1)
  avg = J.mean(0)
  cos = J @ avg / (np.linalg.norm(J, axis=1) * np.linalg.norm(avg))
  w = np.exp(cos / temperature) / np.exp(cos / temperature).sum()
  return dict(cos=cos, w=w, g=(w[:, None] * b["G"]).sum(0),
              g_emb=raw * w[:, None], raw=raw)


@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_joint_gradalign_matches_brute_force(temperature):
  h, theta = tiny_generator(0)
  m = 5
  emb, deltas = cohort_inputs(1, m)
  got = grads_of(h, temperature=temperature, norm_batch_size=2,
                 over="joint")(theta, emb, deltas)
  want = joint_brute_force(h, theta, emb, deltas, temperature)
  np.testing.assert_allclose(got.cos_theta, want["cos"], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got.weights_theta, want["w"], rtol=1e-4)
  np.testing.assert_allclose(got.weights_emb, want["w"], rtol=1e-4)
  flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(got.theta)])
  np.testing.assert_allclose(flat, want["g"], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got.embeddings, want["g_emb"], rtol=1e-4, atol=1e-6)
  # Joint weights differ from both separate softmaxes.
  sep = brute_force(h, theta, emb, deltas, temperature)
  assert np.max(np.abs(want["w"] - sep["w"])) > 1e-3
  assert np.max(np.abs(want["w"] - sep["w_e"])) > 1e-3
  # "theta": theta weighted as "separate", embedding rows a plain mean.
  th = grads_of(h, temperature=temperature, over="theta")(theta, emb, deltas)
  np.testing.assert_allclose(th.weights_theta, sep["w"], rtol=1e-4)
  np.testing.assert_allclose(th.weights_emb, np.full(m, 1 / m), rtol=1e-6)
  np.testing.assert_allclose(th.embeddings, want["raw"] / m, rtol=1e-4, atol=1e-6)


def test_gradalign_weighs_an_opposed_client_least():
  """Independent of the brute force: with a linear generator h(theta, e) =
  theta (every client the same model), client gradients are the deltas; two
  clients agree and one opposes them: it gets the smallest weight (softmax of
  +cos, not -cos), the two agreeing ones equal weights."""
  h = lambda th, e: th
  theta = {"w": jnp.zeros(4)}
  d = jnp.array([[1.0, 2.0, 0.0, 1.0], [1.0, 2.0, 0.0, 1.0],
                 [-1.0, -2.0, 0.5, -1.0]])
  got = grads_of(h)(theta, jnp.zeros((3, 1)), {"w": d})
  w = np.asarray(got.weights_theta)
  assert w[2] < w[0] and abs(w[0] - w[1]) < 1e-7 and abs(w.sum() - 1) < 1e-6


def test_without_gradalign_is_the_plain_mean():
  h, theta = tiny_generator(4)
  emb, deltas = cohort_inputs(5, 3)
  got = grads_of(h, align=False)(theta, emb, deltas)
  want = brute_force(h, theta, emb, deltas)
  flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(got.theta)])
  np.testing.assert_allclose(flat, want["G"].mean(0), rtol=1e-4, atol=1e-6)


def test_hypernetwork_step_moves_generated_params_toward_trained():
  h, theta = tiny_generator(8)
  n = 4
  hp = HyperParams(theta=theta, embeddings=normal(9, (n, 3)))
  gen = jax.jit(jax.vmap(h, in_axes=(None, 0)))
  start = gen(hp.theta, hp.embeddings)
  target = jax.tree.map(lambda x: x + normal(10, x.shape, 0.3), start)
  for align in (True, False):
    step = hypernetwork_step(h, optax.sgd(0.05), align=align)
    deltas = optax.tree.sub(start, target)  # old minus new

    @jax.jit
    def update(deltas, hp, step=step):
      updates, state = step.update(deltas, step.init(hp), hp,
                                   ids=jnp.arange(n))
      return optax.apply_updates(hp, updates), state

    new_hp, state = update(deltas, hp)
    # The state reports the cohort's GradAlign weights (row per client).
    np.testing.assert_allclose(jnp.sum(state.weights_theta), 1.0, rtol=1e-5)
    before = optax.tree.norm(optax.tree.sub(start, target))
    after = optax.tree.norm(optax.tree.sub(gen(new_hp.theta, new_hp.embeddings), target))
    assert float(after) < float(before), (align, before, after)


def test_ema_sequence_matches_hand_computation():
  decay, warm = 0.75, 2
  t = server.ema(decay, warm)
  thetas = [np.array([1.0, -2.0]) * (k + 1) for k in range(6)]
  state = t.init(jnp.asarray(thetas[0]))
  outs, ema = [], None
  for r, th in enumerate(thetas):
    assert int(state.count) == r  # the round counter lives in the state
    out, state = t.update(jnp.asarray(th), state)
    outs.append(np.asarray(out))
    # Hand computation of Alg. 4.
    if r < warm:
      want = th
    elif r == warm:
      ema, want = th, th
    else:
      ema = decay * th + (1 - decay) * ema
      want = ema
    np.testing.assert_allclose(outs[-1], want, rtol=1e-6)
  assert not np.allclose(outs[-1], thetas[-1])  # smoothing actually happened


def test_weighted_mean_weights_by_examples():
  stacked = {"w": jnp.array([[1.0], [3.0]])}
  t = server.weighted_mean()
  out, _ = t.update(stacked, t.init(None), weights=jnp.array([1, 3]))
  np.testing.assert_allclose(out["w"], [2.5])


def test_closed_form_client_norms_match_per_client_autodiff():
  """hFedF's HyperNetwork: |J_i^T delta_i|^2 in closed form (linear heads) equals
  the per-client autodiff gradient, and GradAlign with it equals brute force."""
  from fedjax_dg import models
  from fedjax_dg.models.hypernetwork import (client_grad_sq_norms,
                                              make_hypernetwork)
  model = models.get_model("mlp", input_shape=(4, 4, 1), num_classes=3)
  module, theta = make_hypernetwork(model, jax.random.key(0), hidden=6,
                                    n_hidden=2, embed_dim=3)
  h = lambda th, v: module.apply({"params": th}, v)
  m = 4
  emb = normal(1, (m, 3))
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  leaves, treedef = jax.tree.flatten(shapes)
  deltas = jax.tree.unflatten(treedef, [
      normal((2, i), (m,) + s.shape) for i, s in enumerate(leaves)])
  want = brute_force(h, theta, emb, deltas)
  got_sq = jax.jit(client_grad_sq_norms(module))(theta, emb, deltas)
  np.testing.assert_allclose(got_sq, (want["G"] ** 2).sum(1), rtol=1e-4)
  got = grads_of(h, client_sq_norms=client_grad_sq_norms(module))(
      theta, emb, deltas)
  np.testing.assert_allclose(got.cos_theta, want["cos"], rtol=1e-4, atol=1e-5)
  flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(got.theta)])
  np.testing.assert_allclose(flat, want["g"], rtol=1e-4, atol=1e-5)


def test_hypernetwork_step_names_the_allowed_settings():
  from fedjax_dg.errors import ConfigError
  h = lambda theta, e: theta
  with pytest.raises(ConfigError, match=r"^gradalign granularity='layer': "
                     r"allowed \('model', 'tensor'\)$"):
    hypernetwork_step(h, optax.sgd(1.0), granularity="layer")
  with pytest.raises(ConfigError, match=r"^gradalign align_over='both': "
                     r"allowed \('separate', 'joint', 'theta'\)$"):
    hypernetwork_step(h, optax.sgd(1.0), align_over="both")
