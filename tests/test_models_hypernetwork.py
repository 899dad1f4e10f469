"""HyperNetwork (hFedF Table 8 / pFedHN): structure, head init, vjp/jvp/vmap."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_dg import models
from fedjax_dg.models import hypernetwork

_RNG = np.random.default_rng(0)


@functools.lru_cache(maxsize=None)
def _setup(head_init="client_init"):
  client = models.get_model("mlp", input_shape=(16, 16, 1), num_classes=5,
                            hidden=32)
  hnet, params = models.make_hypernetwork(client, jax.random.key(0), hidden=16,
                                          n_hidden=3, head_init=head_init,
                                          embed_dim=3)
  return client, hnet, params


def _emb(*shape):
  return jnp.asarray(_RNG.standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize("head_init", ["client_init", "default"])
def test_output_matches_client_params(head_init):
  client, hnet, params = _setup(head_init)
  target = jax.eval_shape(client.init, jax.random.key(0))
  gen = jax.jit(hnet.apply)({"params": params}, _emb(3))
  assert jax.tree.structure(gen) == jax.tree.structure(target)
  jax.tree.map(lambda g, t: (g.shape, g.dtype) == (t.shape, t.dtype) or
               pytest.fail(f"{g.shape} vs {t.shape}"), gen, target)
  # Generated params run the client model.
  x = jnp.zeros((2, 16, 16, 1), jnp.uint8)
  assert client.apply(gen, x).shape == (2, 5)
  # Trunk: [Linear(16) + LeakyReLU] x 3 -> Linear(16); one head per tensor.
  assert params["trunk_0"]["kernel"].shape == (3, 16)
  assert params["trunk_3"]["kernel"].shape == (16, 16)
  assert params["head.fc1.kernel"]["kernel"].shape == (16, 256 * 32)
  assert params["head.fc1.kernel"]["bias"].shape == (256 * 32,)


def test_client_init_heads_generate_a_client_init():
  client, hnet, params = _setup("client_init")
  sample = client.init(jax.random.key(7))
  gen = jax.jit(hnet.apply)({"params": params}, _emb(3))
  for (path, g), s in zip(jax.tree_util.tree_flatten_with_path(gen)[0],
                          jax.tree.leaves(sample)):
    ratio = float(jnp.std(g) / jnp.std(s))
    assert 0.7 < ratio < 1.4, (path, ratio)
  # The heads' biases are the client sample: the embedding only modulates it.
  _, default_hnet, default_params = _setup("default")
  gen_default = jax.jit(default_hnet.apply)({"params": default_params}, _emb(3))
  fc1 = lambda t: float(jnp.std(t["fc1"]["kernel"]))
  assert fc1(gen_default) > 3 * fc1(sample)  # the reason for "client_init"


def test_vjp_matches_finite_differences_and_jvp():
  _, hnet, params = _setup()
  emb = _emb(3)
  cot = jax.tree.map(lambda a: jnp.asarray(
      _RNG.standard_normal(a.shape).astype(np.float32)),
      jax.eval_shape(hnet.apply, {"params": params}, emb))
  # A direction that moves every tensor by ~1% of its own scale.
  direction = jax.tree.map(lambda a: jnp.asarray(
      _RNG.standard_normal(a.shape).astype(np.float32)) * jnp.std(a), params)

  def f(theta, v):
    out = hnet.apply({"params": theta}, v)
    return sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(out),
                                              jax.tree.leaves(cot)))

  @jax.jit
  def run(theta, v):
    out, pullback = jax.vjp(lambda t, v: hnet.apply({"params": t}, v), theta, v)
    g_theta, g_v = pullback(cot)
    eps = 1e-2
    shifted = lambda s: jax.tree.map(lambda a, d: a + s * eps * d, theta,
                                     direction)
    fd = (f(shifted(1.0), v) - f(shifted(-1.0), v)) / (2 * eps)
    _, jvp_out = jax.jvp(lambda t: f(t, v), (theta,), (direction,))
    analytic = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(g_theta),
                                                  jax.tree.leaves(direction)))
    return analytic, fd, jvp_out, g_v

  analytic, fd, jvp_out, g_v = run(params, emb)
  print("vjp.d", analytic, "finite difference", fd, "jvp", jvp_out)
  np.testing.assert_allclose(analytic, fd, rtol=1e-3)
  np.testing.assert_allclose(analytic, jvp_out, rtol=1e-4)
  assert g_v.shape == (3,) and np.all(np.isfinite(g_v))


def test_vmap_over_embeddings_equals_loop_and_batched_call():
  _, hnet, params = _setup()
  embs = _emb(4, 3)
  apply = lambda e: hnet.apply({"params": params}, e)
  batched = jax.jit(jax.vmap(apply))(embs)
  direct = jax.jit(apply)(embs)  # leading axes are kept
  for i in range(4):
    one = jax.jit(apply)(embs[i])
    jax.tree.map(lambda b, o, d: (np.testing.assert_allclose(b[i], o, rtol=1e-5,
                                                             atol=1e-6),
                                  np.testing.assert_allclose(d[i], o, rtol=1e-5,
                                                             atol=1e-6)),
                 batched, one, direct)


def test_inception_hypernetwork_param_count():
  client = models.get_model("inception_cnn", input_shape=(32, 32, 3),
                            num_classes=7)
  target = jax.eval_shape(client.init, jax.random.key(0))
  p = hypernetwork.num_params(target)
  assert p == 928_199
  e = 3
  hnet = models.HyperNetwork(target=target, head_init="default")
  shapes = jax.eval_shape(hnet.init, jax.random.key(0), jnp.zeros((e,)))
  n = hypernetwork.num_params(shapes)
  # Trunk: (e*50 + 50) + 3 * (50*50 + 50); heads: (50 + 1) per client scalar.
  assert n == (e * 50 + 50) + 3 * 2550 + 51 * p == 47_345_999
  print(f"hypernetwork params for inception_cnn (e={e}, 7 classes): {n}")
