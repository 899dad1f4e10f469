"""ELCFS (FedDG): the amplitude-spectrum tools against numpy's FFT and the
released code's interpolation, foreign-only draws from the bank, NT-Xent
against a plain loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_dg.client import frequency, objectives

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
  amp, phase = (np.asarray(a) for a in frequency.amplitude_phase(jnp.asarray(x)))
  f = np.fft.fft2(x.astype(np.float64), axes=(0, 1))
  np.testing.assert_allclose(amp, np.abs(f), rtol=1e-4, atol=1e-2)
  big = np.abs(f) > 1.0  # the angle of a tiny coefficient is round-off
  turn = np.angle(np.exp(1j * (phase - np.angle(f))))  # modulo 2 pi
  np.testing.assert_allclose(turn[big], 0.0, atol=1e-3)
  np.testing.assert_allclose(
      frequency.from_amplitude_phase(jnp.asarray(amp), jnp.asarray(phase)), x,
      atol=2e-3)


@pytest.mark.parametrize("h,w,L", [(12, 12, 0.1), (9, 12, 0.25), (16, 10, 0.5),
                                   (11, 11, 0.0), (8, 8, 0.5)])
def test_mixing_and_transfer_equal_the_released_codes_numpy(h, w, L):
  x, foreign = _image(h, w), _image(h, w, lo=40, hi=120)
  amp_x, amp_f = _chw_amp(x), _chw_amp(foreign)
  to_hwc = lambda a: jnp.asarray(a.transpose(1, 2, 0), jnp.float32)
  for lam in (0.0, 0.3, 1.0):
    want = _code_mix(amp_x.copy(), amp_f, L, lam).transpose(1, 2, 0)
    got = frequency.mix_low_frequency(to_hwc(amp_x), to_hwc(amp_f), lam, L)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-2)
    # The bank entry (the window) gives the same mix as the full spectrum.
    entry = frequency.bank_entry(jnp.asarray(foreign), L)
    assert entry.shape[:2] == frequency.window_shape(h, w, L)
    got = frequency.mix_window(to_hwc(amp_x), entry, lam, L)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=5e-2)
    got = frequency.transfer(jnp.asarray(x), entry, lam, L)
    np.testing.assert_allclose(got, _code_transfer(x, amp_f, L, lam),
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
  for L in (0.0, 0.2, 0.5):
    entry = frequency.bank_entry(jnp.asarray(foreign), L)
    np.testing.assert_allclose(frequency.transfer(jnp.asarray(x), entry, 0.0, L),
                               x, atol=2e-3)
  # ratio 0 (the code's L=0) swaps the DC amplitude only: lam=1 gives x with
  # each channel's mean replaced by the foreign image's (no clipping here).
  entry = frequency.bank_entry(jnp.asarray(foreign), 0.0)
  assert entry.shape == (1, 1, 3)
  out = np.asarray(frequency.transfer(jnp.asarray(x), entry, 1.0, 0.0))
  want = x - x.mean((0, 1)) + foreign.mean((0, 1))
  np.testing.assert_allclose(out, want, atol=2e-3)
  # lam interpolates the mean; a larger window changes more than the mean.
  out = np.asarray(frequency.transfer(jnp.asarray(x), entry, 0.25, 0.0))
  np.testing.assert_allclose(out.mean((0, 1)), 0.75 * x.mean((0, 1))
                             + 0.25 * foreign.mean((0, 1)), rtol=1e-5)
  wide = np.asarray(frequency.transfer(
      jnp.asarray(x), frequency.bank_entry(jnp.asarray(foreign), 0.3), 1.0, 0.3))
  assert np.abs((wide - wide.mean((0, 1))) - (x - x.mean((0, 1)))).max() > 1.0


def test_transfer_clamps_to_the_pixel_range():
  x, foreign = _image(8, 8), _image(8, 8)
  entry = frequency.bank_entry(jnp.asarray(foreign), 0.5)  # the whole spectrum
  free = np.real(np.fft.ifft2(_chw_amp(foreign) * np.exp(1j * np.angle(
      np.fft.fft2(x.transpose(2, 0, 1), axes=(-2, -1)))), axes=(-2, -1)))
  assert free.max() > 260.0 and free.min() < -5.0  # the test means something
  out = np.asarray(frequency.transfer(jnp.asarray(x), entry, 1.0, 0.5))
  assert out.min() == 0.0 and out.max() == 255.0
  np.testing.assert_allclose(out, _code_transfer(x, _chw_amp(foreign), 0.5, 1.0),
                             atol=5e-3)


def test_draws_are_foreign_valid_and_uniform_over_clients():
  """Client 1 holds one entry, client 3 three: drawn equally often (a client
  first, then one of its entries, as the code draws), never the own client
  or an empty slot; a client without entries is never drawn."""
  valid = jnp.asarray([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], bool)
  for own in range(4):
    c, s = (np.asarray(a) for a in frequency.sample_foreign(
        jax.random.key(own), valid, jnp.asarray(own), 3000))
    assert not np.any(c == own) and np.all(np.asarray(valid)[c, s])
    allowed = {(i, j) for i in range(4) for j in range(3)
               if i != own and valid[i, j]}
    assert set(zip(c.tolist(), s.tolist())) == allowed
    holders = [i for i in (0, 1, 3) if i != own]
    counts = np.array([np.sum(c == i) for i in holders]) / 3000
    np.testing.assert_allclose(counts, 1 / len(holders), atol=0.04)


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
