"""HyperGenFL's server step: layer-wise aggregation by hypernetwork weights (Sec. 3).

For the m active clients with trained models Theta = {theta_c} (stacked [m, ...]),
embeddings sigma = E[ids] and hypernetwork weights phi:

    A        = HN(phi, sigma)                  [m, L], columns sum to 1 (Eq. 7)
    theta_g  = [Theta * A]                     theta_g^l = sum_c a^l_c theta_c^l (Eq. 8)
    g        = VJP of (phi, sigma) -> theta_g  with Theta fixed (Eq. 10-11), the
               cotangent from the client deltas (`cotangent`, Table 9's losses)
    phi, E   <- AdamW step on (phi, E[ids])   (Alg. 1 lines 16-17)

Sign. Eq. 15 writes Delta theta_c = theta_c - theta_g (new minus old), Eq. 16-17
derive dL/dtheta = (theta - theta') / eta (old minus new), and Alg. 1 subtracts
the gradient. Only old minus new makes the descent step move theta_g toward the
trained models (pFedHN's convention, `server.hypernetwork`): the "default"
cotangent is (1/m) sum_c (theta_start - theta_c), the gradient of the linear
loss (1/m) sum_c <theta_g, theta_start - theta_c>; it does not depend on phi, so
Eq. 10's (1/|C|) sum_c J^T Delta theta_c is ONE VJP with the mean delta.
`tests/test_hypergenfl.py` checks the direction.

Layers. `granularity="module"`: one weight per module (a kernel and its bias
share it: the leaves of one parent dict); "tensor": one weight per parameter
tensor. `layer_groups` gives the static leaf -> layer map.

Only the active clients' embedding rows receive gradients, and only they move:
the AdamW update of the other rows (momentum, weight decay) is masked to zero.

Cost: one forward of the tiny hypernetwork, one weighted sum over the stacked
client models (as FedAvg), and its transpose (one [m, P] pass for the [m, L]
weight gradients); aggregating with the updated phi (Alg. 1's order,
`algorithms.hypergenfl`) adds one more weighted sum, "logcosh" one elementwise
pass. Never a [m, P_hypernetwork] stack.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_dg import tree
from fedjax_dg.errors import ConfigError
from fedjax_dg.server.aggregate import ServerTransform
from fedjax_dg.server.hypernetwork import HyperParams

PyTree = Any
# HN(phi, sigma [m, d]) -> A [m, L] aggregation weights.
WeightNet = Callable[[PyTree, jax.Array], jax.Array]

GRANULARITIES = ("module", "tensor")
LOSSES = ("default", "mse", "logcosh")


class HyperGenFLStepState(NamedTuple):
  """`hypergenfl_step`'s state: the server optimizer's state and the weights
  A of the last step's gradient point per client and layer ([N, L]; zero for
  clients outside the last cohort)."""
  opt: Any
  weights: jax.Array


def _check(name: str, value: str, allowed: tuple) -> None:
  if value not in allowed:
    raise ConfigError(f"hypergenfl.{name}={value!r}: allowed {allowed}")


def _path_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def layer_groups(params: PyTree, granularity: str = "module"
                 ) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """(layer index of every leaf in `jax.tree.leaves` order, layer names).

  "module": leaves with the same parent path (e.g. fc1/kernel, fc1/bias) form
  one layer; "tensor": every leaf is its own layer. Layers are numbered in
  order of first appearance.
  """
  _check("granularity", granularity, GRANULARITIES)
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  names = [_path_name(p if granularity == "tensor" or len(p) < 2 else p[:-1])
           for p in paths]
  order = list(dict.fromkeys(names))
  return tuple(order.index(n) for n in names), tuple(order)


def aggregate(stacked: PyTree, weights: jax.Array,
              layer_of: tuple[int, ...]) -> PyTree:
  """Eq. 8: theta_g^l = sum_c weights[c, l] theta_c^l, leaf by leaf."""
  leaves, treedef = jax.tree.flatten(stacked)
  if len(leaves) != len(layer_of):
    raise ValueError(f"{len(leaves)} parameter tensors, layer map has "
                     f"{len(layer_of)}")
  out = [jnp.tensordot(weights[:, l].astype(x.dtype), x, axes=1)
         for x, l in zip(leaves, layer_of)]
  return jax.tree.unflatten(treedef, out)


def cotangent(loss: str, agg: PyTree, start: PyTree, trained: PyTree) -> PyTree:
  """dL/dtheta_g for Table 9's server losses, averaged over the m clients.

  default: L = (1/m) sum_c <theta_g, sg(theta_start - theta_c)>  (Eq. 10-17)
           -> theta_start - mean_c theta_c
  mse:     L = (1/m) sum_c mean_p (theta_g - theta_c)^2
           -> (2 / P) (theta_g - mean_c theta_c)
  logcosh: L = (1/m) sum_c mean_p log cosh(theta_g - theta_c)
           -> (1 / (m P)) sum_c tanh(theta_g - theta_c)

  `agg` is theta_g(phi, sigma) (the aggregate the gradient is taken at),
  `start` the model the clients started from, `trained` [m, ...]; P is the
  number of client-model parameters (PyTorch's reduction="mean" over the
  flattened model).
  """
  _check("loss", loss, LOSSES)
  m = tree.leading_size(trained)
  mean = tree.weighted_sum(trained, jnp.full((m,), 1.0 / m))
  if loss == "default":
    return jax.tree.map(jnp.subtract, start, mean)
  p = tree.num_params(agg)
  if loss == "mse":
    return jax.tree.map(lambda g, t: (2.0 / p) * (g - t), agg, mean)
  return jax.tree.map(lambda g, t: jnp.mean(jnp.tanh(g[None] - t), 0) / p,
                      agg, trained)


def server_grads(hn: WeightNet, layer_of: tuple[int, ...], phi: PyTree,
                 sigma: jax.Array, start: PyTree, trained: PyTree,
                 loss: str = "default"):
  """(theta_g, A, d phi, d sigma) of Eq. 10-11 with Theta = `trained` fixed.

  One `jax.vjp` of (phi, sigma) -> [Theta * HN(phi, sigma)], pulled back with
  `cotangent(loss, ...)` at its own output.
  """
  def generate(phi, sigma):
    weights = hn(phi, sigma)
    return aggregate(trained, weights, layer_of), weights

  agg, vjp, weights = jax.vjp(generate, phi, sigma, has_aux=True)
  g_phi, g_sigma = vjp(cotangent(loss, agg, start, trained))
  return agg, weights, g_phi, g_sigma


def hypergenfl_step(hn: WeightNet, layer_of: tuple[int, ...],
                    optimizer: optax.GradientTransformation, *,
                    loss: str = "default",
                    learn_embeddings: bool = True) -> ServerTransform:
  """Stacked trained models [m, ...] -> updates of `params` (Alg. 1 lines 16-17).

  `params` is the HyperParams (phi, embedding table [N, d]); extras: `ids` [m],
  the active clients (distinct), and `start`, the global model they started
  from (one model). Apply the result with `optax.apply_updates`; Eq. 8's
  aggregate is then `aggregate(trained, hn(phi, sigma[ids]), layer_of)` with the
  updated (Alg. 1's order) or the previous parameters (`state.weights[ids]`).
  `learn_embeddings=False` freezes the table (Table 6's one-hot embeddings).
  """
  _check("loss", loss, LOSSES)
  num_layers = max(layer_of) + 1

  def init(params: HyperParams):
    n = params.embeddings.shape[0]
    return HyperGenFLStepState(optimizer.init(params),
                               jnp.zeros((n, num_layers)))

  def update(updates, state: HyperGenFLStepState,
             params: HyperParams = None, *, ids: jax.Array, start: PyTree,
             **extra):
    del extra
    sigma = jnp.take(params.embeddings, ids, axis=0)
    _, weights, g_phi, g_sigma = server_grads(hn, layer_of, params.theta, sigma,
                                              start, updates, loss)
    active = jnp.zeros(params.embeddings.shape[:1], bool).at[ids].set(True)
    active = active[:, None] & learn_embeddings
    g_emb = jnp.zeros_like(params.embeddings).at[ids].add(g_sigma)
    grads = HyperParams(theta=g_phi, embeddings=jnp.where(active, g_emb, 0.0))
    out, opt = optimizer.update(grads, state.opt, params)
    out = out._replace(embeddings=jnp.where(active, out.embeddings, 0.0))
    return out, HyperGenFLStepState(
        opt, jnp.zeros_like(state.weights).at[ids].set(weights))

  return ServerTransform(init, update)
