"""The one server-transform shape, and FedAvg's aggregator.

Every server piece is an optax transform (`optax.GradientTransformationExtraArgs`):

    state      = t.init(params)
    out, state = t.update(updates, state, params=None, **extra)

Round counters and what a transform reports (GradAlign weights, FedGMA's
agreement, distillation losses) live in its typed state (NamedTuples, as optax's
`ScaleByAdamState`); a transform without state has `optax.EmptyState()`. A state
keeps its structure, shapes and dtypes across `update` (it is a scan carry). Every
`update` takes `**extra` and ignores what it does not use, so transforms chain
with `optax.chain` and share one contract test (tests/test_server_contract.py).

What flows through `updates` depends on the transform's role, written in its
docstring as `updates -> out`:

* aggregators: the cohort's stacked trained models [m, ...] -> the new server
  model; `params` = the server model the cohort started from; extras `weights`
  [m] (examples per client), `ids` [m], `key` (`weighted_mean`, `gma`, FedDF /
  FedBE / FedLAW's server training);
* hypernetwork steps: stacked per-client cotangents -> optax updates of the
  hypernetwork parameters `params` (`hypernetwork_step`, `hypergenfl_step`);
* smoothers: parameters -> smoothed parameters (`ema`, as `optax.ema` is used
  to track parameters).
"""

from __future__ import annotations

import jax
import optax

from fedjax_dg import tree

ServerTransform = optax.GradientTransformationExtraArgs


def stateless(update) -> ServerTransform:
  """A transform with `optax.EmptyState()` from its `update` function."""
  return ServerTransform(lambda params: optax.EmptyState(), update)


def weighted_mean() -> ServerTransform:
  """FedAvg: stacked models [m, ...] -> sum_i w_i x_i / sum_i w_i (extra `weights`)."""

  def update(updates, state, params=None, *, weights: jax.Array, **extra):
    del params, extra
    return tree.weighted_mean(updates, weights), state

  return stateless(update)
