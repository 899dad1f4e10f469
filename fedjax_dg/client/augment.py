"""Jittable per-image augmentations for FedCCRL (CCDT = MixStyle with foreign
statistics, DIFP = AugMix), usable inside the local step of every client.

Images here are float32 [H, W, C]: *normalized* inputs (`Model.normalize`) for
the style statistics and MixStyle, *pixel values* 0..255 for AugMix (its
operations are defined on 8-bit images). Batches are vmapped over images, each
with its own key.

AugMix follows Hendrycks et al. (2020) and its reference `augmentations.py`:
the nine operations autocontrast, equalize, posterize, rotate, solarize,
shear_x, shear_y, translate_x, translate_y (no colour / contrast / brightness /
sharpness, which overlap ImageNet-C), severity 3, `sample_level` uniform in
[0.1, severity], geometric operations with bilinear resampling and zero fill;
`width` chains of random depth 1..3 mixed by Dirichlet(beta) weights, the mix
blended with the original by m ~ Beta(beta, beta). Every operation and its
level -> parameter mapping is checked against PIL (tests/test_augment.py).

The warps (rotate, shear, translate) have PIL's bilinear semantics
(libImaging/Geometry.c): 0 where the sample point is outside the image, the
four neighbours' indices clamped into it (the edge pixels repeat along the
warped edge), the blend truncated. PIL computes in float64, `affine` in
float32: its sample points are ~1e-6 pixel off PIL's, which moves a value by
one grey level where PIL's blend lies that close to an integer (at AugMix's
random levels about 1 value in 26,000 on 32 x 32 images; more at round,
decimal levels and on odd-sized images' centre pixel under rotation), and
decides a whole pixel the other way where the sample point lies within
float32 rounding of the image's edge (2 pixels in ~180,000 shear images).
Translations are exact. Emulating PIL's float64 bit for bit in integers was
done and dropped: it cost AugMix 2.6x its run time (docs/faithfulness.md,
"AugMix's geometric operations against PIL").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

OPS = ("autocontrast", "equalize", "posterize", "rotate", "solarize", "shear_x",
       "shear_y", "translate_x", "translate_y")


# --------------------------------------------------------------------------
# Style statistics and MixStyle (CCDT, FedCCRL Eq. 6-7 and Algorithm 2).


def style_stats(x: Array, eps: float = 1e-6) -> tuple[Array, Array]:
  """Per-channel mean and std over H, W of one image [H, W, C] (Eq. 6-7, the
  population std, `eps` inside the square root as MixStyle does)."""
  mu = jnp.mean(x, axis=(0, 1))
  var = jnp.mean(jnp.square(x - mu), axis=(0, 1))
  return mu, jnp.sqrt(var + eps)


def mixstyle(x: Array, mu2: Array, sig2: Array, lam: Array,
             eps: float = 1e-6) -> Array:
  """Re-styles image x [H, W, C] with statistics mixed toward (mu2, sig2):
  lam * foreign + (1 - lam) * own, then sig_mix * (x - mu) / sig + mu_mix."""
  mu, sig = style_stats(x, eps)
  mu_mix = lam * mu2 + (1.0 - lam) * mu
  sig_mix = lam * sig2 + (1.0 - lam) * sig
  return (x - mu) / sig * sig_mix + mu_mix


def sample_foreign(key: Array, pool_mu: Array, pool_sig: Array,
                   pool_valid: Array, own: Array, num: int
                   ) -> tuple[Array, Array]:
  """`num` statistics drawn uniformly (with replacement) from the pool without
  the client's own rows: pool [N, S, C] with a validity mask [N, S]."""
  n, s = pool_valid.shape
  allowed = pool_valid & (jnp.arange(n) != own)[:, None]
  logits = jnp.where(allowed, 0.0, -jnp.inf).reshape(-1)
  idx = jax.random.categorical(key, logits, shape=(num,))
  flat = lambda a: a.reshape((n * s,) + a.shape[2:])
  return jnp.take(flat(pool_mu), idx, axis=0), jnp.take(flat(pool_sig), idx, axis=0)


# --------------------------------------------------------------------------
# AugMix operations on one image [H, W, C] of pixel values 0..255.


def symmetric_beta(key: Array, a: float, shape: tuple[int, ...]) -> Array:
  """Beta(a, a) samples of `shape`: G1 / (G1 + G2) for G1, G2 ~ Gamma(a),
  from one Gamma sampler in log space (`jax.random.beta` compiles two)."""
  log_g = jax.random.loggamma(key, a, (2, *shape))
  return jax.nn.sigmoid(log_g[0] - log_g[1])


def _per_channel_lut(x: Array, lut: Array) -> Array:
  """Applies a [C, 256] lookup table to integer-valued x [H, W, C]."""
  idx = jnp.clip(x, 0, 255).astype(jnp.int32)
  return jnp.take_along_axis(lut.T, idx.reshape(-1, x.shape[-1]), axis=0
                             ).reshape(x.shape).astype(jnp.float32)


def _histograms(x: Array) -> Array:
  """[C, 256] histograms of integer-valued x [H, W, C]."""
  idx = jnp.clip(x, 0, 255).astype(jnp.int32).reshape(-1, x.shape[-1])
  return jax.vmap(lambda v: jnp.bincount(v, length=256), in_axes=1)(idx)


def autocontrast(x: Array) -> Array:
  """PIL `ImageOps.autocontrast` (cutoff 0): each channel stretched so its
  minimum maps to 0 and maximum to 255; a constant channel is unchanged."""
  lo = jnp.min(x, axis=(0, 1))
  hi = jnp.max(x, axis=(0, 1))
  scale = 255.0 / jnp.maximum(hi - lo, 1.0)
  v = jnp.arange(256.0)[None, :]
  lut = jnp.clip(jnp.floor(v * scale[:, None] - (lo * scale)[:, None]), 0, 255)
  lut = jnp.where((hi > lo)[:, None], lut, v)
  return _per_channel_lut(x, lut)


def equalize(x: Array) -> Array:
  """PIL `ImageOps.equalize`: per channel, lut[i] = (step // 2 + #{v < i}) //
  step with step = (pixels - count of the largest value) // 255; unchanged when
  step is 0."""
  h = _histograms(x)                                  # [C, 256]
  last = jnp.max(jnp.where(h > 0, jnp.arange(256), -1), axis=1)
  h_last = jnp.take_along_axis(h, last[:, None], axis=1)[:, 0]
  step = (jnp.sum(h, axis=1) - h_last) // 255
  below = jnp.cumsum(h, axis=1) - h                   # #{v < i}
  safe = jnp.maximum(step, 1)[:, None]
  lut = jnp.minimum((step[:, None] // 2 + below) // safe, 255)
  lut = jnp.where((step > 0)[:, None], lut, jnp.arange(256)[None, :])
  return _per_channel_lut(x, lut.astype(jnp.float32))


def posterize(x: Array, bits: Array) -> Array:
  """Keeps the `bits` high bits of every value (PIL `ImageOps.posterize`)."""
  shift = (8 - bits).astype(jnp.int32)
  v = jnp.clip(x, 0, 255).astype(jnp.int32)
  return ((v >> shift) << shift).astype(jnp.float32)


def solarize(x: Array, threshold: Array) -> Array:
  """Inverts values >= threshold (PIL `ImageOps.solarize`)."""
  return jnp.where(x < threshold, x, 255.0 - x)


def affine(x: Array, matrix: Array) -> Array:
  """PIL `Image.transform(size, AFFINE, (a, b, c, d, e, f), BILINEAR)` in
  float32: output pixel (i, j) (row, column) samples the input at the point
  X = a u + b v + c, Y = d u + e v + f with (u, v) = (j + 0.5, i + 0.5). It is
  0 where that point lies outside [0, W) x [0, H); elsewhere the bilinear
  blend of the four neighbours of (X - 1/2, Y - 1/2), their indices clamped
  into the image (the edge pixels repeat), in PIL's order (v1, v2 along the
  rows, then between them) and truncated as PIL's cast to uint8 does (the
  floor, for x >= 0). PIL computes X, Y in float64: the module docstring says
  what float32 changes."""
  h, w, _ = x.shape
  a, b, c, d, e, f = (matrix[k] for k in range(6))
  v, u = jnp.meshgrid(jnp.arange(h) + 0.5, jnp.arange(w) + 0.5, indexing="ij")
  px = a * u + b * v + c
  py = d * u + e * v + f
  col, row = px - 0.5, py - 0.5
  c0, r0 = jnp.floor(col), jnp.floor(row)
  dx, dy = (col - c0)[..., None], (row - r0)[..., None]
  cols = [jnp.clip(c0 + k, 0, w - 1).astype(jnp.int32) for k in (0, 1)]
  rows = [jnp.clip(r0 + k, 0, h - 1).astype(jnp.int32) for k in (0, 1)]
  (p00, p01), (p10, p11) = ([x[r, cc] for cc in cols] for r in rows)
  v1 = p00 + (p01 - p00) * dx
  v2 = p10 + (p11 - p10) * dx
  out = jnp.floor(v1 + (v2 - v1) * dy)
  inside = (px >= 0) & (px < w) & (py >= 0) & (py < h)
  return jnp.where(inside[..., None], out, 0.0)


def rotation_matrix(degrees: Array, h: int, w: int) -> Array:
  """PIL `Image.rotate(degrees)`'s inverse map (counter-clockwise, about the
  image centre)."""
  t = -jnp.deg2rad(degrees)
  cos, sin = jnp.cos(t), jnp.sin(t)
  cx, cy = w / 2.0, h / 2.0
  return jnp.stack([cos, sin, cx - cos * cx - sin * cy,
                    -sin, cos, cy + sin * cx - cos * cy])


def _shift_matrix(dx=0.0, dy=0.0, sx=0.0, sy=0.0) -> Array:
  return jnp.stack([jnp.ones(()), jnp.asarray(sx, jnp.float32), dx,
                    jnp.asarray(sy, jnp.float32), jnp.ones(()), dy]).astype(
                        jnp.float32)


def apply_op(x: Array, op: Array, level: Array, sign: Array) -> Array:
  """Operation `op` (an index into OPS) at `level` in [0.1, severity] with a
  +-1 `sign` for the geometric ones, as the AugMix reference maps levels:
  int_parameter(level, max) = floor(level * max / 10), float_parameter = level *
  max / 10; translations up to a third of the image width."""
  h, w, _ = x.shape
  ip = lambda maxval: jnp.floor(level * maxval / 10.0)
  fp = lambda maxval: level * maxval / 10.0
  geometric = jnp.stack([
      rotation_matrix(sign * ip(30.0), h, w),
      _shift_matrix(sx=sign * fp(0.3)),
      _shift_matrix(sy=sign * fp(0.3)),
      _shift_matrix(dx=sign * ip(w / 3.0)),
      _shift_matrix(dy=sign * ip(h / 3.0)),
  ])
  # One warp serves the five geometric operations; its matrix is picked first.
  g = jnp.where(op >= 5, op - 4, 0)  # rotate (3) -> 0, shear/translate -> 1..4
  warped = affine(x, geometric[g])
  branches = jnp.stack([
      autocontrast(x),
      equalize(x),
      posterize(x, 4 - ip(4.0)),
      warped,
      solarize(x, 256.0 - ip(256.0)),
  ])
  return branches[jnp.where(op >= 5, 3, op)]


def _chain(x: Array, key: Array, depth: int, severity: float) -> Array:
  """One chain: `depth` random operations (depth <= 0: U{1, 2, 3} of them)."""
  k_depth, k_ops = jax.random.split(key)
  d = (jax.random.randint(k_depth, (), 1, 4) if depth <= 0
       else jnp.asarray(depth))

  def step(s, img):
    k_op, k_level, k_sign = jax.random.split(jax.random.fold_in(k_ops, s), 3)
    op = jax.random.randint(k_op, (), 0, len(OPS))
    level = jax.random.uniform(k_level, (), minval=0.1, maxval=severity)
    sign = jnp.where(jax.random.bernoulli(k_sign), -1.0, 1.0)
    return jnp.where(s < d, apply_op(img, op, level, sign), img)

  return jax.lax.fori_loop(0, 3 if depth <= 0 else depth, step, x)


def augmix(x: Array, chain_key: Array, mix_key: Array, *, width: int = 3,
           depth: int = -1, severity: float = 3.0, beta: float = 1.0) -> Array:
  """AugMix of one image [H, W, C] of pixel values 0..255 (float result).

  `chain_key` draws the chains' operations, `mix_key` the Dirichlet and Beta
  weights (one key for both gives the reference's per-image AugMix; a chain key
  shared by a batch gives torchvision's one-chain-per-batch reading).
  `width` > 0 chains (the reference: 3), or 0: k ~ U{1, 2, 3} chains (FedCCRL's
  appendix, Algorithm 3); `depth` <= 0: each chain's depth ~ U{1, 2, 3}.
  """
  k_g, k_k = jax.random.split(mix_key)
  slots = width if width > 0 else 3
  # The chains' Dirichlet(beta) weights and m ~ Beta(beta, beta), both from
  # one draw of slots + 2 Gamma(beta) variates: normalized Gamma variates are
  # Dirichlet, G1 / (G1 + G2) is Beta. In log space (no 0 / 0 at a small
  # beta). One sampler (two nested while loops) compiles instead of three.
  log_g = jax.random.loggamma(k_g, beta, (slots + 2,))
  logits = log_g[:slots]
  if width <= 0:
    k = jax.random.randint(k_k, (), 1, 4)
    logits = jnp.where(jnp.arange(slots) < k, logits, -jnp.inf)
  ws = jax.nn.softmax(logits)
  m = jax.nn.sigmoid(log_g[slots] - log_g[slots + 1])
  keys = jax.vmap(lambda i: jax.random.fold_in(chain_key, i))(jnp.arange(slots))
  chains = jax.vmap(lambda k: _chain(x, k, depth, severity))(keys)
  mix = jnp.tensordot(ws, chains, axes=1)
  return (1.0 - m) * x + m * mix


def to_pixels(x_norm: Array, mean: Array, std: Array, overflow: str) -> Array:
  """Normalized image -> pixel values 0..255 for AugMix: "clamp" (FedCCRL's
  paper: values clamped to the 8-bit range, rounded) or "wrap" (the released
  code: a float-to-uint8 cast, truncated and taken modulo 256)."""
  v = (x_norm * std + mean) * 255.0
  if overflow == "clamp":
    return jnp.round(jnp.clip(v, 0.0, 255.0))
  if overflow == "wrap":
    return jnp.mod(jnp.trunc(v), 256.0)
  raise ValueError(f"overflow={overflow!r}: 'clamp' or 'wrap'")
