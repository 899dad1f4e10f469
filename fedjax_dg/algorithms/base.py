"""The Algorithm record the engine composes: pure functions, no loops over clients.

A round, as the engine runs it (`engine.make_round`; m = the cohort size):

    ids    = the cohort                                              [m]
    rows   = client_state[ids]              local-persistent state   [m, ...]
    start  = client_start(server, rows, ids)                         [m, ...]
    extra  = client_ctx(start, rows, ids)                            [m, ...]
    shared = client_shared(server)                    one copy for the cohort
    per client i (mapped; `ctx` = ClientContext(ids[i], r, start[i], rows[i],
                                                 extra[i], shared, frozen)):
      trained_i, loss_i = local training of `loss(params, batch, rng, ctx)`
                          with `optimizer`, from start[i]
      aux_i             = client_aux(ctx, trained_i, ClientData_i, key_i)
    client_state[ids] = client_end(rows, trained)    (+ aux: client_end_takes_aux)
    server, metrics   = server_update(server, ClientResult(...), key)

Three kinds of parameters, held where they belong:

* **shared-frozen** (a pretrained backbone): `frozen(key)` is called once per
  run; the engine holds the result outside the scan carry (never checkpointed,
  never stacked per client) and hands the one copy to every client as
  `ctx.frozen` (vmap `in_axes=None`, a closed-over operand of `lax.map`,
  replicated under `shard_map`). By convention the frozen pytree is a dict of
  top-level entries of the model's parameters that the trained parameters do not
  hold: the model sees `{**frozen, **params}` (evaluation merges them per model,
  inside the map over clients);
* **global-trainable**: in the server state; `client_start` broadcasts them;
* **local-persistent** (personal models, FedSR's reference distributions, MOON's
  previous models, FedSDAF's domain-aware adapters): `client_state`, an `[N, ...]`
  pytree carried across rounds, gathered at the cohort's rows and scattered back.
  Where it lives is the engine's `placement`: on the device for the whole run,
  or (`"host"`) as numpy on the host, a chunk's cohorts' rows on the device;
  there `init_rows` builds it block by block and `eval_rows` evaluates it so.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import optax

from fedjax_dg.client.update import (ClientContext, ClientData, LossFn,
                                     RunProgress)

PyTree = Any


class ClientResult(NamedTuple):
  """What one round of local training returns to the server (stacked over the cohort)."""
  ids: jax.Array           # [m] client ids of the cohort
  round: jax.Array         # scalar round index
  start: PyTree            # [m, ...] parameters each client started from
  params: PyTree           # [m, ...] parameters after local training
  num_examples: jax.Array  # [m] training examples per client
  loss: jax.Array          # [m] mean local training loss
  aux: PyTree = None       # [m, ...] `Algorithm.client_aux` outputs (None if none)
  rounds: int | None = None  # the run's rounds where `Algorithm.uses_rounds`
                             # (a static int), else None


class ServerState(NamedTuple):
  """The server state of the FedAvg family: the global model and the state of
  the server transform that aggregates it (`optax.EmptyState()` for none)."""
  params: PyTree
  opt: PyTree = optax.EmptyState()


def _no_extra(start, client_state_rows, ids):
  del start, client_state_rows, ids


def _nothing_shared(server):
  del server


def _keep_state(client_state_rows, trained):
  del trained
  return client_state_rows


def _no_extras(server, clients):
  del server, clients
  return {}


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """A federated algorithm = broadcast, local objective, server transform.

  init(key) -> (server_state, client_state): client_state is a per-client
      persistent pytree with leading axis N (or None), carried across rounds.
  client_start(server_state, client_state_rows, ids) -> [m, ...] start params.
  loss(params, batch, rng, ctx: ClientContext): the local objective of one client.
  optimizer: the clients' optax optimizer (fresh state every round).
  server_update(server_state, ClientResult, key) -> (server_state, metrics):
      metrics is a dict of arrays recorded every round (`round_metrics`).
  eval_params(server_state, client_state) -> parameters to evaluate: stacked
      [N, ...] if `personalized`, else one model shared by every client.
  client_ctx(start, client_state_rows, ids) -> [m, ...] per-client values
      (`ctx.extra`), computed once per round (e.g. MOON's previous model).
  client_shared(server_state) -> one pytree every client of the cohort reads
      (`ctx.shared`), not copied per client (e.g. FedCCRL's style statistics).
  client_aux(ctx, trained, ClientData, key) -> pytree: a client-side statistic
      sent to the server with the trained parameters (`ClientResult.aux`);
      None: no statistic. Fixed shapes (it is stacked over the cohort).
      `ClientData.steps` is the number of local steps the client took.
      ClientData holds the client's whole data, so the "host" placement
      then gathers whole clients (`engine.resolve_gather`): without one,
      with fixed local steps, a round's clients see only their batches.
  client_end(client_state_rows, trained) -> new client_state rows; with
      `client_end_takes_aux`, client_end(client_state_rows, trained, aux) also
      gets the cohort's `client_aux` outputs [m, ...] (a statistic the client
      keeps: SCAFFOLD's control variate update).
  frozen(key) -> shared-frozen parameters (module docstring), or None; called
      once per run, eagerly (it may read a pretrained file; jit inside).
  model: the model its parameters are evaluated with where it is not the
      run's (None: the run's), e.g. the run's ViT with FedSDAF's adapters.
  pooled: train one "client" on the union of the clients' data (Central).
  local_steps: > 0 overrides the engine's epochs with a fixed number of local
      steps for every client (pFedHN's inner steps).
  extras(server_state, client_state) -> dict of arrays reported with the final
      evaluation for analysis (e.g. hFedF's learned client embeddings).
  uses_rounds: its server update reads the run's length (`ClientResult.rounds`,
      e.g. FedDG-GA's step size decaying over the run). The programs are then
      compiled per run length; otherwise one compile serves every length (a
      `RunProgress` client optimizer implies it).
  client_init(key, ids) -> the initial client state of clients `ids` [k, ...]:
      rows `ids` of `init(key)[1]` without building the other rows (the
      "host" placement builds [N, ...] block by block on the host). None:
      those rows are taken from `init(key)`, which builds all N on the device.
  eval_clients(server_state, client_state_rows, ids) -> [k, ...] parameters
      of clients `ids` (personalized): rows `ids` of `eval_params(server,
      client_state)`. None: `eval_params(server_state, rows)` (right where
      `eval_params` maps client rows to their models, Local-only's identity).
      A global model's `eval_params` must not read the client state: the
      "host" placement passes None.
  """
  name: str
  init: Callable[[jax.Array], tuple[PyTree, PyTree]]
  client_start: Callable[[PyTree, PyTree, jax.Array], PyTree]
  loss: LossFn
  optimizer: optax.GradientTransformation
  server_update: Callable[[PyTree, ClientResult, jax.Array], tuple[PyTree, dict]]
  eval_params: Callable[[PyTree, PyTree], PyTree]
  personalized: bool
  client_ctx: Callable[[PyTree, PyTree, jax.Array], PyTree] = _no_extra
  client_shared: Callable[[PyTree], PyTree] = _nothing_shared
  client_aux: Callable[..., PyTree] | None = None
  client_end: Callable[[PyTree, PyTree], PyTree] = _keep_state
  frozen: Callable[[jax.Array], PyTree] | None = None
  pooled: bool = False
  local_steps: int = 0
  extras: Callable[[PyTree, PyTree], dict] = _no_extras
  uses_rounds: bool = False
  client_end_takes_aux: bool = False
  model: Any = None
  client_init: Callable[[jax.Array, jax.Array], PyTree] | None = None
  eval_clients: Callable[[PyTree, PyTree, jax.Array], PyTree] | None = None

  @property
  def needs_rounds(self) -> bool:
    """Whether the compiled programs depend on the run's number of rounds."""
    return self.uses_rounds or isinstance(self.optimizer, RunProgress)

  def init_rows(self, key: jax.Array, ids: jax.Array) -> PyTree:
    """Rows `ids` of the initial client state (`client_init`, else `init`'s)."""
    if self.client_init is not None:
      return self.client_init(key, ids)
    return jax.tree.map(lambda a: a[ids], self.init(key)[1])

  def eval_rows(self, server: PyTree, rows: PyTree, ids: jax.Array) -> PyTree:
    """The evaluated parameters [k, ...] of clients `ids` (personalized),
    whose client state rows are `rows`."""
    if self.eval_clients is not None:
      return self.eval_clients(server, rows, ids)
    return self.eval_params(server, rows)


def with_frozen(frozen: PyTree, params: PyTree) -> PyTree:
  """The model's parameters: the shared-frozen entries plus the trained ones."""
  if frozen is None:
    return params
  overlap = set(frozen) & set(params)
  if overlap:
    raise ValueError(f"frozen and trained parameters both hold {sorted(overlap)}: "
                     "the frozen pytree must name entries the trained one lacks")
  return {**frozen, **params}
