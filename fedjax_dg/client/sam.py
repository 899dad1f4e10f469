"""SAM as a client optimizer (Foret et al. 2021; FedSAM: Qu et al. 2022, Caldarola
et al. 2022): one local step at w on batch b is

    g     = grad L_b(w)
    e     = rho * g / (|g| + 1e-12)                     SAM
          = rho * T^2 g / (|T g| + 1e-12), T = |w| + eta  adaptive SAM (ASAM,
                                                        Kwon et al. 2021; T = 1
                                                        for biases)
    g_adv = grad L_b(w + e)                             same batch, same dropout key
    w    <- base_optimizer_step(w, g_adv)               e.g. SGD; weight decay at w

It is `optax.contrib.sam` in opaque mode (sync_period 2: one ascent step, then the
base step at the original parameters) with the ascent direction above.
`client.update.local_update` hands every extra-args optimizer the step's gradient
function `grad_fn(params, i)`, which opaque SAM evaluates at w + e. The base
optimizer's state (momentum) is the only state carried from step to step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from optax import contrib

from fedjax_dg.errors import ConfigError
from fedjax_dg.tree import is_concrete

EPS = 1e-12  # added to the gradient norm (the reference SAM code)


def _is_bias(path) -> bool:
  last = path[-1] if path else None
  return getattr(last, "key", getattr(last, "name", None)) == "bias"


def ascent(rho: float, adaptive: bool = False, eta: float = 0.01
           ) -> optax.GradientTransformation:
  """SAM's ascent as an optax transform: gradient g at w -> -e (minus the step).

  `optax.contrib.sam` negates its adversarial optimizer's output (that is written
  as a descent optimizer, e.g. normalized SGD), so this returns -e and SAM moves to
  w + e.
  """
  if is_concrete(rho) and rho < 0:
    raise ConfigError(f"SAM rho must be >= 0, got {rho}")

  def update(g, state, params=None):
    if adaptive:
      t = jax.tree_util.tree_map_with_path(
          lambda path, w: (jnp.ones_like(w) if _is_bias(path)
                           else jnp.abs(w) + eta), params)
      g = jax.tree.map(jnp.multiply, t, g)                   # T g
      scale = rho / (optax.tree.norm(g) + EPS)
      return jax.tree.map(lambda ti, gi: -scale * ti * gi, t, g), state
    scale = rho / (optax.tree.norm(g) + EPS)
    return jax.tree.map(lambda gi: -scale * gi, g), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def sam(base: optax.GradientTransformation, rho: float, *,
        adaptive: bool = False, eta: float = 0.01
        ) -> optax.GradientTransformationExtraArgs:
  """SAM around the `base` optimizer; `update` needs `grad_fn=(params, i) -> g`."""
  return contrib.sam(base, ascent(rho, adaptive, eta), sync_period=2,
                     reset_state=True, opaque_mode=True)
