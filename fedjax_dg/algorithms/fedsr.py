"""FedSR (Nguyen et al. 2022): FedAvg of a simple probabilistic representation.

    z ~ N(mu(x), sigma(x))          `models.fedsr.ProbabilisticModel` over the
                                    client model's features
    local objective (client i):     CE(cls(z), y) + a_L2R * mean_b |z_b|_2
                                    + a_CMI * mean_b KL(N(C mu, C sigma) ||
                                                        N(r_mu[y], softplus(r_s)[y]))
    server:                         example-weighted mean of the model (FedAvg)

The reference distribution (r_mu, r_s: [classes, z]; scalar C) belongs to each
client: trained locally with the model and never averaged (the reference code
averages only `nn.Sequential(net, cls)`). It is per-client persistent state
(`Reference`, [N, ...]); each round a client trains the pair
{"model": global model, "ref": its own reference} and keeps its "ref".
Evaluation uses z = mu, folded into the client model's last layer
(`ProbabilisticModel.to_model_params`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_dg import tree
from fedjax_dg.algorithms.base import (Algorithm, ClientEnd, ClientResult,
                                       ServerState)
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client import objectives
from fedjax_dg.models.fedsr import ProbabilisticModel
from fedjax_dg.server import weighted_mean

DISPLAY_NAME = "FedSR"
PAPER = dict(
    title=("FedSR: A Simple and Effective Domain Generalization Method for"
           " Federated Learning"),
    authors="Nguyen, Torr, Lim", venue="NeurIPS", year=2022)
# Table 10: lr 1e-3, weight decay 1e-5 PACS (1e-4 Office-Home / VLCS).
CLIENT = dict(lr=1e-3, weight_decay=1e-5)


class Reference(NamedTuple):
  """A client's reference distribution (per-client persistent state, [N, ...])."""
  r_mu: jax.Array     # [classes, z]
  r_sigma: jax.Array  # [classes, z] (softplus gives the scale)
  c: jax.Array        # scalar


def build(model, optimizer, *, num_clients: int,
          z_dim: int = 0,           # 0: the model's feature width (ref.: 512 =
                                    # ResNet-18's)
          l2r_coeff: float = 1e-2,  # ref. code; Table 10: 1e-1 PACS / OH, 1e-2 VLCS
          cmi_coeff: float = 5e-4,  # ref. code (not tuned in Table 10)
          ) -> Algorithm:
  """FedSR over client `model`."""
  prob = ProbabilisticModel(model, z_dim)
  loss = objectives.fedsr(prob, l2r_coeff, cmi_coeff)
  classes, z = model.num_classes, prob.z_dim
  aggregate = weighted_mean()
  base = fedavg(prob, optimizer, loss, name="fedsr")

  def client_init(key, ids):
    del key
    # The reference code's initial values: r_mu = 0, r_sigma = 1, C = 1.
    k = ids.shape[0]
    return Reference(jnp.zeros((k, classes, z)), jnp.ones((k, classes, z)),
                     jnp.ones((k,)))

  def init(key):
    server, _ = base.init(key)
    return server, client_init(key, jnp.arange(num_clients))

  def client_start(server, ref_rows, ids):
    return {"model": tree.broadcast(server.params, ids.shape[0]),
            "ref": ref_rows}

  def end(ctx, trained, data, key):  # its reference is its state; no message
    del ctx, data, key
    return trained["ref"], None

  def server_update(server, result: ClientResult, key):
    params, opt = aggregate.update(result.params["model"], server.opt,
                                   weights=result.num_examples)
    return ServerState(params, opt), {}

  return base.replace(
      init=init, start=client_start, end=ClientEnd(end, reads_data=False),
      update=server_update, init_rows=client_init,
      eval_params=lambda server, clients: prob.to_model_params(server.params))
