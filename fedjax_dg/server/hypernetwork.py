"""The hypernetwork server step (pFedHN convention, hFedF Alg. 1/3) as a transform.

Sign. delta_i = phi_i - phi_i^trained (old minus new, pFedHN's reference code:
`grad_outputs = params_sent - params_after_local`), g = the VJP of the generator
with that cotangent, then a *descent* step of the server optimizer: a step moves
the generated models toward the locally trained ones (tests/test_server.py).
hFedF's algorithm box writes new minus old and still subtracts; we take pFedHN's.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_dg.errors import ConfigError
from fedjax_dg.server.aggregate import ServerTransform
from fedjax_dg.server.gradalign import (ALIGN_OVER, GRANULARITIES, HyperGrads,
                                       hypernetwork_grads)


class HyperParams(NamedTuple):
  theta: Any             # hypernetwork weights
  embeddings: jax.Array  # [N, e] client embeddings (one row per client)


class HypernetworkState(NamedTuple):
  """The server optimizer's state and the last step's GradAlign weights per
  client ([N]; zero for clients outside the last cohort): row `ids` are the
  weights of that cohort, in its order."""
  opt: Any
  weights_theta: jax.Array
  weights_emb: jax.Array
  # [N, T] per hypernetwork tensor (granularity "tensor"), else None.
  weights_theta_tensors: jax.Array | None


def hypernetwork_step(h: Callable, optimizer: optax.GradientTransformation, *,
                      align: bool = True, temperature: float = 1.0,
                      norm_batch_size: int = 1,
                      learn_embeddings: bool = True,
                      granularity: str = "model",
                      client_sq_norms: Callable | None = None,
                      align_over: str = "separate") -> ServerTransform:
  """Stacked deltas [m, ...] (start minus trained) -> updates of `params`.

  `params` is the HyperParams (theta, embeddings [N, e]); extra `ids` [m] are the
  cohort's client ids (distinct). g = VJP of the generator with the deltas as
  cotangents (GradAlign-weighted or the plain mean), then one step of
  `optimizer` on (theta, embeddings); apply the result with
  `optax.apply_updates`. `learn_embeddings=False` freezes the embeddings (zero
  updates). `granularity`: GradAlign over the whole gradient ("model", the
  paper) or per hypernetwork tensor ("tensor"); see `gradalign`.
  `client_sq_norms`: the generator's closed-form per-client gradient norms
  (`gradalign`), if any. `align_over`: "separate" (theta and embeddings each
  their own GradAlign, the conference paper), "joint" (one weight per client,
  arXiv v1) or "theta" (embeddings unweighted); see `gradalign`.
  """
  if granularity not in GRANULARITIES:
    raise ConfigError(f"gradalign granularity={granularity!r}: allowed "
                     f"{GRANULARITIES}")
  if align_over not in ALIGN_OVER:
    raise ConfigError(f"gradalign align_over={align_over!r}: allowed {ALIGN_OVER}")

  def init(params: HyperParams):
    n = params.embeddings.shape[0]
    tensors = (jnp.zeros((n, len(jax.tree.leaves(params.theta))))
               if granularity == "tensor" else None)
    return HypernetworkState(optimizer.init(params), jnp.zeros((n,)),
                             jnp.zeros((n,)), tensors)

  def update(updates, state: HypernetworkState, params: HyperParams = None, *,
             ids: jax.Array, **extra):
    del extra
    emb = jnp.take(params.embeddings, ids, axis=0)
    g: HyperGrads = hypernetwork_grads(h, params.theta, emb, updates,
                                       align=align, temperature=temperature,
                                       norm_batch_size=norm_batch_size,
                                       granularity=granularity,
                                       client_sq_norms=client_sq_norms,
                                       over=align_over)
    emb_grad = jnp.zeros_like(params.embeddings)
    if learn_embeddings:
      emb_grad = emb_grad.at[ids].add(g.embeddings)
    grads = HyperParams(theta=g.theta, embeddings=emb_grad)
    out, opt = optimizer.update(grads, state.opt, params)
    if not learn_embeddings:
      out = out._replace(embeddings=jnp.zeros_like(params.embeddings))
    rows = lambda old, new: jnp.zeros_like(old).at[ids].set(new)
    tensors = (None if state.weights_theta_tensors is None
               else rows(state.weights_theta_tensors, g.weights_theta_tensors))
    return out, HypernetworkState(opt, rows(state.weights_theta, g.weights_theta),
                                  rows(state.weights_emb, g.weights_emb), tensors)

  return ServerTransform(init, update)
