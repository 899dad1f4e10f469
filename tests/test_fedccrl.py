"""FedCCRL: its augmentations against PIL / numpy, its losses against plain
numpy loops of Eq. 11-16, the whole local objective (Eq. 12, 14-16) on the
views it built against numpy, the views' plumbing, the style pool's ceil(r n)
on unequal clients, the cosine schedule over the run, and the algorithm end to
end. AugMix's operations, level mapping and random draws: tests/test_augment.py."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from PIL import Image, ImageOps

from conftest import USERS_CODEGEN, synthetic_federation, with_sizes
from fedjax_dg import algorithms, engine, models, optim
from fedjax_dg.algorithms import fedccrl
from fedjax_dg.algorithms.base import ClientResult
from fedjax_dg.client import augment, objectives, style_pool
from fedjax_dg.client.update import (Batch, ClientContext, ClientData,
                                     local_update)
from fedjax_dg.run.config import base_config
from fedjax_dg.errors import ConfigError, NeedsDataError
from fedjax_dg.run import assemble

RNG = np.random.default_rng(0)


def _image(h=12, w=10, constant_channel=False):
  x = RNG.integers(20, 230, (h, w, 3)).astype(np.uint8)
  if constant_channel:
    x[..., 1] = 77
  return x


# --------------------------------------------------------------------------
# AugMix operations against PIL (the reference's implementation).


# Compiled as a user's run compiles (conftest.USERS_CODEGEN): a grey level is
# a floor of a rounded product.
@functools.partial(jax.jit, compiler_options=USERS_CODEGEN)
def _pixel_ops(xf):
  return (augment.equalize(xf),
          [augment.posterize(xf, jnp.asarray(bits)) for bits in (1, 3, 4)],
          [augment.solarize(xf, float(t)) for t in (0, 100, 256)],
          augment.autocontrast(xf))


@pytest.mark.parametrize("constant_channel", [False, True])
def test_pixel_operations_equal_pil(constant_channel):
  x = _image(constant_channel=constant_channel)
  im = Image.fromarray(x)
  pil = lambda img: np.asarray(img, np.float32)
  # One program for both cases (eagerly: a program per op).
  equalized, posterized, solarized, got = _pixel_ops(jnp.asarray(x, jnp.float32))
  np.testing.assert_array_equal(equalized, pil(ImageOps.equalize(im)))
  for bits, out in zip((1, 3, 4), posterized):
    np.testing.assert_array_equal(out, pil(ImageOps.posterize(im, bits)))
  for threshold, out in zip((0, 100, 256), solarized):
    np.testing.assert_array_equal(out, pil(ImageOps.solarize(im, threshold)))
  # PIL computes the stretch in float64: a value can land one grey level away.
  got = np.asarray(got)
  assert np.max(np.abs(got - pil(ImageOps.autocontrast(im)))) <= 1
  assert got.min() == 0 and got[..., 0].max() == 255
  if constant_channel:
    np.testing.assert_array_equal(got[..., 1], 77)


# Jitted: one program for the cases (eagerly ~35 programs), as a user's run
# compiles (whether a sample point on the edge is inside is a rounding).
_affine = jax.jit(augment.affine, compiler_options=USERS_CODEGEN)
_rotate = jax.jit(lambda x, degrees: augment.affine(
    x, augment.rotation_matrix(degrees, 12, 10)), compiler_options=USERS_CODEGEN)


@pytest.mark.parametrize("matrix", [(1, 0.25, 0, 0, 1, 0), (1, 0, 0, -0.2, 1, 0),
                                    (1, 0, 3, 0, 1, 0), (1, 0, 0, 0, 1, -2)])
def test_affine_equals_pil_bilinear(matrix):
  """Every pixel, the band along the warped edge included (PIL clamps the
  neighbours there, zeroes only a sample point outside the image and
  truncates): equal where float32 computes PIL's float64 sample points
  exactly (the dyadic shear 0.25, whole-pixel translations); at the decimal
  shear -0.2, whose blends are often integers in decimal arithmetic, float32
  and float64 round some of those to either side: one grey level on 10 of
  the 360 values (tests/test_augment.py bounds this residual)."""
  x = _image()
  want = np.asarray(Image.fromarray(x).transform(
      (10, 12), Image.AFFINE, matrix, resample=Image.BILINEAR), np.float32)
  got = np.asarray(_affine(jnp.asarray(x, jnp.float32),
                           jnp.asarray(matrix, jnp.float32)))
  if matrix[3] == -0.2:
    assert np.abs(got - want).max() <= 1 and np.sum(got != want) <= 30
  else:
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("degrees", [7.0, -9.0])
def test_rotation_equals_pil(degrees):
  """Every pixel, the border band included; float32's rotation matrix and
  sample points may move a blend within ~1e-3 of an integer by one grey
  level (none here)."""
  x = _image()
  got = np.asarray(_rotate(jnp.asarray(x, jnp.float32), jnp.asarray(degrees)))
  want = np.asarray(Image.fromarray(x).rotate(degrees, resample=Image.BILINEAR),
                    np.float32)
  assert np.abs(got - want).max() <= 1 and np.sum(got != want) <= 3


def test_one_chain_of_depth_one_is_a_blend_with_one_operation():
  """AugMix with width 1, depth 1 is x + m (op(x) - x): with the chain key
  shared (the released code's one chain per batch) and the mixing keys
  different, the outputs lie on one line through x, at different points;
  different chain keys draw different operations (other lines)."""
  x = jnp.asarray(_image(), jnp.float32)
  run = jax.jit(lambda kc, km: augment.augmix(x, kc, km, width=1, depth=1) - x)
  direction = lambda a: np.asarray(a).ravel() / max(np.linalg.norm(a), 1e-9)
  lines = []
  for seed in range(8):
    kc = jax.random.key(seed)
    a, b = run(kc, jax.random.key(100 + seed)), run(kc, jax.random.key(200 + seed))
    if np.linalg.norm(a) < 1e-3 or np.linalg.norm(b) < 1e-3:
      continue  # an operation that left this image unchanged
    assert abs(np.dot(direction(a), direction(b))) == pytest.approx(1.0, abs=1e-4)
    assert not np.allclose(a, b)  # another m
    lines.append(direction(a))
  cos = [abs(np.dot(u, v)) for i, u in enumerate(lines) for v in lines[:i]]
  assert len(lines) >= 5 and min(cos) < 0.9


def test_augmix_stays_in_the_pixel_range_and_random_width_drops_chains():
  x = jnp.asarray(_image(), jnp.float32)
  keys = jax.random.split(jax.random.key(0), 8)
  # Both widths in one program (two: ~1.4x the compile time).
  outs = dict(zip((0, 3), jax.jit(jax.vmap(lambda k: tuple(
      augment.augmix(x, k, k, width=w) for w in (0, 3))))(keys)))
  for o in outs.values():
    assert float(o.min()) >= 0.0 and float(o.max()) <= 255.0
  # Same keys: k ~ U{1,2,3} chains differ from three chains when k < 3 only.
  same = [bool(np.allclose(a, b)) for a, b in zip(outs[0], outs[3])]
  assert 0 < sum(same) < len(same), same


def test_pixel_overflow_clamps_or_wraps():
  v = jnp.asarray([-3.2, 0.4, 255.6, 300.0]) / 255.0
  np.testing.assert_array_equal(augment.to_pixels(v, 0.0, 1.0, "clamp"),
                                [0, 0, 255, 255])
  np.testing.assert_array_equal(augment.to_pixels(v, 0.0, 1.0, "wrap"),
                                [253, 0, 255, 44])


# --------------------------------------------------------------------------
# CCDT: statistics, MixStyle, the pool without the client's own entries.


def test_mixstyle_moves_the_statistics_to_the_mix():
  x = jnp.asarray(RNG.normal(size=(6, 5, 3)), jnp.float32)
  mu2, sig2 = np.array([1.0, -2.0, 0.5]), np.array([0.3, 2.0, 1.0])
  lams = (0.0, 0.3, 1.0)
  # One program (eagerly: a program per op).
  (mu, sig), mixed = jax.tree.map(np.asarray, jax.jit(lambda x, mu2, sig2: (
      augment.style_stats(x),
      [augment.style_stats(augment.mixstyle(x, mu2, sig2, lam))
       for lam in lams]))(x, mu2, sig2))
  np.testing.assert_allclose(mu, np.asarray(x).mean((0, 1)), rtol=1e-5)
  np.testing.assert_allclose(sig, np.sqrt(np.asarray(x).var((0, 1)) + 1e-6),
                             rtol=1e-5)
  for lam, (m, s) in zip(lams, mixed):
    np.testing.assert_allclose(m, lam * mu2 + (1 - lam) * mu, atol=1e-5)
    np.testing.assert_allclose(s, lam * sig2 + (1 - lam) * sig, rtol=1e-3)


def test_a_client_never_draws_its_own_or_an_empty_slot():
  n, s = 4, 3
  mu = jnp.arange(n * s, dtype=jnp.float32).reshape(n, s, 1)
  valid = jnp.asarray([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], bool)
  draw = jax.jit(augment.sample_foreign, static_argnums=5)  # one program
  for own in range(n):
    got, _ = draw(jax.random.key(own), mu, mu, valid, jnp.asarray(own), 600)
    rows = np.asarray(got[:, 0]).astype(int)
    allowed = {c * s + j for c in range(n) for j in range(s)
               if c != own and valid[c, j]}
    assert set(rows) == allowed  # all allowed, each drawn, nothing else


# --------------------------------------------------------------------------
# Losses against plain numpy loops.


def _supcon_numpy(z1, z2, y, tau):
  z = np.concatenate([z1, z2])
  z = z / np.linalg.norm(z, axis=1, keepdims=True)
  lab = np.concatenate([y, y])
  losses = []
  for i in range(len(z)):
    s = np.exp(z @ z[i] / tau)
    denom = sum(s[a] for a in range(len(z)) if a != i)
    pos = [p for p in range(len(z)) if p != i and lab[p] == lab[i]]
    losses.append(-np.mean([np.log(s[p] / denom) for p in pos]))
  return np.mean(losses)


def test_supervised_contrastive_equals_eq11_and_ignores_padding():
  z1, z2 = RNG.normal(size=(5, 4)), RNG.normal(size=(5, 4))
  y = np.array([0, 1, 0, 2, 1])
  pad = lambda a, v: np.concatenate([a, v])
  # Both calls in one jitted program (eagerly: a program per op).
  got, padded = jax.jit(lambda z1, z2, y, p1, p2, py: (
      objectives.supervised_contrastive(z1, z2, y, jnp.ones(5), 0.1),
      objectives.supervised_contrastive(p1, p2, py, jnp.asarray(
          [1.0] * 5 + [0.0] * 2), 0.1)))(
              z1, z2, y, pad(z1, 9 * np.ones((2, 4))), pad(z2, -np.ones((2, 4))),
              pad(y, [0, 0]))
  np.testing.assert_allclose(got, _supcon_numpy(z1, z2, y, 0.1), rtol=1e-4)
  # Two padded rows (mask 0, garbage values) change nothing.
  np.testing.assert_allclose(padded, _supcon_numpy(z1, z2, y, 0.1), rtol=1e-4)


def test_js_divergence_equals_eq14():
  logits = [RNG.normal(size=(4, 3)) for _ in range(3)]
  p = [np.exp(l) / np.exp(l).sum(1, keepdims=True) for l in logits]
  mix = sum(p) / 3
  want = np.mean([np.sum(q * np.log(q / mix), 1) for q in p], axis=0).mean()
  js = jax.jit(objectives.js_divergence)   # one program (eagerly: per op)
  got = js([jnp.asarray(l) for l in logits], jnp.ones(4))
  np.testing.assert_allclose(got, want, rtol=1e-4)
  same = js([jnp.asarray(logits[0])] * 3, jnp.ones(4))
  assert abs(float(same)) < 1e-6


# --------------------------------------------------------------------------
# The cosine schedule over the run (a fresh optimizer state every round).


def test_cosine_over_run_scales_each_epoch_of_each_round():
  """Loss <w, 1> with SGD lr 1: one round moves w by minus the sum over its
  steps of 0.5 (1 + cos(pi (round E + epoch) / (R E)))."""
  opt = optim.cosine_over_run(optax.sgd(1.0))
  loss = lambda p, batch, rng, ctx: jnp.sum(p["w"]) + 0.0 * jnp.sum(batch.mask)
  x, y = jnp.zeros((6, 2, 2, 1), jnp.uint8), jnp.zeros((6,), jnp.int32)
  R, E, B, n = 4, 2, 2, 5  # 3 steps per epoch
  run = jax.jit(lambda ctx: local_update(   # one program for the rounds
      loss, opt, {"w": jnp.zeros(())}, x, y, jnp.int32(n), jax.random.key(0),
      ctx, batch_size=B, epochs=E, rounds=R)[0])
  for r in range(R):
    ctx = ClientContext(id=jnp.int32(0), round=jnp.int32(r), start=None)
    params = run(ctx)
    want = -sum(3 * 0.5 * (1 + np.cos(np.pi * (r * E + e) / (R * E)))
                for e in range(E))
    np.testing.assert_allclose(params["w"], want, rtol=1e-5)
  with pytest.raises(ValueError, match="rounds"):
    local_update(loss, opt, {"w": jnp.zeros(())}, x, y, jnp.int32(n),
                 jax.random.key(0), ctx, batch_size=B, epochs=E)


# --------------------------------------------------------------------------
# The algorithm.


@pytest.fixture(scope="module")
def setup():
  """An MLP (features: its hidden layer): the objective reads only
  `features` and `head`, and a small CNN compiles and runs several times
  slower without XLA's optimizations."""
  fed = synthetic_federation(num_clients=3, per_domain=40, size=12)
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean,
                           std=fed.std)
  return fed, model


def _build(fed, model, **hp):
  cfg = base_config()
  for k, v in hp.items():
    cfg.fedccrl[k] = v
  return assemble.algorithm("fedccrl", model, fed.num_clients, cfg, data=fed)


def test_without_augmentation_and_alignment_the_loss_is_cross_entropy(setup):
  fed, model = setup
  params = model.init(jax.random.key(0))
  batch = Batch(jnp.asarray(fed.train.x[0, :8]), jnp.asarray(fed.train.y[0, :8]),
                jnp.asarray([1.0] * 6 + [0.0] * 2))
  ctx = ClientContext(id=jnp.int32(0), round=jnp.int32(0), start=params)
  plain_off = [_build(fed, model, ccdt=False, difp=False, lambda1=0.0,
                      lambda2=0.0, cls_loss=cls_loss)
               for cls_loss in ("mean", "sum")]
  # Identical views: L_RA is exactly the contrastive loss of (Z, Z).
  ra = _build(fed, model, ccdt=False, difp=False, lambda1=0.5, lambda2=0.0)
  # Re-styled views (MixStyle only): L_JS adds a positive amount.
  js, plain = (_build(fed, model, difp=False, lambda1=0.0, lambda2=lam)
               for lam in (1.0, 0.0))
  server, _ = plain.init(jax.random.key(0))

  @jax.jit   # one program (eagerly: a program per op)
  def run(params, batch, ctx, pool):
    key = jax.random.key(1)
    ce = objectives.cross_entropy(model)(params, batch, key, ctx)
    z = model.features(params, batch.x, train=True, rng=jax.random.key(0))
    sc = objectives.supervised_contrastive(z, z, batch.y, batch.mask, 0.1)
    styled = ctx._replace(shared=pool)
    return (ce, sc, [a.client.loss(params, batch, key, ctx) for a in plain_off],
            ra.client.loss(params, batch, key, ctx),
            [a.client.loss(params, batch, jax.random.key(2), styled)
             for a in (js, plain)])

  ce, sc, off, with_ra, (with_js, without_js) = run(params, batch, ctx,
                                                    server.pool)
  for got, factor in zip(off, (1.0, 3.0)):   # cls_loss mean, sum
    np.testing.assert_allclose(got, factor * ce, rtol=1e-5)
  np.testing.assert_allclose(with_ra, ce + 0.5 * sc, rtol=1e-4)
  assert float(with_js) > float(without_js) + 1e-6


def test_style_pool_holds_statistics_of_each_clients_own_images(setup):
  fed, model = setup
  alg = _build(fed, model, r=0.25)
  server, _ = alg.init(jax.random.key(0))
  pool = jax.tree.map(np.asarray, server.pool)
  x = np.asarray(fed.train.x)
  for c in range(fed.num_clients):
    n = int(fed.train.n[c])
    assert pool.valid[c].sum() == int(np.ceil(0.25 * n))
    imgs = (x[c, :n] / 255.0 - np.asarray(fed.mean)) / np.asarray(fed.std)
    mus = imgs.mean((1, 2))
    for j in np.flatnonzero(pool.valid[c]):
      assert np.min(np.abs(mus - pool.mu[c, j]).max(1)) < 1e-4


# --------------------------------------------------------------------------
# The objective on the views it built, the views' plumbing, the pool's sizes.


class _Spy:
  """A model that records what `features` saw and returned (tracers inside
  jit: `_run_loss` returns them from the same jitted function)."""

  def __init__(self, model):
    self._model, self.seen = model, []

  def __getattr__(self, name):
    return getattr(self._model, name)

  def features(self, params, x, **kw):
    z = self._model.features(params, x, **kw)
    self.seen.append((x, z))
    return z


@pytest.fixture(scope="module")
def unequal():
  """Three clients of 13, 7 and 2 examples (a padded width of 13) on 12x12x1
  images; an MLP (features: its hidden layer)."""
  fed = with_sizes(synthetic_federation(num_clients=3, per_domain=14, size=12),
                   (13, 7, 2))
  assert fed.train.x.shape[1] == 13
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean,
                           std=fed.std)
  return fed, model


def _noisy_shift(im, chain_key, mix_key):
  """A cheap AugMix stand-in: a per-image brightness shift and pixel noise."""
  shift = jax.random.uniform(mix_key, (), minval=-60.0, maxval=60.0)
  return jnp.clip(im + shift + 10.0 * jax.random.normal(chain_key, im.shape),
                  0.0, 255.0)


def _fake_augmix(monkeypatch, fake):
  """Replaces AugMix by `fake(im, chain_key, mix_key)`; -> the list its
  keyword arguments are appended to (one entry per traced view)."""
  calls = []

  def augmix(im, chain_key, mix_key, **kw):
    calls.append(kw)
    return fake(im, chain_key, mix_key)

  monkeypatch.setattr(augment, "augmix", augmix)
  return calls


def _run_loss(unequal, pool=None, head_scale=1.0, **hp):
  """FedCCRL (`hp`) built on a spy of the model; its loss under jit on client
  1's first 6 examples (the last 2 padded). -> (loss, xs = [X; X1; X2],
  features, batch, params, the algorithm's first pool)."""
  fed, model = unequal
  spy = _Spy(model)
  alg = fedccrl.build(spy, optax.sgd(0.1), data=fed, num_clients=fed.num_clients,
                      **hp)
  if pool is None and hp.get("ccdt", True):
    pool = alg.init(jax.random.key(0))[0].pool
  params = model.init(jax.random.key(1))
  params = dict(params, fc2=jax.tree.map(lambda a: a * head_scale, params["fc2"]))
  batch = Batch(jnp.asarray(fed.train.x[1, :6]), jnp.asarray(fed.train.y[1, :6]),
                jnp.asarray([1.0] * 4 + [0.0] * 2))
  ctx = ClientContext(id=jnp.int32(1), round=jnp.int32(0), start=params,
                      shared=pool)

  @jax.jit
  def run(params, batch, key, ctx):
    loss = alg.client.loss(params, batch, key, ctx)
    (xs, z), = spy.seen[-1:]
    return loss, xs, z

  loss, xs, z = run(params, batch, jax.random.key(5), ctx)
  return (float(loss), np.asarray(xs, np.float64), np.asarray(z, np.float64),
          batch, params, pool)


def _log_softmax(logits):
  m = logits.max(1, keepdims=True)
  return logits - m - np.log(np.exp(logits - m).sum(1, keepdims=True))


def test_the_objective_is_eq15_on_its_own_views_against_numpy(unequal,
                                                              monkeypatch):
  """L = L_CLS + lambda1 L_RA + lambda2 L_JS (Eq. 15) recomputed in float64 from
  the features the loss computed for [X; X1; X2]: L_CLS the mean of the three
  cross-entropies (Eq. 16), L_RA = (L_SC(Z1, Z) + L_SC(Z2, Z)) / 2 (Eq. 12,
  each the plain loop of Eq. 11 over the real rows), L_JS the mean KL to the
  mean prediction (Eq. 14); padded rows take no part. X comes first and is the
  batch itself; the two views (AugMix a noisy stand-in here) differ from it
  and from each other. lambda1, lambda2 unequal and not 1, each term well
  above the tolerance: a dropped weight or term, or a view in the wrong place
  of Eq. 12, shows."""
  _fake_augmix(monkeypatch, _noisy_shift)
  lam1, lam2 = 0.3, 0.7
  model = unequal[1]
  loss, xs, z, batch, params, _ = _run_loss(unequal, ccdt=False, head_scale=8.0,
                                            lambda1=lam1, lambda2=lam2)
  x, v1, v2 = np.split(xs, 3)
  np.testing.assert_allclose(x, model.normalize(batch.x), rtol=1e-6, atol=1e-6)
  real = np.asarray(batch.mask) > 0
  for a, b in ((v1, x), (v2, x), (v1, v2)):
    assert np.abs(a - b)[real].mean() > 0.1
  logits = np.asarray(model.head(params, jnp.asarray(z, jnp.float32)), np.float64)
  y = np.asarray(batch.y)[real]
  zs = [a[real] for a in np.split(z, 3)]
  logp = [_log_softmax(l)[real] for l in np.split(logits, 3)]
  ce = np.mean([-lp[np.arange(len(y)), y].mean() for lp in logp])
  ra = 0.5 * (_supcon_numpy(zs[1], zs[0], y, 0.1)
              + _supcon_numpy(zs[2], zs[0], y, 0.1))
  p = [np.exp(lp) for lp in logp]
  mix = sum(p) / 3
  js = np.mean([np.sum(q * (lq - np.log(mix)), 1) for q, lq in zip(p, logp)],
               axis=0).mean()
  # The terms, and L_SC's order (pairs with the original, not with each other).
  assert ra > 0.1 and js > 0.01 and ce > 0.1, (ce, ra, js)
  swapped = 0.5 * (_supcon_numpy(zs[1], zs[2], y, 0.1)
                   + _supcon_numpy(zs[0], zs[2], y, 0.1))
  assert abs(swapped - ra) > 1e-3
  np.testing.assert_allclose(loss, ce + lam1 * ra + lam2 * js, rtol=1e-5)


def test_views_restyle_toward_a_foreign_statistic(unequal):
  """CCDT alone: each view image's per-channel (mean, std) is lam * a pooled
  statistic of *another* client + (1 - lam) * its own, one lam in [0, 1] for
  both (MixStyle's mix, Eq. 6-7), drawn per image."""
  fed, _ = unequal
  _, xs, _, batch, _, pool = _run_loss(unequal, difp=False, alpha=1.0, r=0.5)
  x, *views = np.split(xs, 3)
  stats = lambda im: np.concatenate([im.mean((0, 1)),
                                     np.sqrt(im.var((0, 1)) + 1e-6)])
  entries = [(c, j) for c, j in zip(*np.nonzero(np.asarray(pool.valid)))]
  assert {c for c, _ in entries} == set(range(fed.num_clients))
  found, moved = set(), 0
  for v in views:
    for b in np.flatnonzero(np.asarray(batch.mask) > 0):
      t = stats(v[b]) - stats(x[b])
      if np.abs(t).max() < 1e-2:
        continue  # lam near 0: any statistic fits
      moved += 1
      fits = []
      for c, j in entries:
        d = np.concatenate([pool.mu[c, j], pool.sig[c, j]]) - stats(x[b])
        lam = float(d @ t / (d @ d))
        if -1e-6 <= lam <= 1 + 1e-6 and np.abs(lam * d - t).max() < 1e-3:
          fits.append((c, j))
      assert fits and all(c != 1 for c, _ in fits), (b, fits)
      found.update(fits)
  assert moved >= 4 and len(found) >= 2  # drawn per image, not per batch


def test_difp_gets_pixels_keys_and_settings_and_is_normalized_back(unequal,
                                                                   monkeypatch):
  """DIFP alone: AugMix gets each image's pixel values (`to_pixels`), a chain
  key and a mix key per image (the chain key shared by the batch with
  augmix_per_batch), and the configured width / severity / beta; its output is
  normalized back (an identity AugMix gives back X). The stand-in writes
  uniform(chain key) and uniform(mix key) into pixel (0, 0) and (0, 1)."""
  u = lambda key: jax.random.uniform(key, ()) * 255.0
  mark = lambda im, kc, km: im.at[0, 0].set(u(kc)).at[0, 1].set(u(km))
  for per_batch in (False, True):
    calls = _fake_augmix(monkeypatch, mark)
    _, xs, _, _, _, _ = _run_loss(unequal, ccdt=False, augmix_width=2,
                                  augmix_severity=2.5, beta=0.7,
                                  augmix_per_batch=per_batch)
    assert calls == [dict(width=2, severity=2.5, beta=0.7)] * 2
    x, v1, v2 = np.split(xs, 3)
    np.testing.assert_allclose(v1[:, 1:], x[:, 1:], atol=1e-5)
    np.testing.assert_allclose(v2[:, 0, 2:], x[:, 0, 2:], atol=1e-5)
    chain, mix = v1[:, 0, 0, 0], v1[:, 0, 1, 0]
    assert np.ptp(mix) > 1e-3
    assert (np.ptp(chain) < 1e-6) == per_batch, (per_batch, chain)
    assert np.abs(v1[:, 0, :2] - v2[:, 0, :2]).min() > 1e-4  # own keys per view


def test_ccdt_draws_one_symmetric_beta_alpha_weight_per_example(unequal,
                                                               monkeypatch):
  """CCDT's mixing weight is MixStyle's lambda ~ Beta(alpha, alpha), one per
  example of each view (a spy on `augment.symmetric_beta`, whose draws
  tests/test_augment.py checks against the Beta distribution): another
  alpha or one weight per batch fails."""
  real = augment.symmetric_beta
  calls = []

  def spy(key, a, shape):
    calls.append((float(a), tuple(shape)))
    return real(key, a, shape)

  monkeypatch.setattr(augment, "symmetric_beta", spy)
  _run_loss(unequal, difp=False, alpha=0.3)
  assert calls == [(0.3, (6,))] * 2  # two views of a batch of 6


def test_style_pool_keeps_ceil_r_n_statistics_per_client(unequal):
  """S = ceil(r n_max) slots, ceil(r n_i) valid statistics per client (Eq. 8,
  Alg. 1), on 13, 7, 2 examples (padded to 13) with r = 0.25: 4 slots and
  4, 2, 1 statistics where floor gives 3 and 3, 1, 0; the same in each
  round's message (its end of round)."""
  fed, model = unequal
  assert style_pool.pool_slots(0.25, 13) == 4
  assert [style_pool.pool_slots(r, 10) for r in (0.05, 0.15, 1.0)] == [1, 2, 10]
  alg = fedccrl.build(model, optax.sgd(0.1), data=fed,
                      num_clients=fed.num_clients, r=0.25)
  server, _ = alg.init(jax.random.key(0))
  valid = np.asarray(server.pool.valid)
  assert valid.shape == (3, 4)
  want = [math.ceil(0.25 * n) for n in fed.train.n]
  assert want == [4, 2, 1]
  np.testing.assert_array_equal(valid.sum(1), want)
  _, aux = jax.jit(alg.client.end.fn)(
      ClientContext(id=jnp.int32(1), round=jnp.int32(0), start=None), None,
      ClientData(jnp.asarray(fed.train.x[1]), jnp.asarray(fed.train.y[1]),
                 jnp.int32(7)), jax.random.key(3))
  np.testing.assert_array_equal(np.asarray(aux.valid), [1, 1, 0, 0])


def test_the_server_writes_the_cohorts_redrawn_statistics(setup):
  """A client's end of round redraws a client's statistics from its own images; the
  server writes the cohort's rows (a cohort [2, 0]: neither sorted nor rows
  0..m-1), keeps the others and reports the pool's size."""
  fed, model = setup
  alg = _build(fed, model)
  first, _ = alg.init(jax.random.key(0))
  ids = np.array([2, 0])
  data = ClientData(*(jnp.asarray(np.asarray(a)[ids]) for a in (
      fed.train.x, fed.train.y, fed.train.n)))
  stacked = jax.tree.map(lambda v: jnp.stack([v] * 2), first.params)

  @jax.jit   # the cohort's uploads and the server update in one program
  def round_end(server, data):
    ctx = ClientContext(id=jnp.int32(0), round=jnp.int32(0), start=None)
    aux = jax.vmap(lambda d, k: alg.client.end.fn(ctx, None, d, k)[1])(
        data, jax.random.split(jax.random.key(7), 2))
    result = ClientResult(ids=jnp.asarray(ids), round=jnp.int32(0),
                          start=stacked, params=stacked,
                          num_examples=data.n, loss=jnp.zeros(2), message=aux)
    return aux, alg.server.update(server, result, jax.random.key(1))

  aux, (server, metrics) = jax.device_get(round_end(first, data))
  old = jax.device_get(first.pool)
  for row, c in enumerate(ids):
    for got, want, was in zip(server.pool, aux, old):
      np.testing.assert_array_equal(got[c], want[row])
    assert not np.allclose(server.pool.mu[c], old.mu[c])  # redrawn
  for got, was in zip(server.pool, old):
    np.testing.assert_array_equal(got[1], was[1])  # not in the cohort
  assert int(metrics["ccdt_pool_size"]) == int(server.pool.valid.sum()) == int(
      old.valid.sum())


# FedCCRL end to end in the default suite (CCDT and DIFP on, ~25 s of
# compiling AugMix in a round program): its pinned entry in
# tests/test_pinned.py, which compiles the optimized program for ~60 s, is
# slow. With test_the_server_writes_the_cohorts_redrawn_statistics it pins
# the pool's refresh and size (a server that keeps the first pool fails
# both).
def test_fedccrl_learns_and_refreshes_the_pool(setup):
  fed, model = setup
  alg = _build(fed, model, augmix_width=1)
  res = engine.run(alg, fed, model, engine.EngineConfig(
      rounds=3, eval_every=3, epochs=1, batch_size=16, progress=False))
  assert res.final["id_acc"] > 1.0 / fed.num_classes + 0.2, res.final
  first, _ = alg.init(jax.random.key(0))
  sizes = np.asarray(res.round_metrics["ccdt_pool_size"])
  np.testing.assert_array_equal(sizes, int(first.pool.valid.sum()))
  assert not np.allclose(res.server.pool.mu, first.pool.mu)  # redrawn


def test_bad_settings_and_missing_data_are_errors(setup):
  fed, model = setup
  for hp, needle in ((dict(r=0.0), "fedccrl.r=0.0"),
                     (dict(pixel_overflow="mod"), "pixel_overflow"),
                     (dict(cls_loss="avg"), "cls_loss"),
                     (dict(temperature=0.0), "temperature")):
    with pytest.raises(ConfigError, match=needle):
      _build(fed, model, **hp)
  with pytest.raises(NeedsDataError, match="first style pool"):
    assemble.algorithm("fedccrl", model, 3, base_config())
  assert fedccrl.uses_data({"ccdt": True}) and not fedccrl.uses_data(
      {"ccdt": False})
