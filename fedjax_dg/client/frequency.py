"""Amplitude-spectrum tools for ELCFS (FedDG, Liu et al. CVPR 2021): jittable,
per image and per channel, usable inside the local step of every client.

An image x [H, W, C] (pixel values, float) has per channel the 2-D discrete
Fourier transform F = fft2(x) over H, W; its amplitude |F| carries the
"style" (intensity, contrast, texture statistics) and its phase angle(F) the
structure. ELCFS (the paper's Sec. 3.2, the released code's
`freq_space_interpolation_demo.py` and `dataloaders/fundus_dataloader.py`):

    A_mix = A_local outside the low-frequency window M,
            (1 - lam) A_local + lam A_foreign inside it,
    x'    = real(ifft2(A_mix * exp(i phase_local))), clamped to the pixel range.

The window M is the centred square of the fftshifted spectrum with half-width
b = floor(min(H, W) * ratio) (the code's `L`): rows floor(H/2) - b ..
floor(H/2) + b, likewise columns, i.e. the signed frequencies -b..b on each
axis. `ratio = 0` keeps only the DC term (b = 0): x' then is x with each
channel's mean moved toward the foreign image's (the window always holds the
DC, as in the code). `lam = 0` returns x (up to float round-off).

What a client shares (its "amplitude bank" entry) is `bank_entry(x, ratio)`:
the window of the fftshifted amplitude, [2b+1, 2b+1, C]; nothing outside the
window is ever read, so nothing else is uploaded. `mix_window` takes such an
entry; `mix_low_frequency` takes a full foreign amplitude.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array
AXES = (0, 1)  # H, W of one image [H, W, C]


def spectrum(x: Array) -> Array:
  """Per-channel 2-D DFT of one image [H, W, C] (complex, not shifted)."""
  return jnp.fft.fft2(x.astype(jnp.float32), axes=AXES)


def amplitude_phase(x: Array) -> tuple[Array, Array]:
  """(|F|, angle(F)) of one image [H, W, C], each [H, W, C]."""
  f = spectrum(x)
  return jnp.abs(f), jnp.angle(f)


def amplitude(x: Array) -> Array:
  """|fft2(x)| per channel of one image [H, W, C]."""
  return jnp.abs(spectrum(x))


def from_amplitude_phase(amp: Array, phase: Array) -> Array:
  """The real image whose spectrum is amp * exp(i phase) (the real part of
  the inverse DFT, as the code takes it)."""
  f = amp * jnp.exp(1j * phase.astype(jnp.float32))
  return jnp.real(jnp.fft.ifft2(f, axes=AXES))


def half_width(h: int, w: int, ratio: float) -> int:
  """b = floor(min(H, W) * ratio): the window's half-width (static)."""
  if not 0.0 <= ratio <= 0.5:
    raise ValueError(f"ratio={ratio!r}: allowed [0, 0.5] (the window is "
                     "centred on the DC term and must fit in the spectrum)")
  return int(math.floor(min(h, w) * ratio))


def _window(h: int, w: int, ratio: float) -> tuple[slice, slice]:
  """The window's rows and columns in fftshifted coordinates."""
  b = half_width(h, w, ratio)
  ch, cw = h // 2, w // 2
  return slice(ch - b, ch + b + 1), slice(cw - b, cw + b + 1)


def window_shape(h: int, w: int, ratio: float) -> tuple[int, int]:
  """The (rows, columns) of a bank entry for [H, W] images (slicing clips the
  window at ratio 0.5 on even sizes, as numpy's does in the code)."""
  rows, cols = _window(h, w, ratio)
  return len(range(h)[rows]), len(range(w)[cols])


def low_frequency_window(amp: Array, ratio: float) -> Array:
  """The centred low-frequency window of an amplitude [H, W, C] (fftshifted
  coordinates): [rows, cols, C] (`window_shape`)."""
  h, w = amp.shape[:2]
  rows, cols = _window(h, w, ratio)
  return jnp.fft.fftshift(amp, axes=AXES)[rows, cols]


def bank_entry(x: Array, ratio: float) -> Array:
  """What a client shares of image x [H, W, C]: its amplitude's window."""
  return low_frequency_window(amplitude(x), ratio)


def mix_window(amp_local: Array, window_foreign: Array, lam: Array,
               ratio: float) -> Array:
  """A_local with its window interpolated toward a foreign window:
  (1 - lam) A_local + lam A_foreign inside, A_local outside (unshifted)."""
  h, w = amp_local.shape[:2]
  rows, cols = _window(h, w, ratio)
  shifted = jnp.fft.fftshift(amp_local, axes=AXES)
  mixed = (1.0 - lam) * shifted[rows, cols] + lam * window_foreign
  return jnp.fft.ifftshift(shifted.at[rows, cols].set(mixed), axes=AXES)


def mix_low_frequency(amp_local: Array, amp_foreign: Array, lam: Array,
                      ratio: float) -> Array:
  """`mix_window` with a full foreign amplitude [H, W, C]."""
  return mix_window(amp_local, low_frequency_window(amp_foreign, ratio), lam,
                    ratio)


def transfer(x: Array, window_foreign: Array, lam: Array, ratio: float,
             low: float = 0.0, high: float = 255.0) -> Array:
  """Image x [H, W, C] (pixel values) with its low-frequency amplitude
  interpolated toward a foreign bank entry, its own phase kept, clamped to
  [low, high] (the code clips to 0..255)."""
  amp, phase = amplitude_phase(x)
  out = from_amplitude_phase(mix_window(amp, window_foreign, lam, ratio), phase)
  return jnp.clip(out, low, high)


def sample_foreign(key: Array, valid: Array, own: Array, num: int
                   ) -> tuple[Array, Array]:
  """`num` (client, slot) draws from a bank with validity [N, S], as the
  code draws: a client uniformly among the others holding an entry, then one
  of its valid entries uniformly (with replacement). Never `own`."""
  n = valid.shape[0]
  k_client, k_slot = jax.random.split(key)
  others = jnp.any(valid, axis=1) & (jnp.arange(n) != own)
  clients = jax.random.categorical(k_client, jnp.where(others, 0.0, -jnp.inf),
                                   shape=(num,))
  slots = jax.random.categorical(
      k_slot, jnp.where(jnp.take(valid, clients, axis=0), 0.0, -jnp.inf))
  return clients, slots
