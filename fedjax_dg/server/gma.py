"""Gradient Masked Averaging (FedGMA, Tenison et al. 2022) as an aggregator.

For the cohort's client deltas delta_k = w_k - w (stacked [m, ...]), per parameter:

    A     = | (1/m) sum_k sign(delta_k) |          agreement in [0, 1]
    mask  = 1 where A >= tau, else A
    w'    = w + eta * mask * sum_k p_k delta_k     p_k = n_k / sum_j n_j

Deltas here are new minus old (trained - start), so the server *adds* the masked
mean (`optax.apply_updates`). The paper writes the pseudo-gradient old minus new
and subtracts; A is invariant under the sign flip, so both read the same.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_dg import tree
from fedjax_dg.errors import ConfigError
from fedjax_dg.server.aggregate import ServerTransform
from fedjax_dg.tree import is_concrete

PyTree = Any


class GmaState(NamedTuple):
  unmasked: jax.Array  # share of parameters the last mask left undamped (A >= tau)


def agreement(deltas: PyTree) -> PyTree:
  """Per-parameter A = |mean over clients of sign(delta_k)| (leaves without axis 0)."""
  return jax.tree.map(lambda d: jnp.abs(jnp.mean(jnp.sign(d), axis=0)), deltas)


def agreement_mask(deltas: PyTree, threshold: float) -> PyTree:
  """mask = 1 where A >= threshold, else A."""
  return jax.tree.map(lambda a: jnp.where(a >= threshold, 1.0, a).astype(a.dtype),
                      agreement(deltas))


def gradient_masked_averaging(threshold: float,
                              step_size: float = 1.0) -> ServerTransform:
  """Stacked trained models [m, ...] -> the new server model (extra `weights`).

  Args:
    threshold: tau, the agreement at or above which a parameter is not damped.
    step_size: eta, the server step on the masked mean delta (1 = FedAvg's step).
  """
  if is_concrete(threshold) and not 0.0 <= threshold <= 1.0:
    raise ConfigError(f"FedGMA threshold must be in [0, 1], got {threshold}")
  if is_concrete(step_size) and step_size <= 0:
    raise ConfigError(f"FedGMA server step size must be > 0, got {step_size}")

  def init(params):
    del params
    return GmaState(unmasked=jnp.ones((), jnp.float32))

  def update(updates, state, params=None, *, weights: jax.Array, **extra):
    del state, extra
    deltas = optax.tree.sub(updates, params)
    mean = tree.weighted_mean(deltas, weights)
    mask = agreement_mask(deltas, threshold)
    step = jax.tree.map(lambda m, d: step_size * m * d, mask, mean)
    kept = sum(jnp.sum(m == 1.0) for m in jax.tree.leaves(mask))
    total = sum(m.size for m in jax.tree.leaves(mask))
    return (optax.apply_updates(params, step),
            GmaState(unmasked=(kept / total).astype(jnp.float32)))

  return ServerTransform(init, update)
