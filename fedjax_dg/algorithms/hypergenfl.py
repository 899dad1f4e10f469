"""HyperGenFL (HG-FL, Chen et al., CIKM '25): Algorithm 1 of the paper.

    sigma  <- 1                                   line 3 (`embeddings="ones"`)
    C      : m active clients, drawn by the engine (`train.cohort_size`)
    start  : theta_g, broadcast to C              line 10
    local  : local training of each theta_c       lines 11-13
    A      = HN(phi, sigma[C])                    Eq. 4-7 (`models.hypergenfl`)
    g      = VJP of [Theta * A], cotangent        Eq. 10-11, 15-17 (old minus new)
             theta_g - mean_c theta_c
    phi, sigma[C] <- AdamW step                   lines 16-17
    theta_g = [Theta * HN(phi, sigma[C])]         Eq. 8, lines 8-9 of the next round

One shared global model (not personalized), no client weighting by data size.
Everything is `server.hypergenfl_step`; the switches (`embeddings`,
`granularity`, `server_loss`, `order`) are described in docs/faithfulness.md.

Round metrics: `hg_weight_min` / `hg_weight_max` (over the cohort and layers),
`hg_entropy` (mean over layers of the weights' entropy; log m = uniform),
`hg_client_weight` ([m] mean over layers, cohort order as `cohort`),
`hg_dead` (fraction of (client, layer) scores whose ReLU is off, Eq. 5) and
`hg_mse` (mean squared distance of the new theta_g to the trained models).
Extras: the embedding table and `weights` [N, L] (the last cohort's rows; 0
for clients not in it), layers in `layer_groups` order.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_dg import tree
from fedjax_dg.algorithms.base import Algorithm, ClientResult
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.errors import ConfigError
from fedjax_dg.models.hypergenfl import (AttentionScores, decoder_preactivations,
                                         init_attention_scores)
from fedjax_dg.optim import make_optimizer
from fedjax_dg.server.hypergenfl import (LOSSES, HyperGenFLStepState,
                                         aggregate, hypergenfl_step,
                                         layer_groups)
from fedjax_dg.server.hypernetwork import HyperParams

DISPLAY_NAME = "HG-FL"
PAPER = dict(
    title=("HyperGenFL: Hypernetwork-Generated Model Aggregation in "
           "Federated Learning"),
    authors="Chen, Lu, Tian, Niu, Li", venue="CIKM", year=2025)
EMBEDDINGS = ("ones", "onehot", "random")  # Table 6
# "update_first": theta_g of the next round is aggregated with the updated
# (phi, sigma) (Alg. 1: lines 16-17 of round t run before lines 8-9 of round
# t + 1); "aggregate_first": with the (phi, sigma) the gradient was taken at.
ORDERS = ("update_first", "aggregate_first")


class HyperGenFLState(NamedTuple):
  params: dict              # the global model theta_g
  hp: HyperParams           # phi and the [N, d] embedding table
  opt: HyperGenFLStepState  # AdamW's state and the last gradient point's
                            # weights
  weights: jax.Array        # [N, L] weights of the last aggregate (0 outside
                            # the last cohort)


def init_embeddings(kind: str, num_clients: int, dim: int,
                    key: jax.Array) -> jax.Array:
  """[N, d] table: all ones (the paper), one-hot (d = N, fixed) or N(0, 1)."""
  if kind == "ones":
    return jnp.ones((num_clients, dim))
  if kind == "onehot":
    return jnp.eye(num_clients)
  if kind == "random":
    return jax.random.normal(key, (num_clients, dim))
  raise ConfigError(f"hypergenfl.embeddings={kind!r}: allowed {EMBEDDINGS}")


def init_alive(module: AttentionScores, key: jax.Array, dim: int,
               embeddings: jax.Array, max_tries: int = 64) -> dict:
  """phi from `key`; re-drawn from fold_in(key, t), t = 1, 2, ..., while every
  decoder ReLU of Eq. 5 is off for the embedding table (as one cohort).

  Such a hypernetwork is dead from round 0: its gradients are exactly zero, so
  it never trains and aggregates with weights 1/m (unweighted FedAvg reported
  as HG-FL; ~5.5 % of keys with the 5-layer CIFAR CNN). A key that starts alive
  keeps its phi (docs/faithfulness.md, "HyperGenFL").
  """
  def alive(phi):
    return jnp.any(decoder_preactivations(module, phi, embeddings) > 0)

  def draw(t):
    return init_attention_scores(module, jax.random.fold_in(key, t), dim)

  phi0 = init_attention_scores(module, key, dim)
  _, phi = jax.lax.while_loop(
      lambda c: (c[0] < max_tries) & ~alive(c[1]),
      lambda c: (c[0] + 1, draw(c[0] + 1)), (jnp.int32(0), phi0))
  return phi


def build(model, optimizer, loss, *, num_clients: int,
          embed_dim: int = 128,   # Sec. 4.1 (= the attention width);
                                  # Tables 7-8: 64-256
          embeddings: str = "ones",  # ones (Alg. 1, Sec. 5.1) | onehot
                                     # (fixed, d = N) | random (N(0, 1),
                                     # learned): Table 6
          num_heads: int = 4,     # not given; must divide d (and N for
                                  # onehot: 1/2/4 fit 128 and Table 6's 100)
          attention_layers: int = 1,  # residual MHA blocks (Sec. 5.2;
                                      # Tables 7-8: 1-3)
          lam: float = 1e-3,      # lambda of Eq. 5: "a small positive
                                  # constant", no value given
          granularity: str = "module",  # one weight per module (kernel +
                                        # bias, Eq. 3's "layer") | tensor
          server_loss: str = "default",  # Table 9: default (Eq. 10-17) |
                                         # mse | logcosh
          order: str = "update_first",   # aggregate with the updated
                                         # hypernetwork (Alg. 1) |
                                         # aggregate_first
          server_optimizer: str = "adamw",  # Sec. 4.1: AdamW
          server_lr: float = 1e-2,  # Sec. 4.1: "learning rate for the
                                    # hypernetwork 0.01"
          server_weight_decay: float = 1e-5,  # Sec. 4.1
          ) -> Algorithm:
  """HyperGenFL; `embed_dim` is ignored for one-hot embeddings (d = N).

  The clients use the run's optimizer (`client`): Sec. 4.1's "AdamW lr 0.01,
  weight decay 1e-5 for the HG-FL" may also describe them; batch size 32 and
  10 local epochs are engine settings (train.*).
  """
  if embeddings not in EMBEDDINGS:
    raise ConfigError(f"hypergenfl.embeddings={embeddings!r}: allowed {EMBEDDINGS}")
  if order not in ORDERS:
    raise ConfigError(f"hypergenfl.order={order!r}: allowed {ORDERS}")
  if server_loss not in LOSSES:
    raise ConfigError(f"hypergenfl.server_loss={server_loss!r}: allowed {LOSSES}")
  d = num_clients if embeddings == "onehot" else embed_dim
  sample = jax.eval_shape(model.init, jax.random.key(0))
  layer_of, _ = layer_groups(sample, granularity)
  module = AttentionScores(embed_dim=d, num_layers=max(layer_of) + 1,
                           num_heads=num_heads,
                           attention_layers=attention_layers, lam=lam)
  hn = lambda phi, sigma: module.apply({"params": phi}, sigma)
  step = hypergenfl_step(
      hn, layer_of, make_optimizer(server_optimizer, server_lr,
                                   server_weight_decay),
      loss=server_loss, learn_embeddings=embeddings != "onehot")

  def init(key):
    k_model, k_phi, k_emb = jax.random.split(key, 3)
    table = init_embeddings(embeddings, num_clients, d, k_emb)
    hp = HyperParams(theta=init_alive(module, k_phi, d, table), embeddings=table)
    return HyperGenFLState(model.init(k_model), hp, step.init(hp),
                 jnp.zeros((num_clients, module.num_layers))), None

  def server_update(server, result: ClientResult, key):
    del key
    updates, opt = step.update(result.params, server.opt, server.hp,
                               ids=result.ids, start=server.params)
    hp = optax.apply_updates(server.hp, updates)
    if order == "update_first":
      w = hn(hp.theta, jnp.take(hp.embeddings, result.ids, axis=0))
    else:
      w = jnp.take(opt.weights, result.ids, axis=0)
    params = aggregate(result.params, w, layer_of)
    pre = decoder_preactivations(module, hp.theta,
                                 jnp.take(hp.embeddings, result.ids, axis=0))
    sq = tree.rowwise_sq_norm(jax.tree.map(lambda t, g: t - g[None],
                                           result.params, params))
    metrics = {
        "hg_weight_min": jnp.min(w), "hg_weight_max": jnp.max(w),
        "hg_entropy": jnp.mean(-jnp.sum(w * jnp.log(jnp.maximum(w, 1e-30)), 0)),
        "hg_client_weight": jnp.mean(w, 1),
        "hg_dead": jnp.mean((pre <= 0).astype(jnp.float32)),
        "hg_mse": jnp.mean(sq) / tree.num_params(params),
    }
    weights = jnp.zeros_like(server.weights).at[result.ids].set(w)
    return HyperGenFLState(params, hp, opt, weights), metrics

  def extras(server, clients):
    del clients
    return {"embeddings": server.hp.embeddings, "weights": server.weights}

  # FedAvg's broadcast and evaluation of the global model `params`.
  return fedavg(model, optimizer, loss, name="hypergenfl").replace(
      init=init, update=server_update, extras=extras)


def diagnose(round_metrics) -> list[str]:
  """A hypernetwork dead at the end of the run (`hg_dead` = 1: every decoder
  ReLU off for every cohort client): its gradients are exactly zero and every
  weight is 1/m, so the rounds since it died were unweighted FedAvg."""
  dead = np.asarray(round_metrics.get("hg_dead", []), np.float64) >= 1.0
  if not dead.size or not dead[-1]:
    return []
  alive = np.flatnonzero(~dead)
  since = int(alive[-1]) + 1 if alive.size else 0
  return [f"the attention hypernetwork went dead at round {since} and stayed "
          f"dead to the end ({dead.size - since} of {dead.size} rounds): every "
          "decoder ReLU (Eq. 5) is off for every client, its gradients are "
          "zero and every layer's weights are 1/m, so those rounds were "
          "unweighted FedAvg, not HyperGenFL. Likely: the all-ones embeddings "
          "(hypergenfl.embeddings='random' gives the clients different "
          "inputs) or a server learning rate too large (hypergenfl.server_lr) "
          "(docs/faithfulness.md, \"Dead decoders\")"]
