"""hFedF (hypernetwork-based federated fusion): Algorithm 1 of the paper.

    phi_i   = h(theta, v[i])                  client_start: generate each model
    local   : E epochs of cross-entropy       (Alg. 2)
    delta_i = phi_i - phi_i^trained           (pFedHN sign, old minus new)
    g_i     = J_i^T delta_i                   VJP through the generator
    g       = sum_i GradAlign_i g_i           (Alg. 3, separately for theta and v)
    theta, v <- Adam(+weight decay) step      (server optimizer)
    theta, v <- EMA(theta, v, t)              (Alg. 4, warm-up round w)

Everything is a composition of `server.hypernetwork_step` and `server.ema`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_dg.algorithms.base import Algorithm, ClientResult
from fedjax_dg.models.hypernetwork import hypernetwork_module, init_hypernetwork
from fedjax_dg.optim import make_optimizer
from fedjax_dg.server import ema as ema_transform
from fedjax_dg.server.hypernetwork import HyperParams, hypernetwork_step


def default_embed_dim(num_clients: int) -> int:
  """floor(1 + N / 4), pFedHN's rule used by hFedF."""
  return int(1 + num_clients / 4)


def hfedf(model, optimizer, loss, *, num_clients: int, embed_dim: int = 0,
          hidden: int = 50, n_hidden: int = 3, head_init: str = "client_init",
          server_optimizer: str = "adam", server_lr: float = 1e-3,
          server_weight_decay: float = 1e-5, server_clip_norm: float = 0.0,
          gradalign: bool = True, temperature: float = 1.0,
          norm_batch_size: int = 1, ema: bool = True, ema_decay: float = 0.95,
          ema_warmup: int = 5, learn_embeddings: bool = True,
          name: str = "hfedf") -> Algorithm:
  e = embed_dim or default_embed_dim(num_clients)
  module = hypernetwork_module(model, hidden=hidden, n_hidden=n_hidden,
                               head_init=head_init)
  h = lambda theta, v: module.apply({"params": theta}, v)
  generate_many = jax.vmap(h, in_axes=(None, 0))
  # Weight decay on the hypernetwork weights only (pFedHN excludes embeddings).
  server_opt = make_optimizer(server_optimizer, server_lr, server_weight_decay,
                              clip_norm=server_clip_norm,
                              decay_mask=HyperParams(theta=True, embeddings=False))
  step = hypernetwork_step(h, server_opt, align=gradalign, temperature=temperature,
                           norm_batch_size=norm_batch_size,
                           learn_embeddings=learn_embeddings)
  smoother = ema_transform(ema_decay, ema_warmup) if ema else None

  def init(key):
    k_theta, k_emb = jax.random.split(key)
    hp = HyperParams(theta=init_hypernetwork(module, model, k_theta, e),
                     embeddings=jax.random.normal(k_emb, (num_clients, e)))
    server = {"hp": hp, "opt": step.init(hp)}
    if smoother is not None:
      server["ema"] = smoother.init(hp)
    return server, None

  def client_start(server, rows, ids):
    del rows
    hp = server["hp"]
    return generate_many(hp.theta, jnp.take(hp.embeddings, ids, axis=0))

  def server_update(server, result: ClientResult, key, round_idx):
    del key
    hp, opt, g = step.update(server["hp"], server["opt"], result.ids,
                             result.start, result.params)
    new = dict(server, hp=hp, opt=opt)
    if smoother is not None:
      new["hp"], new["ema"] = smoother.update(hp, server["ema"], round_idx)
    metrics = {"gradalign_theta": g.weights_theta, "gradalign_emb": g.weights_emb}
    return new, metrics

  def eval_params(server, clients):
    del clients
    hp = server["hp"]
    return generate_many(hp.theta, hp.embeddings)

  return Algorithm(name=name, init=init, client_start=client_start, loss=loss,
                   optimizer=optimizer, server_update=server_update,
                   eval_params=eval_params, personalized=True)
