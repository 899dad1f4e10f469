"""Server-side training on the server's split (FedDF, FedBE, FedLAW).

Pieces shared by the three server-data baselines, all jit- and scan-safe
(the server arrays are closed over as constants of the round program):

* `require_server_data`: the run's server split, or an error naming
  `data.server_fraction`;
* `predict` / `predict_many`: logits of one / a stack of models on all server
  images, in chunks (teachers are fixed while the server trains, so their
  outputs are computed once per round, as FedBE's reference code does);
* `kl_to_teacher`: the distillation loss T^2 KL(p_teacher || softmax(s / T)),
  averaged over the real examples of a batch (PyTorch's "batchmean");
* `epoch_batch`: the indices of server step t's batch, epochs of a seeded
  permutation (a DataLoader with shuffle=True, no drop_last), static shapes;
* `server_train`: `steps` optimizer steps of an objective over such batches as
  one `lax.scan`, with optional stochastic weight averaging (SWA) of the
  iterates (FedBE).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_dg.errors import ConfigError, NeedsDataError

PyTree = Any


def prepare_server(model=None, *, data, name: str = "it", **unused) -> dict:
  """An algorithm's `prepare` (`algorithms.recipe`) when what it derives
  from the run's data is the server's split: {"server": (x, y)} numpy,
  checked as `require_server_data` checks it."""
  del model, unused
  sx, sy = require_server_data(data, name)
  return dict(server=(np.asarray(sx), np.asarray(sy)))


def require_server_data(data, name: str, prepared=None
                        ) -> tuple[jax.Array, jax.Array]:
  """(server_x, server_y) of the run's FederatedData as device arrays (or
  `prepared["server"]`, `prepare_server`'s, possibly traced).

  A clear error, naming the setting to change, when the federation holds no
  server split (data.server_fraction = 0).
  """
  if prepared is not None:
    return jax.tree.map(jnp.asarray, prepared["server"])
  if data is None:
    raise NeedsDataError(f"{name} trains on the server's split: pass the run's "
                         "FederatedData, built with data.server_fraction > 0, "
                         "as algorithms.build(..., data=fed)")
  if getattr(data, "server_size", 0) == 0:
    raise ConfigError(
        f"{name} trains on the server's split, but this federation has none: "
        "set data.server_fraction > 0 (e.g. 0.02, the share of FedLAW's proxy "
        "set) so that share of the source training examples is held by the "
        "server; from Python, build the FederatedData with server_fraction > 0 "
        "and pass it as algorithms.build(..., data=fed)")
  return jnp.asarray(data.server_x), jnp.asarray(data.server_y)


def predict(apply_fn: Callable, params: PyTree, x: jax.Array,
            chunk: int = 256) -> jax.Array:
  """[S, C] logits of `apply_fn(params, x_chunk)` over `x` [S, ...] in chunks."""
  s = x.shape[0]
  chunk = max(1, min(chunk, s))
  n = -(-s // chunk)
  pad = n * chunk - s
  xp = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
  out = jax.lax.map(lambda xb: apply_fn(params, xb),
                    xp.reshape((n, chunk) + x.shape[1:]))
  return out.reshape((n * chunk,) + out.shape[2:])[:s]


def predict_many(apply_fn: Callable, stacked: PyTree, x: jax.Array,
                 chunk: int = 256) -> jax.Array:
  """[M, S, C] logits of each of the M stacked models (sequential over M)."""
  return jax.lax.map(lambda p: predict(apply_fn, p, x, chunk), stacked)


def kl_to_teacher(student_logits: jax.Array, teacher_probs: jax.Array,
                  mask: jax.Array, temperature: float = 1.0) -> jax.Array:
  """T^2 * mean over real rows of KL(teacher || softmax(student / T)).

  `teacher_probs` [B, C] are already at temperature T (rows sum to 1); rows with
  mask 0 (padding) do not count. The T^2 factor (Hinton et al. 2015) keeps the
  gradient scale independent of T; it is 1 at FedDF's T = 1.
  """
  log_q = jax.nn.log_softmax(student_logits / temperature, axis=-1)
  p = teacher_probs
  log_p = jnp.log(jnp.where(p > 0, p, 1.0))
  kl = jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)
  mean = jnp.sum(kl * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  return temperature**2 * mean


def steps_per_epoch(num: int, batch_size: int) -> int:
  return -(-num // batch_size)


def epoch_batch(key: jax.Array, step: jax.Array, num: int,
                batch_size: int) -> tuple[jax.Array, jax.Array]:
  """(indices [B], mask [B]) of step `step`: epochs over a fresh permutation.

  Epoch e = step // ceil(num / B) shuffles with `fold_in(key, e)`; the last
  batch of an epoch is short (mask 0 on the padding rows), as a PyTorch
  DataLoader with shuffle=True and drop_last=False.
  """
  spe = steps_per_epoch(num, batch_size)
  epoch, i = step // spe, step % spe
  perm = jax.random.permutation(jax.random.fold_in(key, epoch), num)
  perm = jnp.pad(perm, (0, spe * batch_size - num))
  start = i * batch_size
  idx = jax.lax.dynamic_slice(perm, (start,), (batch_size,))
  mask = ((start + jnp.arange(batch_size)) < num).astype(jnp.float32)
  return idx, mask


def resolve_steps(steps: int, epochs: int, num: int, batch_size: int) -> int:
  """`steps` if > 0, else `epochs` passes over `num` examples in batches."""
  if steps > 0:
    return int(steps)
  if epochs < 1:
    raise ConfigError(f"server training needs steps > 0 or epochs >= 1, got "
                     f"steps={steps}, epochs={epochs}")
  return int(epochs) * steps_per_epoch(num, batch_size)


class DistillState(NamedTuple):
  """A server-training aggregator's report of its last round (FedDF, FedBE)."""
  loss_first: jax.Array  # the objective at the first server step
  loss_last: jax.Array   # ... and at the last


def initial_distill_state(params=None) -> DistillState:
  del params
  return DistillState(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))


def distill_metrics(state: DistillState, result=None) -> dict:
  del result
  return {"distill_loss_first": state.loss_first,
          "distill_loss_last": state.loss_last}


class TrainResult(NamedTuple):
  params: PyTree     # the last iterate
  averaged: PyTree   # the SWA average (the last iterate without SWA snapshots)
  losses: jax.Array  # [steps] objective of every step (before its update)


def server_train(params: PyTree, objective: Callable, optimizer:
                 optax.GradientTransformation, *, key: jax.Array, steps: int,
                 num: int, batch_size: int, swa_start: int = -1,
                 swa_freq: int = 1) -> TrainResult:
  """`steps` steps of `optimizer` on `objective(params, idx, mask, rng)`.

  One `lax.scan`; a fresh optimizer state every call (every round). Batches
  are `epoch_batch(key_batches, t, num, batch_size)`; `rng` is a per-step key
  (dropout of the trained model). With `swa_start >= 0`, SWA as torchcontrib's
  `SWA(swa_start, swa_freq)` (FedBE's reference code): after the update of step
  t (1-based count c = t + 1), if c > swa_start and c % swa_freq == 0 the
  iterate enters an equal-weight running average; `averaged` is that average,
  or the last iterate if no step qualified.
  """
  if steps < 1:
    raise ConfigError(f"server training needs steps >= 1, got {steps}")
  k_batch, k_rng = jax.random.split(key)
  grad_fn = jax.value_and_grad(objective)
  use_swa = swa_start >= 0

  def step(carry, t):
    p, opt_state, avg, count = carry
    idx, mask = epoch_batch(k_batch, t, num, batch_size)
    loss, g = grad_fn(p, idx, mask, jax.random.fold_in(k_rng, t))
    updates, opt_state = optimizer.update(g, opt_state, p)
    p = optax.apply_updates(p, updates)
    if use_swa:
      c = t + 1
      take = (c > swa_start) & (c % swa_freq == 0)
      w = jnp.where(take, 1.0 / (count + 1.0), 0.0)
      avg = jax.tree.map(lambda a, x: a + w * (x - a), avg, p)
      count = count + take.astype(count.dtype)
    return (p, opt_state, avg, count), loss

  init = (params, optimizer.init(params), params, jnp.zeros((), jnp.float32))
  (p, _, avg, count), losses = jax.lax.scan(step, init, jnp.arange(steps))
  if use_swa:
    avg = jax.tree.map(lambda a, x: jnp.where(count > 0, a, x), avg, p)
  else:
    avg = p
  return TrainResult(params=p, averaged=avg, losses=losses)


def swa_start_step(fraction: float, steps: int) -> int:
  """The SWA start as a step count from a fraction of the server steps."""
  if not 0 <= fraction < 1:
    raise ConfigError(f"swa_start={fraction!r}: a fraction of the server steps "
                     "in [0, 1)")
  return int(math.floor(fraction * steps))
