import jax
import jax.numpy as jnp
import numpy as np

from fedjax_dg import tree


def _stacked(key, c=4):
  k1, k2 = jax.random.split(key)
  return {"w": jax.random.normal(k1, (c, 3, 2)), "b": jax.random.normal(k2, (c, 5))}


def test_stack_unstack_roundtrip():
  s = _stacked(jax.random.key(0))
  back = tree.stack(tree.unstack(s))
  jax.tree.map(np.testing.assert_array_equal, s, back)


def test_weighted_mean_matches_numpy_loop():
  s = _stacked(jax.random.key(1))
  w = jnp.array([1.0, 2.0, 3.0, 4.0])
  got = tree.weighted_mean(s, w)
  for name in s:
    want = sum(float(w[i]) * np.asarray(s[name][i]) for i in range(4)) / 10.0
    np.testing.assert_allclose(got[name], want, rtol=1e-6)


def test_rowwise_vdot_and_cosine():
  a, b = _stacked(jax.random.key(2)), _stacked(jax.random.key(3))
  flat = lambda t, i: np.concatenate([np.ravel(t[k][i]) for k in sorted(t)])
  got = tree.rowwise_vdot(a, b)
  for i in range(4):
    np.testing.assert_allclose(got[i], flat(a, i) @ flat(b, i), rtol=1e-5)
  a0 = jax.tree.map(lambda x: x[0], a)
  b0 = jax.tree.map(lambda x: x[0], b)
  fa, fb = flat(a, 0), flat(b, 0)
  np.testing.assert_allclose(
      tree.cosine(a0, b0), fa @ fb / np.linalg.norm(fa) / np.linalg.norm(fb), rtol=1e-5)


def test_take_put():
  s = _stacked(jax.random.key(4))
  idx = jnp.array([2, 0])
  rows = tree.take(s, idx)
  np.testing.assert_array_equal(rows["w"][0], s["w"][2])
  zeroed = tree.put(s, idx, jax.tree.map(jnp.zeros_like, rows))
  assert float(jnp.abs(zeroed["w"][2]).sum()) == 0.0
  np.testing.assert_array_equal(zeroed["w"][1], s["w"][1])
