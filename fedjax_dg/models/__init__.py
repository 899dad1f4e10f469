"""Client models: a `Model` bundles a flax module with its input normalization.

    model = get_model("inception_cnn", input_shape=(32, 32, 3), num_classes=7)
    params = model.init(key)                       # plain nested dict ('params')
    logits = model.apply(params, x_uint8)          # [B, 7], normalizes inside
    logits = model.apply(params, x, train=True, rng=key)   # dropout active
    feats = model.features(params, x)              # [B, 256] penultimate layer

All modules are loop-safe (see `layers`): usable inside `lax.scan` / `lax.map` /
`vmap` over clients. `mobilenet_v3_large` loads pretrained torchvision / timm
weights (`get_model(..., weights="mnv3.pth")`; `weights.py`), `vit_b16` /
`vit_tiny` AugReg / timm / torchvision ones (`vit_weights.py`). See
docs/models.md.

Mixed precision (`get_model(..., dtype="bfloat16")`, `model.dtype`): the
module computes in bfloat16, its parameters (and so every optimizer state
made from them) stay float32, and what a `Model` hands out, logits and
features, is float32, so every loss and metric is reduced in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_dg.errors import ConfigError, DataError
from fedjax_dg.models import cnn
from fedjax_dg.models import layers
from fedjax_dg.models import mobilenet
from fedjax_dg.models import resnet
from fedjax_dg.models import vit as vit_lib
from fedjax_dg.models import vit_weights
from fedjax_dg.models import weights as weights_lib
from fedjax_dg.models.cnn import MLP, CifarCNN, InceptionCNN, NaiveInception, SmallCNN
from fedjax_dg.models.mobilenet import MobileNetV3Large
from fedjax_dg.models.resnet import ResNet

Params = Any


@dataclasses.dataclass(frozen=True)
class Model:
  """A client model: module + input shape + classes + per-channel normalization
  (+ a pretrained weights file for `init`)."""
  name: str
  module: nn.Module
  input_shape: tuple[int, int, int]
  num_classes: int
  mean: tuple[float, ...]
  std: tuple[float, ...]
  weights: str = ""
  skip_head: bool = False

  def init(self, key: jax.Array) -> Params:
    """Samples the 'params' collection (a plain nested dict); jitted. With
    `weights`, the file's tensors replace the samples (all but the head's,
    `fc2` / `head`, when `skip_head`; a ViT's adapters are always sampled)."""
    # The normalization is not read by the sampling (and may be traced:
    # a recipe's values), so it is no part of the cached program's key.
    params = _jitted_init(dataclasses.replace(self.unnormalized(), weights="",
                                              skip_head=False))(key)
    if not self.weights:
      return params
    if self.name in _VIT:
      (h, w), p = self.module.input_hw, self.module.patch
      loaded = vit_weights.load(self.weights, params, grid=(h // p, w // p),
                                skip_head=self.skip_head)
    else:
      loaded = weights_lib.load(self.weights, params, skip_head=self.skip_head)
    return jax.tree.map(jnp.asarray, loaded)

  def normalize(self, x: jax.Array) -> jax.Array:
    """uint8 -> float32 / 255 (floats are taken as [0, 1]); then (x - mean) / std."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.integer):
      x = x.astype(jnp.float32) / 255.0
    else:
      x = x.astype(jnp.float32)
    mean = jnp.asarray(self.mean, jnp.float32)
    std = jnp.asarray(self.std, jnp.float32)
    return (x - mean) / std

  def structure(self) -> "Model":
    """This model without its input normalization: what its programs are
    built from when the normalization is an argument of them
    (`algorithms.recipe`)."""
    return dataclasses.replace(self, mean=(), std=())

  def normalized_by(self, mean, std) -> "Model":
    """This model with another per-channel normalization (arrays, possibly
    traced)."""
    return dataclasses.replace(self, mean=mean, std=std)

  def unnormalized(self) -> "Model":
    """This model without its normalization, which parameter sampling never
    reads and which may be traced (a recipe's values): what an init cache
    is keyed by."""
    return self.normalized_by((), ())

  @property
  def dtype(self):
    """The compute dtype (`model.dtype`); parameters are float32 whatever it is."""
    return getattr(self.module, "dtype", jnp.float32)

  def _run(self, params, x, train, rng, normalized, method):
    rngs = {} if rng is None else {"dropout": rng}
    x = jnp.asarray(x, jnp.float32) if normalized else self.normalize(x)
    return self.module.apply({"params": params}, x, train=train, rngs=rngs,
                             method=method)

  def apply(self, params: Params, x: jax.Array, *, train: bool = False,
            rng: jax.Array | None = None, normalized: bool = False) -> jax.Array:
    """Logits [B, num_classes] for a uint8 (or [0, 1] float) NHWC batch.

    `rng` (the dropout key) is required when `train=True` and the module has
    dropout. `normalized=True`: `x` is already normalized by `normalize`
    (e.g. FedCCRL's style mixing, which works on the normalized input).
    """
    return self._run(params, x, train, rng, normalized, None)

  def features(self, params: Params, x: jax.Array, *, train: bool = False,
               rng: jax.Array | None = None, normalized: bool = False
               ) -> jax.Array:
    """Penultimate representation [B, F] (the input of the last Linear
    layer), float32 whatever the compute dtype."""
    return layers.cast(self._run(params, x, train, rng, normalized, "features"),
                       jnp.float32)

  @property
  def head_name(self) -> str:
    """The params key of the last Linear layer: `fc2`, a ViT's `head`."""
    return getattr(self.module, "HEAD", "fc2")

  def head(self, params: Params, feats: jax.Array) -> jax.Array:
    """Logits from `features` output (the last Linear layer, `head_name`),
    computed in the compute dtype, returned as float32."""
    head = {"params": params[self.head_name]}
    if getattr(self.module, "MIXED_ON_CPU", False):  # as the module's own
      logits = layers.Dense(self.num_classes, dtype=self.dtype).apply(head,
                                                                      feats)
    else:
      logits = layers.Dense(self.num_classes).apply(
          head, layers.cast(feats, self.dtype))
    return layers.cast(logits, jnp.float32)


@functools.lru_cache(maxsize=64)
def _jitted_init(model: Model):
  x = np.zeros((1,) + tuple(model.input_shape), np.float32)  # not a tracer

  def init(key):
    with layers.init_rng_mode():
      params = model.module.init({"params": key}, x, train=False)["params"]
    return flax.core.unfreeze(params)

  return jax.jit(init)


def _inception_cnn(num_classes, conv_impl, **kw):
  return InceptionCNN(num_classes=num_classes, conv_impl=conv_impl, **kw)


def _small_cnn(num_classes, conv_impl, **kw):
  return SmallCNN(num_classes=num_classes, conv_impl=conv_impl, **kw)


def _mlp(num_classes, conv_impl, **kw):
  del conv_impl
  return MLP(num_classes=num_classes, **kw)


def _cifar_cnn(num_classes, conv_impl, **kw):
  return CifarCNN(num_classes=num_classes, conv_impl=conv_impl, **kw)


def _resnet50(num_classes, conv_impl, **kw):
  kw.setdefault("stages", resnet.RESNET50_STAGES)
  return ResNet(num_classes=num_classes, conv_impl=conv_impl, **kw)


def _mobilenet_v3_large(num_classes, conv_impl, **kw):
  return MobileNetV3Large(num_classes=num_classes, conv_impl=conv_impl, **kw)


def _vit(size):
  def make(num_classes, conv_impl, input_hw, **kw):
    del conv_impl  # patches are a matmul
    return vit_lib.vit(num_classes, input_hw, size=size, **kw)
  return make


_REGISTRY = {
    "inception_cnn": _inception_cnn,
    "small_cnn": _small_cnn,
    "mlp": _mlp,
    "cifar_cnn": _cifar_cnn,    # HyperGenFL's CIFAR-10 simple CNN
    "resnet50": _resnet50,      # HyperGenFL's ResNet-50 (GroupNorm)
    "mobilenet_v3_large": _mobilenet_v3_large,   # FedCCRL's backbone
    "vit_b16": _vit("b16"),     # FedSDAF's backbone (ViT-B/16)
    "vit_tiny": _vit("ti16"),   # ViT-Ti/16: the same code, for tests / CPU
}
_VIT = ("vit_b16", "vit_tiny")
# Models whose pretrained PyTorch weights `get_model(weights=...)` converts.
PRETRAINED = ("mobilenet_v3_large", "vit_b16", "vit_tiny")
# Where docs/models.md says how to get each one's weights.
_WEIGHTS_DOCS = {"mobilenet_v3_large": "MobileNetV3", "vit_b16": "ViT",
                 "vit_tiny": "ViT"}


def available() -> tuple[str, ...]:
  """Names accepted by `get_model`."""
  return tuple(_REGISTRY)


def _per_channel(v, ch: int, what: str) -> tuple[float, ...]:
  v = tuple(float(a) for a in (v if isinstance(v, (tuple, list)) else (v,)))
  if len(v) == 1:
    v = v * ch
  if len(v) != ch:
    raise ConfigError(f"{what} has {len(v)} entries for {ch} input channels")
  if not all(np.isfinite(v)) or (what == "std" and min(v) <= 0):
    raise ConfigError(f"{what}={v}: the input normalization needs finite values"
                      + (" and std > 0 (a constant channel: std 1)"
                         if what == "std" else ""))
  return v


def check_weights(name: str, weights: str) -> None:
  """A weights file ("" = none) is allowed for `name` and exists."""
  if not weights:
    return
  if name not in PRETRAINED:
    raise ConfigError(f"model.weights={weights!r}: only {PRETRAINED} load "
                      f"pretrained weights, not {name!r}")
  if not os.path.isfile(weights):
    raise DataError(f"model.weights={weights!r}: no such file (see "
                    f"docs/models.md, {_WEIGHTS_DOCS[name]}, for how to get "
                    "one)")


def get_model(name: str, *, input_shape, num_classes: int, mean=(0.5,),
              std=(0.5,), conv_impl: str = "auto", weights: str = "",
              skip_head: bool = False, dtype: str = "float32",
              **kwargs) -> Model:
  """Builds a registered model.

  Args:
    name: one of `available()`.
    input_shape: (H, W, channels); CNNs need H and W divisible by 4.
    num_classes: number of output logits.
    mean, std: per-channel normalization in [0, 1] units (one value broadcasts).
    conv_impl: "im2col" | "custom_vjp" | "xla" | "auto" ("xla" on GPU/TPU; on CPU
      decided per layer, see `layers.resolve_conv_impl`).
    **kwargs: module fields, e.g. `dropout`, `hidden_relu`, `hidden`,
      `weight_init` (alias `init`): "torch" (default) or "flax"; for
      `resnet50`: `stem` ("cifar" | "imagenet"), `norm_groups`, `width`,
      `stages`, `zero_init_residual`; for `mobilenet_v3_large`: `norm`
      ("group" | "affine"), `norm_groups`, `dropout`.
    weights: a pretrained file that `Model.init` loads; models in `PRETRAINED`
      only. `mobilenet_v3_large`: a state dict (`.pth` or `.safetensors`,
      torchvision or timm layout); `norm` defaults to "affine" then
      (BatchNorm folds into it exactly), to "group" without weights. ViTs:
      an AugReg `.npz` or a timm / torchvision state dict (`vit_weights.py`;
      position embeddings resized to the input's grid).
    skip_head: with `weights`: the last Linear starts fresh (another number of
      classes than the file's).
    dtype: the compute dtype, "float32" or "bfloat16" (`layers.DTYPES`; any
      other: ConfigError): activations, matmuls and convolutions in it,
      parameters float32, norm statistics, softmax and the returned logits
      and features float32.

  Returns:
    A `Model` (frozen and hashable): `init(key)` gives its parameters (a
    nested dict), `apply(params, x)` the logits [B, num_classes] of a uint8
    batch x [B, H, W, ch] (normalized inside), `features` / `head` the
    input of the last Linear and that Linear alone.

  Example::

    import jax
    from fedjax_dg import models
    model = models.get_model("small_cnn", input_shape=(16, 16, 1),
                             num_classes=10, mean=(0.29,), std=(0.35,))
    params = model.init(jax.random.key(0))
    logits = model.apply(params, images_uint8)      # [B, 10]
  """
  if name not in _REGISTRY:
    raise ConfigError(f"unknown model {name!r}; available: {available()}")
  kwargs["dtype"] = layers.compute_dtype(dtype)
  check_weights(name, weights)
  if weights and name == "mobilenet_v3_large":
    kwargs.setdefault("norm", "affine")
    if kwargs["norm"] != "affine":
      raise ConfigError(f"model.weights needs norm='affine' (BatchNorm folds "
                        f"into it), got norm={kwargs['norm']!r}")
  h, w, ch = (int(v) for v in input_shape)
  if name in _VIT:
    patch = int(kwargs.get("patch", 16))
    if patch < 1 or h % patch or w % patch:
      raise ConfigError(f"{name}: model.vit.patch={patch} (get_model's "
                        f"patch=) must divide the input size {h}x{w} "
                        "(data.image_size)")
    kwargs["input_hw"] = (h, w)
  elif name != "mlp" and (h % 4 or w % 4):
    raise ConfigError(f"{name} needs H and W divisible by 4, got {input_shape}")
  if "init" in kwargs:  # Alias: `init=` is the modules' `weight_init`.
    kwargs["weight_init"] = kwargs.pop("init")
  module = _REGISTRY[name](int(num_classes), layers.resolve_conv_impl(conv_impl),
                           **kwargs)
  return Model(name=name, module=module, input_shape=(h, w, ch),
               num_classes=int(num_classes), mean=_per_channel(mean, ch, "mean"),
               std=_per_channel(std, ch, "std"), weights=weights,
               skip_head=bool(skip_head))


from fedjax_dg.models.hypernetwork import (  # noqa: E402
    HyperNetwork, hypernetwork_module, init_hypernetwork, make_hypernetwork)

__all__ = [
    "MLP", "PRETRAINED", "CifarCNN", "HyperNetwork", "InceptionCNN",
    "MobileNetV3Large", "Model", "NaiveInception", "Params", "ResNet", "SmallCNN",
    "available", "check_weights", "cnn", "get_model", "hypernetwork_module", "init_hypernetwork",
    "layers", "make_hypernetwork", "mobilenet", "resnet", "vit_lib",
    "vit_weights", "weights_lib",
]
