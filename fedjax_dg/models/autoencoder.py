"""hFedF's convolutional autoencoder (Table 6) for data-conditioned client embeddings.

Table 6 (32x32x3 input, PyTorch NCHW shapes):

    Conv 3x3/1 p1 -> 16, ReLU;  MaxPool 2/2          [16, 16, 16]
    Conv 3x3/1 p1 -> 32, ReLU;  MaxPool 2/2          [32, 8, 8]
    Flatten 2048 -> Linear e                         the latent (embedding)
    Linear e -> 2048, reshape [32, 8, 8]
    ConvTranspose k2 s2 -> 16, ReLU                  [16, 16, 16]
    ConvTranspose k2 s2 -> 3, Sigmoid                [3, 32, 32]

Here for any H x W x ch input with H, W divisible by 4 (flatten size
32 * H/4 * W/4, last ConvTranspose back to `ch` channels). Convolutions are the
loop-safe `layers.Conv`; a ConvTranspose with kernel 2 and stride 2 has
non-overlapping windows, so it is one matmul [.., Cin] @ [Cin, 2*2*Cout] and a
reshape of the 2x2 blocks into the doubled grid (`conv_transpose_2x2`).

The input is the image in [0, 1] (uint8 / 255), not the classifier's normalized
input: the Sigmoid output reconstructs pixel values (App. C.7), and the MSE
target is that same [0, 1] image.
"""

from __future__ import annotations

import math

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_dg.errors import ConfigError
from fedjax_dg.models import layers

Array = jax.Array


def to_unit(x: Array) -> Array:
  """uint8 -> float32 / 255; floats are taken as already in [0, 1]."""
  x = jnp.asarray(x)
  if jnp.issubdtype(x.dtype, jnp.integer):
    return x.astype(jnp.float32) / 255.0
  return x.astype(jnp.float32)


def conv_transpose_2x2(x: Array, kernel: Array) -> Array:
  """ConvTranspose2d(kernel_size=2, stride=2, padding=0) of NHWC `x`, no bias.

  `kernel` is [Cin, 2, 2, Cout] (PyTorch's [Cin, Cout, kh, kw] with the output
  channels last): output pixel (2i + a, 2j + b) = sum_c x[i, j, c] kernel[c, a, b].
  """
  b, h, w, cin = x.shape
  _, kh, kw, cout = kernel.shape
  y = x.reshape(-1, cin) @ kernel.reshape(cin, kh * kw * cout)
  y = y.reshape(b, h, w, kh, kw, cout).transpose(0, 1, 3, 2, 4, 5)
  return y.reshape(b, h * kh, w * kw, cout)


class ConvTranspose2x2(nn.Module):
  """ConvTranspose2d(k=2, s=2) with PyTorch's default init.

  PyTorch computes the init fan-in of a transposed conv from weight.shape[1] *
  kh * kw = Cout * 4, so kernel and bias are U(+-1/sqrt(4 Cout)).
  """
  features: int

  @nn.compact
  def __call__(self, x: Array) -> Array:
    bound = 1.0 / math.sqrt(4 * self.features)
    init = lambda key, shape, dtype=jnp.float32: jax.random.uniform(
        key, shape, dtype, -bound, bound)
    kernel = self.param("kernel", init, (x.shape[-1], 2, 2, self.features))
    bias = self.param("bias", init, (self.features,))
    return conv_transpose_2x2(x, kernel) + bias


class AutoEncoder(nn.Module):
  """Table 6 autoencoder for [H, W, ch] images (H, W divisible by 4).

  `encode(x)` -> [B, latent] codes; `__call__(x)` -> the [B, H, W, ch]
  reconstruction in [0, 1]. Inputs are images in [0, 1] (`to_unit`).
  """
  latent: int
  image_shape: tuple[int, int, int]
  conv_impl: str = "auto"
  weight_init: str = "torch"

  def setup(self):
    h, w, ch = self.image_shape
    if h % 4 or w % 4:
      raise ConfigError("the autoencoder needs H and W divisible by 4, got "
                       f"{tuple(self.image_shape)}")
    conv = lambda f: layers.Conv(f, 3, padding=1, impl=self.conv_impl,
                                 weight_init=self.weight_init)
    self.enc1 = conv(16)
    self.enc2 = conv(32)
    self.to_latent = layers.Dense(self.latent, weight_init=self.weight_init)
    self.from_latent = layers.Dense(32 * (h // 4) * (w // 4),
                                    weight_init=self.weight_init)
    self.dec1 = ConvTranspose2x2(16)
    self.dec2 = ConvTranspose2x2(ch)

  def encode(self, x: Array) -> Array:
    x = layers.max_pool(nn.relu(self.enc1(x)), 2)
    x = layers.max_pool(nn.relu(self.enc2(x)), 2)
    # Flatten in C, H, W order like PyTorch's `flatten(1)` on NCHW.
    return self.to_latent(x.transpose(0, 3, 1, 2).reshape(x.shape[0], -1))

  def decode(self, z: Array) -> Array:
    h, w, _ = self.image_shape
    y = self.from_latent(z).reshape(-1, 32, h // 4, w // 4).transpose(0, 2, 3, 1)
    return nn.sigmoid(self.dec2(nn.relu(self.dec1(y))))

  def __call__(self, x: Array) -> Array:
    return self.decode(self.encode(x))


def reconstruction_loss(module: AutoEncoder):
  """`loss(params, batch, rng, ctx)`: masked mean squared error (the
  `client.update.local_update` loss signature; labels are unused)."""

  def loss(params, batch, rng, ctx=None):
    del rng, ctx
    x = to_unit(batch.x)
    recon = module.apply({"params": params}, x)
    per_image = jnp.mean((recon - x) ** 2, axis=(1, 2, 3))
    mask = batch.mask
    return jnp.sum(per_image * mask) / jnp.maximum(jnp.sum(mask), 1.0)

  return loss


def init_autoencoder(module: AutoEncoder, key: Array) -> dict:
  """Initial params (a plain nested dict); traceable (usable inside a jit)."""
  x = jnp.zeros((1,) + tuple(module.image_shape), jnp.float32)
  with layers.init_rng_mode():
    return flax.core.unfreeze(module.init(key, x)["params"])


__all__ = ["AutoEncoder", "ConvTranspose2x2", "conv_transpose_2x2",
           "init_autoencoder", "reconstruction_loss", "to_unit"]
