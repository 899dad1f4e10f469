"""FedProx (Li et al. 2020): FedAvg with a proximal term in the local objective.

    client i : min_w  F_i(w) + mu/2 |w - w^t|^2      w^t = ctx.start, the broadcast model
    server   : w^{t+1} = sum_i n_i w_i / sum_i n_i   (as FedAvg)
"""

from __future__ import annotations

from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.algorithms.fedavg import fedavg
from fedjax_dg.client import objectives
from fedjax_dg.errors import ConfigError
from fedjax_dg.tree import is_concrete

DISPLAY_NAME = "FedProx"
PAPER = dict(
    title="Federated Optimization in Heterogeneous Networks",
    authors="Li et al.", venue="MLSys", year=2020)
# Table 10's client settings, all three datasets.
CLIENT = dict(lr=1e-3, weight_decay=1e-4)
# Hyperparameters that are arguments of the compiled programs, not constants
# of them (`algorithms.recipe`): a grid over mu shares one compile.
TRACED = ("mu",)


def build(model, optimizer, loss, *,
          mu: float = 1e-2,  # "L2 regularizer", Table 10: 1e-2 PACS / OH / VLCS
          ) -> Algorithm:
  if is_concrete(mu) and mu < 0:
    raise ConfigError(f"FedProx mu must be >= 0, got {mu}")
  return fedavg(model, optimizer, objectives.proximal(loss, mu), name="fedprox")
