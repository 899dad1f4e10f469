"""The hypernetwork server (pFedHN convention, hFedF Alg. 1/3): its step as a
transform, and the whole server as plain functions (`hypernetwork_server`:
hFedF adds GradAlign and the EMA to it, pFedHN is it with the reference
code's settings).

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
from fedjax_dg.models.hypernetwork import (client_grad_sq_norms,
                                            hypernetwork_module,
                                            init_hypernetwork)
from fedjax_dg.optim import make_optimizer
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


class HypernetworkServer(NamedTuple):
  """A hypernetwork server as plain functions (`hypernetwork_server`).

  init(key) -> (HyperParams, HypernetworkState): theta and the [N, e]
      embedding table, the step's state.
  models(hp, ids) -> [m, ...] the generated models of clients `ids`.
  all_models(hp) -> [N, ...] every client's generated model.
  step(hp, state, start, trained, ids) -> (hp, state): one server step from
      the cohort's generated (`start`) and trained models [m, ...].
  """
  init: Callable[[jax.Array], tuple[HyperParams, HypernetworkState]]
  models: Callable[[HyperParams, jax.Array], Any]
  all_models: Callable[[HyperParams], Any]
  step: Callable[..., tuple[HyperParams, HypernetworkState]]


def default_embed_dim(num_clients: int) -> int:
  """floor(1 + N / 4): pFedHN's rule for the embedding size e, hFedF's too."""
  return int(1 + num_clients / 4)


def hypernetwork_server(model, *, num_clients: int, embed_dim: int = 0,
                        hidden: int, n_hidden: int, head_init: str,
                        optimizer: str, lr: float, weight_decay: float,
                        momentum: float, clip_norm: float,
                        decay_embeddings: bool,
                        embeddings: jax.Array | None = None,
                        **step_options) -> HypernetworkServer:
  """The server of a hypernetwork generating `model`'s parameters, one
  embedding row per client.

  `embed_dim` 0: `default_embed_dim`. `hidden`, `n_hidden`, `head_init`: the
  generator (`models.hypernetwork`). The server optimizer is
  `optim.make_optimizer(optimizer, lr, weight_decay, momentum, clip_norm)`
  with weight decay on theta, and on the embeddings with
  `decay_embeddings`. `embeddings`: a fixed [N, e] table; None: N(0, 1)
  draws at `init`. `step_options` go to `hypernetwork_step` (GradAlign,
  `learn_embeddings`, ...); the generator's closed-form per-client gradient
  norms are given to it.
  """
  e = embed_dim or default_embed_dim(num_clients)
  module = hypernetwork_module(model, hidden=hidden, n_hidden=n_hidden,
                               head_init=head_init)
  h = lambda theta, v: module.apply({"params": theta}, v)
  generate_many = jax.vmap(h, in_axes=(None, 0))
  server_opt = make_optimizer(
      optimizer, lr, weight_decay, momentum, clip_norm=clip_norm,
      decay_mask=HyperParams(theta=True, embeddings=decay_embeddings))
  transform = hypernetwork_step(h, server_opt,
                                client_sq_norms=client_grad_sq_norms(module),
                                **step_options)

  def init(key):
    k_theta, k_emb = jax.random.split(key)
    emb = (embeddings if embeddings is not None
           else jax.random.normal(k_emb, (num_clients, e)))
    hp = HyperParams(theta=init_hypernetwork(module, model, k_theta, e),
                     embeddings=emb)
    return hp, transform.init(hp)

  def models(hp, ids):
    return generate_many(hp.theta, jnp.take(hp.embeddings, ids, axis=0))

  def all_models(hp):
    return generate_many(hp.theta, hp.embeddings)

  def step(hp, state, start, trained, ids):
    deltas = jax.tree.map(jnp.subtract, start, trained)
    updates, state = transform.update(deltas, state, hp, ids=ids)
    return optax.apply_updates(hp, updates), state

  return HypernetworkServer(init, models, all_models, step)
