"""ResNet-50 (He et al. 2016) with GroupNorm, loop-safe, for federated training.

HyperGenFL uses "Resnet50 [8]" for Fashion-MNIST, CIFAR-100 and Tiny-ImageNet
without further detail. This is the bottleneck ResNet-50 (stages of 3, 4, 6, 3
blocks, widths 64-128-256-512, expansion 4, stride on the 3x3 conv as in
torchvision's "v1.5") with two documented choices:

* **GroupNorm instead of BatchNorm** (`norm_groups=32`, Wu & He 2018's default;
  every width here is a multiple of 32). BatchNorm keeps running statistics,
  a second, non-trainable variable collection that federated averaging would
  have to treat separately (average them? keep them local, FedBN? the papers
  do not say), and its batch statistics of label-skewed local batches differ
  from the global ones (Hsieh et al. 2020, "The Non-IID Data Quagmire",
  replace it by GroupNorm for this reason). GroupNorm normalizes each example
  by itself, so train and eval behave the same and the model stays a pure
  function of its 'params' (the repo's `Model` has no mutable collections:
  every algorithm averages / generates / mixes exactly the params pytree).
  GroupNorm has the same learnable scale and bias per channel as BatchNorm, so
  the parameter count equals torchvision's.
* **Stem** `"cifar"` (default): conv3x3/1 + GN + ReLU, no max pool, the CIFAR
  ResNet of FedLAW's code base (kuangliu/pytorch-cifar), whose baselines
  HyperGenFL reuses; right for 28x28 / 32x32 / 64x64 inputs. `"imagenet"`:
  torchvision's conv7x7/2 + GN + ReLU + maxpool3x3/2.

Global average pooling -> `features` [B, 2048] -> `fc2` Dense(num_classes).
Convolutions are `layers.Conv` (im2col / custom-VJP on CPU, XLA on GPU);
the max pool of the ImageNet stem is `layers.max_pool` (no select_and_scatter).
Conv kernels use torchvision's init (kaiming normal, fan_out), the classifier
PyTorch's Linear default; GroupNorm scale 1, bias 0 (`zero_init_residual`
starts each block's last GN scale at 0, torchvision's option, off by default).
`dtype` (`model.dtype`) is the compute dtype: GroupNorm computes its
statistics in float32 whatever it is, parameters stay float32, logits come
back as float32.
"""

from __future__ import annotations

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_dg.errors import ConfigError
from fedjax_dg.models import layers

Array = jax.Array

RESNET50_STAGES = (3, 4, 6, 3)
STEMS = ("cifar", "imagenet")


class Bottleneck(nn.Module):
  """1x1 -> 3x3 (stride) -> 1x1 (x4), GN after each; projection shortcut if needed."""
  planes: int
  strides: int = 1
  norm_groups: int = 32
  conv_impl: str = "auto"
  zero_init_residual: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    out_ch = 4 * self.planes
    conv = lambda f, k, s, name: layers.Conv(
        f, k, strides=s, padding=k // 2, use_bias=False, impl=self.conv_impl,
        weight_init="kaiming_out", name=name)
    gn = lambda name, zero=False: nn.GroupNorm(
        num_groups=self.norm_groups, epsilon=1e-5, name=name, dtype=self.dtype,
        scale_init=nn.initializers.zeros if zero else nn.initializers.ones)
    y = nn.relu(gn("gn1")(conv(self.planes, 1, 1, "conv1")(x)))
    y = nn.relu(gn("gn2")(conv(self.planes, 3, self.strides, "conv2")(y)))
    y = gn("gn3", self.zero_init_residual)(conv(out_ch, 1, 1, "conv3")(y))
    if self.strides != 1 or x.shape[-1] != out_ch:
      x = gn("shortcut_gn")(conv(out_ch, 1, self.strides, "shortcut_conv")(x))
    return nn.relu(x + y)


class ResNet(nn.Module):
  """Bottleneck ResNet with GroupNorm; `stages=(3, 4, 6, 3)` is ResNet-50."""
  num_classes: int
  stages: Sequence[int] = RESNET50_STAGES
  width: int = 64
  stem: str = "cifar"
  norm_groups: int = 32
  conv_impl: str = "auto"
  zero_init_residual: bool = False
  dtype: Any = jnp.float32  # compute dtype (model.dtype)

  def setup(self):
    if self.stem not in STEMS:
      raise ConfigError(f"stem must be one of {STEMS}, got {self.stem!r}")
    k, s = (3, 1) if self.stem == "cifar" else (7, 2)
    self.stem_conv = layers.Conv(self.width, k, strides=s, padding=k // 2,
                                 use_bias=False, impl=self.conv_impl,
                                 weight_init="kaiming_out")
    self.stem_gn = nn.GroupNorm(num_groups=self.norm_groups, epsilon=1e-5,
                                dtype=self.dtype)
    blocks = []
    for i, n in enumerate(self.stages):
      for j in range(n):
        blocks.append(Bottleneck(
            self.width * 2**i, strides=2 if (i > 0 and j == 0) else 1,
            norm_groups=self.norm_groups, conv_impl=self.conv_impl,
            zero_init_residual=self.zero_init_residual, dtype=self.dtype,
            name=f"stage{i + 1}_block{j + 1}"))
    self.blocks = blocks
    self.fc2 = layers.Dense(self.num_classes, weight_init="torch")

  def features(self, x: Array, *, train: bool = False) -> Array:
    del train  # No dropout; GroupNorm behaves the same in training and eval.
    x = layers.cast(x, self.dtype)
    x = nn.relu(self.stem_gn(self.stem_conv(x)))
    if self.stem == "imagenet":
      x = layers.max_pool(x, 3, 2, padding=((1, 1), (1, 1)))
    for block in self.blocks:
      x = block(x)
    return jnp.mean(x, axis=(1, 2))

  def __call__(self, x: Array, *, train: bool = False) -> Array:
    return layers.cast(self.fc2(self.features(x, train=train)), jnp.float32)


def resnet50_param_count(num_classes: int, in_channels: int = 3,
                         stem: str = "cifar") -> int:
  """Closed-form parameter count of `ResNet(stages=(3, 4, 6, 3))`.

  Convs have no bias; every norm layer has a scale and a bias per channel;
  torchvision's resnet50 (BatchNorm, 7x7 stem, 1000 classes) has 25,557,032.
  """
  k = 3 if stem == "cifar" else 7
  total = k * k * in_channels * 64 + 2 * 64  # stem conv + norm
  cin = 64
  for i, n in enumerate(RESNET50_STAGES):
    planes = 64 * 2**i
    for j in range(n):
      total += cin * planes + 2 * planes               # conv1 1x1 + norm
      total += 9 * planes * planes + 2 * planes        # conv2 3x3 + norm
      total += planes * 4 * planes + 2 * 4 * planes    # conv3 1x1 + norm
      if j == 0:                                       # projection shortcut
        total += cin * 4 * planes + 2 * 4 * planes
      cin = 4 * planes
  return total + cin * num_classes + num_classes
