"""AugMix (`client/augment.py`) against its reference: each operation's level ->
parameter mapping against a transcription of Hendrycks et al.'s
`augmentations.py` run on PIL, the warps' border against a float64 model of
PIL's bilinear filter, and the random draws of a chain and of the mix (depth,
operation, level, sign; Dirichlet and Beta weights) from their outputs.

The reference (github.com/google-research/augmix, `augmentations.py`) maps a
level in [0.1, severity] to each operation's parameter:

    int_parameter(level, maxval) = int(level * maxval / 10)
    float_parameter(level, maxval) = float(level) * maxval / 10
    posterize(bits = 4 - int_parameter(level, 4)), solarize(256 -
    int_parameter(level, 256)), rotate(+-int_parameter(level, 30) degrees),
    shear_x/y(+-float_parameter(level, 0.3)), translate_x/y(+-int_parameter(
    level, IMAGE_SIZE / 3) pixels), autocontrast / equalize (no level).

**The warps' border** (rotate, shear; translations are by whole pixels and
equal PIL everywhere). PIL's bilinear filter (libImaging/Geometry.c,
`BILINEAR_HEAD` / `BILINEAR_BODY`) outputs 0 where the sample point
(a u + b v + c, d u + e v + f), (u, v) the output pixel's centre, lies outside
[0, W) x [0, H); elsewhere it clamps the four neighbours' indices into the
image (edge pixels repeat) and truncates the blend to an integer.
`augment.affine` blends out-of-image neighbours as 0 and rounds. So:

* interior (all four neighbours inside the image): ours - PIL is 0 or 1 (round
  against truncate);
* the border band (some neighbours inside, some outside, at most one pixel
  wide along the warped image's edge): ours blends toward 0 where PIL repeats
  the edge pixel or outputs 0, up to ~110 grey levels apart on random images;
* beyond it (no neighbour inside) both are 0.

docs/faithfulness.md ("FedCCRL", AugMix operations) states the same.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image, ImageOps

from fedjax_dg.client import augment

SIZE = 32  # the reference's IMAGE_SIZE (CIFAR)
LEVELS = (0.1, 0.35, 1.0, 1.25, 1.7, 2.2, 2.9, 3.0)


def _image(seed=0, h=SIZE, w=SIZE):
  return np.random.default_rng(seed).integers(0, 256, (h, w, 3)).astype(np.uint8)


# --------------------------------------------------------------------------
# The reference's operations with an explicit level and sign (its
# `sample_level` and coin flips drawn by the caller instead).


def int_parameter(level, maxval):
  return int(level * maxval / 10)


def float_parameter(level, maxval):
  return float(level) * maxval / 10.


def _warp(im, matrix):
  return im.transform((SIZE, SIZE), Image.AFFINE, matrix, resample=Image.BILINEAR)


REFERENCE = {
    "autocontrast": lambda im, level, sign: ImageOps.autocontrast(im),
    "equalize": lambda im, level, sign: ImageOps.equalize(im),
    "posterize": lambda im, level, sign: ImageOps.posterize(
        im, 4 - int_parameter(level, 4)),
    "rotate": lambda im, level, sign: im.rotate(
        sign * int_parameter(level, 30), resample=Image.BILINEAR),
    "solarize": lambda im, level, sign: ImageOps.solarize(
        im, 256 - int_parameter(level, 256)),
    "shear_x": lambda im, level, sign: _warp(
        im, (1, sign * float_parameter(level, 0.3), 0, 0, 1, 0)),
    "shear_y": lambda im, level, sign: _warp(
        im, (1, 0, 0, sign * float_parameter(level, 0.3), 1, 0)),
    "translate_x": lambda im, level, sign: _warp(
        im, (1, 0, sign * int_parameter(level, SIZE / 3), 0, 1, 0)),
    "translate_y": lambda im, level, sign: _warp(
        im, (1, 0, 0, 0, 1, sign * int_parameter(level, SIZE / 3))),
}


def _matrix(name, level, sign):
  """The affine matrix PIL applies for a geometric operation (Image.rotate's
  own construction for rotate), or None."""
  if name == "rotate":
    t = -np.deg2rad(sign * int_parameter(level, 30))
    a, b = round(np.cos(t), 15), round(np.sin(t), 15)
    c = SIZE / 2
    return (a, b, c - a * c - b * c, -b, a, c + b * c - a * c)
  p = sign * float_parameter(level, 0.3)
  q = sign * int_parameter(level, SIZE / 3)
  return {"shear_x": (1, p, 0, 0, 1, 0), "shear_y": (1, 0, 0, p, 1, 0),
          "translate_x": (1, 0, q, 0, 1, 0),
          "translate_y": (1, 0, 0, 0, 1, q)}.get(name)


def _bilinear(x, matrix, pil):
  """Float64 bilinear warp of uint8 x [H, W, C]: `pil` clamps the neighbours
  and outputs 0 where the sample point is outside the image (PIL, before its
  truncation), else out-of-image neighbours count 0 (augment.affine, before
  its rounding). Also -> how many of the four neighbours lie inside."""
  x = x.astype(np.float64)
  h, w, _ = x.shape
  a, b, c, d, e, f = matrix
  i, j = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
  xin, yin = a * (j + .5) + b * (i + .5) + c, d * (j + .5) + e * (i + .5) + f
  col, row = xin - .5, yin - .5
  c0, r0 = np.floor(col).astype(int), np.floor(row).astype(int)
  fc, fr = (col - c0)[..., None], (row - r0)[..., None]
  inside = lambda r, cc: (r >= 0) & (r < h) & (cc >= 0) & (cc < w)
  at = lambda r, cc: x[np.clip(r, 0, h - 1), np.clip(cc, 0, w - 1)] * (
      1.0 if pil else inside(r, cc)[..., None])
  v1 = at(r0, c0) + (at(r0, c0 + 1) - at(r0, c0)) * fc
  v2 = at(r0 + 1, c0) + (at(r0 + 1, c0 + 1) - at(r0 + 1, c0)) * fc
  v = v1 + (v2 - v1) * fr
  if pil:
    v = np.where(((xin >= 0) & (xin < w) & (yin >= 0) & (yin < h))[..., None],
                 v, 0.0)
  count = sum(inside(r0 + dr, c0 + dc).astype(int) for dr in (0, 1)
              for dc in (0, 1))
  return v, count


@pytest.fixture(scope="module")
def ops_at_levels():
  """apply_op and the reference at every (operation, level, sign), one jit."""
  x = _image()
  combos = [(k, level, sign) for k in range(len(augment.OPS)) for level in LEVELS
            for sign in (1.0, -1.0)]
  op, level, sign = (jnp.asarray(v) for v in zip(*combos))
  got = np.asarray(jax.jit(jax.vmap(
      lambda o, l, s: augment.apply_op(jnp.asarray(x, jnp.float32), o, l, s)))(
          op, level.astype(jnp.float32), sign.astype(jnp.float32)))
  want = [np.asarray(REFERENCE[augment.OPS[k]](Image.fromarray(x), lv, s),
                     np.float64) for k, lv, s in combos]
  return x, combos, got, want


def test_operation_names_are_the_references():
  assert set(augment.OPS) == set(REFERENCE) and len(augment.OPS) == 9


@pytest.mark.parametrize("name", augment.OPS)
def test_level_to_parameter_mapping_equals_the_reference_on_pil(name,
                                                                ops_at_levels):
  """apply_op(x, op, level, sign) against the reference operation at the same
  level and sign on PIL: pixel operations exactly (autocontrast within one
  grey level: PIL stretches in float64), translations exactly, rotate and
  shear exactly up to their rounding inside the border band (below)."""
  x, combos, got, want = ops_at_levels
  k = augment.OPS.index(name)
  checked = 0
  for (op, level, sign), g, w in zip(combos, got, want):
    if op != k:
      continue
    where = f"{name} level={level} sign={sign}"
    matrix = _matrix(name, level, sign)
    if name == "autocontrast":
      assert np.abs(g - w).max() <= 1, where
    elif matrix is None or name.startswith("translate"):
      np.testing.assert_array_equal(g, w, err_msg=where)
    else:
      _, count = _bilinear(x, matrix, pil=True)
      diff = (g - w)[count == 4]
      assert set(np.unique(diff)) <= {0.0, 1.0}, (where, np.unique(diff))
    checked += 1
  assert checked == 2 * len(LEVELS)
  # The level moves the parameter: not every level gives the same image
  # (autocontrast and equalize take none).
  outs = {got[i].tobytes() for i, c in enumerate(combos) if c[0] == k}
  assert (len(outs) == 1) == (name in ("autocontrast", "equalize")), name


@pytest.mark.parametrize("name,level,sign", [
    ("rotate", 1.0, 1.0), ("rotate", 2.9, -1.0), ("shear_x", 2.2, 1.0),
    ("shear_y", 3.0, -1.0)])
def test_warp_border_band_blends_toward_zero_where_pil_repeats_the_edge(
    name, level, sign, ops_at_levels):
  """The documented difference, pixel by pixel (module docstring): PIL is
  exactly the clamped model truncated; ours is the zero-filled model rounded
  (one grey level for float32 ties); they differ only on the border band and
  there by far more than rounding."""
  x, combos, got, want = ops_at_levels
  i = combos.index((augment.OPS.index(name), level, sign))
  matrix = _matrix(name, level, sign)
  pil_model, count = _bilinear(x, matrix, pil=True)
  zero_model, _ = _bilinear(x, matrix, pil=False)
  np.testing.assert_array_equal(want[i], np.trunc(pil_model))
  assert np.abs(got[i] - np.round(zero_model)).max() <= 1
  band = (count > 0) & (count < 4)
  assert band.sum() >= SIZE  # a band along the edges
  diff = np.abs(got[i] - want[i]).max(-1)
  assert diff[~band].max() <= 1
  assert diff[band].max() > 30
  assert np.all(got[i][count == 0] == 0) and np.all(want[i][count == 0] == 0)


# --------------------------------------------------------------------------
# A chain's random draws, read through a stand-in operation.


def _chains(monkeypatch, fake_op, depth, n=600, severity=3.0, shape=(1, 1, 3)):
  """`n` chains on a zero image with `augment.apply_op` replaced by `fake_op`."""
  monkeypatch.setattr(augment, "apply_op", fake_op)
  keys = jax.random.split(jax.random.key(7), n)
  x = jnp.zeros(shape)
  return np.asarray(jax.jit(jax.vmap(
      lambda k: augment._chain(x, k, depth, severity)))(keys))  # pylint: disable=protected-access


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_a_chain_of_fixed_depth_applies_that_many_operations(monkeypatch, depth):
  out = _chains(monkeypatch, lambda img, op, level, sign: img + 1.0, depth,
                n=8)
  np.testing.assert_array_equal(out, depth)


def test_a_random_depth_is_uniform_on_1_2_3(monkeypatch):
  """The reference: depth = depth if depth > 0 else randint(1, 4)."""
  out = _chains(monkeypatch, lambda img, op, level, sign: img + 1.0, -1)
  depth = out[:, 0, 0, 0]
  assert np.all(out == depth[:, None, None, None])
  values, counts = np.unique(depth, return_counts=True)
  np.testing.assert_array_equal(values, [1, 2, 3])
  # 600 draws: each share within 5 standard deviations (0.019) of 1/3.
  np.testing.assert_allclose(counts / len(depth), 1 / 3, atol=0.07)


def test_each_step_draws_an_operation_a_level_and_a_sign(monkeypatch):
  """Operations uniform over the nine, levels U[0.1, severity] (the
  reference's sample_level), signs +-1 with probability 1/2."""
  fake = lambda img, op, level, sign: jnp.stack(
      [op.astype(jnp.float32), level, sign]).reshape(img.shape)
  out = _chains(monkeypatch, fake, 1, n=2000, severity=2.5)[:, 0, 0]
  op, level, sign = out.T
  np.testing.assert_array_equal(np.unique(op), np.arange(9))
  np.testing.assert_allclose(np.bincount(op.astype(int)) / len(op), 1 / 9,
                             atol=0.035)
  assert level.min() >= 0.1 and level.max() <= 2.5
  assert level.min() < 0.15 and level.max() > 2.45
  np.testing.assert_allclose(level.mean(), (0.1 + 2.5) / 2, atol=0.06)
  assert set(np.unique(sign)) == {-1.0, 1.0}
  np.testing.assert_allclose(np.mean(sign > 0), 0.5, atol=0.05)


# --------------------------------------------------------------------------
# The mix: Dirichlet(beta) chain weights, Beta(beta, beta) blend.


@pytest.fixture(scope="module")
def mix_coefficients():
  """augmix on a zero image with each chain replaced by a random image drawn
  from its key (fold_in(chain_key, i), the key chain i receives): the output
  is m * sum_i w_i chain_i, and least squares against the chains recovers
  each draw's coefficients a_i = m w_i. -> {(width, beta): [512, 3]}, from one
  jit (compiling the Gamma and Beta samplers is most of the cost)."""
  fake_chain = lambda x, key, depth, severity: x + jax.random.uniform(
      key, x.shape, maxval=255.0)
  x, n = jnp.zeros((4, 4, 3)), 512
  chain_key = jax.random.key(11)
  cases = [(3, 1.0), (3, 0.5), (0, 1.0)]
  betas = jnp.repeat(jnp.asarray([1.0, 0.5]), n)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(augment, "_chain", fake_chain)
    mix = lambda km, beta, width: augment.augmix(x, chain_key, km, width=width,
                                                 beta=beta)
    outs = jax.jit(jax.vmap(lambda km, b: (mix(km, b, 3), mix(km, b, 0))))(
        jax.random.split(jax.random.key(12), 2 * n), betas)
  outs = {(3, 1.0): outs[0][:n], (3, 0.5): outs[0][n:], (0, 1.0): outs[1][:n]}
  basis = np.stack([np.asarray(fake_chain(x, jax.random.fold_in(chain_key, i),
                                          0, 0.0)).ravel()
                    for i in range(3)], 1).astype(np.float64)
  result = {}
  for case in cases:
    out = np.asarray(outs[case], np.float64).reshape(n, -1)
    coef, *_ = np.linalg.lstsq(basis, out.T, rcond=None)
    assert np.abs(basis @ coef - out.T).max() < 1e-2, (
        f"{case}: the output is not a mix of the chains")
    result[case] = coef.T
  return result


@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_chain_weights_are_dirichlet_and_the_blend_beta(mix_coefficients, beta):
  """The reference: ws = Dirichlet([beta] * width), m = Beta(beta, beta),
  mixed = (1 - m) x + m sum_i ws_i chain_i. From 512 draws: the weights sum
  to 1 and each has the Dirichlet's mean 1/3 and variance 2 / (9 (3 beta + 1));
  m has the Beta's mean 1/2 and variance 1 / (4 (2 beta + 1)). Uniform weights
  (variance 0), unnormalized weights (m's mean 3/2) or a beta that does not
  reach the draws fail."""
  a = mix_coefficients[(3, beta)]
  m = a.sum(1)
  ws = a / m[:, None]
  assert a.min() > -1e-4 and m.max() < 1 + 1e-4
  np.testing.assert_allclose(ws.mean(0), 1 / 3, atol=0.04)
  np.testing.assert_allclose(ws.var(0), 2 / (9 * (3 * beta + 1)), rtol=0.25)
  np.testing.assert_allclose(m.mean(), 0.5, atol=0.05)
  np.testing.assert_allclose(m.var(), 1 / (4 * (2 * beta + 1)), rtol=0.25)


def test_random_width_mixes_one_two_or_three_chains(mix_coefficients):
  """width=0 (FedCCRL's appendix): k ~ U{1, 2, 3} chains get the Dirichlet
  weights, the others 0 (the first k)."""
  a = mix_coefficients[(0, 1.0)]
  used = (np.abs(a) > 1e-6).sum(1)
  np.testing.assert_array_equal(np.unique(used), [1, 2, 3])
  np.testing.assert_allclose(np.bincount(used)[1:] / len(used), 1 / 3, atol=0.08)
  for k in (1, 2, 3):  # the first k chains
    assert np.all(np.abs(a[used == k][:, k:]) < 1e-6)
