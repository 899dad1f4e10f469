"""One client's local training: a pure function the engine maps over clients.

E local epochs over a client's `n` valid examples (of `n_max` padded ones) are
`E * ceil(n / B)` steps; every client runs the same static number of scanned steps
`E * ceil(n_max / B)` and steps past its own count change nothing (skipped by a
`lax.cond` where the client is mapped alone, else masked out with
`jnp.where(active, new, old)`), so one compile serves unequal clients and E
epochs mean E epochs for every client. Each epoch is a fresh permutation of the valid
examples; the last batch of an epoch is partial (PyTorch `drop_last=False`) and its
padding is masked out of the loss.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

PyTree = Any


class Batch(NamedTuple):
  x: jax.Array      # uint8 [B, H, W, ch]
  y: jax.Array      # int32 [B]
  mask: jax.Array   # float32 [B]: 1 for real examples, 0 for padding


class ClientContext(NamedTuple):
  """What one client's objective (and `Algorithm.client_aux`) sees besides its
  batch; built per client by the engine (`algorithms.base` describes the round)."""
  id: jax.Array     # scalar: the client's id in 0..N-1
  round: jax.Array  # scalar: the round index
  start: PyTree     # the parameters it started this round from
  state: PyTree = None   # its row of the persistent client state
  extra: PyTree = None   # its row of `Algorithm.client_ctx`
  shared: PyTree = None  # `Algorithm.client_shared(server)`: one copy for the cohort
  frozen: PyTree = None  # the shared-frozen parameters
  epoch: Any = 0         # the local epoch of the current step (0-based; filled
                         # by `local_update`, 0 elsewhere, e.g. in `client_aux`)


class ClientData(NamedTuple):
  """One client's padded training arrays (and, from the engine, the local steps
  it took this round: `local_steps`)."""
  x: jax.Array  # uint8 [n_max, H, W, ch]
  y: jax.Array  # int32 [n_max]
  n: jax.Array  # scalar: real examples (rows 0..n-1; the rest is padding)
  steps: jax.Array | None = None  # scalar: its local steps this round


class RunProgress(optax.GradientTransformationExtraArgs):
  """A client optimizer whose `update` takes `progress=`: the share of the
  run's local epochs done before the current one, (round * E + epoch) /
  (rounds * E), so a schedule can span the run although the optimizer state
  starts fresh every round (`optim.cosine_over_run`). `local_update` passes it
  (and needs `rounds`)."""


# loss_fn(params, batch, rng, ctx: ClientContext) -> scalar loss.
LossFn = Callable[[PyTree, Batch, jax.Array, ClientContext], jax.Array]


def num_steps(n_max: int, batch_size: int, epochs: int) -> int:
  """The static number of scanned local steps for padded size `n_max`."""
  return epochs * math.ceil(n_max / batch_size)


def local_steps(n: jax.Array, batch_size: int, epochs: int,
                steps: int = 0) -> jax.Array:
  """The local steps a client with `n` real examples takes (int32 scalar):
  `steps` when fixed (> 0), else `epochs * ceil(n / batch_size)`; 0 when it has
  no examples (`local_update` then leaves its parameters unchanged)."""
  n = jnp.asarray(n)
  taken = steps if steps > 0 else epochs * ((n + batch_size - 1) // batch_size)
  return jnp.where(n > 0, taken, 0).astype(jnp.int32)


def epoch_permutations(key: jax.Array, n: jax.Array, n_max: int,
                       epochs: int) -> jax.Array:
  """[epochs, n_max] int32: per epoch a random order of the `n` valid examples first."""
  u = jax.random.uniform(key, (epochs, n_max))
  u = jnp.where(jnp.arange(n_max)[None, :] < n, u, 2.0)  # padding sorts last
  return jnp.argsort(u, axis=1).astype(jnp.int32)


def batch_at(step: jax.Array, perms: jax.Array, n: jax.Array,
             batch_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Indices [B], example mask [B] and step-active flag of local step `step`."""
  epochs, n_max = perms.shape
  steps_per_epoch = jnp.maximum((n + batch_size - 1) // batch_size, 1)
  epoch = step // steps_per_epoch
  pos = (step % steps_per_epoch) * batch_size + jnp.arange(batch_size)
  valid = pos < n
  row = jax.lax.dynamic_index_in_dim(perms, jnp.minimum(epoch, epochs - 1), 0,
                                     keepdims=False)
  idx = jnp.take(row, jnp.minimum(pos, n_max - 1))
  active = (epoch < epochs) & (n > 0)
  return idx, valid, active


def _varying_axes(x) -> frozenset:
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  return frozenset(mat.varying) if mat is not None else frozenset(
      getattr(aval, "vma", ()))


def match_varying(values: PyTree, like: jax.Array) -> PyTree:
  """Marks `values` as varying over the mesh axes `like` varies over.

  Inside `shard_map` a scan carry built from constants (a zero loss sum, an
  optimizer step count) is device-invariant while the body makes it vary per
  client shard; `pcast` makes the types agree. A no-op outside `shard_map`.
  """
  axes = _varying_axes(like)
  if not axes:
    return values

  def cast(x):
    missing = tuple(sorted(axes - _varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, values)


def local_update(loss_fn: LossFn, optimizer: optax.GradientTransformation,
                 params: PyTree, x: jax.Array, y: jax.Array, n: jax.Array,
                 key: jax.Array, ctx: Any = None, *, batch_size: int,
                 epochs: int, steps: int = 0, rounds: int = 0,
                 skip_idle: bool = False) -> tuple[PyTree, jax.Array]:
  """Trains one client; returns (params, mean loss over its steps).

  `epochs` passes over the client's own `n` examples, or, with `steps > 0`,
  exactly `steps` steps for every client (pFedHN's "inner steps"), cycling through
  fresh permutations. The optimizer state starts fresh every call (every round),
  as in the papers' reference code. `x`: uint8 [n_max, ...], `y`: [n_max], `n`:
  scalar count. `rounds`: the run's rounds, for a `RunProgress` optimizer.
  `skip_idle`: a step past the client's own count is a `lax.cond` branch that
  computes nothing, with the same numbers; only where the client is not
  vmapped (the engine passes it for clients mapped one at a time): under
  vmap the branch would become a select over batched operands (the shared
  frozen parameters copied per client). Otherwise an idle step's update is
  computed and discarded (`jnp.where`).
  A `ClientContext` reaches the loss with `epoch` set to the step's pass over
  the client's data: `s // ceil(n / B)`, at most the last pass (with `steps >
  0` too, where a pass is `ceil(n / B)` steps).
  """
  n_max = x.shape[0]
  scheduled = isinstance(optimizer, RunProgress)
  if scheduled and rounds < 1:
    raise ValueError("a RunProgress optimizer (a schedule over the run) needs "
                     "local_update(..., rounds=R)")
  fixed_steps = steps > 0
  perm_key, step_key = jax.random.split(key)
  steps_taken = jnp.maximum(local_steps(n, batch_size, epochs, steps), 1)
  if steps > 0:  # at most one epoch per step: `steps` permutations suffice
    perms = epoch_permutations(perm_key, n, n_max, steps)
  else:
    steps = num_steps(n_max, batch_size, epochs)
    perms = epoch_permutations(perm_key, n, n_max, epochs)
  grad_fn = jax.value_and_grad(loss_fn)
  # An optimizer taking extra arguments gets `grad_fn(params, i)`, the gradient of
  # the step's own loss (same batch, key and ctx) at other parameters: SAM's
  # second gradient (`client.sam`, optax.contrib.sam's opaque mode). Transforms
  # that take no extra arguments ignore it (optax.chain).
  extra_args = isinstance(optimizer, optax.GradientTransformationExtraArgs)

  def train(carry, s, idx, valid, x, y, rng, ctx):
    p, opt_state, loss_sum = carry
    batch = Batch(jnp.take(x, idx, axis=0), jnp.take(y, idx, axis=0),
                  valid.astype(jnp.float32))
    step_ctx = ctx
    if isinstance(ctx, ClientContext):
      per_pass = jnp.maximum((n + batch_size - 1) // batch_size, 1)
      step_ctx = ctx._replace(epoch=jnp.minimum(s // per_pass,
                                                perms.shape[0] - 1))
    loss, grads = grad_fn(p, batch, rng, step_ctx)
    kw = {}
    if extra_args:
      kw["grad_fn"] = lambda q, _: jax.grad(loss_fn)(q, batch, rng, step_ctx)
    if scheduled:
      # With fixed steps a round counts as one epoch.
      e = 1 if fixed_steps else epochs
      per_epoch = jnp.maximum((n + batch_size - 1) // batch_size, 1)
      epoch = 0 if fixed_steps else jnp.minimum(s // per_epoch, e - 1)
      kw["progress"] = (getattr(ctx, "round", 0) * e + epoch) / (rounds * e)
    updates, new_opt_state = optimizer.update(grads, opt_state, p, **kw)
    return optax.apply_updates(p, updates), new_opt_state, loss_sum + loss

  def step(carry, s):
    idx, valid, active = batch_at(s, perms, n, batch_size)
    # Outside the branch: a fold_in inside a cond batched under shard_map
    # fails to trace (jax 0.10.2).
    rng = jax.random.fold_in(step_key, s)
    if skip_idle:
      return jax.lax.cond(active, train, lambda c, *_: c, carry, s, idx,
                          valid, x, y, rng, ctx), None
    new = train(carry, s, idx, valid, x, y, rng, ctx)
    return jax.tree.map(lambda a, b: jnp.where(active, a, b), new, carry), None

  init = match_varying(
      (params, optimizer.init(params), jnp.zeros((), jnp.float32)), n)
  (params, _, loss_sum), _ = jax.lax.scan(step, init, jnp.arange(steps))
  return params, loss_sum / steps_taken
