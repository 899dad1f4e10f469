"""Client CNNs: hFedF's Inception-style CNN (Table 9), a small CNN and a tiny MLP.

Every module takes a float NHWC batch (already normalized) and has two methods:
`features(x, train=...)` -> the penultimate representation [B, F] and
`__call__(x, train=...)` -> logits [B, num_classes]. `dtype` is the compute
dtype (`model.dtype`), given to every layer: the input is cast to it,
parameters stay float32, the logits come back as float32; on a CPU a bfloat16
model keeps float32 activations and its layers run bfloat16 matmuls where
they pay (`MIXED_ON_CPU`, `layers.matmul`). Dropout draws from the
'dropout' rng and is active only with `train=True`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_dg.errors import ConfigError
from fedjax_dg.models import layers

Array = jax.Array


def _flatten(x: Array, order: str) -> Array:
  """Flattens NHWC maps; order "chw" matches PyTorch's NCHW `flatten(1)`."""
  if order == "chw":
    x = x.transpose(0, 3, 1, 2)
  elif order != "hwc":
    raise ConfigError(f"flatten_order must be 'chw' or 'hwc', got {order!r}")
  return x.reshape(x.shape[0], -1)


class NaiveInception(nn.Module):
  """Naive Inception module (Szegedy et al. 2015, Fig. 2a), stride 1, SAME.

  Parallel 1x1 (c1), 3x3 (c3) and 5x5 (c5) convolutions and a 3x3/1 max pool of the
  input, concatenated in that order: C_in + c1 + c3 + c5 channels. The ReLU of
  Table 9 follows the concatenation (equal to a per-branch ReLU: the pooled branch
  is already non-negative there).
  """
  channels: tuple[int, int, int] = (32, 64, 16)
  conv_impl: str = "auto"
  weight_init: str = "torch"
  dtype: Any = None  # compute dtype of the convolutions (`layers.Conv`)

  @nn.compact
  def __call__(self, x: Array) -> Array:
    c1, c3, c5 = self.channels
    conv = lambda f, k, name: layers.Conv(
        f, k, padding="SAME", impl=self.conv_impl, weight_init=self.weight_init,
        dtype=self.dtype, name=name)
    b1 = conv(c1, 1, "branch1x1")(x)
    b3 = conv(c3, 3, "branch3x3")(x)
    b5 = conv(c5, 5, "branch5x5")(x)
    bp = layers.max_pool(x, 3, 1, padding="SAME")
    return jnp.concatenate([b1, b3, b5, bp], axis=-1)


class InceptionCNN(nn.Module):
  """hFedF client model (Table 9 of the conference paper, Table 7 of arXiv v1).

  32x32x3 input: conv3x3-32 -> pool2, relu -> conv1x1-32 -> conv3x3-64 ->
  pool2, relu -> inception (176), relu -> inception (288), relu ->
  adaptive avg pool 3x3 -> flatten 2592 -> dropout 0.2 -> linear 256 (no activation
  in the table; `hidden_relu=True` adds one) -> linear num_classes.
  """
  MIXED_ON_CPU = True  # layers get `dtype` (layers.mixed_on_cpu)
  num_classes: int
  dropout: float = 0.2
  hidden_relu: bool = False
  conv_impl: str = "auto"
  weight_init: str = "torch"
  inception_channels: tuple[int, int, int] = (32, 64, 16)
  hidden: int = 256
  pool_size: int = 3
  flatten_order: str = "chw"
  dtype: Any = jnp.float32  # compute dtype (model.dtype)

  def setup(self):
    conv = lambda f, k, p: layers.Conv(f, k, padding=p, impl=self.conv_impl,
                                       weight_init=self.weight_init,
                                       dtype=self.dtype)
    self.conv1 = conv(32, 3, 1)
    self.conv2 = conv(32, 1, 0)
    self.conv3 = conv(64, 3, 1)
    self.inception1 = NaiveInception(self.inception_channels, self.conv_impl,
                                     self.weight_init, self.dtype)
    self.inception2 = NaiveInception(self.inception_channels, self.conv_impl,
                                     self.weight_init, self.dtype)
    self.drop = nn.Dropout(self.dropout)
    self.fc1 = layers.Dense(self.hidden, weight_init=self.weight_init,
                            dtype=self.dtype)
    self.fc2 = layers.Dense(self.num_classes, weight_init=self.weight_init,
                            dtype=self.dtype)

  def features(self, x: Array, *, train: bool = False) -> Array:
    x = layers.cast(x, layers.activation_dtype(self.dtype))
    x = self.conv1(x)
    x = nn.relu(layers.max_pool(x, 2))
    x = self.conv2(x)
    x = self.conv3(x)
    x = nn.relu(layers.max_pool(x, 2))
    x = nn.relu(self.inception1(x))
    x = nn.relu(self.inception2(x))
    x = layers.adaptive_avg_pool(x, self.pool_size)
    x = _flatten(x, self.flatten_order)
    x = self.drop(x, deterministic=not train)
    x = self.fc1(x)
    return nn.relu(x) if self.hidden_relu else x

  def __call__(self, x: Array, *, train: bool = False) -> Array:
    return layers.cast(self.fc2(self.features(x, train=train)), jnp.float32)


class SmallCNN(nn.Module):
  """conv3x3-32, relu, pool2, conv3x3-64, relu, pool2, dense 256, relu, dense C."""
  MIXED_ON_CPU = True  # layers get `dtype` (layers.mixed_on_cpu)
  num_classes: int
  conv_impl: str = "auto"
  weight_init: str = "torch"
  hidden: int = 256
  flatten_order: str = "chw"
  dtype: Any = jnp.float32  # compute dtype (model.dtype)

  def setup(self):
    conv = lambda f: layers.Conv(f, 3, padding=1, impl=self.conv_impl,
                                 weight_init=self.weight_init, dtype=self.dtype)
    self.conv1 = conv(32)
    self.conv2 = conv(64)
    self.fc1 = layers.Dense(self.hidden, weight_init=self.weight_init,
                            dtype=self.dtype)
    self.fc2 = layers.Dense(self.num_classes, weight_init=self.weight_init,
                            dtype=self.dtype)

  def features(self, x: Array, *, train: bool = False) -> Array:
    x = layers.cast(x, layers.activation_dtype(self.dtype))
    del train
    x = layers.max_pool(nn.relu(self.conv1(x)), 2)
    x = layers.max_pool(nn.relu(self.conv2(x)), 2)
    return nn.relu(self.fc1(_flatten(x, self.flatten_order)))

  def __call__(self, x: Array, *, train: bool = False) -> Array:
    return layers.cast(self.fc2(self.features(x, train=train)), jnp.float32)


class MLP(nn.Module):
  """flatten -> Dense(hidden) -> relu -> Dense(num_classes). For unit tests."""
  MIXED_ON_CPU = True  # layers get `dtype` (layers.mixed_on_cpu)
  num_classes: int
  hidden: int = 32
  weight_init: str = "torch"
  dtype: Any = jnp.float32  # compute dtype (model.dtype)

  def setup(self):
    self.fc1 = layers.Dense(self.hidden, weight_init=self.weight_init,
                            dtype=self.dtype)
    self.fc2 = layers.Dense(self.num_classes, weight_init=self.weight_init,
                            dtype=self.dtype)

  def features(self, x: Array, *, train: bool = False) -> Array:
    x = layers.cast(x, layers.activation_dtype(self.dtype))
    del train
    return nn.relu(self.fc1(x.reshape(x.shape[0], -1)))

  def __call__(self, x: Array, *, train: bool = False) -> Array:
    return layers.cast(self.fc2(self.features(x, train=train)), jnp.float32)


class CifarCNN(nn.Module):
  """HyperGenFL's CIFAR-10 "simple CNN": two conv + two dense layers (encoder).

  The paper: "a simple CNN model, with two convolution layers followed by two MLP
  layers in the encoder". Sizes are those of the simple CNN of MOON (Li et al.
  2021; a HyperGenFL baseline with the same wording) and FedMA / NIID-Bench, the
  PyTorch CIFAR tutorial's LeNet-5:
  conv5x5-6 (valid), relu, pool2 -> conv5x5-16 (valid), relu, pool2 -> flatten
  400 (C,H,W order) -> dense 120, relu -> dense 84, relu (= `features`) ->
  dense num_classes (`fc2`, the classifier). 62,006 parameters for 10 classes
  on 32x32x3. `hidden=(120, 84)` and `channels=(6, 16)` are fields.
  """
  MIXED_ON_CPU = True  # layers get `dtype` (layers.mixed_on_cpu)
  num_classes: int
  conv_impl: str = "auto"
  weight_init: str = "torch"
  channels: tuple[int, int] = (6, 16)
  hidden: tuple[int, int] = (120, 84)
  flatten_order: str = "chw"
  dtype: Any = jnp.float32  # compute dtype (model.dtype)

  def setup(self):
    conv = lambda f: layers.Conv(f, 5, padding="VALID", impl=self.conv_impl,
                                 weight_init=self.weight_init, dtype=self.dtype)
    self.conv1 = conv(self.channels[0])
    self.conv2 = conv(self.channels[1])
    # The encoder's two dense layers; `fc2` is the classifier (the name every
    # model gives its last Linear: `Model.head`, FedSR).
    self.dense1 = layers.Dense(self.hidden[0], weight_init=self.weight_init,
                               dtype=self.dtype)
    self.dense2 = layers.Dense(self.hidden[1], weight_init=self.weight_init,
                               dtype=self.dtype)
    self.fc2 = layers.Dense(self.num_classes, weight_init=self.weight_init,
                            dtype=self.dtype)

  def features(self, x: Array, *, train: bool = False) -> Array:
    x = layers.cast(x, layers.activation_dtype(self.dtype))
    del train
    x = layers.max_pool(nn.relu(self.conv1(x)), 2)
    x = layers.max_pool(nn.relu(self.conv2(x)), 2)
    x = nn.relu(self.dense1(_flatten(x, self.flatten_order)))
    return nn.relu(self.dense2(x))

  def __call__(self, x: Array, *, train: bool = False) -> Array:
    return layers.cast(self.fc2(self.features(x, train=train)), jnp.float32)
