"""ELCFS (FedDG): the amplitude-spectrum tools against numpy's FFT and the
released code's interpolation, foreign-only draws from the bank, NT-Xent
against a plain loop, the episodic loss and both of its gradients against
autodiff of an explicitly written inner step, and the algorithm end to end."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import synthetic_federation
from fedjax_dg import algorithms, engine, models
from fedjax_dg.algorithms import elcfs
from fedjax_dg.algorithms.base import ClientResult
from fedjax_dg.client import frequency, objectives
from fedjax_dg.client.update import Batch, ClientContext, ClientData
from fedjax_dg.run.config import base_config
from fedjax_dg.errors import ConfigError, NeedsDataError
from fedjax_dg.run import assemble

RNG = np.random.default_rng(0)


# --------------------------------------------------------------------------
# The frequency tools against numpy (the released code's functions, written
# channels-first as the code has them).


def _code_mix(amp_local, amp_trg, L, lam):
  """`amp_spectrum_swap` of freq_space_interpolation_demo.py with the code's
  `ratio` = 1 - lam (the weight of the local amplitude); [C, H, W]."""
  a_local = np.fft.fftshift(amp_local, axes=(-2, -1))
  a_trg = np.fft.fftshift(amp_trg, axes=(-2, -1))
  _, h, w = a_local.shape
  b = int(np.floor(min(h, w) * L))
  c_h, c_w = h // 2, w // 2
  win = (slice(None), slice(c_h - b, c_h + b + 1), slice(c_w - b, c_w + b + 1))
  ratio = 1 - lam
  a_local[win] = a_local[win] * ratio + a_trg[win] * (1 - ratio)
  return np.fft.ifftshift(a_local, axes=(-2, -1))


def _code_transfer(img_hwc, amp_trg_chw, L, lam):
  """`freq_space_interpolation` then the dataloader's clip to 0..255."""
  img = img_hwc.transpose(2, 0, 1).astype(np.float64)
  f = np.fft.fft2(img, axes=(-2, -1))
  mixed = _code_mix(np.abs(f), amp_trg_chw, L, lam)
  out = np.real(np.fft.ifft2(mixed * np.exp(1j * np.angle(f)), axes=(-2, -1)))
  return np.clip(out, 0, 255).transpose(1, 2, 0)


def _image(h, w, c=3, lo=0, hi=256):
  return RNG.integers(lo, hi, (h, w, c)).astype(np.float32)


def _chw_amp(img):
  return np.abs(np.fft.fft2(img.transpose(2, 0, 1).astype(np.float64),
                            axes=(-2, -1)))


def test_amplitude_and_phase_are_numpys_per_channel_fft():
  x = _image(9, 12)
  # One program (eagerly: a program per op).
  (amp, phase), back = jax.tree.map(np.asarray, jax.jit(lambda x: (
      frequency.amplitude_phase(x),
      frequency.from_amplitude_phase(*frequency.amplitude_phase(x))))(x))
  f = np.fft.fft2(x.astype(np.float64), axes=(0, 1))
  np.testing.assert_allclose(amp, np.abs(f), rtol=1e-4, atol=1e-2)
  big = np.abs(f) > 1.0  # the angle of a tiny coefficient is round-off
  turn = np.angle(np.exp(1j * (phase - np.angle(f))))  # modulo 2 pi
  np.testing.assert_allclose(turn[big], 0.0, atol=1e-3)
  np.testing.assert_allclose(back, x, atol=2e-3)


@pytest.mark.parametrize("h,w,L", [(12, 12, 0.1), (9, 12, 0.25), (16, 10, 0.5),
                                   (11, 11, 0.0), (8, 8, 0.5)])
def test_mixing_and_transfer_equal_the_released_codes_numpy(h, w, L):
  x, foreign = _image(h, w), _image(h, w, lo=40, hi=120)
  amp_x, amp_f = _chw_amp(x), _chw_amp(foreign)
  to_hwc = lambda a: np.asarray(a.transpose(1, 2, 0), np.float32)
  lams = (0.0, 0.3, 1.0)

  @jax.jit   # one program (eagerly: ~20)
  def run(amp_x, amp_f, x, foreign):
    entry = frequency.bank_entry(foreign, L)
    return entry, [(frequency.mix_low_frequency(amp_x, amp_f, lam, L),
                    frequency.mix_window(amp_x, entry, lam, L),
                    frequency.transfer(x, entry, lam, L)) for lam in lams]

  entry, outs = run(to_hwc(amp_x), to_hwc(amp_f), x, foreign)
  # The bank entry (the window) gives the same mix as the full spectrum.
  assert entry.shape[:2] == frequency.window_shape(h, w, L)
  for lam, (full, window, transferred) in zip(lams, outs):
    want = _code_mix(amp_x.copy(), amp_f, L, lam).transpose(1, 2, 0)
    np.testing.assert_allclose(full, want, rtol=1e-5, atol=1e-2)
    np.testing.assert_allclose(window, want, rtol=1e-4, atol=5e-2)
    np.testing.assert_allclose(transferred, _code_transfer(x, amp_f, L, lam),
                               atol=5e-3)


def test_window_is_centred_on_the_dc_term():
  """The entry's centre is the DC amplitude |sum x| per channel, and the
  window spans the signed frequencies -b..b."""
  x = _image(10, 13)
  entry = np.asarray(frequency.bank_entry(jnp.asarray(x), 0.2))  # b = 2
  assert entry.shape == (5, 5, 3)
  np.testing.assert_allclose(entry[2, 2], x.sum((0, 1)), rtol=1e-5)
  f = np.abs(np.fft.fft2(x.astype(np.float64), axes=(0, 1)))
  np.testing.assert_allclose(entry[0, 4], f[-2, 2], rtol=1e-4)
  np.testing.assert_allclose(entry[3, 1], f[1, -1], rtol=1e-4)


def test_lam_zero_returns_the_image_and_ratio_zero_moves_only_the_mean():
  x = _image(12, 10, lo=80, hi=180)
  foreign = _image(12, 10, lo=100, hi=140)

  @jax.jit   # one program (eagerly: a program per op and window size)
  def run(x, foreign):
    entry = lambda L: frequency.bank_entry(foreign, L)
    return dict(
        lam0=[frequency.transfer(x, entry(L), 0.0, L) for L in (0.0, 0.2, 0.5)],
        dc=entry(0.0), mean=frequency.transfer(x, entry(0.0), 1.0, 0.0),
        quarter=frequency.transfer(x, entry(0.0), 0.25, 0.0),
        wide=frequency.transfer(x, entry(0.3), 1.0, 0.3))

  out = jax.tree.map(np.asarray, run(x, foreign))
  for got in out["lam0"]:   # L = 0, 0.2, 0.5
    np.testing.assert_allclose(got, x, atol=2e-3)
  # ratio 0 (the code's L=0) swaps the DC amplitude only: lam=1 gives x with
  # each channel's mean replaced by the foreign image's (no clipping here).
  assert out["dc"].shape == (1, 1, 3)
  want = x - x.mean((0, 1)) + foreign.mean((0, 1))
  np.testing.assert_allclose(out["mean"], want, atol=2e-3)
  # lam interpolates the mean; a larger window changes more than the mean.
  np.testing.assert_allclose(out["quarter"].mean((0, 1)), 0.75 * x.mean((0, 1))
                             + 0.25 * foreign.mean((0, 1)), rtol=1e-5)
  wide = out["wide"]
  assert np.abs((wide - wide.mean((0, 1))) - (x - x.mean((0, 1)))).max() > 1.0


def test_transfer_clamps_to_the_pixel_range():
  x, foreign = _image(8, 8), _image(8, 8)
  free = np.real(np.fft.ifft2(_chw_amp(foreign) * np.exp(1j * np.angle(
      np.fft.fft2(x.transpose(2, 0, 1), axes=(-2, -1)))), axes=(-2, -1)))
  assert free.max() > 260.0 and free.min() < -5.0  # the test means something
  # the whole spectrum; one program (eagerly: a program per op)
  out = np.asarray(jax.jit(lambda x, foreign: frequency.transfer(
      x, frequency.bank_entry(foreign, 0.5), 1.0, 0.5))(x, foreign))
  assert out.min() == 0.0 and out.max() == 255.0
  np.testing.assert_allclose(out, _code_transfer(x, _chw_amp(foreign), 0.5, 1.0),
                             atol=5e-3)


def test_draws_are_foreign_valid_and_uniform_over_clients():
  """Client 1 holds one entry, client 3 three: drawn equally often (a client
  first, then one of its entries, as the code draws), never the own client
  or an empty slot; a client without entries is never drawn."""
  valid = jnp.asarray([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], bool)
  draw = jax.jit(frequency.sample_foreign, static_argnums=3)
  for own in range(4):
    c, s = (np.asarray(a) for a in draw(jax.random.key(own), valid,
                                        jnp.asarray(own), 3000))
    assert not np.any(c == own) and np.all(np.asarray(valid)[c, s])
    allowed = {(i, j) for i in range(4) for j in range(3)
               if i != own and valid[i, j]}
    assert set(zip(c.tolist(), s.tolist())) == allowed
    holders = [i for i in (0, 1, 3) if i != own]
    counts = np.array([np.sum(c == i) for i in holders]) / 3000
    np.testing.assert_allclose(counts, 1 / len(holders), atol=0.04)


def test_a_client_transforms_its_batch_toward_other_clients_only():
  """ratio 0: each transformed image is the image shifted by a constant per
  channel, its mean moved from its own toward one foreign client's entry (a
  DC entry of value mean * H W) by a share lam in [lam_low, lam_high]. Every
  image is explained by a valid foreign entry (means 90, 150), both appear;
  a draw of the own row (mean 240) or of an invalid slot (mean 10) would
  move the mean by a share outside [0.2, 0.6] of either."""
  h, w, b = 6, 5, 64
  pixels = jnp.asarray(RNG.integers(100, 141, (b, h, w, 2)), jnp.float32)
  means = np.array([[240.0, 240.0], [90.0, 10.0], [150.0, 10.0]])  # [N, S]
  amp = jnp.asarray(np.repeat(means[:, :, None, None, None], 2, -1) * h * w,
                    jnp.float32)                              # [3, 2, 1, 1, 2]
  bank = elcfs.AmplitudeBank(amp, jnp.asarray([[1, 1], [1, 0], [1, 0]], bool))
  out = np.asarray(jax.jit(lambda k: elcfs.transformed_batch(
      pixels, k, bank, jnp.int32(0), ratio=0.0, lam_low=0.2, lam_high=0.6))(
          jax.random.key(0)))
  shift = out - np.asarray(pixels)
  np.testing.assert_allclose(  # the mean moves, nothing else
      shift, np.broadcast_to(shift.mean((1, 2), keepdims=True), shift.shape),
      atol=2e-3)
  own = np.asarray(pixels).mean((1, 2))
  new = out.mean((1, 2))
  share = {m: (new - own) / (m - own) for m in (90.0, 150.0)}
  hit = {m: np.all((v > 0.2 - 1e-4) & (v < 0.6 + 1e-4), axis=1)
         for m, v in share.items()}
  assert np.all(hit[90.0] ^ hit[150.0])
  assert hit[90.0].sum() > 10 and hit[150.0].sum() > 10
  # One lam per image, shared by its channels.
  lam = np.where(hit[90.0][:, None], share[90.0], share[150.0])
  np.testing.assert_allclose(lam[:, 0], lam[:, 1], atol=1e-4)
  assert lam.min() < 0.3 and lam.max() > 0.5  # spread over the range


# --------------------------------------------------------------------------
# NT-Xent against a plain loop (pytorch_metric_learning's NTXentLoss).


def _ntxent_numpy(z, y, tau):
  z = z / np.linalg.norm(z, axis=1, keepdims=True)
  s = z @ z.T / tau
  losses = []
  for a in range(len(z)):
    negs = [n for n in range(len(z)) if y[n] != y[a]]
    for p in range(len(z)):
      if p != a and y[p] == y[a]:
        denom = np.exp(s[a, p]) + sum(np.exp(s[a, n]) for n in negs)
        losses.append(-np.log(np.exp(s[a, p]) / denom))
  if not losses or all(y == y[0]):
    return 0.0
  return np.mean(losses)


def test_ntxent_equals_the_loop_and_ignores_padding():
  ntxent = jax.jit(objectives.ntxent, static_argnums=3)
  z = RNG.normal(size=(7, 5))
  y = np.array([0, 1, 0, 2, 1, 0, 3])  # class 3: an anchor without positives
  got = ntxent(jnp.asarray(z), jnp.asarray(y), jnp.ones(7), 0.5)
  np.testing.assert_allclose(got, _ntxent_numpy(z, y, 0.5), rtol=1e-5)
  padded = np.concatenate([z, 10 * RNG.normal(size=(2, 5))])
  got = ntxent(jnp.asarray(padded), jnp.asarray(np.r_[y, 0, 1]),
                          jnp.asarray([1.0] * 7 + [0.0] * 2), 0.5)
  np.testing.assert_allclose(got, _ntxent_numpy(z, y, 0.5), rtol=1e-5)
  # One label only: no negatives, loss 0 and a finite (zero) gradient.
  same = jnp.zeros(4, jnp.int32)
  assert float(ntxent(jnp.asarray(z[:4]), same, jnp.ones(4), 0.5)) == 0
  g = jax.jit(jax.grad(objectives.ntxent), static_argnums=3)(
      jnp.asarray(z[:4]), same, jnp.ones(4), 0.5)
  assert np.all(np.asarray(g) == 0)
  # An anchor whose label has no negatives among valid rows: loss 0 pairs.
  y2 = np.array([0, 0, 0, 1])
  np.testing.assert_allclose(
      ntxent(jnp.asarray(z[:4]), jnp.asarray(y2), jnp.ones(4), 0.5),
      _ntxent_numpy(z[:4], y2, 0.5), rtol=1e-5)


# --------------------------------------------------------------------------
# The episodic loss against an explicitly written inner step.


@pytest.fixture(scope="module")
def setup():
  fed = synthetic_federation(num_clients=3, per_domain=40, size=12)
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean,
                           std=fed.std, hidden=16)
  return fed, model


def _explicit(model, x, x_trs, y, beta, clip, gamma, tau):
  """(f(theta, theta'), theta -> theta') written out on the real rows."""

  def ce(p, xs):
    logp = jax.nn.log_softmax(model.apply(p, xs, normalized=True))
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

  def f(theta, theta_prime):
    z_in = model.features(theta, x, normalized=True)
    z_out = model.features(theta_prime, x_trs, normalized=True)
    con = objectives.ntxent(jnp.concatenate([z_in, z_out]),
                            jnp.concatenate([y, y]), jnp.ones(2 * len(y)), tau)
    return ce(theta, x) + ce(theta_prime, x_trs) + gamma * con

  def inner_step(theta):
    g = jax.grad(ce)(theta, x)
    return jax.tree.map(lambda p, v: p - beta * jnp.clip(v, -clip, clip),
                        theta, g), g

  return f, inner_step


def _flat(tree):
  return np.concatenate([np.asarray(v).ravel() for v in jax.tree.leaves(tree)])


def test_episodic_loss_and_both_gradients_equal_the_explicit_inner_step(setup):
  fed, model = setup
  params = model.init(jax.random.key(1))
  b, real = 12, 9
  x = model.normalize(jnp.asarray(fed.train.x[0, :b]))
  x_trs = model.normalize(jnp.asarray(fed.train.x[1, :b]))  # any other batch
  y = jnp.asarray(fed.train.y[0, :b])
  mask = jnp.asarray([1.0] * real + [0.0] * (b - real))
  beta, gamma, tau = 0.5, 0.3, 0.2
  f, inner_step = _explicit(model, x[:real], x_trs[:real], y[:real], beta,
                            1e9, gamma, tau)
  g = np.abs(_flat(jax.jit(inner_step)(params)[1]))
  clip = float(np.quantile(g[g > 0], 0.7))  # some entries clipped, not all
  f, inner_step = _explicit(model, x[:real], x_trs[:real], y[:real], beta,
                            clip, gamma, tau)
  assert 0.1 < np.mean(g > clip) < 0.5

  def ours(p, second_order):
    return elcfs.episodic_loss(
        model, p, x, x_trs, y, mask, jax.random.key(0), jax.random.key(1),
        meta_step_size=beta, clip_value=clip, second_order=second_order,
        contrastive_weight=gamma, temperature=tau)

  @jax.jit   # the explicit step and ours, both orders, in one program
  def explicit_and_ours(theta):
    theta_prime = inner_step(theta)[0]
    value = f(theta, theta_prime)
    # First order: theta' = theta - beta * (a constant), so the gradient is
    # df/dtheta + df/dtheta' at (theta, theta').
    d_theta, d_prime = jax.grad(f, argnums=(0, 1))(theta, theta_prime)
    # Second order: autodiff through the written-out inner step.
    full = jax.grad(lambda t: f(t, inner_step(t)[0]))(theta)
    mine = {second: jax.value_and_grad(lambda p: ours(p, second))(theta)
            for second in (False, True)}
    return value, jax.tree.map(jnp.add, d_theta, d_prime), full, mine

  value, want_first, want_second, mine = explicit_and_ours(params)
  got = {}
  for second in (False, True):
    loss, grad = mine[second]
    np.testing.assert_allclose(loss, value, rtol=1e-5)
    got[second] = _flat(grad)
  np.testing.assert_allclose(got[False], _flat(want_first), rtol=1e-4,
                             atol=1e-6)
  np.testing.assert_allclose(got[True], _flat(want_second), rtol=1e-4,
                             atol=1e-6)
  diff = np.abs(got[True] - got[False]).max()
  assert diff > 1e-3 * np.abs(got[False]).max()


def _build(fed, model, **hp):
  cfg = base_config()
  for k, v in hp.items():
    cfg.elcfs[k] = v
  return assemble.algorithm("elcfs", model, fed.num_clients, cfg, data=fed)


def test_local_loss_is_the_episodic_loss_of_the_batch_and_its_transform(setup):
  """The objective = episodic_loss(x, x_trs), x_trs = transformed_batch of
  the client's batch with the bank it reads (the three keys split from the
  step's: transform, inner pass, outer pass); the transform matters."""
  fed, model = setup
  params = model.init(jax.random.key(0))
  batch = Batch(jnp.asarray(fed.train.x[0, :8]), jnp.asarray(fed.train.y[0, :8]),
                jnp.asarray([1.0] * 6 + [0.0] * 2))
  alg = _build(fed, model, lam_low=0.3, lam_high=0.9, ratio=0.25)
  server, _ = alg.init(jax.random.key(0))
  ctx = ClientContext(id=jnp.int32(1), round=jnp.int32(0), start=params,
                      shared=server.bank)
  key = jax.random.key(3)
  k_view, k_inner, k_outer = jax.random.split(key, 3)
  hp = dict(meta_step_size=1e-3, clip_value=100.0, second_order=False,
            contrastive_weight=0.1, temperature=0.05)

  pixels = batch.x.astype(jnp.float32)

  @jax.jit   # the explicit composition and the objective in one program
  def run(params, batch, ctx):
    x_trs = elcfs.transformed_batch(
        pixels, k_view, server.bank, jnp.int32(1), ratio=0.25, lam_low=0.3,
        lam_high=0.9)
    want = elcfs.episodic_loss(
        model, params, model.normalize(batch.x),
        model.normalize(x_trs / 255.0), batch.y, batch.mask, k_inner, k_outer,
        **hp)
    return x_trs, want, alg.client.loss(params, batch, key, ctx)

  x_trs, want, got = run(params, batch, ctx)
  assert float(np.mean(np.abs(np.asarray(x_trs) - np.asarray(pixels)))
               ) > 1.0  # the transform acts
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_bank_holds_windows_of_each_clients_own_images(setup):
  fed, model = setup
  alg = _build(fed, model, bank_fraction=0.25, ratio=0.25)
  server, _ = alg.init(jax.random.key(0))
  bank = jax.tree.map(np.asarray, server.bank)
  x = np.asarray(fed.train.x, np.float32)
  assert bank.amp.shape[2:] == (7, 7, 1)  # 12 x 12 images, b = 3
  for c in range(fed.num_clients):
    n = int(fed.train.n[c])
    assert bank.valid[c].sum() == int(np.ceil(0.25 * n))
    dc = x[c, :n].sum((1, 2))  # [n, C]: the window's centre
    for j in np.flatnonzero(bank.valid[c]):
      assert np.min(np.abs(dc - bank.amp[c, j, 3, 3]).max(1)) < 1e-2


def test_the_server_keeps_the_cohorts_new_bank_rows(setup):
  """A client's end of round re-draws a client's rows from its own images; the server
  writes the cohort's rows and keeps the others (refresh_bank=False: nothing
  uploaded, the first bank kept)."""
  fed, model = setup
  alg = _build(fed, model, ratio=0.25)
  first, _ = alg.init(jax.random.key(0))
  ids = jnp.asarray([2, 0])
  data = lambda c: ClientData(jnp.asarray(fed.train.x[c]),
                              jnp.asarray(fed.train.y[c]),
                              jnp.asarray(fed.train.n[c]))

  @jax.jit   # the uploads and the server update in one program
  def round_end(first, datas):
    aux = [alg.client.end.fn(ClientContext(id=c, round=0, start=None), None,
                             d, jax.random.key(7 + int(c)))[1]
           for d, c in zip(datas, ids.tolist())]
    aux = jax.tree.map(lambda *a: jnp.stack(a), *aux)
    stacked = jax.tree.map(lambda v: jnp.stack([v] * 2), first.params)
    result = ClientResult(ids=ids, round=jnp.asarray(0), start=stacked,
                          params=stacked, num_examples=jnp.asarray([5, 5]),
                          loss=jnp.zeros(2), message=aux)
    return result, alg.server.update(first, result, jax.random.key(0))

  result, (server, metrics) = round_end(first, [data(int(c)) for c in ids])
  aux = result.message
  for row, c in enumerate(ids.tolist()):
    np.testing.assert_array_equal(server.bank.amp[c], aux.amp[row])
    assert not np.allclose(server.bank.amp[c], first.bank.amp[c])  # redrawn
  np.testing.assert_array_equal(server.bank.amp[1], first.bank.amp[1])
  assert int(metrics["elcfs_bank_size"]) == int(first.bank.valid.sum())
  kept = _build(fed, model, ratio=0.25, refresh_bank=False)
  assert kept.client.end is None
  server, _ = jax.jit(kept.server.update)(first, result._replace(message=None),
                                          jax.random.key(0))
  np.testing.assert_array_equal(server.bank.amp, first.bank.amp)


@pytest.mark.slow  # ~6 s of compiling; tests/test_pinned.py runs ELCFS too
def test_elcfs_learns_through_the_engine(setup):
  fed, model = setup
  alg = _build(fed, model, ratio=0.25)
  res = engine.run(alg, fed, model, engine.EngineConfig(
      rounds=3, eval_every=3, epochs=1, batch_size=16, progress=False))
  assert res.final["id_acc"] > 1.0 / fed.num_classes + 0.2, res.final
  first, _ = alg.init(jax.random.key(0))
  sizes = np.asarray(res.round_metrics["elcfs_bank_size"])
  np.testing.assert_array_equal(sizes, int(first.bank.valid.sum()))
  assert not np.allclose(res.server.bank.amp, first.bank.amp)  # redrawn


def test_bad_settings_and_missing_data_are_errors(setup):
  fed, model = setup
  for hp, needle in ((dict(ratio=0.6), "elcfs.ratio=0.6"),
                     (dict(lam_low=0.8, lam_high=0.2), "elcfs.lam_low"),
                     (dict(bank_fraction=0.0), "elcfs.bank_fraction"),
                     (dict(clip_value=0.0), "elcfs.clip_value"),
                     (dict(temperature=0.0), "elcfs.temperature"),
                     (dict(meta_step_size=-1.0), "elcfs.meta_step_size")):
    with pytest.raises(ConfigError, match=needle):
      _build(fed, model, **hp)
  _build(fed, model, ratio=0.5)  # [0, 0.5]: the upper end is allowed
  with pytest.raises(NeedsDataError, match="amplitude bank"):
    assemble.algorithm("elcfs", model, 3, base_config())
  with pytest.raises(ConfigError, match="2 clients"):
    elcfs.build(model, optax.sgd(0.1), num_clients=1, data=fed)
