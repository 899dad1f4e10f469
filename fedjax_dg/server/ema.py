"""Exponential moving average with a warm-up round (hFedF Algorithm 4)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_dg.server.aggregate import ServerTransform


class EmaState(NamedTuple):
  ema: Any


def ema(decay: float, warmup_round: int) -> ServerTransform:
  """hFedF Alg. 4, applied after the server step of round `t` (0-based).

  t <  w: parameters pass through untouched;
  t == w: the EMA copy is initialized to the current parameters;
  t >  w: ema <- decay * theta + (1 - decay) * ema, and theta <- ema.
  (The paper's `alpha` weighs the *new* parameters: 0.75-0.95 in Table 10.)
  """
  if not 0.0 <= decay <= 1.0:
    raise ValueError(f"ema decay must be in [0, 1], got {decay}")
  if warmup_round < 0:
    raise ValueError(f"ema warm-up round must be >= 0, got {warmup_round}")

  def init(params):
    return EmaState(ema=params)

  def update(params, state: EmaState, round_idx: jax.Array):
    mixed = jax.tree.map(lambda p, e: decay * p + (1.0 - decay) * e, params,
                         state.ema)
    new_ema = jax.tree.map(
        lambda p, m, e: jnp.where(round_idx == warmup_round, p,
                                  jnp.where(round_idx > warmup_round, m, e)),
        params, mixed, state.ema)
    new_params = jax.tree.map(
        lambda p, m: jnp.where(round_idx > warmup_round, m, p), params, mixed)
    return new_params, EmaState(ema=new_ema)

  return ServerTransform(init, update)
