"""Local-only: every client trains its own model on its own data; no communication.

Each client's model is local-persistent state carried across rounds in the scan.
All clients start from the same initialization (as FedAvg does).
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from fedjax_dg import tree
from fedjax_dg.algorithms.base import (Algorithm, ClientEnd, ClientSide,
                                       ServerSide)

DISPLAY_NAME = "Local-only"
FEDERATED = False


def build(model, optimizer, loss, *, num_clients: int) -> Algorithm:

  def client_init(key, ids):
    return tree.broadcast(model.init(key), ids.shape[0])

  def init(key):
    return optax.EmptyState(), client_init(key, jnp.arange(num_clients))

  def end(ctx, trained, data, key):  # its model is its state; no message
    del ctx, data, key
    return trained, None

  return Algorithm(
      name="local_only", init=init,
      client=ClientSide(start=lambda server, rows, ids: rows, loss=loss,
                        optimizer=optimizer,
                        end=ClientEnd(end, reads_data=False),
                        init_rows=client_init),
      server=ServerSide(update=lambda server, result, key: (server, {}),
                        eval_params=lambda server, clients: clients,
                        personalized=True))
