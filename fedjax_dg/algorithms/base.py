"""The Algorithm record the engine composes: pure functions, no loops over clients."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import optax

from fedjax_dg.client.update import LossFn

PyTree = Any


class ClientResult(NamedTuple):
  """What one round of local training returns to the server (stacked over the cohort)."""
  ids: jax.Array           # [m] client ids of the cohort
  start: PyTree            # [m, ...] parameters each client started from
  params: PyTree           # [m, ...] parameters after local training
  num_examples: jax.Array  # [m] training examples per client
  loss: jax.Array          # [m] mean local training loss


def _start_is_ctx(start, client_state_rows):
  del client_state_rows
  return start


def _keep_state(client_state_rows, trained):
  del trained
  return client_state_rows


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """A federated algorithm = broadcast, local objective, server transform.

  init(key) -> (server_state, client_state): client_state is a per-client
      persistent pytree with leading axis N (or None), carried across rounds.
  client_start(server_state, client_state_rows, ids) -> [m, ...] start params.
  loss(params, batch, rng, ctx): the local objective of one client.
  client_ctx(start, client_state_rows) -> ctx given to `loss` (stacked over m).
  client_end(client_state_rows, trained) -> new client_state rows.
  server_update(server_state, ClientResult, key, round) -> (server_state, metrics).
  eval_params(server_state, client_state) -> parameters to evaluate: stacked
      [N, ...] if `personalized`, else one model shared by every client.
  pooled: train one "client" on the union of the clients' data (Central).
  local_steps: > 0 overrides the engine's epochs with a fixed number of local
      steps for every client (pFedHN's inner steps).
  extras(server_state, client_state) -> dict of arrays reported with the final
      evaluation for analysis (e.g. hFedF's learned client embeddings).
  """
  name: str
  init: Callable[[jax.Array], tuple[PyTree, PyTree]]
  client_start: Callable[[PyTree, PyTree, jax.Array], PyTree]
  loss: LossFn
  optimizer: optax.GradientTransformation
  server_update: Callable[..., tuple[PyTree, dict]]
  eval_params: Callable[[PyTree, PyTree], PyTree]
  personalized: bool
  client_ctx: Callable[[PyTree, PyTree], Any] = _start_is_ctx
  client_end: Callable[[PyTree, PyTree], PyTree] = _keep_state
  pooled: bool = False
  local_steps: int = 0
  extras: Callable[[PyTree, PyTree], dict] = lambda server, clients: {}
