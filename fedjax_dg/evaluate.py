"""Accuracy of stacked (per-client) or shared models on padded evaluation arrays.

All functions are jittable and map over clients and over example batches with
`lax.map`, so evaluating N personalized models on a large target domain keeps
memory bounded (one batch of one model's activations at a time).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


class Scores(NamedTuple):
  correct: jax.Array  # number of correct predictions
  count: jax.Array    # number of real (unpadded) examples
  nll: jax.Array      # summed negative log-likelihood


def pad_to_multiple(x: np.ndarray, y: np.ndarray, multiple: int):
  """Pads examples (axis 0) with zeros to a multiple of `multiple`; returns mask."""
  n = x.shape[0]
  total = max(multiple, -(-n // multiple) * multiple)
  mask = np.zeros((total,), np.float32)
  mask[:n] = 1.0
  pad = [(0, total - n)] + [(0, 0)] * (x.ndim - 1)
  return np.pad(x, pad), np.pad(y, [(0, total - n)]), mask


def scores(apply_fn, params: PyTree, x: jax.Array, y: jax.Array,
           mask: jax.Array, batch_size: int) -> Scores:
  """Scores of one model on [N, ...] examples; N must be a multiple of batch_size."""
  nb = x.shape[0] // batch_size
  xb = x.reshape((nb, batch_size) + x.shape[1:])
  yb, mb = y.reshape(nb, batch_size), mask.reshape(nb, batch_size)

  def one(batch):
    bx, by, bm = batch
    logp = jax.nn.log_softmax(apply_fn(params, bx))
    hit = (jnp.argmax(logp, -1) == by).astype(jnp.float32)
    nll = -jnp.take_along_axis(logp, by[:, None], axis=1)[:, 0]
    return jnp.stack([jnp.sum(hit * bm), jnp.sum(bm), jnp.sum(nll * bm)])

  tot = jnp.sum(jax.lax.map(one, (xb, yb, mb)), axis=0)
  return Scores(tot[0], tot[1], tot[2])


def per_client_scores(apply_fn, stacked_params: PyTree | None, shared_params,
                      x: jax.Array, y: jax.Array, mask: jax.Array,
                      batch_size: int) -> Scores:
  """Scores [C] of each client's model on each client's own padded data.

  x: [C, V, ...]; pass `stacked_params` ([C, ...], personalized) or
  `shared_params` (one model for all clients).
  """

  def one(args):
    if stacked_params is None:
      cx, cy, cm = args
      p = shared_params
    else:
      p, cx, cy, cm = args
    return scores(apply_fn, p, cx, cy, cm, batch_size)

  args = (x, y, mask) if stacked_params is None else (stacked_params, x, y, mask)
  return jax.lax.map(one, args)


def models_on_shared_data(apply_fn, stacked_params: PyTree, x, y, mask,
                          batch_size: int) -> Scores:
  """Scores [C] of C models on the same (e.g. target-domain) data."""
  return jax.lax.map(
      lambda p: scores(apply_fn, p, x, y, mask, batch_size), stacked_params)
