"""Optimizer factory shared by clients and servers (optax only)."""

from __future__ import annotations

import jax.numpy as jnp
import optax

from fedjax_dg.client.update import RunProgress
from fedjax_dg.tree import is_concrete  # noqa: F401 (checks of traced values)
from fedjax_dg.errors import ConfigError

OPTIMIZERS = ("sgd", "adam", "adamw")

# The clients' learning-rate schedules (`client.schedule`).
SCHEDULES = ("constant", "cosine")


def make_optimizer(name: str, lr: float, weight_decay: float = 0.0,
                   momentum: float = 0.0, clip_norm: float = 0.0,
                   decay_mask=None) -> optax.GradientTransformation:
  """An optax optimizer with PyTorch semantics for `weight_decay`.

  "sgd" and "adam" add `weight_decay * w` to the gradient before the update, as
  `torch.optim.SGD/Adam(weight_decay=...)` do (the papers' reference code);
  "adamw" decouples it. `clip_norm > 0` clips the global gradient norm first
  (pFedHN's reference code clips at 50). `decay_mask` (a pytree of bools or a
  callable) limits weight decay to some leaves.
  """
  if name not in OPTIMIZERS:
    raise ConfigError(f"optimizer={name!r} is not supported; allowed: {OPTIMIZERS}")
  if is_concrete(lr) and lr <= 0:  # a traced lr was checked when concrete
    raise ConfigError(f"learning rate must be > 0, got {lr}")
  parts = []
  if clip_norm and clip_norm > 0:
    parts.append(optax.clip_by_global_norm(clip_norm))
  if name == "adamw":
    parts.append(optax.adamw(lr, weight_decay=weight_decay, mask=decay_mask))
    return optax.chain(*parts)
  if weight_decay:
    parts.append(optax.add_decayed_weights(weight_decay, mask=decay_mask))
  if name == "sgd":
    parts.append(optax.sgd(lr, momentum=momentum or None))
  else:
    parts.append(optax.adam(lr))
  return optax.chain(*parts)


def cosine_over_run(base: optax.GradientTransformation) -> RunProgress:
  """`base`'s steps scaled by 0.5 (1 + cos(pi * progress)), progress = the
  share of the run's local epochs done (an epoch-wise cosine annealing over the
  whole run to 0, as FedCCRL's reference code steps its scheduler once per
  local epoch over rounds x epochs), although each round's optimizer state is
  fresh. `base` takes no extra arguments."""

  def update(updates, state, params=None, *, progress, **extra):
    del extra
    out, state = base.update(updates, state, params)
    return optax.tree.scale(0.5 * (1.0 + jnp.cos(jnp.pi * progress)), out), state

  return RunProgress(base.init, update)


def with_schedule(base: optax.GradientTransformation,
                  schedule: str) -> optax.GradientTransformation:
  """`base` under the run's learning-rate `schedule`: "constant" (as is) or
  "cosine" (`cosine_over_run`)."""
  if schedule not in SCHEDULES:
    raise ConfigError(f"schedule={schedule!r} is not supported; allowed: "
                      f"{SCHEDULES}")
  return cosine_over_run(base) if schedule == "cosine" else base
