"""Unequal clients under vmap: W lanes, each training several clients one
after another, so a vmapped round computes about the steps the cohort really
takes.

Under `vmap` every client of a batch takes a step at every iteration, so a
client with few steps idles (masked) while the largest one trains. Here the
cohort's g clients are packed into W < g lanes (`schedule`: longest first,
each to the lane that is free earliest): lane w runs its clients back to back
and the vmapped loop runs `max_w (steps of lane w)` iterations, an unbatched
scalar, so the `lax.while_loop` really stops there. At each iteration every
busy lane takes one local step of its current client (that client's own step
index, permutations and step key: `client.update.LocalTraining`, exactly the
steps `local_update` takes); a lane whose client starts loads its parameters
and a fresh optimizer state, a lane whose client takes its last step writes
its parameters to the client's row. Loads and stores sit behind a `lax.cond`
on "any lane" (a scalar), so iterations without one pay nothing for them.

Cost: W * max_w(lane steps) step computations against g * (largest count)
when masked; the longest-first schedule keeps max_w(lane steps) within 4/3 of
the best possible, and at least the largest client's count (docs/architecture.md,
"Unequal clients").
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedjax_dg.client.update import LocalTraining, keep_where, match_varying

PyTree = Any


def schedule(work: jax.Array, lanes: int) -> tuple[jax.Array, jax.Array,
                                                   jax.Array]:
  """(lane [g], offset [g], lane steps [lanes]): longest-processing-time-first
  packing of clients with `work` [g] steps into `lanes` lanes; client i runs in
  lane[i] at iterations offset[i] .. offset[i] + work[i] - 1."""
  order = jnp.argsort(-work, stable=True)

  def place(loads, i):
    w = jnp.argmin(loads)
    return loads.at[w].add(work[i]), (w, loads[w])

  loads, (lane, offset) = jax.lax.scan(
      place, match_varying(jnp.zeros((lanes,), work.dtype), work), order)
  inverse = jnp.argsort(order)
  return lane[inverse].astype(jnp.int32), offset[inverse], loads


def packed_update(training: LocalTraining, lanes: int, params: PyTree,
                  fetch: Callable, n: jax.Array, key: jax.Array, rows: PyTree,
                  context: Callable) -> tuple[PyTree, jax.Array]:
  """Trains g clients in `lanes` vmapped lanes; returns (params [g, ...],
  mean losses [g]), each client's exactly as `local_update(...,
  own_steps=True)` alone would give them.

  `params`: [g, ...] start parameters; `fetch(c, idx) -> (x, y)`: rows `idx`
  of client c (0..g-1), `n` [g] its real examples, `key` [g] the client
  keys `local_update` takes; `rows`: a pytree [g, ...]
  of per-client values the objective's context needs, `context(row)` builds a
  client's context from its row (what all clients share is closed over, not
  copied per lane). A client with no steps keeps its parameters, loss 0.
  """
  g = n.shape[0]
  lanes = min(lanes, g)
  work = training.count(n)
  lane, offset, loads = schedule(work, lanes)
  ids = jnp.arange(g)
  take = lambda tree, c: jax.tree.map(lambda a: a[c], tree)

  def at(t):
    """Per lane: its client at iteration t, that client's step, busy."""
    on = ((lane[None, :] == jnp.arange(lanes)[:, None]) & (offset <= t)
          & (t < offset + work))
    c = jnp.argmax(on, axis=1)
    return c, t - offset[c], jnp.any(on, axis=1)

  perms, step_keys = jax.vmap(training.order)(n, key)  # once per client

  def start(c):
    local = jax.vmap(training.begin)(take(params, c), take(perms, c),
                                     step_keys[c],
                                     n[c])
    return local, take(rows, c)

  def one_step(local, s, c, row):
    return training.step(local, s, lambda idx: fetch(c, idx),
                         context(row))[0]

  def body(t, carry):
    state, out, losses = carry
    c, s, busy = at(t)
    fresh = busy & (s == 0)
    state = jax.lax.cond(
        jnp.any(fresh),
        lambda st: jax.tree.map(
            lambda a, b: jnp.where(_rows(fresh, a), a, b), start(c), st),
        lambda st: st, state)
    local, row = state
    new = jax.vmap(one_step)(local, s, c, row)
    local = jax.vmap(keep_where)(busy, new, local)
    done = busy & (s == work[c] - 1)
    where = jnp.where(done, c, g)  # g: out of range, dropped

    def store(outs):
      trained, loss = jax.vmap(training.end)(local)
      out, losses = outs
      return (jax.tree.map(lambda o, p: o.at[where].set(p, mode="drop"), out,
                           trained),
              losses.at[where].set(loss, mode="drop"))

    out, losses = jax.lax.cond(jnp.any(done), store, lambda o: o,
                               (out, losses))
    return (local, row), out, losses

  init = match_varying((start(ids[:lanes]), params,
                        jnp.zeros((g,), jnp.float32)), n)
  _, out, losses = jax.lax.fori_loop(0, jnp.max(loads), body, init)
  return out, losses


def _rows(flags: jax.Array, like: jax.Array) -> jax.Array:
  """[W] flags shaped to broadcast against a [W, ...] leaf."""
  return flags.reshape(flags.shape + (1,) * (like.ndim - 1))
