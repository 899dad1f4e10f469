"""Local objectives: pure `loss(params, batch, rng, ctx)` builders over a Model."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedjax_dg.client.update import Batch


def masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
  return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def cross_entropy(model) -> Any:
  """Mean softmax cross-entropy over the real (unmasked) examples of a batch."""

  def loss(params, batch: Batch, rng: jax.Array, ctx=None) -> jax.Array:
    del ctx
    logits = model.apply(params, batch.x, train=True, rng=rng)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)
    return masked_mean(ce, batch.mask)

  return loss


def proximal(base_loss, mu: float) -> Any:
  """FedProx: base loss + mu/2 |w - w_start|^2, with `ctx` = start params."""

  def loss(params, batch: Batch, rng: jax.Array, ctx) -> jax.Array:
    sq = optax.tree.norm(optax.tree.sub(params, ctx), squared=True)
    return base_loss(params, batch, rng, ctx) + 0.5 * mu * sq

  return loss
