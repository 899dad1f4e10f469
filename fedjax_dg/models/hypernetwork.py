"""Hypernetwork of hFedF (Table 8) / pFedHN: client embedding -> client params.

    embedding [e] -> [Linear(hidden) + LeakyReLU(0.01)] x n_hidden -> Linear(hidden)
                  -> one Linear head per client-parameter tensor, reshaped.

`HyperNetwork.apply({'params': theta}, v)` is a pure function of (theta, v): use it
under `jax.vjp` (the pFedHN server step feeds `params_sent - params_trained` as the
cotangent), `jax.jvp`, or `vmap` over a batch of embeddings (a leading batch axis on
the embedding is also accepted directly).

Head initialization (the papers are silent):

* ``"client_init"`` (default): each head's bias is a sample of the client model's
  own initialization of that tensor, and its kernel is
  N(0, c * (s_t / sqrt(hidden))^2) with s_t the std of that sample and c =
  `head_scale`. At init, h(theta, v) is a properly initialized client model, and the
  embedding modulates it a little.
* ``"default"``: a plain Linear init (the trunk's `init`), like pFedHN's reference
  code. Generated weights then have O(0.1-1) magnitude whatever the fan-in of the
  target layer, far too large for e.g. a conv with fan-in 1600.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from fedjax_dg.errors import ConfigError
from fedjax_dg.models import layers

Array = jax.Array
HEAD_INITS = ("client_init", "default")


def _path_name(path) -> str:
  parts = []
  for k in path:
    for attr in ("key", "idx", "name"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return ".".join(parts)


class _Head(nn.Module):
  """Linear head `hidden -> size` with explicit initializers (nn.Dense names)."""
  size: int
  kernel_init: Callable[..., Array]
  bias_init: Callable[..., Array]

  @nn.compact
  def __call__(self, h: Array) -> Array:
    kernel = self.param("kernel", self.kernel_init, (h.shape[-1], self.size),
                        jnp.float32)
    bias = self.param("bias", self.bias_init, (self.size,), jnp.float32)
    return jnp.dot(h, kernel) + bias


class HyperNetwork(nn.Module):
  """Maps a client embedding [e] (or [n, e]) to a client-params pytree.

  Attributes:
    target: pytree of `jax.ShapeDtypeStruct` (or arrays): the client's params.
    hidden: width of the trunk (50 in hFedF, 100 in pFedHN).
    n_hidden: number of Linear + LeakyReLU layers before the last trunk Linear.
    head_init: "client_init" | "default" (module docstring).
    head_scale: c, the variance scale of the "client_init" head kernels.
    client_init: key -> client params, sampled for "client_init" heads. If None,
      `target`'s leaves must be arrays and are used as that sample.
    weight_init: "torch" | "flax" init of the trunk (and of "default" heads).
  """
  target: Any
  hidden: int = 50
  n_hidden: int = 3
  head_init: str = "client_init"
  head_scale: float = 0.1
  client_init: Callable[[Array], Any] | None = None
  weight_init: str = "torch"

  @nn.compact
  def __call__(self, embedding: Array, client_sample: Any = None) -> Any:
    """Client params for `embedding` [e] (or [..., e]: leading axes are kept).

    `client_sample` (init only, "client_init" heads): a sample of the client params
    to use instead of calling `client_init`.
    """
    if self.head_init not in HEAD_INITS:
      raise ConfigError(f"head_init must be one of {HEAD_INITS}, "
                       f"got {self.head_init!r}")
    h = jnp.asarray(embedding, jnp.float32)
    for i in range(self.n_hidden):
      h = layers.Dense(self.hidden, weight_init=self.weight_init,
                       name=f"trunk_{i}")(h)
      h = nn.leaky_relu(h, negative_slope=0.01)
    h = layers.Dense(self.hidden, weight_init=self.weight_init,
                     name=f"trunk_{self.n_hidden}")(h)

    # Linen freezes dict attributes; generate plain nested dicts.
    target = flax.core.unfreeze(self.target)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(target)
    sizes = [math.prod(leaf.shape) for _, leaf in paths_leaves]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    inits = [(None, None)] * len(sizes)
    if self.is_initializing():
      inits = self._head_inits(target, treedef, sizes, offsets, client_sample)

    outs = []
    for (path, leaf), size, (k_init, b_init) in zip(paths_leaves, sizes, inits):
      head = _Head(size, k_init or _unused, b_init or _unused,
                   name=f"head.{_path_name(path)}")
      out = head(h).reshape(h.shape[:-1] + tuple(leaf.shape))
      outs.append(out.astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, outs)

  def _head_inits(self, target, treedef, sizes, offsets, client_sample):
    """Per-head (kernel_init, bias_init), all heads' kernels drawn in ONE call.

    One random draw of shape [hidden, sum(sizes)] sliced per head has the same
    distribution as one draw per head, and compiles in a fraction of the time
    (each threefry call costs ~1 s of XLA:CPU compile time).
    """
    total = sum(sizes)
    cols = lambda a, i: lax.dynamic_slice_in_dim(a, offsets[i], sizes[i], axis=-1)
    if self.head_init == "default":
      kernels = layers.kernel_init(self.weight_init)(
          self.make_rng("params"), (self.hidden, total), jnp.float32)
      biases = layers.bias_init(self.weight_init, self.hidden)(
          self.make_rng("params"), (total,), jnp.float32)
      return [(_const(cols(kernels, i)), _const(cols(biases, i)))
              for i in range(len(sizes))]
    if client_sample is None:
      if self.client_init is not None:
        client_sample = self.client_init(self.make_rng("params"))
      else:
        client_sample = target
    sample, sdef = jax.tree_util.tree_flatten(flax.core.unfreeze(client_sample))
    if sdef != treedef:
      raise ValueError("the client-params sample does not match the target "
                       f"structure: {sdef} vs {treedef}")
    if any(isinstance(v, jax.ShapeDtypeStruct) for v in sample):
      raise ValueError("head_init='client_init' needs `client_init`, a "
                       "`client_sample` or a target of arrays")
    noise = jax.random.normal(self.make_rng("params"), (self.hidden, total),
                              jnp.float32)
    inits = []
    for i, value in enumerate(sample):
      value = jnp.asarray(value, jnp.float32).reshape(-1)
      scale = jnp.std(value) * math.sqrt(self.head_scale / self.hidden)
      inits.append((_const(cols(noise, i) * scale), _const(value)))
    return inits


def _const(value: Array) -> Callable[..., Array]:
  def init(key, shape, dtype=jnp.float32):
    del key
    return value.reshape(shape).astype(dtype)
  return init


def _unused(key, shape, dtype=jnp.float32):
  # Outside init flax only evaluates an initializer's shape (never its values).
  del key
  return jnp.zeros(shape, dtype)


def hypernetwork_module(model, *, hidden: int = 50, n_hidden: int = 3,
                        head_init: str = "client_init", head_scale: float = 0.1,
                        init: str = "torch") -> HyperNetwork:
  """The hypernetwork module for a `Model` (its params define the heads)."""
  if head_init not in HEAD_INITS:
    raise ConfigError(f"head_init={head_init!r}: allowed {HEAD_INITS}")
  target = jax.eval_shape(model.init, jax.random.key(0))
  return HyperNetwork(target=target, hidden=hidden, n_hidden=n_hidden,
                      head_init=head_init, head_scale=head_scale,
                      client_init=model.init, weight_init=init)


def init_hypernetwork(module: HyperNetwork, model, key: Array,
                      embed_dim: int) -> Any:
  """Initial hypernetwork params (a fresh client-init sample for the heads)."""
  k_client, k_hnet = jax.random.split(key)
  sample = model.init(k_client) if module.head_init == "client_init" else None

  @jax.jit
  def _init(k, sample):
    with layers.init_rng_mode():
      return module.init(k, jnp.zeros((embed_dim,), jnp.float32), sample)

  return flax.core.unfreeze(_init(k_hnet, sample)["params"])


def make_hypernetwork(model, key: Array, *, hidden: int = 50, n_hidden: int = 3,
                      head_init: str = "client_init", embed_dim: int = 4,
                      head_scale: float = 0.1, init: str = "torch"
                      ) -> tuple[HyperNetwork, Any]:
  """Builds the hypernetwork for a `Model` and initializes it.

  Args:
    model: a `fedjax_dg.models.Model`; its params define the heads.
    key: PRNG key for the hypernetwork (and the client-init sample).
    hidden, n_hidden, head_init, head_scale: see `HyperNetwork`.
    init: "torch" | "flax", the trunk's `weight_init`.
    embed_dim: e, the embedding size (hFedF and pFedHN: floor(1 + N / 4)).

  Returns:
    (module, params): `module.apply({'params': params}, v)` gives client params.
  """
  module = hypernetwork_module(model, hidden=hidden, n_hidden=n_hidden,
                               head_init=head_init, head_scale=head_scale,
                               init=init)
  return module, init_hypernetwork(module, model, key, embed_dim)


def client_grad_sq_norms(module: HyperNetwork) -> Callable[..., Array]:
  """Closed-form per-client squared gradient norms |J_i^T delta_i|^2.

  h(theta, e) = heads(u), u = trunk(theta_trunk, e) [hidden], and every head is
  affine in u: out_t = u K_t + b_t. For one client the head gradients are
  d/dK_t = u (x) delta_t and d/db_t = delta_t, so

      |g_i|^2 = |g_trunk,i|^2 + (|u_i|^2 + 1) |delta_i|^2,

  and g_trunk,i is the VJP of the small trunk with cotangent sum_t K_t delta_i,t
  (one batched product, as costly as one batched VJP). No per-client
  hypernetwork-sized gradient is formed: the [m, P_trunk] stack of trunk
  gradients is tiny (P_trunk ~ 10k for hFedF). Returns
  `sq_norms(theta, emb [m, e], deltas [m, ...]) -> [m]`; checked against
  per-client autodiff in tests/test_server.py.
  """
  n = module.n_hidden
  trunk_names = [f"trunk_{i}" for i in range(n + 1)]

  def trunk(tp, e):
    h = e
    for i, name in enumerate(trunk_names):
      h = jnp.dot(h, tp[name]["kernel"]) + tp[name]["bias"]
      if i < n:
        h = nn.leaky_relu(h, negative_slope=0.01)
    return h

  def sq_norms(theta, emb, deltas):
    tp = {k: theta[k] for k in trunk_names}
    heads = {k: v for k, v in theta.items() if k not in tp}
    paths_leaves, _ = jax.tree_util.tree_flatten_with_path(deltas)
    m = emb.shape[0]
    flat = [(heads[f"head.{_path_name(p)}"]["kernel"], d.reshape(m, -1))
            for p, d in paths_leaves]
    u = jax.vmap(trunk, (None, 0))(tp, emb)                        # [m, hidden]
    cot_u = sum(jnp.einsum("hs,ms->mh", k, d) for k, d in flat)   # [m, hidden]
    delta_sq = sum(jnp.sum(d * d, axis=1) for _, d in flat)       # [m]

    def trunk_sq(e_i, c_i):
      _, vjp_i = jax.vjp(lambda tp_: trunk(tp_, e_i), tp)
      g = vjp_i(c_i)[0]
      return sum(jnp.vdot(x, x) for x in jax.tree.leaves(g))

    trunk_part = jax.vmap(trunk_sq)(emb, cot_u)
    return trunk_part + (jnp.sum(u * u, axis=1) + 1.0) * delta_sq

  return sq_norms


def num_params(tree: Any) -> int:
  """Total number of scalars in a pytree of arrays or ShapeDtypeStructs."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
