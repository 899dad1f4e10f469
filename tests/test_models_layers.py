"""Loop-safe layers: conv impls vs lax.conv, pooling vs numpy loops, inits."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from fedjax_dg.models import layers

# Test data from numpy: every distinct jax.random shape costs ~1 s of XLA:CPU compile.
_RNG = np.random.default_rng(0)


def _normal(*shape):
  return jnp.asarray(_RNG.standard_normal(shape).astype(np.float32))


def _reference(x, w, strides, padding):
  pads = layers.conv_padding(padding, w.shape[:2], layers._pair(strides),
                             x.shape[1:3])
  return lax.conv_general_dilated(x, w, layers._pair(strides), pads,
                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _compare(impl, x, w, cases):
  """Asserts values and grads (wrt x and w) of `impl` equal lax.conv's; one jit."""

  def value_and_grads(f, c):
    return (f(x, w),) + jax.grad(lambda x, w: jnp.sum(f(x, w) * c), (0, 1))(x, w)

  @jax.jit
  def run(x, w, cs):
    out = []
    for (strides, padding), c in zip(cases, cs):
      ours = lambda x, w: layers.conv2d(x, w, strides=strides, padding=padding,
                                        impl=impl)
      ref = lambda x, w: _reference(x, w, strides, padding)
      out.append((value_and_grads(ours, c), value_and_grads(ref, c)))
    return out

  cs = [_normal(*jax.eval_shape(lambda x, w, c=case: _reference(x, w, *c), x,
                                w).shape) for case in cases]
  for case, (ours, ref) in zip(cases, run(x, w, cs)):
    for name, a, b in zip(("value", "d/dx", "d/dw"), ours, ref):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4,
                                 err_msg=f"{impl} {case} {name}")


# Per implementation, every kernel size and both input widths run by default
# (1x1 on 3 channels, 3x3 on 3, 5x5 on 1: each k's padding and stride cases,
# a single input channel); the other three (k, cin) pairs are slow: the same
# code on the same cases (test ids as before: impl-k-cin).
_DEFAULT_K_CIN = ((1, 3), (3, 3), (5, 1))


@pytest.mark.parametrize("impl,k,cin", [
    pytest.param(impl, k, cin, id=f"{cin}-{k}-{impl}",
                 marks=() if (k, cin) in _DEFAULT_K_CIN else pytest.mark.slow)
    for cin in (1, 3) for k in (1, 3, 5)
    for impl in ("im2col", "custom_vjp", "taps")])
def test_conv_matches_lax_conv(impl, k, cin):
  cases = [(1, "SAME"), (1, k // 2), (1, "VALID"), (2, "SAME"), (2, (1, 2))]
  _compare(impl, _normal(2, 7, 6, cin), _normal(k, k, cin, 4), cases)


def test_custom_vjp_padding_larger_than_kernel():
  _compare("custom_vjp", _normal(2, 6, 6, 2), _normal(3, 3, 2, 3), [(1, 4)])


def test_taps_where_auto_picks_it():
  """A wide input to a few channels (AdaIN's decoder's last conv, 64 -> 3)."""
  _compare("taps", _normal(2, 6, 5, 64), _normal(3, 3, 64, 3),
           [(1, "SAME"), (2, (1, 2)), (1, "VALID")])


@functools.lru_cache(maxsize=None)
def _scan_data(k, cin):
  """3 clients' kernels, 4 local steps of batch 2 and targets; the XLA
  conv's final kernels and losses on them (computed once for the three
  implementations)."""
  ws = _normal(3, k, k, cin, 4) * 0.3  # 3 clients
  xs = _normal(3, 4, 2, 6, 6, cin)    # 4 local steps, batch 2
  ts = _normal(3, 4, 2, 6, 6, 4) * 0.5
  return (ws, xs, ts), _client_loop("xla", k)(ws, xs, ts)


def _client_loop(impl, k):
  """lax.map over clients x lax.scan over SGD steps on a conv -> final kernels."""

  def loss(w, x, t):
    y = layers.conv2d(x, w, padding="SAME", impl=impl)
    return jnp.mean((jnp.tanh(y) - t) ** 2)

  def client(args):
    w, xs, ts = args

    def step(w, batch):
      g = jax.grad(loss)(w, *batch)
      return w - 0.5 * g, loss(w, *batch)

    return lax.scan(step, w, (xs, ts))

  return jax.jit(lambda ws, xs, ts: lax.map(client, (ws, xs, ts)))


@pytest.mark.parametrize("impl", ["im2col", "custom_vjp", "taps"])
def test_conv_inside_scan_and_map_matches_xla(impl):
  for k, cin in ((3, 3), (5, 1)):
    data, (w_ref, l_ref) = _scan_data(k, cin)
    w, l = _client_loop(impl, k)(*data)
    np.testing.assert_allclose(l, l_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(w, w_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["im2col", "custom_vjp"])
def test_conv_vmap_over_client_kernels(impl):
  ws, xs = _normal(3, 3, 3, 2, 4), _normal(3, 2, 5, 5, 2)

  def f(impl):
    g = lambda w, x: jax.grad(
        lambda w: jnp.sum(layers.conv2d(x, w, impl=impl) ** 2))(w)
    return jax.jit(jax.vmap(g))(ws, xs)

  np.testing.assert_allclose(f(impl), f("xla"), rtol=1e-4, atol=1e-4)


def test_auto_resolution():
  assert layers.resolve_conv_impl("im2col", (3, 3, 64, 8)) == "im2col"
  if jax.default_backend() == "cpu":
    assert layers.resolve_conv_impl("auto", (3, 3, 3, 32)) == "im2col"
    assert layers.resolve_conv_impl("auto", (1, 1, 176, 32)) == "im2col"
    assert layers.resolve_conv_impl("auto", (3, 3, 176, 64)) == "custom_vjp"
    assert layers.resolve_conv_impl("auto", (3, 3, 64, 3)) == "taps"
    assert layers.resolve_conv_impl("auto", (3, 3, 64, 8)) == "custom_vjp"
  else:
    assert layers.resolve_conv_impl("auto", (3, 3, 3, 32)) == "xla"
  with pytest.raises(ValueError):
    layers.resolve_conv_impl("cudnn")


def _init(module, x, key=0):
  with layers.init_rng_mode():  # Cheap to compile (see layers.init_rng_mode).
    return jax.jit(module.init)(jax.random.key(key), x)


def test_conv_and_dense_params_match_flax_modules():
  x = jnp.asarray(_RNG.standard_normal((1, 6, 6, 3)).astype(np.float32))
  ours = _init(layers.Conv(5, 3, weight_init="flax"), x)
  theirs = _init(nn.Conv(5, (3, 3)), x)
  jax.tree.map(np.testing.assert_array_equal, ours, theirs)
  for impl in ("im2col", "custom_vjp", "auto"):
    np.testing.assert_allclose(
        jax.jit(layers.Conv(5, 3, impl=impl).apply)(ours, x),
        jax.jit(nn.Conv(5, (3, 3)).apply)(ours, x), rtol=1e-5, atol=1e-5)
  ours = _init(layers.Dense(4, weight_init="flax"), x)
  theirs = _init(nn.Dense(4), x)
  jax.tree.map(np.testing.assert_array_equal, ours, theirs)


def test_torch_init_bounds():
  p = _init(layers.Conv(64, 3, weight_init="torch"), jnp.ones((1, 6, 6, 16)))
  p = p["params"]
  bound = 1 / math.sqrt(3 * 3 * 16)
  for name in ("kernel", "bias"):
    v = np.asarray(p[name])
    assert np.abs(v).max() <= bound
    assert np.abs(v).max() > 0.9 * bound
  np.testing.assert_allclose(np.std(p["kernel"]), bound / math.sqrt(3), rtol=0.05)
  p = _init(layers.Dense(8, weight_init="torch"), jnp.ones((1, 100)))["params"]
  assert np.abs(p["bias"]).max() <= 0.1 and np.abs(p["kernel"]).max() <= 0.1


def _np_max_pool(x, k, s, pad):
  x = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)), constant_values=-np.inf)
  b, h, w, c = x.shape
  ho, wo = (h - k) // s + 1, (w - k) // s + 1
  out = np.empty((b, ho, wo, c), x.dtype)
  for n in range(b):
    for i in range(ho):
      for j in range(wo):
        for ch in range(c):
          out[n, i, j, ch] = x[n, i * s:i * s + k, j * s:j * s + k, ch].max()
  return out


def test_max_pool_matches_numpy():
  x = _RNG.standard_normal((2, 8, 6, 3)).astype(np.float32)
  np.testing.assert_array_equal(layers.max_pool(x, 2), _np_max_pool(x, 2, 2, 0))
  np.testing.assert_array_equal(layers.max_pool(x, 3, 1, "SAME"),
                                _np_max_pool(x, 3, 1, 1))
  np.testing.assert_array_equal(layers.max_pool(x, 3, 2, 1),
                                _np_max_pool(x, 3, 2, 1))
  # Gradient goes to the arg-max of each window (distinct values, no ties).
  g = jax.grad(lambda x: layers.max_pool(x, 2).sum())(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(g).reshape(2, 4, 2, 3, 2, 3).sum(
      axis=(2, 4)), np.ones((2, 4, 3, 3)))


def _np_adaptive_avg_pool(x, oh, ow):
  b, h, w, c = x.shape
  out = np.empty((b, oh, ow, c), np.float64)
  for i in range(oh):
    h0, h1 = int(np.floor(i * h / oh)), int(np.ceil((i + 1) * h / oh))
    for j in range(ow):
      w0, w1 = int(np.floor(j * w / ow)), int(np.ceil((j + 1) * w / ow))
      out[:, i, j] = x[:, h0:h1, w0:w1].mean(axis=(1, 2))
  return out


@pytest.mark.parametrize("hw,out", [((8, 8), 3), ((7, 5), (3, 2)), ((2, 2), 3),
                                    ((6, 6), 3), ((8, 8), 1)])
def test_adaptive_avg_pool_matches_pytorch_formula(hw, out):
  x = _RNG.standard_normal((2,) + hw + (3,)).astype(np.float32)
  oh, ow = (out, out) if isinstance(out, int) else out
  np.testing.assert_allclose(layers.adaptive_avg_pool(x, out),
                             _np_adaptive_avg_pool(x, oh, ow), rtol=1e-5,
                             atol=1e-6)


def test_adaptive_bins_8_to_3_overlap():
  assert layers.adaptive_bins(8, 3) == [(0, 3), (2, 6), (5, 8)]
