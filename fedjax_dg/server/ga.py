"""Generalization Adjustment (FedDG-GA, Zhang et al., CVPR 2023) as an aggregator.

The server keeps one aggregation weight a_k per client (uniform 1/N at the
start) and moves it by the client's generalization gap, the metric of the
global model minus the metric of the client's own local model, both on the
client's data (FedSDAF's Appendix A.1, Eq. 9-11, recaps the paper):

    G_k   = E_k(theta^r) - E_k(theta_k^{r-1})      E_k on client k's data
    g_k   = sign * G_k                             sign = +1 loss, -1 accuracy
    a_k  += g_k / max_j |g_j| * d^r / K            d^r = (1 - r / R) d
    a     = clip(a, 0, 1) / sum(clip(a, 0, 1))
    theta^{r+1} = sum_k a_k theta_k^r              (the adjusted weights)

This is the released code (github.com/MediaBrain-SJTU/FedDG-GA,
`utils/weight_adjust.py`): raw gaps divided by their largest magnitude, the
step divided by the number of clients K (its `1/3` for three source domains),
clip and renormalize. The paper's Eq. (10) centres the gaps first:
`(g_k - mean g) / max_j (g_j - mean g) * d^r` (`center=True`, still / K).

Sign. A client on which the global model does worse than the client's own
model (a larger loss gap, a more negative accuracy gap) gains weight, so the
next global model leans towards it: the adjustment flattens the gaps. Tested
in tests/test_feddg_ga.py.

Timing. theta_k^{r-1} is the client's local model of its last round; its
metric, measured then on the same fixed examples in evaluation mode, is the
same number, so the state keeps it (`before`, [N]) instead of the model. In
round r a cohort client reports E_k(theta^r) (`received`: the model it
received) and E_k(theta_k^r) (`trained`: the model it trained), its
`GapMetrics`: the first with the stored `before` makes G_k, the second
becomes the next `before`. A client without a stored value (its first
round, all of round 0) has no gap and keeps its weight, as the paper's
`r > 0`.

Cohorts. Weights are per client id (`[N]`). Only the cohort's clients with a
gap move (gap 0 for the others: the code's update with their weights left
alone); clipping and renormalization run over all N weights, as the code's
`weight_clip` over its whole dictionary (under full participation exactly the
code). The cohort's models are averaged with its weights renormalized over the
cohort, a_k / sum_{j in cohort} a_j (uniform if they are all 0).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_dg import tree
from fedjax_dg.errors import ConfigError
from fedjax_dg.server.aggregate import ServerTransform
from fedjax_dg.tree import is_concrete

# The metric's sign: a loss gap > 0 and an accuracy gap < 0 both mean the global
# model generalizes worse to the client than its own model (code: `signal`).
SIGNS = {"loss": 1.0, "acc": -1.0}


class GapMetrics(NamedTuple):
  """What a client reports (its message, `ClientEnd`): E_k of the model it received
  and of the model it trained, on its fixed slice (`client.passes.
  slice_metrics`). Stacked over the cohort: [m] each."""
  received: jax.Array
  trained: jax.Array


class GAState(NamedTuple):
  """Per client id: the aggregation weights, the metric of the client's last
  local model, whether it has one; what the last update did (for metrics)."""
  weights: jax.Array  # [N] a_k, sum 1
  before: jax.Array   # [N] E_k(theta_k) of the client's last local model
  seen: jax.Array     # [N] bool: `before` holds a value
  gaps: jax.Array     # [N] the last update's G_k (0 where none)
  step: jax.Array     # scalar d^r of the last update


def step_at(step_size: float, progress: jax.Array) -> jax.Array:
  """d^r = (1 - r / R) d, `progress` = r / R."""
  return step_size * (1.0 - progress)


def generalization_adjustment(weights: jax.Array, gaps: jax.Array,
                              step: jax.Array, valid: jax.Array | None = None,
                              *, sign: float = 1.0,
                              center: bool = False) -> jax.Array:
  """New weights [K] from weights [K] (sum 1) and generalization gaps [K].

  `w_k += sign * gap_k / max_j |gap_j| * step / K` over the `valid` clients
  (all by default; the others keep their weight before renormalization), then
  clip to [0, 1] and renormalize to sum 1. `center`: the paper's Eq. (10), the
  valid gaps minus their mean, divided by the largest centred value. Where the
  normalizer is 0 (no valid gap, all gaps 0, or all equal when centred) or
  every weight clips to 0, the weights are returned unchanged.
  """
  weights = jnp.asarray(weights, jnp.float32)
  num = weights.shape[0]
  valid = (jnp.ones(num, bool) if valid is None
           else jnp.asarray(valid, bool))
  g = jnp.where(valid, sign * jnp.asarray(gaps, jnp.float32), 0.0)
  if center:
    mean = jnp.sum(g) / jnp.maximum(jnp.sum(valid), 1)
    g = jnp.where(valid, g - mean, 0.0)
    scale = jnp.max(jnp.where(valid, g, -jnp.inf))
  else:
    scale = jnp.max(jnp.abs(g))
  moves = scale > 0
  g = g / jnp.where(moves, scale, 1.0)
  w = jnp.clip(weights + g * step / num, 0.0, 1.0)
  total = jnp.sum(w)
  ok = moves & (total > 0)
  return jnp.where(ok, w / jnp.where(ok, total, 1.0), weights)


def cohort_weights(weights: jax.Array, ids: jax.Array) -> jax.Array:
  """The cohort's aggregation weights: a[ids] / sum(a[ids]) (uniform if 0)."""
  a = jnp.take(weights, ids)
  total = jnp.sum(a)
  return jnp.where(total > 0, a / jnp.where(total > 0, total, 1.0),
                   1.0 / ids.shape[0])


def ga_aggregation(num_clients: int, *, step_size: float = 0.2,
                   metric: str = "loss", center: bool = False
                   ) -> ServerTransform:
  """Stacked trained models [m, ...] -> sum_k a_k theta_k over the cohort.

  Extras: `ids` [m]; `received` [m], E_k of the model the client received
  (theta^r); `trained` [m], E_k of the model it trained (theta_k^r);
  `progress` = r / R (the step decays linearly over the run). `metric`
  ("loss" or "acc") fixes the sign; E_k must be that metric.
  """
  if num_clients < 1:
    raise ConfigError(f"GA num_clients={num_clients!r}: must be >= 1")
  if is_concrete(step_size) and not (math.isfinite(step_size)
                                    and step_size >= 0):
    raise ConfigError(f"GA step_size={step_size!r}: must be a finite value "
                      ">= 0 (0: uniform weights)")
  if metric not in SIGNS:
    raise ConfigError(f"GA metric={metric!r}: allowed {tuple(SIGNS)}")
  sign = SIGNS[metric]

  def init(params):
    del params
    n = num_clients
    return GAState(weights=jnp.full((n,), 1.0 / n, jnp.float32),
                   before=jnp.zeros((n,), jnp.float32),
                   seen=jnp.zeros((n,), bool),
                   gaps=jnp.zeros((n,), jnp.float32),
                   step=jnp.zeros((), jnp.float32))

  def update(updates, state: GAState, params=None, *, ids, received, trained,
             progress, **extra):
    del params, extra
    valid_c = jnp.take(state.seen, ids)
    gap_c = jnp.where(valid_c, received - jnp.take(state.before, ids), 0.0)
    zero = jnp.zeros_like(state.gaps)
    gaps = zero.at[ids].set(gap_c.astype(jnp.float32))
    valid = jnp.zeros_like(state.seen).at[ids].set(valid_c)
    step = jnp.asarray(step_at(step_size, progress), jnp.float32)
    weights = generalization_adjustment(state.weights, gaps, step, valid,
                                        sign=sign, center=center)
    out = tree.weighted_sum(updates, cohort_weights(weights, ids))
    new = GAState(weights=weights,
                  before=state.before.at[ids].set(
                      jnp.asarray(trained, jnp.float32)),
                  seen=state.seen.at[ids].set(True),
                  gaps=gaps, step=step)
    return out, new

  return ServerTransform(init, update)


def ga_server_update(aggregator: ServerTransform, server, stacked, result,
                     key):
  """The server step of GA aggregation (FedDG-GA's and FedSDAF's) over the
  cohort's `stacked` models: `server` a (params, opt) NamedTuple with the
  aggregator's `GAState` as `opt`, `result` the round's `ClientResult`
  (`GapMetrics` as its `message`; `rounds`, the run's length, a traced
  scalar). Returns the
  new server (`server._replace`) and the round metrics in cohort order:
  `ga_weights`, `ga_gaps`, `ga_step`."""
  params, opt = aggregator.update(
      stacked, server.opt, server.params, ids=result.ids,
      received=result.message.received, trained=result.message.trained,
      # r * (1 / R), not r / R: what XLA makes of a division by a constant
      # R, so the numbers do not depend on R being traced (one compile for
      # every run length) or a constant.
      progress=result.round * (1.0 / result.rounds),
      weights=result.num_examples, key=key)
  cohort = lambda v: jnp.take(v, result.ids)
  return server._replace(params=params, opt=opt), {
      "ga_weights": cohort(opt.weights), "ga_gaps": cohort(opt.gaps),
      "ga_step": opt.step}
