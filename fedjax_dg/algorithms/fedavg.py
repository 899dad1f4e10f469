"""FedAvg (McMahan et al. 2017): broadcast, local SGD, example-weighted mean."""

from __future__ import annotations

from fedjax_dg import tree
from fedjax_dg.algorithms.base import Algorithm, ClientResult
from fedjax_dg.server import weighted_mean


def fedavg(model, optimizer, loss, *, name: str = "fedavg",
           pooled: bool = False) -> Algorithm:
  aggregate = weighted_mean()

  def init(key):
    return {"params": model.init(key)}, None

  def client_start(server, client_rows, ids):
    del client_rows
    return tree.broadcast(server["params"], ids.shape[0])

  def server_update(server, result: ClientResult, key, round_idx):
    del key, round_idx
    params, _ = aggregate.update(result.params, (), result.num_examples)
    return {"params": params}, {}

  return Algorithm(name=name, init=init, client_start=client_start, loss=loss,
                   optimizer=optimizer, server_update=server_update,
                   eval_params=lambda server, clients: server["params"],
                   personalized=False, pooled=pooled)


def central(model, optimizer, loss) -> Algorithm:
  """Central: one model trained on the union of all clients' data (no federation)."""
  return fedavg(model, optimizer, loss, name="central", pooled=True)
