"""Exponential moving average with a warm-up round (hFedF Algorithm 4)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_dg.errors import ConfigError
from fedjax_dg.server.aggregate import ServerTransform
from fedjax_dg.tree import is_concrete


class EmaState(NamedTuple):
  count: jax.Array  # updates seen so far (the round index of the next update)
  ema: Any          # the EMA copy of the parameters


def ema(decay: float, warmup_round: int) -> ServerTransform:
  """hFedF Alg. 4: parameters -> smoothed parameters, once per round.

  The `t`-th update (0-based; `state.count`, so the round when applied once per
  round from round 0):
    t <  w: parameters pass through untouched;
    t == w: the EMA copy is initialized to the current parameters;
    t >  w: ema <- decay * theta + (1 - decay) * ema, and theta <- ema.
  (The paper's `alpha` weighs the *new* parameters: 0.75-0.95 in Table 10.)
  """
  if is_concrete(decay) and not 0.0 <= decay <= 1.0:
    raise ConfigError(f"ema decay must be in [0, 1], got {decay}")
  if warmup_round < 0:
    raise ConfigError(f"ema warm-up round must be >= 0, got {warmup_round}")

  def init(params):
    return EmaState(count=jnp.zeros((), jnp.int32), ema=params)

  def update(updates, state: EmaState, params=None, **extra):
    del params, extra
    t = state.count
    mixed = jax.tree.map(lambda p, e: decay * p + (1.0 - decay) * e, updates,
                         state.ema)
    new_ema = jax.tree.map(
        lambda p, m, e: jnp.where(t == warmup_round, p,
                                  jnp.where(t > warmup_round, m, e)),
        updates, mixed, state.ema)
    out = jax.tree.map(lambda p, m: jnp.where(t > warmup_round, m, p), updates,
                       mixed)
    return out, EmaState(count=t + 1, ema=new_ema)

  return ServerTransform(init, update)
