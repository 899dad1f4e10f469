"""GroupDRO (Sagawa et al. 2020) on each client: FedAvg of a client-side
exponentiated weighting of the client's own source domains.

    client i : at every local step, with L_g the batch's mean cross-entropy
               of domain g (`Batch.d`; 0 where absent),
               q_g <- q_g exp(eta L_g),   min_w  sum_g q_g L_g(w) / sum_g q_g
               (`objectives.group_dro`)
    server   : w^{t+1} = sum_i n_i w_i / sum_i n_i   (as FedAvg)

The weights q belong to the client (its persistent state, `GroupWeights`
[N, D]: the released code's client object keeps `group_weights` from round
to round) and are never averaged. Each round a client trains the pair
{"model": global model, "weights": its weights}: the model with the run's
client optimizer, the weights by the exponentiated rule (an SGD step of
learning rate 1 that `objectives.carried` makes the rule's). The weights
normalize over the domains the client has met in a batch so far
(docs/faithfulness.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedjax_dg import tree
from fedjax_dg.algorithms.base import (Algorithm, ClientEnd, ClientResult,
                                       ServerState)
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client import objectives
from fedjax_dg.errors import ConfigError
from fedjax_dg.server import weighted_mean
from fedjax_dg.tree import is_concrete

DISPLAY_NAME = "GroupDRO"
PAPER = dict(title=("Distributionally Robust Neural Networks for Group Shifts: "
                    "On the Importance of Regularization for Worst-Case "
                    "Generalization"),
             authors="Sagawa, Koh, Hashimoto, Liang", venue="ICLR", year=2020)
NEEDS_DOMAINS = True
# A grid over the step size shares one compile (`algorithms.recipe`).
TRACED = ("eta",)


def build(model, optimizer, *, num_clients: int, data=None,
          eta: float = 0.01,       # hparam1, sweep/*/pacs/groupdro.json
          num_domains: int = 16,   # the weights' table size: every domain
                                   # index of the federation must be below it
          ) -> Algorithm:
  """GroupDRO over client `model`."""
  if is_concrete(eta) and eta < 0:
    raise ConfigError(f"groupdro.eta={eta}: must be >= 0 (0: the mean of the "
                      "domains' risks, equally weighted)")
  if data is not None and len(data.domain_names) > num_domains:
    raise ConfigError(
        f"groupdro.num_domains={num_domains}: the federation has "
        f"{len(data.domain_names)} domains; set groupdro.num_domains >= "
        f"{len(data.domain_names)}")
  loss = objectives.group_dro(model, eta, num_domains)
  weights_step = optax.multi_transform(
      {"model": optimizer, "weights": optax.sgd(1.0)},
      lambda p: {k: jax.tree.map(lambda _: k, v) for k, v in p.items()})
  base = fedavg(model, weights_step, loss, name="groupdro")
  aggregate = weighted_mean()

  def client_init(key, ids):
    del key
    k = ids.shape[0]
    return objectives.GroupWeights(jnp.zeros((k, num_domains)),
                                   jnp.zeros((k, num_domains)))

  def init(key):
    server, _ = base.init(key)
    return server, client_init(key, jnp.arange(num_clients))

  def client_start(server, rows, ids):
    return {"model": tree.broadcast(server.params, ids.shape[0]),
            "weights": rows}

  def end(ctx, trained, data, key):  # its weights are its state; no message
    del ctx, data, key
    return trained["weights"], None

  def server_update(server, result: ClientResult, key):
    del key
    params, opt = aggregate.update(result.params["model"], server.opt,
                                   weights=result.num_examples)
    return ServerState(params, opt), {}

  return base.replace(init=init, start=client_start, init_rows=client_init,
                      end=ClientEnd(end, reads_data=False),
                      update=server_update)
