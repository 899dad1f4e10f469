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
* |g_i| comes from `client_sq_norms` when the generator has a closed form
  (hFedF's HyperNetwork: `models.hypernetwork.client_grad_sq_norms`, linear
  heads), else from a `lax.map` over clients (chunks of `norm_batch_size`), so
  at most that many per-client gradients exist at once;
* the aligned gradient sum_i w_i g_i is one more VJP with cotangents w_i delta_i.

Client i's embedding gradient only touches row e_i, so its rows come out of the
same VJP and their cosines to the mean are computed exactly from row norms.

`granularity="tensor"` applies GradAlign per hypernetwork parameter tensor t
(each leaf of theta: every trunk and head kernel and bias): cos_{i,t} =
<g_avg_t, g_i_t> / (|g_avg_t| |g_i_t|), weights softmax_i(cos_{i,t} / T) per
tensor, and g_t = sum_i w_{i,t} g_i_t. Still no [m, P] stack:

* g_avg is the same one VJP;
* per-tensor dots and norms come from the chunked `lax.map` over clients that
  the model mode uses for |g_i| (it holds g_i anyway; per-tensor JVPs would
  cost one batched forward per tensor instead);
* sum_i w_{i,t} g_i_t cannot be one VJP (the weights differ per tensor, and a
  cotangent scales whole clients), so it is a second chunked pass: a
  `lax.scan` over chunks of `norm_batch_size` clients accumulating
  sum_i w_{i,t} g_i_t into one theta-sized carry.

Memory: model mode holds g_avg and `norm_batch_size` per-client gradients;
tensor mode the same plus one theta-sized accumulator (about 3 theta-sized
buffers with chunks of 1, independent of m). Compute: tensor mode does 2 m
per-client VJPs plus the batched VJP (model mode: m per-client VJPs, one JVP
and two batched VJPs). The embedding table is a single tensor, so its GradAlign
is the same in both modes.

`over` picks which gradients one GradAlign weight covers:

* "separate" (the conference version's Algorithm 1, the default): one softmax
  for theta, another for the embeddings;
* "joint" (arXiv v1, Algorithm 1: g_i = grad_{theta, v} phi_i . delta_i,
  one GradAlign over it): one weight per client from the cosine of the whole
  (theta, embedding table) gradient, exactly
  <g_avg, g_i> = <g_avg_theta, g_i_theta> + |row_i|^2 / m and
  |g_i|^2 = |g_i_theta|^2 + |row_i|^2 (model granularity only);
* "theta" (GradAlign for theta only, the embeddings' gradients unweighted:
  client i's embedding gradient lives in its own row, so its "alignment" is
  only its norm, docs/faithfulness.md).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_dg import tree
from fedjax_dg.errors import ConfigError

PyTree = Any
Generator = Callable[[PyTree, jax.Array], PyTree]  # h(theta, embedding[e]) -> params


class HyperGrads(NamedTuple):
  theta: PyTree          # aggregated gradient for the hypernetwork weights
  embeddings: jax.Array  # [m, e]: aggregated gradient rows for the cohort's embeddings
  weights_theta: jax.Array  # [m] weights used for theta (sum to 1)
  weights_emb: jax.Array    # [m] weights used for the embeddings (sum to 1)
  cos_theta: jax.Array      # [m] cosine of g_i to g_avg (nan-free, 0 if undefined)
  cos_emb: jax.Array        # [m]
  # granularity="tensor" only ([m, T], T = leaves of theta in `jax.tree.leaves`
  # order); weights_theta / cos_theta are then their means over tensors.
  weights_theta_tensors: jax.Array | None = None
  cos_theta_tensors: jax.Array | None = None


GRANULARITIES = ("model", "tensor")
ALIGN_OVER = ("separate", "joint", "theta")


def _safe_div(a, b, eps=1e-30):
  return jnp.where(b > eps, a / jnp.maximum(b, eps), 0.0)


def hypernetwork_grads(h: Generator, theta: PyTree, emb: jax.Array,
                       deltas: PyTree, *, align: bool = True,
                       temperature: float = 1.0,
                       norm_batch_size: int = 1,
                       granularity: str = "model",
                       client_sq_norms: Callable | None = None,
                       over: str = "separate") -> HyperGrads:
  """Aggregated hypernetwork gradients for one server step.

  Args:
    h: generator of one client model from one embedding.
    theta: hypernetwork weights.
    emb: [m, e] embeddings of the cohort.
    deltas: stacked [m, ...] client deltas, start minus trained.
    align: GradAlign weights if True, uniform 1/m otherwise.
    temperature: softmax temperature of GradAlign (1 = the paper).
    norm_batch_size: clients per chunk when computing per-client gradients.
    granularity: "model" (one cosine per client over the whole gradient, the
      paper) or "tensor" (one cosine and softmax per theta tensor).
    client_sq_norms: optional `(theta, emb, deltas) -> [m]` closed form of
      |J_i^T delta_i|^2 (model granularity), replacing the per-client VJPs.
    over: "separate" | "joint" | "theta" (module docstring).
  """
  if granularity not in GRANULARITIES:
    raise ConfigError(f"granularity={granularity!r}: allowed {GRANULARITIES}")
  if over not in ALIGN_OVER:
    raise ConfigError(f"GradAlign over={over!r}: allowed {ALIGN_OVER}")
  if over == "joint" and granularity != "model":
    raise ConfigError("GradAlign over='joint' (one weight per client over theta "
                      "and the embeddings) needs granularity='model'")
  m = emb.shape[0]
  h_many = jax.vmap(h, in_axes=(None, 0))
  _, vjp = jax.vjp(h_many, theta, emb)
  g_avg, emb_avg_rows = vjp(optax.tree.scale(1.0 / m, deltas))
  rows = emb_avg_rows * m  # per-client embedding gradients (each its own row)
  uniform = jnp.full((m,), 1.0 / m)
  if not align:
    zeros = jnp.zeros((m,))
    return HyperGrads(g_avg, emb_avg_rows, uniform, uniform, zeros, zeros)

  # embeddings: g_i is row_i at position id_i, g_avg = (1/m) sum_i g_i, so
  # <g_avg, g_i> = |row_i|^2 / m and |g_avg| = sqrt(sum_j |row_j|^2) / m.
  row_norms = jnp.linalg.norm(rows, axis=1)
  cos_emb = _safe_div(row_norms, jnp.sqrt(jnp.sum(row_norms**2)))
  w_emb = (uniform if over == "theta"
           else jax.nn.softmax(cos_emb / temperature))
  if granularity == "tensor":
    return _per_tensor(h, theta, emb, deltas, g_avg, rows * w_emb[:, None],
                       w_emb, cos_emb, temperature, norm_batch_size)

  # theta: cos(g_avg, g_i) = <delta_i, J_i g_avg> / (|g_avg| |g_i|).
  _, jg = jax.jvp(lambda th: h_many(th, emb), (theta,), (g_avg,))
  dots = tree.rowwise_vdot(deltas, jg)

  def client_norm(args):
    e_i, d_i = args
    _, vjp_i = jax.vjp(lambda th: h(th, e_i), theta)
    return optax.tree.norm(vjp_i(d_i)[0])

  if client_sq_norms is not None:
    norms = jnp.sqrt(jnp.maximum(client_sq_norms(theta, emb, deltas), 0.0))
  else:
    norms = jax.lax.map(client_norm, (emb, deltas), batch_size=norm_batch_size)
  avg_norm = optax.tree.norm(g_avg)
  cos_theta = _safe_div(dots, avg_norm * norms)
  if over == "joint":
    # One cosine over (theta, embedding table): the embedding part of
    # <g_avg, g_i> is |row_i|^2 / m, of |g_avg|^2 it is sum_j |row_j|^2 / m^2.
    sq_rows = row_norms**2
    cos_theta = cos_emb = _safe_div(
        dots + sq_rows / m,
        jnp.sqrt(avg_norm**2 + jnp.sum(sq_rows) / m**2)
        * jnp.sqrt(norms**2 + sq_rows))

  w_theta = jax.nn.softmax(cos_theta / temperature)
  if over == "joint":
    w_emb = w_theta
  weighted = jax.tree.map(lambda d: d * w_theta.reshape((m,) + (1,) * (d.ndim - 1)),
                          deltas)
  g_theta, _ = vjp(weighted)
  return HyperGrads(g_theta, rows * w_emb[:, None], w_theta, w_emb, cos_theta,
                    cos_emb)


def _per_tensor(h: Generator, theta: PyTree, emb: jax.Array, deltas: PyTree,
                g_avg: PyTree, emb_grads: jax.Array, w_emb: jax.Array,
                cos_emb: jax.Array, temperature: float,
                chunk: int) -> HyperGrads:
  """GradAlign per theta tensor (module docstring), two chunked client passes."""
  m = emb.shape[0]
  avg_leaves, treedef = jax.tree.flatten(g_avg)

  def client_grad(e_i, d_i):
    _, vjp_i = jax.vjp(lambda th: h(th, e_i), theta)
    return jax.tree.leaves(vjp_i(d_i)[0])

  # Pass 1: per-client, per-tensor <g_avg_t, g_i_t> and |g_i_t|^2 -> [m, T].
  def stats(args):
    g = client_grad(*args)
    dots = jnp.stack([jnp.vdot(a, b) for a, b in zip(avg_leaves, g)])
    sq = jnp.stack([jnp.vdot(b, b) for b in g])
    return dots, sq

  dots, sq = jax.lax.map(stats, (emb, deltas), batch_size=chunk)
  avg_norms = jnp.stack([jnp.linalg.norm(a.ravel()) for a in avg_leaves])
  cos = _safe_div(dots, avg_norms[None, :] * jnp.sqrt(sq))
  w = jax.nn.softmax(cos / temperature, axis=0)  # [m, T], columns sum to 1

  # Pass 2: sum_i w_{i,t} g_i_t, `chunk` clients at a time (zero-padded: a zero
  # delta has a zero gradient and its weight is zero).
  c = max(1, min(chunk, m))
  n_chunks = -(-m // c)
  pad = n_chunks * c - m
  padded = lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(
      (n_chunks, c) + a.shape[1:])
  xs = (padded(emb), jax.tree.map(padded, deltas), padded(w))

  def accumulate(acc, xs_k):
    e_k, d_k, w_k = xs_k
    g = jax.vmap(client_grad)(e_k, d_k)  # T leaves of [c, ...]
    return [a + jnp.tensordot(w_k[:, t], g_t, axes=1)
            for t, (a, g_t) in enumerate(zip(acc, g))], None

  acc0 = [jnp.zeros_like(a) for a in avg_leaves]
  acc, _ = jax.lax.scan(accumulate, acc0, xs)
  return HyperGrads(jax.tree.unflatten(treedef, acc), emb_grads, jnp.mean(w, 1),
                    w_emb, jnp.mean(cos, 1), cos_emb, w, cos)
