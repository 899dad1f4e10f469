"""FedAvg (McMahan et al. 2017): broadcast, local training, example-weighted mean.

The base of the FedAvg family: every algorithm with one global model (FedProx,
FedSAM, FedGMA, MOON, FedSR, FedDF, FedBE, FedLAW, HyperGenFL, Central) is this
record with a different objective, optimizer, aggregator or state
(`dataclasses.replace`). Its server state is `ServerState(params, opt)`:
`aggregator` is a server transform (stacked trained models -> the new global
model; `server.aggregate`) whose state is `opt`, and `metrics(opt, result)`
reads what it reports each round.
"""

from __future__ import annotations

from typing import Callable

from fedjax_dg import tree
import jax.numpy as jnp

from fedjax_dg.algorithms.base import (Algorithm, ClientEnd, ClientResult,
                                       ClientSide, ServerSide, ServerState)
from fedjax_dg.client import objectives
from fedjax_dg.server import ServerTransform, weighted_mean

DISPLAY_NAME = "FedAvg"
PAPER = dict(
    title=("Communication-Efficient Learning of Deep Networks from "
           "Decentralized Data"),
    authors="McMahan et al.", venue="AISTATS", year=2017)


def _no_metrics(opt, result):
  del opt, result
  return {}


def fedavg(model, optimizer, loss, *, aggregator: ServerTransform | None = None,
           metrics: Callable[..., dict] = _no_metrics,
           name: str = "fedavg") -> Algorithm:
  """FedAvg of `model`; `aggregator` defaults to the example-weighted mean.

  The aggregator's update gets the cohort's trained models, the global model
  as `params`, and extras `weights` (examples per client), `ids`, `key`.
  """
  aggregator = aggregator or weighted_mean()

  def init(key):
    params = model.init(key)
    return ServerState(params, aggregator.init(params)), None

  def client_start(server, client_rows, ids):
    del client_rows
    return tree.broadcast(server.params, ids.shape[0])

  def server_update(server, result: ClientResult, key):
    params, opt = aggregator.update(result.params, server.opt, server.params,
                                    weights=result.num_examples, ids=result.ids,
                                    key=key)
    return ServerState(params, opt), metrics(opt, result)

  return Algorithm(
      name=name, init=init,
      client=ClientSide(start=client_start, loss=loss, optimizer=optimizer),
      server=ServerSide(update=server_update,
                        eval_params=lambda server, clients: server.params))


def counting_steps(alg: Algorithm, num_clients: int) -> Algorithm:
  """`alg` (a FedAvg of no client state) whose clients keep the local steps
  of their earlier rounds as client state (int32 [N], 0 at the start; each
  end of round adds the round's steps, no data read): the count an annealed
  objective reads (`objectives.annealed_weight`; IRM's, V-REx's)."""

  def init(key):
    server, _ = alg.init(key)
    return server, objectives.no_steps(key, jnp.arange(num_clients))

  return alg.replace(init=init, init_rows=objectives.no_steps,
                     end=ClientEnd(objectives.add_steps, reads_data=False))


def build(model, optimizer, loss) -> Algorithm:
  """The registry's FedAvg (no hyperparameters)."""
  return fedavg(model, optimizer, loss)
