"""MOON (Li, He, Song 2021): FedAvg with a model-contrastive local objective.

    z, z_glob, z_prev = projections of x by the model being trained, the round's
                        global model w^t (frozen) and the client's previous local
                        model w_i^{t-1} (frozen; both in evaluation mode)
    l_con = -log( e^{sim(z, z_glob)/tau} / (e^{sim(z, z_glob)/tau}
                                            + e^{sim(z, z_prev)/tau}) )
    local objective (client i):   CE(logits, y) + mu * l_con     (batch means)
    server:                       example-weighted mean of the whole model,
                                  projection head included (FedAvg)

sim is the cosine similarity. The projection head is `models.moon.ContrastiveModel`
(a 2-layer MLP on the client model's features). The previous-model buffer is
per-client persistent state (`Previous`, [N, ...]): after each round a cohort
client's row becomes its trained model; the others keep theirs.

A client without a previous local model: the reference code's pool is empty in
round 0 (no negative: l_con = 0 exactly), and under partial participation a client
first sampled in a later round gets its own untouched, untrained network as the
negative. `prev_init` "initial" (default) starts every buffer at the initial model:
in round 0 that is the global model, and later an untrained model, as the
reference; "global" uses the round's global model until the client has trained.
Wherever the previous model equals the global model the contrastive term is off
(`ctx.extra.on = 0`, the reference's empty pool): z_prev = z_glob would give the
constant log 2, whose gradient is zero only up to rounding, which Adam would
amplify into steps of the projection head.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_dg import tree
from fedjax_dg.algorithms.base import Algorithm, ClientContext, ClientEnd
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client.objectives import masked_mean, row_norms
from fedjax_dg.client.update import Batch
from fedjax_dg.errors import ConfigError
from fedjax_dg.models.moon import ContrastiveModel
from fedjax_dg.tree import is_concrete

DISPLAY_NAME = "MOON"
PAPER = dict(
    title="Model-Contrastive Federated Learning",
    authors="Li, He, Song", venue="CVPR", year=2021)
# Arguments of the compiled programs, not constants (`algorithms.recipe`).
TRACED = ("mu", "temperature")
PREV_INIT = ("initial", "global")
COS_EPS = 1e-8  # torch.nn.CosineSimilarity's eps


class Previous(NamedTuple):
  """Per-client persistent state: the previous local model."""
  params: dict         # [N, ...] each client's last trained model
  trained: jax.Array   # [N] bool: the client has trained at least once


class Negative(NamedTuple):
  """Per-client context of a round (`ctx.extra`)."""
  prev: dict           # the previous model used as the negative
  on: jax.Array        # 1.0, or 0.0 where it equals the global model


def cosine_similarity(a: jax.Array, b: jax.Array) -> jax.Array:
  """[B] row-wise a.b / max(|a| |b|, eps) (torch.nn.CosineSimilarity(dim=-1))."""
  return jnp.sum(a * b, -1) / jnp.maximum(row_norms(a) * row_norms(b), COS_EPS)


def model_contrastive_loss(z: jax.Array, z_glob: jax.Array, z_prev: jax.Array,
                           temperature: float, mask: jax.Array) -> jax.Array:
  """MOON's l_con: CE of logits [sim(z, z_glob), sim(z, z_prev)] / tau, label 0."""
  sims = cosine_similarity(z[None], jnp.stack([z_glob, z_prev]))  # [2, B]
  logits = sims.T / temperature
  ce = optax.softmax_cross_entropy_with_integer_labels(
      logits, jnp.zeros(z.shape[:1], jnp.int32))
  return masked_mean(ce, mask)


def objective(cm: ContrastiveModel, mu: float, temperature: float):
  """CE + mu * on * l_con; the positive is the round's global model `ctx.start`,
  the negative `ctx.extra.prev`, `ctx.extra.on` switches the term off."""

  def loss(params, batch: Batch, rng: jax.Array, ctx: ClientContext) -> jax.Array:
    logits, z = cm.forward(params, batch.x, train=True, rng=rng)
    frozen = lambda p: cm.forward(jax.lax.stop_gradient(p), batch.x)[1]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)
    con = model_contrastive_loss(z, frozen(ctx.start), frozen(ctx.extra.prev),
                                 temperature, batch.mask)
    return masked_mean(ce, batch.mask) + mu * ctx.extra.on * con

  return loss


def _select_rows(flags: jax.Array, a, b):
  """Row r of `a` where flags[r], else of `b` (leading axis m)."""
  pick = lambda x, y: jnp.where(flags.reshape((-1,) + (1,) * (x.ndim - 1)), x, y)
  return jax.tree.map(pick, a, b)


def _rows_equal(a, b) -> jax.Array:
  """[m] bool: row r of `a` equals row r of `b` in every leaf."""
  same = lambda x, y: jnp.all((x == y).reshape(x.shape[0], -1), axis=1)
  return jnp.stack(jax.tree.leaves(jax.tree.map(same, a, b))).all(axis=0)


def build(model, optimizer, *, num_clients: int,
          mu: float = 1.0,           # ref. code default; paper: 5 CIFAR-10,
                                     # 1 CIFAR-100 / Tiny-ImageNet;
                                     # HyperGenFL 0.01
          temperature: float = 0.5,  # paper, ref. code and HyperGenFL
          proj_dim: int = 256,       # projection head output (ref. --out_dim)
          prev_init: str = "initial",  # initial | global: a client's previous
                                       # model before it has trained
                                       # (docs/faithfulness.md)
          ) -> Algorithm:
  """MOON over client `model` with a `proj_dim` projection head.

  The clients use the run's optimizer (`client`; the reference code: SGD lr
  1e-2, momentum 0.9, weight decay 1e-5).
  """
  if is_concrete(mu) and mu < 0:
    raise ConfigError(f"MOON mu must be >= 0, got {mu}")
  if is_concrete(temperature) and temperature <= 0:
    raise ConfigError(f"MOON temperature must be > 0, got {temperature}")
  if prev_init not in PREV_INIT:
    raise ConfigError(f"prev_init={prev_init!r}; allowed: {PREV_INIT}")
  cm = ContrastiveModel(model, proj_dim)
  base = fedavg(cm, optimizer, objective(cm, mu, temperature), name="moon")

  def client_init(key, ids):
    server, _ = base.init(key)
    return Previous(tree.broadcast(server.params, ids.shape[0]),
                    jnp.zeros(ids.shape, bool))

  def init(key):
    server, _ = base.init(key)
    return server, client_init(key, jnp.arange(num_clients))

  def extra(start, rows: Previous, ids):
    del ids
    prev = rows.params
    if prev_init == "global":
      prev = _select_rows(rows.trained, prev, start)
    # A previous model equal to the global one: no negative, no contrastive term.
    on = 1.0 - _rows_equal(prev, start).astype(jnp.float32)
    return Negative(prev, on)

  def end(ctx, trained, data, key):  # the previous model is its state
    del data, key
    return Previous(trained, jnp.ones_like(ctx.state.trained)), None

  return base.replace(
      init=init, extra=extra, end=ClientEnd(end, reads_data=False),
      init_rows=client_init,
      eval_params=lambda server, clients: cm.to_model_params(server.params))
