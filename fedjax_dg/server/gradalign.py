"""Hypernetwork gradients from client deltas, with GradAlign weights (hFedF Alg. 1/3).

For a cohort of m clients with embeddings e_i and generated models
phi_i = h(theta, e_i), the client i "gradient" of the hypernetwork is the VJP
g_i = J_i^T delta_i with delta_i = phi_i - phi_i^trained (pFedHN's old-minus-new
convention, so a descent step moves phi_i toward the trained model).

GradAlign weighs the g_i by a softmax of their cosine to the mean
g_avg = (1/m) sum_i g_i, separately for theta and the embeddings. It never builds
the [m, P_hypernetwork] stack of per-client gradients:

* g_avg is one VJP of the batched generator with cotangent delta / m;
* <g_avg, g_i> = <delta_i, J_i g_avg>: one JVP of the batched generator in the
  direction g_avg, then a row-wise dot with the deltas;
* |g_i| comes from a `lax.map` over clients (chunks of `norm_batch_size`), so at
  most that many per-client gradients exist at once;
* the aligned gradient sum_i w_i g_i is one more VJP with cotangents w_i delta_i.

Client i's embedding gradient only touches row e_i, so its rows come out of the
same VJP and their cosines to the mean are computed exactly from row norms.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_dg import tree

PyTree = Any
Generator = Callable[[PyTree, jax.Array], PyTree]  # h(theta, embedding[e]) -> params


class HyperGrads(NamedTuple):
  theta: PyTree          # aggregated gradient for the hypernetwork weights
  embeddings: jax.Array  # [m, e]: aggregated gradient rows for the cohort's embeddings
  weights_theta: jax.Array  # [m] weights used for theta (sum to 1)
  weights_emb: jax.Array    # [m] weights used for the embeddings (sum to 1)
  cos_theta: jax.Array      # [m] cosine of g_i to g_avg (nan-free, 0 if undefined)
  cos_emb: jax.Array        # [m]


def _safe_div(a, b, eps=1e-30):
  return jnp.where(b > eps, a / jnp.maximum(b, eps), 0.0)


def hypernetwork_grads(h: Generator, theta: PyTree, emb: jax.Array,
                       deltas: PyTree, *, align: bool = True,
                       temperature: float = 1.0,
                       norm_batch_size: int = 1) -> HyperGrads:
  """Aggregated hypernetwork gradients for one server step.

  Args:
    h: generator of one client model from one embedding.
    theta: hypernetwork weights.
    emb: [m, e] embeddings of the cohort.
    deltas: stacked [m, ...] client deltas, start minus trained.
    align: GradAlign weights if True, uniform 1/m otherwise.
    temperature: softmax temperature of GradAlign (1 = the paper).
    norm_batch_size: clients per chunk when computing |g_i|.
  """
  m = emb.shape[0]
  h_many = jax.vmap(h, in_axes=(None, 0))
  _, vjp = jax.vjp(h_many, theta, emb)
  g_avg, emb_avg_rows = vjp(optax.tree.scale(1.0 / m, deltas))
  rows = emb_avg_rows * m  # per-client embedding gradients (each its own row)
  uniform = jnp.full((m,), 1.0 / m)
  if not align:
    zeros = jnp.zeros((m,))
    return HyperGrads(g_avg, emb_avg_rows, uniform, uniform, zeros, zeros)

  # theta: cos(g_avg, g_i) = <delta_i, J_i g_avg> / (|g_avg| |g_i|).
  _, jg = jax.jvp(lambda th: h_many(th, emb), (theta,), (g_avg,))
  dots = tree.rowwise_vdot(deltas, jg)

  def client_norm(args):
    e_i, d_i = args
    _, vjp_i = jax.vjp(lambda th: h(th, e_i), theta)
    return optax.tree.norm(vjp_i(d_i)[0])

  norms = jax.lax.map(client_norm, (emb, deltas), batch_size=norm_batch_size)
  cos_theta = _safe_div(dots, optax.tree.norm(g_avg) * norms)

  # embeddings: g_i is row_i at position id_i, g_avg = (1/m) sum_i g_i, so
  # <g_avg, g_i> = |row_i|^2 / m and |g_avg| = sqrt(sum_j |row_j|^2) / m.
  row_norms = jnp.linalg.norm(rows, axis=1)
  cos_emb = _safe_div(row_norms, jnp.sqrt(jnp.sum(row_norms**2)))

  w_theta = jax.nn.softmax(cos_theta / temperature)
  w_emb = jax.nn.softmax(cos_emb / temperature)
  weighted = jax.tree.map(lambda d: d * w_theta.reshape((m,) + (1,) * (d.ndim - 1)),
                          deltas)
  g_theta, _ = vjp(weighted)
  return HyperGrads(g_theta, rows * w_emb[:, None], w_theta, w_emb, cos_theta,
                    cos_emb)
