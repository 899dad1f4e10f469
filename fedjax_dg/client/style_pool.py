"""Per-client pools of style statistics that the other clients draw from.

FedCCRL's CCDT (MixStyle statistics of normalized inputs), CCST (AdaIN
styles of encoder features) and ELCFS (low-frequency amplitude windows) each
keep, per client, the statistics of ceil(r n_i) of its images, drawn at
random: a fixed number of slots S = ceil(r n_max) per client (the pool is
stacked over clients, `[N, S, ...]`) of which the first ceil(r n_i) are
valid. This module holds that shared shape: the slot count, the random rows
a client's statistics come from, which slots are valid, and `StylePool`,
the (mean, std, validity) pool of MixStyle and AdaIN. A cohort's new rows go
into the pool with `tree.put`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_dg.client.update import epoch_permutations


class StylePool(NamedTuple):
  """Style statistics: [N, S, C] means and stds, [N, S] validity (or one
  client's row of each, as a client computes them)."""
  mu: jax.Array
  sig: jax.Array
  valid: jax.Array


def pool_slots(r: float, n_max: int) -> int:
  """S = ceil(r n_max): the statistics slots per client."""
  return max(1, math.ceil(r * n_max))


def sampled_rows(x: jax.Array, n: jax.Array, key: jax.Array,
                 slots: int) -> jax.Array:
  """`slots` rows of x [n_max, ...], a random order of its `n` valid rows
  first (the rows past n, padding, come last)."""
  order = epoch_permutations(key, n, x.shape[0], 1)[0, :slots]
  return jnp.take(x, order, axis=0)


def valid_slots(r: float, n: jax.Array, slots: int) -> jax.Array:
  """[slots] bool: the first ceil(r n) slots hold a statistic."""
  count = jnp.ceil(r * n.astype(jnp.float32)).astype(jnp.int32)
  return jnp.arange(slots) < count
