"""Passes over one client's whole (padded) data, a chunk of rows at a time.

A client-side statistic of all its examples (FedIIR's classifier gradient,
SCAFFOLD's option-I control variate, FedDG-GA's and FedSDAF's gaps) cannot
take the [n_max, ...] rows in one batch: the activations of a large client
would not fit. `sum_over_chunks` scans over chunks of a fixed size, the last
padded, with a mask of the real rows; `slice_metrics` is the evaluation-mode
loss and accuracy of a model over a client's first rows, so measured.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from fedjax_dg.client.update import Batch, match_varying

PyTree = Any


def sum_over_chunks(fn: Callable[[jax.Array, Batch], PyTree], zero: PyTree,
                    x: jax.Array, y: jax.Array, n: jax.Array,
                    chunk: int) -> PyTree:
  """sum_c fn(c, Batch(x_c, y_c, mask_c)) over the chunks c = 0, 1, ... of
  `chunk` rows of x [k, ...] and y [k] (zero-padded to a multiple of
  `chunk`); mask_c marks the rows among the first `n`. `zero`: the sum's
  start (fn's output shape), made varying per client shard under shard_map."""
  k = x.shape[0]
  pad = -k % chunk
  x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
  y = jnp.pad(y, (0, pad))
  mask = (jnp.arange(k + pad) < n).astype(jnp.float32)
  split = lambda a: a.reshape((-1, chunk) + a.shape[1:])

  def step(total, piece):
    i, xc, yc, mc = piece
    return jax.tree.map(jnp.add, total, fn(i, Batch(xc, yc, mc))), None

  pieces = (jnp.arange((k + pad) // chunk), split(x), split(y), split(mask))
  total, _ = jax.lax.scan(step, match_varying(zero, x), pieces)
  return total


def slice_metrics(model, params, x, y, n, examples: int, chunk: int):
  """(mean cross-entropy, accuracy) of `params` over the first
  min(n, examples) rows of x [n_max, ...] (`examples` = 0: all n), in
  evaluation mode, `chunk` rows at a time."""
  n_max = x.shape[0]
  k = n_max if examples <= 0 else min(examples, n_max)
  count = jnp.minimum(n, k)

  def sums(i, batch):
    del i
    logits = model.apply(params, batch.x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)
    hit = (jnp.argmax(logits, axis=-1) == batch.y).astype(jnp.float32)
    return jnp.sum(ce * batch.mask), jnp.sum(hit * batch.mask)

  zero = jnp.zeros((), jnp.float32)
  ce, hits = sum_over_chunks(sums, (zero, zero), x[:k], y[:k], count,
                             min(chunk, k))
  denom = jnp.maximum(count, 1).astype(jnp.float32)
  return ce / denom, hits / denom
