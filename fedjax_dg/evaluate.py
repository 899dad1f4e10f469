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


CONFIDENCE_BINS = 15  # equal-width bins of the top-class probability over [0, 1]


class Scores(NamedTuple):
  correct: jax.Array  # number of correct predictions
  count: jax.Array    # number of real (unpadded) examples
  nll: jax.Array      # summed negative log-likelihood
  # [3, CONFIDENCE_BINS] per confidence bin: examples, summed confidence, correct.
  bins: jax.Array


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
    conf = jnp.exp(jnp.max(logp, -1))
    b = jnp.clip((conf * CONFIDENCE_BINS).astype(jnp.int32), 0, CONFIDENCE_BINS - 1)
    per_bin = jax.ops.segment_sum(jnp.stack([bm, conf * bm, hit * bm], 1), b,
                                  num_segments=CONFIDENCE_BINS).T
    return jnp.stack([jnp.sum(hit * bm), jnp.sum(bm), jnp.sum(nll * bm)]), per_bin

  tot, bins = jax.tree.map(lambda a: jnp.sum(a, axis=0),
                           jax.lax.map(one, (xb, yb, mb)))
  return Scores(tot[0], tot[1], tot[2], bins)


def expected_calibration_error(bins: np.ndarray) -> float:
  """ECE = sum_b n_b / N |accuracy_b - confidence_b| from `Scores.bins` [3, B]."""
  count, conf, correct = np.asarray(bins, np.float64)
  total = count.sum()
  if total == 0:
    return float("nan")
  nz = count > 0
  return float(np.sum(np.abs(correct[nz] - conf[nz])) / total)


def calibration_summary(bins: np.ndarray) -> dict:
  """ECE and confidence histograms of correct and incorrect predictions."""
  count, _, correct = np.asarray(bins, np.float64)
  return dict(ece=expected_calibration_error(bins),
              hist_correct=correct.astype(int).tolist(),
              hist_incorrect=(count - correct).astype(int).tolist(),
              bin_edges=np.linspace(0, 1, count.shape[0] + 1).round(4).tolist())


def weight_divergence(stacked_params: PyTree) -> dict[str, float]:
  """Per parameter tensor: mean over client pairs of ||w_i - w_j|| / mean ||w_i||.

  The "Euclidean weight divergence between client models, per layer" of the hFedF
  paper (Fig. 5b), normalized by the tensor's mean norm so layers compare.
  O(C^2) per tensor: the engine passes at most
  `engine.evaluation.DIVERGENCE_CLIENTS` clients (a seeded sample in larger
  federations).
  """
  out = {}
  for path, w in jax.tree_util.tree_flatten_with_path(stacked_params)[0]:
    w = np.asarray(w, np.float64).reshape(w.shape[0], -1)
    c = w.shape[0]
    if c < 2:
      continue
    sq = np.sum(w**2, 1)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2 * w @ w.T, 0.0)
    pair = np.sqrt(d2[np.triu_indices(c, 1)]).mean()
    name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    out[name] = float(pair / max(np.sqrt(sq).mean(), 1e-12))
  return out


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
