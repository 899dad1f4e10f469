"""AugMix (`client/augment.py`) against its reference: each operation's level ->
parameter mapping against a transcription of Hendrycks et al.'s
`augmentations.py` run on PIL, the geometric operations against PIL on every
pixel at random levels and signs on images of several sizes, and the random
draws of a chain and of the mix (depth, operation, level, sign; Dirichlet and
Beta weights) from their outputs.

The reference (github.com/google-research/augmix, `augmentations.py`) maps a
level in [0.1, severity] to each operation's parameter:

    int_parameter(level, maxval) = int(level * maxval / 10)
    float_parameter(level, maxval) = float(level) * maxval / 10
    posterize(bits = 4 - int_parameter(level, 4)), solarize(256 -
    int_parameter(level, 256)), rotate(+-int_parameter(level, 30) degrees),
    shear_x/y(+-float_parameter(level, 0.3)), translate_x/y(+-int_parameter(
    level, IMAGE_SIZE / 3) pixels), autocontrast / equalize (no level).

The levels handed to the reference are float32 values (apply_op's), so both
sides read the same level (`int_parameter` in float32 can still differ from
Python's float64 by one step where level * maxval / 10 lands within float32
rounding of an integer, e.g. 1.6666666 at 30: 5 degrees for 4; no level here
does).

**The warps.** PIL's bilinear filter (libImaging/Geometry.c, `BILINEAR_HEAD`
/ `BILINEAR_BODY`) outputs 0 where the float64 sample point (a u + b v + c,
d u + e v + f), (u, v) the output pixel's centre, lies outside [0, W) x
[0, H); elsewhere it clamps the four neighbours' indices into the image (edge
pixels repeat) and truncates the float64 blend. `augment.affine` does the
same in float32. `_bilinear` is PIL's filter in float64 numpy (checked: PIL
is its truncation on every pixel), and `_check_warp` bounds what float32
changes, on the whole image:

* off by one grey level where PIL's float64 blend lies within `TIE` of an
  integer (float32 sample points are ~1e-6 pixel off, times neighbour
  differences up to 255): at random levels measured 1 value in ~17,000
  (rotate, 32 x 32) to ~40,000 (shear_y), 1 in ~26,000 over the three; more
  on odd sides, where rotate's centre pixel maps onto itself exactly in
  float64 and a hair off in float32 (optimized XLA:CPU: 1 in ~1,000 values at
  9 x 13, ~5,600 at 33 x 33; unoptimized, as the tests run: ~58,000 and
  ~10,000), and at decimal parameters (a shear of 0.2, level 1.0's 0.03),
  whose blends are often integers in decimal arithmetic;
* a whole pixel, 0 on one side, where the sample point lies within `EDGE` of
  the image's edge and float32 rounds it to the other side: measured 2
  pixels in ~180,000 random shear images (ON_EDGE pins one), none in 80,000
  rotations.

Translations move by whole pixels and equal PIL exactly. The old `affine`
(neighbours outside the image blended as 0, the blend rounded) was up to ~110
grey levels from PIL on the band along the warped edge and one above it on
about half the other values; the random-level test checks that its cases
contain that band. docs/faithfulness.md ("AugMix's geometric operations
against PIL") states the same.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image, ImageOps

from fedjax_dg.client import augment

SIZE = 32  # the reference's IMAGE_SIZE (CIFAR)
# float32 levels (apply_op's dtype), handed to the reference as Python floats.
LEVELS = tuple(float(np.float32(v))
               for v in (0.1, 0.35, 1.0, 1.25, 1.7, 2.2, 2.9, 3.0))
GEOMETRIC = ("rotate", "shear_x", "shear_y", "translate_x", "translate_y")
# Where float32 may leave PIL (module docstring): a float64 blend this close to
# an integer (a float32 sample point a few 1e-6 pixel off, times a neighbour
# difference up to 255; measured at most 4.1e-4 at random levels), a sample
# point this close to the edge (float32's rounding at 32 is 1.9e-6).
TIE, EDGE = 2e-3, 1e-5
# Values one grey level off, measured: OFF_GRID at the round LEVELS on image 0
# (decimal levels: 1.0, 1.25 and 3.0 give most); OFF_RANDOM, the mean over 13
# seeds of `random_warps`'s cases (of 175,000 values per operation) with XLA's
# optimizations on (rotate with them off, as the tests run: 12; the centre
# pixel of the odd sides). The tests allow three times as many.
OFF_GRID = {"rotate": 5, "shear_x": 16, "shear_y": 38}
OFF_RANDOM = {"rotate": 40, "shear_x": 5, "shear_y": 5}


def _image(seed=0, h=SIZE, w=SIZE):
  return np.random.default_rng(seed).integers(0, 256, (h, w, 3)).astype(np.uint8)


# --------------------------------------------------------------------------
# The reference's operations with an explicit level and sign (its
# `sample_level` and coin flips drawn by the caller instead). Translations
# take a third of the image's own width / height (IMAGE_SIZE / 3 on a square).


def int_parameter(level, maxval):
  return int(level * maxval / 10)


def float_parameter(level, maxval):
  return float(level) * maxval / 10.


def _warp(im, matrix):
  return im.transform(im.size, Image.AFFINE, matrix, resample=Image.BILINEAR)


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
        im, (1, 0, sign * int_parameter(level, im.width / 3), 0, 1, 0)),
    "translate_y": lambda im, level, sign: _warp(
        im, (1, 0, 0, 0, 1, sign * int_parameter(level, im.height / 3))),
}


def _matrix(name, level, sign, h=SIZE, w=SIZE):
  """The affine matrix PIL applies for a geometric operation (for rotate,
  Image.rotate's own construction in its order of float operations)."""
  if name == "rotate":
    t = -math.radians((sign * int_parameter(level, 30)) % 360.0)
    a, b, d = (round(v, 15) for v in (math.cos(t), math.sin(t), -math.sin(t)))
    cx, cy = w / 2, h / 2
    return (a, b, a * -cx + b * -cy + 0.0 + cx, d, a, d * -cx + a * -cy + 0.0 + cy)
  p = sign * float_parameter(level, 0.3)
  return {"shear_x": (1, p, 0, 0, 1, 0), "shear_y": (1, 0, 0, p, 1, 0),
          "translate_x": (1, 0, sign * int_parameter(level, w / 3), 0, 1, 0),
          "translate_y": (1, 0, 0, 0, 1, sign * int_parameter(level, h / 3))
          }[name]


def _bilinear(x, matrix, old=False):
  """PIL's bilinear filter on uint8 x [H, W, C] in float64 numpy, the C
  code's operations in its order, before the truncation: 0 where the sample
  point is outside the image, else the blend of the four neighbours, their
  indices clamped. old=True: the old augment.affine before its rounding
  (neighbours outside the image count 0, no outside test). -> (v, whether the
  sample point is inside [H, W], how many neighbours are [H, W], the sample
  point's distance to the image's edge [H, W])."""
  x = x.astype(np.float64)
  h, w, _ = x.shape
  a, b, c, d, e, f = matrix
  i, j = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
  xin, yin = a * (j + .5) + b * (i + .5) + c, d * (j + .5) + e * (i + .5) + f
  col, row = xin - .5, yin - .5
  c0, r0 = np.floor(col).astype(int), np.floor(row).astype(int)
  dx, dy = (col - c0)[..., None], (row - r0)[..., None]
  inside = lambda r, cc: (r >= 0) & (r < h) & (cc >= 0) & (cc < w)
  at = lambda r, cc: x[np.clip(r, 0, h - 1), np.clip(cc, 0, w - 1)] * (
      inside(r, cc)[..., None] if old else 1.0)
  p00, p01, p10, p11 = (at(r0 + k, c0 + l) for k in (0, 1) for l in (0, 1))
  v1 = p00 + (p01 - p00) * dx
  v2 = p10 + (p11 - p10) * dx
  v = v1 + (v2 - v1) * dy
  point = (xin >= 0) & (xin < w) & (yin >= 0) & (yin < h)
  if not old:
    v = np.where(point[..., None], v, 0.0)
  count = sum(inside(r0 + k, c0 + l).astype(int) for k in (0, 1)
              for l in (0, 1))
  edge = np.minimum.reduce([np.abs(xin), np.abs(xin - w), np.abs(yin),
                            np.abs(yin - h)])
  return v, point, count, edge


def _check_warp(got, want, x, matrix, where):
  """ours against PIL on every pixel, as the module docstring says: PIL is
  the float64 model truncated; ours equals it but one grey level off where
  that blend is within TIE of an integer, and a whole pixel (0 on one side)
  where the sample point is within EDGE of the image's edge. -> (values one
  grey level off, pixels decided the other way at the edge)."""
  v, _, _, edge = _bilinear(x, matrix)
  np.testing.assert_array_equal(want, np.trunc(v), err_msg=f"PIL read {where}")
  off = got != want
  landed = off.any(-1) & (edge < EDGE)
  assert np.all(((got == 0).all(-1) | (want == 0).all(-1))[landed]), where
  off &= ~landed[..., None]
  tie = np.abs(v - np.round(v)) < TIE
  assert np.all(np.abs(got - want)[off] == 1) and np.all(tie[off]), (
      where, np.abs(got - want)[off], np.abs(v - np.round(v))[off])
  return int(off.sum()), int(landed.sum())


@pytest.fixture(scope="module")
def ops_at_levels():
  """apply_op and the reference at every (operation, level, sign), one jit,
  and at ON_EDGE (last: its own test)."""
  x = _image()
  combos = [(k, level, sign) for k in range(len(augment.OPS)) for level in LEVELS
            for sign in (1.0, -1.0)]
  all_ = combos + [(augment.OPS.index(ON_EDGE[0]),) + ON_EDGE[1:]]
  op, level, sign = (jnp.asarray(v) for v in zip(*all_))
  got = np.asarray(jax.jit(jax.vmap(
      lambda o, l, s: augment.apply_op(jnp.asarray(x, jnp.float32), o, l, s)))(
          op, level.astype(jnp.float32), sign.astype(jnp.float32)))
  want = [np.asarray(REFERENCE[augment.OPS[k]](Image.fromarray(x), lv, s),
                     np.float64) for k, lv, s in all_]
  return x, combos, got[:-1], want[:-1], (got[-1], want[-1])


def test_operation_names_are_the_references():
  assert set(augment.OPS) == set(REFERENCE) and len(augment.OPS) == 9


@pytest.mark.parametrize("name", augment.OPS)
def test_level_to_parameter_mapping_equals_the_reference_on_pil(name,
                                                                ops_at_levels):
  """apply_op(x, op, level, sign) against the reference operation at the same
  level and sign on PIL, the whole image: pixel operations exactly
  (autocontrast within one grey level: PIL stretches in float64),
  translations exactly, rotate and shear as `_check_warp` says (a few values
  one grey level off at level 1.0, shear 0.03: decimal arithmetic)."""
  x, combos, got, want, _ = ops_at_levels
  k = augment.OPS.index(name)
  checked = off = 0
  for (op, level, sign), g, w in zip(combos, got, want):
    if op != k:
      continue
    where = f"{name} level={level} sign={sign}"
    if name == "autocontrast":
      assert np.abs(g - w).max() <= 1, where
    elif name in ("rotate", "shear_x", "shear_y"):
      one, landed = _check_warp(g, w, x, _matrix(name, level, sign), where)
      assert landed == 0, where
      off += one
    else:
      np.testing.assert_array_equal(g, w, err_msg=where)
    checked += 1
  assert checked == 2 * len(LEVELS)
  assert off <= 3 * OFF_GRID.get(name, 0), off
  # The level moves the parameter: not every level gives the same image
  # (autocontrast and equalize take none).
  outs = {got[i].tobytes() for i, c in enumerate(combos) if c[0] == k}
  assert (len(outs) == 1) == (name in ("autocontrast", "equalize")), name


# A float32 level AugMix can draw (found among 400 random shear_y images; such
# a point occurs in about one shear image in 10^5) where pixel (31, 19)'s
# sample point lies 6.9e-7 inside the bottom edge: p u + v = 0.0256410 x 19.5
# + 31.5 = 31.9999993 in float64, 32.0 in float32.
ON_EDGE = ("shear_y", float(np.float32(0.8546997)), 1.0)


def test_a_sample_point_within_float32_rounding_of_the_edge_falls_outside(
    ops_at_levels):
  """At ON_EDGE float32 rounds that sample point onto the edge: ours outputs
  0 where PIL blends the clamped bottom row; every other pixel as
  `_check_warp` says. A non-strict outside test (Y <= H inside) would take
  the point in and equal PIL."""
  x, _, _, _, (got, want) = ops_at_levels
  name, level, sign = ON_EDGE
  _, landed = _check_warp(got, want, x, _matrix(name, level, sign), ON_EDGE)
  assert landed == 1
  assert np.all(got[31, 19] == 0) and np.all(want[31, 19] > 0), (
      got[31, 19], want[31, 19])


WARP_SIZES = ((32, 32), (33, 33), (9, 13))  # CIFAR's, odd sides, not square
WARP_IMAGES = {(32, 32): 24, (33, 33): 24, (9, 13): 64}  # per operation


@pytest.fixture(scope="module")
def random_warps():
  """Each geometric operation on random images of each size at random
  float32 levels U[0.1, 3) (AugMix's draws at severity 3) and random signs:
  {size: (images, cases, apply_op's, PIL's)}, one jit per size."""
  rng = np.random.default_rng(23)
  out = {}
  for h, w in WARP_SIZES:
    n = WARP_IMAGES[(h, w)]
    cases = [(name, float(level), float(sign)) for name in GEOMETRIC
             for level, sign in zip(
                 rng.uniform(0.1, 3.0, n).astype(np.float32),
                 rng.choice([-1.0, 1.0], n))]
    xs = rng.integers(0, 256, (len(cases), h, w, 3)).astype(np.uint8)
    op, level, sign = zip(*cases)
    got = np.asarray(jax.jit(jax.vmap(augment.apply_op))(
        jnp.asarray(xs, jnp.float32),
        jnp.asarray([augment.OPS.index(o) for o in op]),
        jnp.asarray(level, jnp.float32), jnp.asarray(sign, jnp.float32)))
    want = np.stack([np.asarray(REFERENCE[o](Image.fromarray(x), l, s))
                     for x, (o, l, s) in zip(xs, cases)]).astype(np.float32)
    out[(h, w)] = (xs, cases, got, want)
  return out


@pytest.mark.parametrize("name", GEOMETRIC)
def test_geometric_operations_equal_pil_on_every_pixel(name, random_warps):
  """Random images of three sizes, random float32 levels as AugMix draws
  them, random signs: apply_op is the reference on PIL on every pixel, the
  band along the warped edge included, but for float32's residual
  (`_check_warp`), bounded here by three times what the measured rates give
  for these cases. The cases contain that band (sample point inside, some
  neighbour outside) for rotate and shear, where the old affine (outside
  neighbours blended as 0) is far from PIL."""
  off = landed = values = band = old_far = 0
  for h, w in WARP_SIZES:
    xs, cases, got, want = random_warps[(h, w)]
    for x, (op, level, sign), g, wt in zip(xs, cases, got, want):
      if op != name:
        continue
      where = f"{name} {h}x{w} level={level!r} sign={sign}"
      values += g.size
      if name.startswith("translate"):  # whole pixels: exact
        np.testing.assert_array_equal(g, wt, err_msg=where)
        continue
      matrix = _matrix(name, level, sign, h, w)
      one, edge = _check_warp(g, wt, x, matrix, where)
      off, landed = off + one, landed + edge
      _, point, count, _ = _bilinear(x, matrix)
      in_band = point & (count < 4)
      old = np.round(_bilinear(x, matrix, old=True)[0])
      band += in_band.sum()
      old_far += (np.abs(old - wt).max(-1)[in_band] > 30).sum()
  assert values == 3 * sum(WARP_IMAGES[s] * s[0] * s[1] for s in WARP_SIZES)
  assert off <= 3 * OFF_RANDOM.get(name, 0) and landed <= 1, (off, landed)
  if name in ("rotate", "shear_x", "shear_y"):
    assert band >= 2000 and old_far >= 500, (band, old_far)


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


@pytest.mark.parametrize("a", [0.1, 0.5, 3.0])
def test_symmetric_beta_draws_beta_a_a(a):
  """CCDT's lambda ~ Beta(alpha, alpha) (`symmetric_beta`, one Gamma sampler
  in log space), 4,000 draws: inside [0, 1], the Beta's mean 1/2 and variance
  1 / (4 (2a + 1)), and (a >= 0.5) its CDF (Kolmogorov-Smirnov statistic
  under 0.03; 4,000 true draws exceed 0.026 one time in a hundred). At
  a = 0.1 a tenth of the draws lie within float32's spacing of 0 or 1 and
  round to them, as `jax.random.beta`'s do, so only the moments are held
  there. Beta(a, 2a), a uniform or draws shared across the shape fail."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  draws = np.asarray(jax.jit(lambda k: augment.symmetric_beta(k, a, (4000,)))(
      jax.random.key(5)), np.float64)
  assert np.isfinite(draws).all() and draws.min() >= 0 and draws.max() <= 1
  np.testing.assert_allclose(draws.mean(), 0.5, atol=0.03)
  np.testing.assert_allclose(draws.var(), 1 / (4 * (2 * a + 1)), rtol=0.15)
  if a >= 0.5:
    assert stats.kstest(draws, stats.beta(a, a).cdf).statistic < 0.03
