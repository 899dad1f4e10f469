"""Linear aggregation of stacked client models."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from fedjax_dg import tree


class ServerTransform(NamedTuple):
  """An optax-style pair: `init(params) -> state`, `update(..., state) -> (out, state)`."""
  init: Any
  update: Any


def weighted_mean() -> ServerTransform:
  """FedAvg: sum_i n_i w_i / sum_i n_i over the client axis. Stateless."""

  def init(params):
    del params
    return ()

  def update(stacked_params, state, weights: jax.Array):
    return tree.weighted_mean(stacked_params, weights), state

  return ServerTransform(init, update)
