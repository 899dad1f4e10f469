"""MobileNetV3-Large (Howard et al. 2019), torchvision's layout, loop-safe.

FedCCRL (Sec. 4.1): "We utilize MobileNetV3-Large [9] as the backbone network,
where the final fully connected layer acts as the classifier g, and the
preceding layers serve as the representation encoder h". This is torchvision's
`mobilenet_v3_large` (width 1.0): the same inverted-residual table
(`INVERTED_RESIDUAL_SETTING`), squeeze-and-excitation with
`make_divisible(expanded // 4, 8)` squeeze channels, ReLU then hardsigmoid
inside SE, hardswish / ReLU per block, depthwise convolutions padded
`(k - 1) // 2`, a residual where the stride is 1 and the width is kept, a last
1x1 conv to 960, global average pooling, then the classifier
Linear(960 -> 1280) + hardswish + Dropout(0.2) + Linear(1280 -> classes).
`features` is the input of the last Linear ([B, 1280], after the dropout), as
for every model of the package; `fc2` is the last Linear (`Model.head`).

**Normalization instead of BatchNorm** (`norm`): the engine trains one plain
'params' pytree (no running statistics, see `resnet.py`), so each BatchNorm is
replaced by

* ``"affine"``: a per-channel `scale` and `bias` (trainable). torchvision's
  eval-mode BatchNorm is exactly such an affine map, so `weights.py` folds a
  pretrained BatchNorm into it (`scale = w / sqrt(var + eps)`,
  `bias = b - mean * scale`) and a loaded model computes what torchvision
  computes in eval mode. Training it does not renormalize activations.
* ``"group"``: GroupNorm (`norm_groups` groups, eps 1e-5; every width here is a
  multiple of 8) with the same `scale` and `bias` parameters, for training from
  scratch (as `resnet.py`).

Both have the same parameter tree and count as torchvision's (5,483,032 for
1000 classes). Initialization is torchvision's: convs kaiming normal (fan_out),
zero biases, norm scale 1 / bias 0, the classifier's Linears N(0, 0.01).
Any input size works (the net strides by 32; 32x32 ends at 1x1).
`dtype` (`model.dtype`) is the compute dtype: norm statistics in float32,
parameters float32, logits back as float32.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_dg.errors import ConfigError
from fedjax_dg.models import layers

Array = jax.Array

# torchvision's `_mobilenet_v3_conf("mobilenet_v3_large")`: input channels,
# kernel, expanded channels, output channels, squeeze-excitation, activation,
# stride (dilation 1 everywhere).
INVERTED_RESIDUAL_SETTING = (
    (16, 3, 16, 16, False, "relu", 1),
    (16, 3, 64, 24, False, "relu", 2),
    (24, 3, 72, 24, False, "relu", 1),
    (24, 5, 72, 40, True, "relu", 2),
    (40, 5, 120, 40, True, "relu", 1),
    (40, 5, 120, 40, True, "relu", 1),
    (40, 3, 240, 80, False, "hardswish", 2),
    (80, 3, 200, 80, False, "hardswish", 1),
    (80, 3, 184, 80, False, "hardswish", 1),
    (80, 3, 184, 80, False, "hardswish", 1),
    (80, 3, 480, 112, True, "hardswish", 1),
    (112, 3, 672, 112, True, "hardswish", 1),
    (112, 5, 672, 160, True, "hardswish", 2),
    (160, 5, 960, 160, True, "hardswish", 1),
    (160, 5, 960, 160, True, "hardswish", 1),
)
STEM_CHANNELS = 16
LAST_CONV_CHANNELS = 960
LAST_CHANNEL = 1280
NORMS = ("group", "affine")
_ACTIVATIONS = {"relu": nn.relu, "hardswish": jax.nn.hard_swish}


def make_divisible(v: float, divisor: int = 8) -> int:
  """torchvision's `_make_divisible`: nearest multiple, never 10% below `v`."""
  new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
  return new_v + divisor if new_v < 0.9 * v else new_v


def squeeze_channels(expanded: int) -> int:
  """Squeeze width of the SE block of an `expanded`-channel layer."""
  return make_divisible(expanded // 4, 8)


class Norm(nn.Module):
  """Per-channel `scale`/`bias` after an affine identity or a GroupNorm.
  A GroupNorm's statistics are float32 whatever the input's dtype; the
  output has the input's dtype."""
  kind: str = "group"
  groups: int = 8

  @nn.compact
  def __call__(self, x: Array) -> Array:
    ch, dtype = x.shape[-1], x.dtype
    scale = self.param("scale", nn.initializers.ones_init(), (ch,), jnp.float32)
    bias = self.param("bias", nn.initializers.zeros_init(), (ch,), jnp.float32)
    if self.kind == "group":
      g = layers.cast(x, jnp.float32)
      g = g.reshape(x.shape[:-1] + (self.groups, ch // self.groups))
      mean = g.mean(axis=(1, 2, 4), keepdims=True)
      var = jnp.square(g - mean).mean(axis=(1, 2, 4), keepdims=True)
      x = layers.cast(((g - mean) * jax.lax.rsqrt(var + 1e-5)).reshape(x.shape),
                      dtype)
    return x * layers.cast(scale, dtype) + layers.cast(bias, dtype)


class ConvNorm(nn.Module):
  """Conv (no bias, padding (k - 1) // 2) + norm; depthwise when `depthwise`."""
  features: int
  kernel_size: int = 1
  strides: int = 1
  depthwise: bool = False
  norm: str = "group"
  norm_groups: int = 8
  conv_impl: str = "auto"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    k, pad = self.kernel_size, (self.kernel_size - 1) // 2
    if self.depthwise:
      conv = layers.DepthwiseConv(k, strides=self.strides, padding=pad,
                                  impl=self.conv_impl, weight_init="kaiming_out",
                                  name="conv")
    else:
      conv = layers.Conv(self.features, k, strides=self.strides, padding=pad,
                         use_bias=False, impl=self.conv_impl,
                         weight_init="kaiming_out", name="conv")
    return Norm(self.norm, self.norm_groups, name="norm")(conv(x))


class SqueezeExcitation(nn.Module):
  """x * hardsigmoid(fc2(relu(fc1(mean_hw(x))))); fc1/fc2 are torch 1x1 convs."""
  squeeze: int

  @nn.compact
  def __call__(self, x: Array) -> Array:
    s = jnp.mean(x, axis=(1, 2))
    s = nn.relu(layers.Dense(self.squeeze, weight_init="kaiming_out",
                             name="fc1")(s))
    s = layers.Dense(x.shape[-1], weight_init="kaiming_out", name="fc2")(s)
    return x * jax.nn.hard_sigmoid(s)[:, None, None, :]


class InvertedResidual(nn.Module):
  """[expand 1x1] -> depthwise kxk (stride) -> [SE] -> project 1x1 (+ input)."""
  setting: tuple
  norm: str = "group"
  norm_groups: int = 8
  conv_impl: str = "auto"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cin, k, expanded, cout, use_se, act, stride = self.setting
    act = _ACTIVATIONS[act]
    cn = lambda f, name, **kw: ConvNorm(f, norm=self.norm,
                                        norm_groups=self.norm_groups,
                                        conv_impl=self.conv_impl, name=name, **kw)
    y = x
    if expanded != cin:
      y = act(cn(expanded, "expand")(y))
    y = act(cn(expanded, "depthwise", kernel_size=k, strides=stride,
               depthwise=True)(y))
    if use_se:
      y = SqueezeExcitation(squeeze_channels(expanded), name="se")(y)
    y = cn(cout, "project")(y)
    return x + y if stride == 1 and cin == cout else y


class MobileNetV3Large(nn.Module):
  """torchvision's `mobilenet_v3_large` with `norm` in place of BatchNorm."""
  num_classes: int
  norm: str = "group"
  norm_groups: int = 8
  dropout: float = 0.2
  conv_impl: str = "auto"
  dtype: Any = jnp.float32  # compute dtype (model.dtype)

  def setup(self):
    if self.norm not in NORMS:
      raise ConfigError(f"norm must be one of {NORMS}, got {self.norm!r}")
    kw = dict(norm=self.norm, norm_groups=self.norm_groups,
              conv_impl=self.conv_impl)
    self.stem = ConvNorm(STEM_CHANNELS, 3, strides=2, **kw)
    self.blocks = [InvertedResidual(s, **kw, name=f"block{i + 1}")
                   for i, s in enumerate(INVERTED_RESIDUAL_SETTING)]
    self.last = ConvNorm(LAST_CONV_CHANNELS, 1, **kw)
    linear = lambda f: layers.Dense(f, weight_init="normal")
    self.fc1 = linear(LAST_CHANNEL)
    self.drop = nn.Dropout(self.dropout)
    self.fc2 = linear(self.num_classes)

  def features(self, x: Array, *, train: bool = False) -> Array:
    x = jax.nn.hard_swish(self.stem(layers.cast(x, self.dtype)))
    for block in self.blocks:
      x = block(x)
    x = jax.nn.hard_swish(self.last(x))
    x = jax.nn.hard_swish(self.fc1(jnp.mean(x, axis=(1, 2))))
    return self.drop(x, deterministic=not train)

  def __call__(self, x: Array, *, train: bool = False) -> Array:
    return layers.cast(self.fc2(self.features(x, train=train)), jnp.float32)
