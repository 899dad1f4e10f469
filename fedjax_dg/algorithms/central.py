"""Central: one model trained on the union of all clients' data (no federation)."""

from __future__ import annotations

from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.algorithms.fedavg import fedavg

DISPLAY_NAME = "Central"
FEDERATED = False  # no arrows against FedAvg in the tables, never bolded


def build(model, optimizer, loss) -> Algorithm:
  return fedavg(model, optimizer, loss, name="central").replace(pooled=True)
