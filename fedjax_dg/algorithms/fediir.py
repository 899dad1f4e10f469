"""FedIIR (Guo et al., ICML 2023): FedAvg with inter-client gradient alignment of
the classifier, for invariant relationships across clients.

    g_i(theta)  = grad over the classifier (`fc2`) of client i's cross-entropy
    g_bar       <- ema * g_bar + (1 - ema) * example-weighted mean of the
                   cohort's g_i at the global model
    local loss  = CE + penalty * || g_i(theta; batch) - g_bar ||^2
                  (differentiated through g_i: a second-order term)
    server      = example-weighted FedAvg; g_bar in the server state

The released code (github.com/YamingGuo98/FedIIR) measures g_bar over the
cohort's data with the global model at the start of the round, before local
training. Here each client measures its g_i at the model it receives
(`ctx.start`) at its end of round (its message) and the server folds the
cohort's mean into g_bar after the round, so round t trains against a g_bar that includes the
gradients at round t-1's global model, one round later than the code (g_bar
is an EMA with ema = 0.95 either way). docs/faithfulness.md, "FedIIR".
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_dg.algorithms.base import (Algorithm, ClientEnd, ClientResult,
                                       ServerState)
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client.passes import sum_over_chunks
from fedjax_dg.errors import ConfigError
from fedjax_dg.tree import is_concrete

DISPLAY_NAME = "FedIIR"
PAPER = dict(
    title=("Out-of-Distribution Generalization of Federated Learning via "
           "Implicit Invariant Relationships"),
    authors="Guo et al.", venue="ICML", year=2023)
# Arguments of the compiled programs, not constants (`algorithms.recipe`).
TRACED = ("penalty", "ema")
# The released code's clients: SGD with momentum 0.9 (lr per dataset, 1e-3 by
# default), no weight decay.
CLIENT = dict(optimizer="sgd", lr=1e-3, momentum=0.9, weight_decay=0.0)
HEAD = "fc2"  # the classifier: every model's last Linear layer (`Model.head`)


class FedIIRState(NamedTuple):
  params: dict
  opt: optax.OptState
  grad_mean: dict  # g_bar, shaped like params["fc2"]


def head_ce_and_grad(model, params, feats, y, mask):
  """(summed cross-entropy over the masked examples, its gradient over the
  classifier `fc2`), the features held fixed."""
  def ce(head):
    logits = model.head({HEAD: head}, feats)
    per = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.sum(per * mask)
  return jax.value_and_grad(ce)(params[HEAD])


def client_gradient(model, params, x, y, n, chunk: int):
  """g_i: the gradient over `fc2` of the mean cross-entropy over a client's
  `n` real examples (x: [n_max, ...]), computed `chunk` examples at a time."""

  def chunk_grad(i, batch):
    del i
    feats = model.features(params, batch.x)
    return head_ce_and_grad(model, params, feats, batch.y, batch.mask)[1]

  zero = jax.tree.map(jnp.zeros_like, params[HEAD])
  total = sum_over_chunks(chunk_grad, zero, x, y, n, chunk)
  return jax.tree.map(lambda g: g / jnp.maximum(n, 1), total)


def build(model, optimizer, *, penalty: float = 1e-3,  # code: 1e-2 RMNIST,
                                                       # 5e-3 VLCS, 1e-3 PACS,
                                                       # 5e-4 OfficeHome
          ema: float = 0.95,       # g_bar's EMA (code default)
          grad_chunk: int = 64,    # examples per pass when measuring g_i
          name: str = "fediir") -> Algorithm:
  """FedIIR on `model` (any model with `features` + `head`)."""
  if is_concrete(penalty) and penalty < 0:
    raise ConfigError(f"fediir.penalty={penalty!r}: must be >= 0 (0 is FedAvg)")
  if is_concrete(ema) and not 0 <= ema < 1:
    raise ConfigError(f"fediir.ema={ema!r}: allowed [0, 1) (the weight of the "
                      "previous g_bar)")
  if grad_chunk < 1:
    raise ConfigError(f"fediir.grad_chunk={grad_chunk!r}: must be >= 1")

  def loss(params, batch, rng, ctx):
    feats = model.features(params, batch.x, train=True, rng=rng)
    count = jnp.maximum(jnp.sum(batch.mask), 1.0)
    ce, g = head_ce_and_grad(model, params, feats, batch.y, batch.mask)
    g = jax.tree.map(lambda v: v / count, g)
    gap = jax.tree.map(lambda a, b: jnp.sum(jnp.square(a - b)), g, ctx.shared)
    return ce / count + penalty * sum(jax.tree.leaves(gap))

  base = fedavg(model, optimizer, loss, name=name)

  def init(key):
    server, clients = base.init(key)
    zero = jax.tree.map(jnp.zeros_like, server.params[HEAD])
    return FedIIRState(server.params, server.opt, zero), clients

  def end(ctx, trained, data_i, key):  # message: its head's gradient at start
    del trained, key
    return ctx.state, client_gradient(model, ctx.start, data_i.x, data_i.y,
                                      data_i.n, grad_chunk)

  def server_update(server, result: ClientResult, key):
    new, metrics = base.server.update(ServerState(server.params, server.opt),
                                      result, key)
    w = result.num_examples.astype(jnp.float32)
    w = w / jnp.maximum(jnp.sum(w), 1.0)
    mean = jax.tree.map(lambda g: jnp.tensordot(w, g, axes=1), result.message)
    # 1 - ema in float32 whether ema is a constant or traced (`TRACED`):
    # the same numbers either way.
    decay = jnp.asarray(ema, jnp.float32)
    grad_mean = jax.tree.map(lambda old, m: decay * old + (1 - decay) * m,
                             server.grad_mean, mean)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g))
                        for g in jax.tree.leaves(grad_mean)))
    return (FedIIRState(new.params, new.opt, grad_mean),
            dict(metrics, iir_grad_mean_norm=norm))

  return base.replace(init=init, update=server_update,
                      shared=lambda server: server.grad_mean,
                      end=ClientEnd(end, reads_data=True))
