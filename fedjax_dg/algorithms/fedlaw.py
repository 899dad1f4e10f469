"""FedLAW (Li et al. 2023, "Revisiting weighted aggregation in FL with NNs").

Learnable aggregation: a global shrinking factor gamma and aggregation weights
lambda over the cohort's models, optimized on the server's labeled proxy set.

    client i : local training from w^t -> w_i                  (as FedAvg)
    gamma    = exp(g),  lambda = softmax(l)        g = 0, l = log p (p_i = n_i/n)
    w(g, l)  = gamma * sum_i lambda_i w_i
    repeat `steps` times, batch (x, y) of the proxy set:
      (g, l) <- Adam(lr, betas (0.5, 0.999)) step on CE(f(x; w(g, l)), y)
    w^{t+1}  = w(g, l)

As the reference code's default (`server_funct="exp"`, `whether_swa="none"`):
the exp / softmax parametrization, initialized at FedAvg's weights and
gamma = 1, Adam with beta1 = 0.5, 20 epochs over the proxy set in batches of
128, the model in training mode (dropout on) while (g, l) train. gamma scales
every parameter (the reference flattens the whole model). Only (g, l) are
learned: the client models are fixed. Choices: docs/faithfulness.md.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_dg import tree
from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client.objectives import masked_mean
from fedjax_dg.errors import ConfigError
from fedjax_dg.server import ServerTransform, distill

DISPLAY_NAME = "FedLAW"
PAPER = dict(
    title=("Revisiting Weighted Aggregation in Federated Learning with "
           "Neural Networks"),
    authors="Li et al.", venue="ICML", year=2023)
NEEDS_SERVER_DATA = True
LAMBDA_INITS = ("size", "uniform")


class FedLawState(NamedTuple):
  """What the last round learned: gamma, and lambda per client ([N]; 0 outside
  the last cohort), with the proxy loss at the first and last server step."""
  gamma: jax.Array
  lam: jax.Array
  loss_first: jax.Array
  loss_last: jax.Array


def aggregation_weights(g, l):
  """gamma * softmax(l) as one weight per client."""
  return jnp.exp(g) * jax.nn.softmax(l)


def aggregate(stacked, g, l):
  """w(g, l) = exp(g) * sum_i softmax(l)_i w_i."""
  return tree.weighted_sum(stacked, aggregation_weights(g, l))


def initial_logits(num_examples, init: str):
  """l at the start of a round: log p_i (FedAvg's weights) or zeros (uniform)."""
  if init == "uniform":
    return jnp.zeros(num_examples.shape, jnp.float32)
  n = num_examples.astype(jnp.float32)
  return jnp.log(n / jnp.sum(n))


def learned_aggregation(model, server_x, server_y, optimizer, *,
                        num_clients: int, steps: int, batch_size: int,
                        lambda_init: str = "size") -> ServerTransform:
  """Stacked trained models [m, ...] -> w(g, l) (extras `weights`, `ids`,
  `key`): (g, l) trained `steps` steps of `optimizer` on the cross-entropy of
  w(g, l) over the labeled proxy set (server_x, server_y); `FedLawState`."""
  num = int(server_x.shape[0])

  def init(params):
    del params
    zero = jnp.zeros((), jnp.float32)
    return FedLawState(zero, jnp.zeros((num_clients,)), zero, zero)

  def proxy_loss(stacked, gl, idx, mask, rng):
    """Cross-entropy of w(g, l) on the proxy examples `idx` (mask: real rows)."""
    w = aggregate(stacked, gl["g"], gl["l"])
    logits = model.apply(w, jnp.take(server_x, idx, axis=0), train=True, rng=rng)
    ce = optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.take(server_y, idx, axis=0))
    return masked_mean(ce, mask)

  def update(updates, state, params=None, *, weights, ids, key, **extra):
    del params, extra
    gl = {"g": jnp.zeros((), jnp.float32),
          "l": initial_logits(weights, lambda_init)}
    objective = lambda p, idx, mask, rng: proxy_loss(updates, p, idx, mask, rng)
    res = distill.server_train(gl, objective, optimizer, key=key, steps=steps,
                               num=num, batch_size=batch_size)
    g, l = res.params["g"], res.params["l"]
    lam = jnp.zeros_like(state.lam).at[ids].set(jax.nn.softmax(l))
    return (aggregate(updates, g, l),
            FedLawState(jnp.exp(g), lam, res.losses[0], res.losses[-1]))

  return ServerTransform(init, update)


def _metrics(state: FedLawState, result) -> dict:
  return {"fedlaw_gamma": state.gamma,
          "fedlaw_lambda": jnp.take(state.lam, result.ids, axis=0),
          "proxy_loss_first": state.loss_first,
          "proxy_loss_last": state.loss_last}


def prepare(model=None, *, data, **unused) -> dict:
  """What `build` reads of the run's data, as arrays (the recipe's values,
  `algorithms.recipe`: runs of other seeds and targets then share one
  program): the server's split."""
  return distill.prepare_server(model, data=data, name="fedlaw")


def build(model, optimizer, loss, *, data, prepared=None, num_clients: int,
          epochs: int = 20, steps: int = 0,  # ref. code server_epochs
          batch_size: int = 128,     # ref. code validate_batchsize
          lr: float = 1e-2,          # ref. code: 1e-2 CIFAR-10, 5e-3 otherwise
          b1: float = 0.5, b2: float = 0.999,  # ref. code's Adam betas
          lambda_init: str = "size",  # size (ref. code: log data shares) |
                                      # uniform
          ) -> Algorithm:
  """FedLAW; `data` is the run's FederatedData (its `server_x` / `server_y`).

  Args:
    epochs, steps, batch_size: server steps as in `distill.resolve_steps`.
    lr, b1, b2: the server's Adam on (g, l).
    lambda_init: "size" (reference code: log of the cohort's data shares) or
      "uniform" (l = 0).
  """
  if lambda_init not in LAMBDA_INITS:
    raise ConfigError(f"fedlaw.lambda_init={lambda_init!r}: allowed "
                     f"{LAMBDA_INITS}")
  sx, sy = distill.require_server_data(data, "fedlaw", prepared)
  num = int(sx.shape[0])
  bs = max(1, min(batch_size, num))
  aggregator = learned_aggregation(
      model, sx, sy, optax.adam(lr, b1=b1, b2=b2), num_clients=num_clients,
      steps=distill.resolve_steps(steps, epochs, num, bs), batch_size=bs,
      lambda_init=lambda_init)
  return fedavg(model, optimizer, loss, aggregator=aggregator,
                metrics=_metrics, name="fedlaw")
