"""AdaIN style transfer (Huang & Belongie, ICCV 2017), the network CCST uses.

    net = init(key, depth=4)                 # or load(vgg, decoder, depth)
    feats = encode(net, x01, depth=4)        # [B, H/8, W/8, 512] relu4_1
    t = adain(feats, style_mean, style_std)  # [B, C] statistics each
    out = decode(net, t, depth=4)            # [B, H, W, 3], ~[0, 1]
    out = transfer(net, x01, style_mean, style_std, depth=4, alpha=1.0)

The encoder is the reference release's `vgg_normalised` (a Caffe VGG-19 with
a leading 1x1 conv that maps RGB in [0, 1] to mean-subtracted BGR in 0..255)
up to relu4_1 (the AdaIN code keeps `list(vgg.children())[:31]`); the decoder
mirrors it (the reference `net.decoder`). Every 3x3 conv is preceded by a
reflection pad of 1 and followed by ReLU (but the decoder's last); the
encoder max-pools 2x2/2 with `ceil_mode=True` after relu1_2, relu2_2,
relu3_4; the decoder upsamples x2 (nearest) where the encoder pooled.

`depth` d in 1..4 ends the encoder at relu{d}_1 (d = 4: the paper's network)
and keeps the decoder layers that mirror it, a suffix of the full decoder
(d = 1: conv0, conv1_1 | dec1_1, one 64->3 conv), so tests and CPU runs use
the same code at a fraction of the cost. The smallest feature map must be at
least 2x2 (reflection padding): `min_image_size(depth)`.

Weights: `load(vgg_path, decoder_path, depth)` reads the reference release's
`vgg_normalised.pth` / `decoder.pth` (torch state dicts named by the index in
the `nn.Sequential`: `0.weight`, `2.weight`, ... / `1.weight`, ...; `.pth`
needs torch) or the same tensors as `.safetensors` (torch-free), through
`weights.read_state_dict` and `weights.conv_kernel` (OIHW -> HWIO). The
encoder file may hold the deeper VGG-19 layers (the release holds them all
up to relu5_4; they are ignored); the decoder file must hold exactly the
depth's decoder. A tensor of another shape is a `DataError` naming it and
both shapes. `init` samples PyTorch's default Conv2d init (random weights:
tests and wiring only; the transfer is meaningless without trained weights).

AdaIN normalizes with the *population* variance plus `eps` inside the square
root, so the output has exactly the given mean and (up to eps) std per
channel; the reference `calc_mean_std` uses the unbiased variance, which
scales the result's std by sqrt((n - 1) / n) over n = h w positions
(docs/faithfulness.md, "CCST").
"""

from __future__ import annotations

import functools
import re
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_dg.errors import ConfigError, DataError
from fedjax_dg.models import layers
from fedjax_dg.models import weights as weights_lib

Params = Any
DEPTHS = (1, 2, 3, 4)

# (index in the reference `net.vgg` nn.Sequential, name, out channels, kernel).
ENCODER = (
    (0, "conv0", 3, 1),
    (2, "conv1_1", 64, 3),
    (5, "conv1_2", 64, 3),
    (9, "conv2_1", 128, 3),
    (12, "conv2_2", 128, 3),
    (16, "conv3_1", 256, 3),
    (19, "conv3_2", 256, 3),
    (22, "conv3_3", 256, 3),
    (25, "conv3_4", 256, 3),
    (29, "conv4_1", 512, 3),
)
POOL_AFTER = ("conv1_2", "conv2_2", "conv3_4")
# (index in the reference `net.decoder`, name, out channels); all 3x3. The
# name says which encoder conv it mirrors (dec3_1 undoes conv3_1).
DECODER = (
    (1, "dec4_1", 256),
    (5, "dec3_4", 256),
    (8, "dec3_3", 256),
    (11, "dec3_2", 256),
    (14, "dec3_1", 128),
    (18, "dec2_2", 128),
    (21, "dec2_1", 64),
    (25, "dec1_2", 64),
    (28, "dec1_1", 3),
)
UPSAMPLE_AFTER = ("dec4_1", "dec3_1", "dec2_1")
_LAST_ENCODER = {1: "conv1_1", 2: "conv2_1", 3: "conv3_1", 4: "conv4_1"}


def _check_depth(depth: int) -> None:
  if depth not in DEPTHS:
    raise ConfigError(f"AdaIN depth={depth!r}: allowed {DEPTHS} (the encoder "
                      "ends at relu{depth}_1)")


def encoder_layers(depth: int) -> tuple[tuple[int, str, int, int], ...]:
  """The encoder's convs at `depth`: (torch index, name, channels, kernel)."""
  _check_depth(depth)
  names = [e[1] for e in ENCODER]
  return ENCODER[:names.index(_LAST_ENCODER[depth]) + 1]


def decoder_layers(depth: int) -> tuple[tuple[int, str, int], ...]:
  """The decoder's convs at `depth`: those mirroring the encoder's convs."""
  mirrored = {"dec" + e[1][4:] for e in encoder_layers(depth)[1:]}
  return tuple(d for d in DECODER if d[1] in mirrored)


def channels(depth: int) -> int:
  """Channels of the relu{depth}_1 features (the style statistics' length)."""
  return encoder_layers(depth)[-1][2]


def min_image_size(depth: int) -> int:
  """The smallest input side: the relu{depth}_1 map must be >= 2 for its
  reflection padding (each pool halves, rounding up)."""
  _check_depth(depth)
  return 2 ** (depth - 1) + 1


def _reflect(x):
  return jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="reflect")


def _pool(x):
  """MaxPool2d(2, 2, ceil_mode=True)."""
  h, w = x.shape[1:3]
  return layers.max_pool(x, 2, 2, padding=((0, h % 2), (0, w % 2)))


def _upsample(x):
  """Upsample(scale_factor=2, mode='nearest')."""
  return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


class Encoder(nn.Module):
  """vgg_normalised up to relu{depth}_1; input RGB in [0, 1], NHWC."""
  depth: int = 4
  impl: str = "auto"

  @nn.compact
  def __call__(self, x):
    for _, name, cout, k in encoder_layers(self.depth):
      if k == 3:
        x = _reflect(x)
      x = layers.Conv(cout, k, padding="VALID", impl=self.impl,
                      weight_init="torch", name=name)(x)
      if name != "conv0":
        x = jax.nn.relu(x)
      if name in POOL_AFTER:
        x = _pool(x)
    return x


class Decoder(nn.Module):
  """The mirror of `Encoder(depth)`: relu{depth}_1 features -> RGB."""
  depth: int = 4
  impl: str = "auto"

  @nn.compact
  def __call__(self, x):
    convs = decoder_layers(self.depth)
    for i, (_, name, cout) in enumerate(convs):
      x = layers.Conv(cout, 3, padding="VALID", impl=self.impl,
                      weight_init="torch", name=name)(_reflect(x))
      if i < len(convs) - 1:
        x = jax.nn.relu(x)
      if name in UPSAMPLE_AFTER:
        x = _upsample(x)
    return x


def init(key: jax.Array, depth: int = 4, image_size: int = 32) -> Params:
  """{"encoder": ..., "decoder": ...} with PyTorch's default Conv2d init."""
  return _jitted_init(depth, max(image_size, min_image_size(depth)))(key)


@functools.lru_cache(maxsize=8)
def _jitted_init(depth: int, image_size: int):
  x = np.zeros((1, image_size, image_size, 3), np.float32)

  def init_(key):
    k_enc, k_dec = jax.random.split(key)
    with layers.init_rng_mode():
      enc = Encoder(depth).init(k_enc, x)["params"]
      feats = Encoder(depth).apply({"params": enc}, x)
      dec = Decoder(depth).init(k_dec, jnp.zeros_like(feats))["params"]
    return {"encoder": dict(enc), "decoder": dict(dec)}

  return jax.jit(init_)


def encode(net: Params, x: jax.Array, *, depth: int = 4,
           impl: str = "auto") -> jax.Array:
  """relu{depth}_1 features of RGB images in [0, 1] (NHWC)."""
  return Encoder(depth, impl).apply({"params": net["encoder"]}, x)


def decode(net: Params, feats: jax.Array, *, depth: int = 4,
           impl: str = "auto") -> jax.Array:
  """Images (NHWC, RGB, roughly [0, 1], not clipped) from relu{depth}_1
  features; 2^(depth-1) times their size."""
  return Decoder(depth, impl).apply({"params": net["decoder"]}, feats)


def instance_stats(feats: jax.Array, eps: float = 1e-5
                   ) -> tuple[jax.Array, jax.Array]:
  """Per image and channel over H, W: mean and sqrt(population var + eps),
  [B, C] each (feats [B, H, W, C])."""
  mean = jnp.mean(feats, axis=(1, 2))
  var = jnp.mean(jnp.square(feats - mean[:, None, None]), axis=(1, 2))
  return mean, jnp.sqrt(var + eps)


def adain(content_feat: jax.Array, style_mean: jax.Array, style_std: jax.Array,
          eps: float = 1e-5) -> jax.Array:
  """AdaIN(x, y) = sigma(y) (x - mu(x)) / sigma(x) + mu(y), per image and
  channel: content [B, H, W, C], the style's statistics [B, C]."""
  mean, std = instance_stats(content_feat, eps)
  normalized = (content_feat - mean[:, None, None]) / std[:, None, None]
  return normalized * style_std[:, None, None] + style_mean[:, None, None]


def transfer(net: Params, x: jax.Array, style_mean: jax.Array,
             style_std: jax.Array, *, depth: int = 4, alpha: float = 1.0,
             eps: float = 1e-5, impl: str = "auto") -> jax.Array:
  """Images x (RGB in [0, 1], [B, H, W, 3]) re-styled to the given relu{depth}_1
  statistics ([B, C]): decode(alpha AdaIN(f) + (1 - alpha) f), f = encode(x),
  cropped to H x W (odd sides come back one pixel larger); not clipped."""
  feats = encode(net, x, depth=depth, impl=impl)
  t = adain(feats, style_mean, style_std, eps)
  t = alpha * t + (1.0 - alpha) * feats
  return decode(net, t, depth=depth, impl=impl)[:, :x.shape[1], :x.shape[2]]


# --------------------------------------------------------------------------
# The reference release's weights.


def expected_shapes(depth: int, part: str) -> dict[str, tuple]:
  """{torch name: shape} of the encoder's ("vgg") or decoder's convs at
  `depth`, as the reference `nn.Sequential`s name them."""
  out, cin = {}, 3
  if part == "vgg":
    for idx, _, cout, k in encoder_layers(depth):
      out[f"{idx}.weight"], out[f"{idx}.bias"] = (cout, cin, k, k), (cout,)
      cin = cout
    return out
  if part == "decoder":
    cin = channels(depth)
    for idx, _, cout in decoder_layers(depth):
      out[f"{idx}.weight"], out[f"{idx}.bias"] = (cout, cin, 3, 3), (cout,)
      cin = cout
    return out
  raise ValueError(f"part={part!r}: 'vgg' or 'decoder'")


_TORCH_NAME = re.compile(r"^(\d+)\.(weight|bias)$")


def to_flax(state: Mapping[str, Any], depth: int, part: str, *,
            source: str = "the state dict") -> dict:
  """The encoder's ("vgg") or decoder's flax params from a reference state
  dict; every tensor is checked first (`DataError` naming each misfit)."""
  expected = expected_shapes(depth, part)
  last = max(int(n.split(".")[0]) for n in expected)

  def deeper_vgg(name):  # the release's VGG-19 goes on to relu5_4
    m = _TORCH_NAME.match(name)
    return part == "vgg" and m is not None and int(m.group(1)) > last

  mismatched, missing, unexpected = weights_lib.compare_shapes(
      state, expected, extra_ok=deeper_vgg)
  if mismatched or missing or unexpected:
    what = "vgg_normalised (the encoder)" if part == "vgg" else "the decoder"
    message = weights_lib.mismatch_message(
        f"{source} does not fit {what} at depth={depth}", mismatched, missing,
        unexpected)
    full = set(expected_shapes(4, "decoder"))
    if part == "decoder" and depth < 4 and unexpected and set(
        unexpected) <= full:
      message += ("; it holds a deeper decoder's layers (the reference "
                  "decoder.pth decodes relu4_1: depth=4); another depth needs "
                  "a decoder trained for its relu{depth}_1 features")
    raise DataError(message)
  convs = ([(i, n) for i, n, _, _ in encoder_layers(depth)] if part == "vgg"
           else [(i, n) for i, n, _ in decoder_layers(depth)])
  return {name: {"kernel": weights_lib.conv_kernel(state[f"{idx}.weight"]
                                                   ).astype(np.float32),
                 "bias": np.asarray(state[f"{idx}.bias"], np.float32)}
          for idx, name in convs}


def load(vgg_path: str, decoder_path: str, depth: int = 4) -> Params:
  """{"encoder": ..., "decoder": ...} from the reference release's files
  (`.pth` with torch, or `.safetensors`)."""
  return {"encoder": to_flax(weights_lib.read_state_dict(vgg_path), depth,
                             "vgg", source=repr(vgg_path)),
          "decoder": to_flax(weights_lib.read_state_dict(decoder_path), depth,
                             "decoder", source=repr(decoder_path))}


__all__ = ["DECODER", "DEPTHS", "Decoder", "ENCODER", "Encoder", "adain",
           "channels", "decode", "decoder_layers", "encode", "encoder_layers",
           "expected_shapes", "init", "instance_stats", "load",
           "min_image_size", "to_flax", "transfer"]
