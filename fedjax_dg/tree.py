"""Pytree math over stacked (leading client axis) pytrees.

Element-wise arithmetic lives in `optax.tree` (add, sub, scale, vdot, norm, where);
this module adds what a *stack* of pytrees needs: building and slicing stacks,
weighted means over the client axis and per-client inner products. No model or data
knowledge here.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

PyTree = Any


def stack(trees: Sequence[PyTree]) -> PyTree:
  """Stacks a list of identically structured pytrees along a new leading axis."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def unstack(tree: PyTree) -> list[PyTree]:
  """Inverse of `stack`: one pytree per index of the leading axis."""
  n = leading_size(tree)
  return [jax.tree.map(lambda x, i=i: x[i], tree) for i in range(n)]


def leading_size(tree: PyTree) -> int:
  leaves = jax.tree.leaves(tree)
  if not leaves:
    raise ValueError("empty pytree has no leading axis")
  return leaves[0].shape[0]


def broadcast(tree: PyTree, n: int) -> PyTree:
  """Repeats a pytree `n` times along a new leading axis."""
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + jnp.shape(x)), tree)


def take(tree: PyTree, idx: jax.Array) -> PyTree:
  """Gathers rows `idx` of every leaf (leading axis)."""
  return jax.tree.map(lambda x: jnp.take(x, idx, axis=0), tree)


def put(tree: PyTree, idx: jax.Array, rows: PyTree) -> PyTree:
  """Scatters `rows` into the leading axis of `tree` at `idx` (functional update)."""
  return jax.tree.map(lambda x, r: x.at[idx].set(r), tree, rows)


def weighted_mean(stacked: PyTree, weights: jax.Array) -> PyTree:
  """sum_i w_i x_i / sum_i w_i over the leading axis of every leaf."""
  w = weights / jnp.sum(weights)
  return weighted_sum(stacked, w)


def weighted_sum(stacked: PyTree, weights: jax.Array) -> PyTree:
  """sum_i w_i x_i over the leading axis of every leaf."""
  return jax.tree.map(
      lambda x: jnp.tensordot(weights.astype(x.dtype), x, axes=1), stacked)


def rowwise_vdot(a: PyTree, b: PyTree) -> jax.Array:
  """[C] vector of <a_i, b_i> for stacked pytrees a, b."""
  per_leaf = jax.tree.map(
      lambda x, y: jnp.sum((x * y).reshape(x.shape[0], -1), axis=1), a, b)
  return sum(jax.tree.leaves(per_leaf))


def rowwise_sq_norm(a: PyTree) -> jax.Array:
  """[C] vector of |a_i|^2."""
  return rowwise_vdot(a, a)


def cosine(a: PyTree, b: PyTree, eps: float = 1e-12) -> jax.Array:
  """Cosine similarity of two whole pytrees (flattened)."""
  num = sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  na = jnp.sqrt(sum(jnp.vdot(x, x) for x in jax.tree.leaves(a)))
  nb = jnp.sqrt(sum(jnp.vdot(y, y) for y in jax.tree.leaves(b)))
  return num / jnp.maximum(na * nb, eps)


def num_params(tree: PyTree) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(tree))


def is_concrete(x) -> bool:
  """Whether `x` is a value, not a tracer: a recipe's values
  (`algorithms.base.Recipe`) are traced inside the engine's programs, where
  the checks that ran on their concrete values are skipped."""
  return not isinstance(x, jax.core.Tracer)
