"""MOON's projection head on top of a client model (Li, He, Song 2021).

    h      = model.features(x)               penultimate representation [B, F]
    logits = model.head(h)                   the client model's own last layer fc2
    z      = l2(relu(l1(h)))                 projection head: Linear(F, F), ReLU,
                                             Linear(F, proj_dim) (reference code
                                             `ModelFedCon.l1/l2`)

Params: {"model": the client model's params, "proj": {"l1", "l2"}}; the projection
head is part of the trained and averaged model, PyTorch-default initialized like the
client model. `z` feeds only the model-contrastive loss.

Deviation: the reference code puts its output layer `l3` on top of z
(logits = l3(z)); here the classifier stays the client model's `fc2` on h, so every
baseline evaluates the same client architecture and the engine evaluates MOON with
the plain client model (`to_model_params`). See docs/faithfulness.md.

The projection head computes in the client model's compute dtype
(`model.dtype`); z is float32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_dg.errors import ConfigError
from fedjax_dg.models import layers
from fedjax_dg.models.fedsr import feature_dim

Params = Any


@dataclasses.dataclass(frozen=True)
class ContrastiveModel:
  """A client `Model` with MOON's 2-layer projection head on its features.

  Attributes:
    model: the client model (its `features` feed the projection head).
    proj_dim: output size of the projection head (MOON: 256).
  """
  model: Any
  proj_dim: int = 256
  feature_width: int = dataclasses.field(init=False, default=0)  # F

  def __post_init__(self):
    if self.proj_dim < 1:
      raise ConfigError(f"proj_dim must be >= 1, got {self.proj_dim}")
    object.__setattr__(self, "feature_width", feature_dim(self.model))

  def init(self, key: jax.Array) -> Params:
    """{"model": model.init(key), "proj": ...}: the client model as `model.init(key)`."""
    return _jitted_init(dataclasses.replace(
        self, model=self.model.unnormalized()))(key)

  def project(self, params: Params, h: jax.Array) -> jax.Array:
    """z = l2(relu(l1(h))), [B, proj_dim]."""
    l1, l2 = params["proj"]["l1"], params["proj"]["l2"]
    dtype = self.model.dtype
    a = jax.nn.relu(layers.dense(l1, h, dtype))
    return layers.cast(layers.dense(l2, a, dtype), jnp.float32)

  def forward(self, params: Params, x: jax.Array, *, train: bool = False,
              rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(logits [B, classes], z [B, proj_dim]) from one pass of the body."""
    h = self.model.features(params["model"], x, train=train, rng=rng)
    return self.model.head(params["model"], h), self.project(params, h)

  def apply(self, params: Params, x: jax.Array, *, train: bool = False,
            rng: jax.Array | None = None) -> jax.Array:
    """Logits: the client model's own."""
    return self.model.apply(params["model"], x, train=train, rng=rng)

  def to_model_params(self, params: Params) -> Params:
    """The client model's params (the evaluation model)."""
    return params["model"]


@functools.lru_cache(maxsize=16)
def _jitted_init(cm: ContrastiveModel):
  how = getattr(cm.model.module, "weight_init", "torch")
  f, d = cm.feature_width, cm.proj_dim
  dense = lambda kk, kb, fan_in, out: {
      "kernel": layers.kernel_init(how)(kk, (fan_in, out), jnp.float32),
      "bias": layers.bias_init(how, fan_in)(kb, (out,), jnp.float32)}

  def init(key):
    k1k, k1b, k2k, k2b = jax.random.split(jax.random.fold_in(key, 1), 4)
    with layers.init_rng_mode():
      proj = {"l1": dense(k1k, k1b, f, f), "l2": dense(k2k, k2b, f, d)}
    # The client model from `key` itself: the same start as FedAvg's.
    return {"model": cm.model.init(key), "proj": proj}

  return jax.jit(init)
