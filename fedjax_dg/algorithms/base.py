"""The Algorithm record the engine composes: pure functions, no loops over clients.

An algorithm is its state's `init`, a client side (`ClientSide`: what each
client of a round does) and a server side (`ServerSide`: what the server does
with the cohort's results and what is evaluated). A round, as the engine runs
it (`engine.round.make_round`; m = the cohort size):

    ids    = the cohort                                              [m]
    rows   = client_state[ids]              local-persistent state   [m, ...]
    start  = client.start(server, rows, ids)                         [m, ...]
    extra  = client.extra(start, rows, ids)                          [m, ...]
    shared = client.shared(server)                    one copy for the cohort
    per client i (mapped; `ctx` = ClientContext(ids[i], r, start[i], rows[i],
                                                 extra[i], shared, frozen)):
      trained_i, loss_i = local training of `client.loss(params, batch, rng,
                          ctx)` with `client.optimizer`, from start[i]
      row_i, message_i  = client.end(ctx, trained_i, ClientData_i, key_i)
                          (no `end`: row_i = rows[i], no message)
    client_state[ids] = row                                     scattered back
    server, metrics   = server.update(server, ClientResult(..., message), key)

Three kinds of parameters, held where they belong:

* **shared-frozen** (a pretrained backbone): `frozen(key)` is called once per
  run; the engine holds the result outside the scan carry (never checkpointed,
  never stacked per client) and hands the one copy to every client as
  `ctx.frozen` (vmap `in_axes=None`, a closed-over operand of `lax.map`,
  replicated under `shard_map`). By convention the frozen pytree is a dict of
  top-level entries of the model's parameters that the trained parameters do not
  hold: the model sees `{**frozen, **params}` (evaluation merges them per model,
  inside the map over clients);
* **global-trainable**: in the server state; `client.start` broadcasts them;
* **local-persistent** (personal models, FedSR's reference distributions, MOON's
  previous models, FedSDAF's domain-aware adapters, SCAFFOLD's and FedDyn's
  per-client corrections): `client_state`, an `[N, ...]` pytree carried
  across rounds, gathered at the cohort's rows, each row replaced by the
  client's `end` and scattered back. Where it lives is the engine's
  `placement`: on the device for the whole run, or (`"host"`) as numpy on the
  host, a chunk's cohorts' rows on the device; there `initial_rows` builds it
  block by block and `eval_rows` evaluates it so.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import optax

from fedjax_dg.client.update import ClientContext, ClientData, LossFn

PyTree = Any


class ClientResult(NamedTuple):
  """What one round of local training returns to the server (stacked over the cohort)."""
  ids: jax.Array           # [m] client ids of the cohort
  round: jax.Array         # scalar round index
  start: PyTree            # [m, ...] parameters each client started from
  params: PyTree           # [m, ...] parameters after local training
  num_examples: jax.Array  # [m] training examples per client
  loss: jax.Array          # [m] mean local training loss
  message: PyTree = None   # [m, ...] the clients' messages (`ClientEnd`),
                           # None without an `end`
  rounds: Any = None       # scalar: the run's number of rounds (traced: one
                           # compile serves every run length)


class ServerState(NamedTuple):
  """The server state of the FedAvg family: the global model and the state of
  the server transform that aggregates it (`optax.EmptyState()` for none)."""
  params: PyTree
  opt: PyTree = optax.EmptyState()


class ClientEnd(NamedTuple):
  """How a client ends its round, after its local steps.

  fn(ctx, trained, data, key) -> (row, message):
      ctx: its `ClientContext` (the model it started from is `ctx.start`,
      its state row `ctx.state`); trained: its parameters after the local
      steps; data: its `ClientData` (`data.steps`: the local steps it took);
      key: its own key for this hook.
      row: its new row of the client state (the structure of `ctx.state`;
      None without client state); message: any pytree of fixed shapes sent
      to the server (`ClientResult.message`, stacked over the cohort; None:
      nothing), e.g. FedCCRL's style statistics, FedDG-GA's gaps,
      SCAFFOLD's control delta.
  reads_data: whether `fn` reads the client's examples (`data.x`, `data.y`).
      Then the "host" placement gathers each cohort member's whole data
      (`engine.placement.resolve_gather`); without, `data.x` and `data.y`
      are None (a read is an error at trace time) and with fixed local
      steps a round's clients hold only the rows their batches read.
  """
  fn: Callable[[ClientContext, PyTree, ClientData, jax.Array],
               tuple[PyTree, PyTree]]
  reads_data: bool


def _no_extra(start, client_state_rows, ids):
  del start, client_state_rows, ids


def _nothing_shared(server):
  del server


def _no_extras(server, clients):
  del server, clients
  return {}


@dataclasses.dataclass(frozen=True)
class ClientSide:
  """What each client of a round does.

  start(server_state, client_state_rows, ids) -> [m, ...] start params.
  loss(params, batch, rng, ctx: ClientContext): the local objective of one client.
  optimizer: the clients' optax optimizer (fresh state every round).
  extra(start, client_state_rows, ids) -> [m, ...] per-client values
      (`ctx.extra`), computed once per round (e.g. MOON's previous model).
  shared(server_state) -> one pytree every client of the cohort reads
      (`ctx.shared`), not copied per client (e.g. FedCCRL's style statistics).
  end: the client's end of round (`ClientEnd`): its new state row and its
      message to the server. None: the row is kept, no message.
  init_rows(key, ids) -> the initial client state of clients `ids` [k, ...]:
      rows `ids` of `init(key)[1]` without building the other rows (the
      "host" placement builds [N, ...] block by block on the host). None:
      those rows are taken from `init(key)`, which builds all N on the device.
  local_steps: > 0 overrides the engine's epochs with a fixed number of local
      steps for every client (pFedHN's inner steps).
  pooled: one "client" trains on the union of the clients' data (Central).
  domains: its objective reads each example's domain (`Batch.d`, int32 [B]):
      the engine then carries the federation's domains with its examples
      (`FederatedData.with_domains`), on either placement; without, `Batch.d`
      is None and the programs take no domain array (the registry sets it
      from the module's `NEEDS_DOMAINS`).
  """
  start: Callable[[PyTree, PyTree, jax.Array], PyTree]
  loss: LossFn
  optimizer: optax.GradientTransformation
  extra: Callable[[PyTree, PyTree, jax.Array], PyTree] = _no_extra
  shared: Callable[[PyTree], PyTree] = _nothing_shared
  end: ClientEnd | None = None
  init_rows: Callable[[jax.Array, jax.Array], PyTree] | None = None
  local_steps: int = 0
  pooled: bool = False
  domains: bool = False


@dataclasses.dataclass(frozen=True)
class ServerSide:
  """What the server does with a round's results, and what is evaluated.

  update(server_state, ClientResult, key) -> (server_state, metrics):
      metrics is a dict of arrays recorded every round (`round_metrics`).
      `ClientResult.rounds` is the run's length (FedDG-GA's step decays
      over it), a traced scalar: one compile serves every length.
  eval_params(server_state, client_state) -> parameters to evaluate: stacked
      [N, ...] if `personalized`, else one model shared by every client.
      A global model's `eval_params` must not read the client state: the
      "host" placement passes None.
  personalized: a model per client is evaluated (stacked `eval_params`).
  eval_clients(server_state, client_state_rows, ids) -> [k, ...] parameters
      of clients `ids` (personalized): rows `ids` of `eval_params(server,
      client_state)`. None: `eval_params(server_state, rows)` (right where
      `eval_params` maps client rows to their models, Local-only's identity).
  extras(server_state, client_state) -> dict of arrays reported with the final
      evaluation for analysis (e.g. hFedF's learned client embeddings).
  """
  update: Callable[[PyTree, ClientResult, jax.Array], tuple[PyTree, dict]]
  eval_params: Callable[[PyTree, PyTree], PyTree]
  personalized: bool = False
  eval_clients: Callable[[PyTree, PyTree, jax.Array], PyTree] | None = None
  extras: Callable[[PyTree, PyTree], dict] = _no_extras


_CLIENT_FIELDS = frozenset(f.name for f in dataclasses.fields(ClientSide))
_SERVER_FIELDS = frozenset(f.name for f in dataclasses.fields(ServerSide))


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """A federated algorithm: its state, its client side, its server side.

  Attributes:
    name: its name (the registry's).
    init: `init(key) -> (server_state, client_state)`; client_state is a
      per-client persistent pytree with leading axis N (or None), carried
      across rounds.
    client: what each client does (`ClientSide`).
    server: what the server does and what is evaluated (`ServerSide`).
    frozen: `frozen(key) ->` shared-frozen parameters (module docstring), or
      None; called once per run, eagerly (it may read a pretrained file; jit
      inside).
    model: the model its parameters are evaluated with where it is not the
      run's (None: the run's), e.g. the run's ViT with FedSDAF's adapters.
  """
  name: str
  init: Callable[[jax.Array], tuple[PyTree, PyTree]]
  client: ClientSide
  server: ServerSide
  frozen: Callable[[jax.Array], PyTree] | None = None
  model: Any = None

  def replace(self, **changes) -> "Algorithm":
    """This algorithm with fields replaced by name, on whichever part holds
    them (`Algorithm`, `ClientSide` or `ServerSide`: their names differ), as
    a family member changes its root: `fedavg(...).replace(loss=..., update=...)`."""
    own = {k: v for k, v in changes.items()
           if k not in _CLIENT_FIELDS | _SERVER_FIELDS}
    client = {k: v for k, v in changes.items() if k in _CLIENT_FIELDS}
    server = {k: v for k, v in changes.items() if k in _SERVER_FIELDS}
    if client:
      own["client"] = dataclasses.replace(self.client, **client)
    if server:
      own["server"] = dataclasses.replace(self.server, **server)
    return dataclasses.replace(self, **own)

  def initial_rows(self, key: jax.Array, ids: jax.Array) -> PyTree:
    """Rows `ids` of the initial client state (`client.init_rows`, else
    `init`'s)."""
    if self.client.init_rows is not None:
      return self.client.init_rows(key, ids)
    return jax.tree.map(lambda a: a[ids], self.init(key)[1])

  def eval_rows(self, server: PyTree, rows: PyTree, ids: jax.Array) -> PyTree:
    """The evaluated parameters [k, ...] of clients `ids` (personalized),
    whose client state rows are `rows`."""
    if self.server.eval_clients is not None:
      return self.server.eval_clients(server, rows, ids)
    return self.server.eval_params(server, rows)


def with_frozen(frozen: PyTree, params: PyTree) -> PyTree:
  """The model's parameters: the shared-frozen entries plus the trained ones."""
  if frozen is None:
    return params
  overlap = set(frozen) & set(params)
  if overlap:
    raise ValueError(f"frozen and trained parameters both hold {sorted(overlap)}: "
                     "the frozen pytree must name entries the trained one lacks")
  return {**frozen, **params}


class Recipe:
  """An algorithm as a function of the values its runs differ in.

  Runs whose programs have the same shapes (other seeds, targets, splits,
  learning rates, input normalizations) share one compiled program when
  everything they differ in is an argument of it, not a constant baked into
  it. A Recipe says how: `make(values) -> (Algorithm, model)` builds the
  algorithm and its model from a pytree of arrays `values` (called inside
  the engine's traced programs, so `values` are tracers there), and `key`
  is what the programs are cached by: two recipes with equal keys make the
  same programs for values of equal shapes.

  `template` is `make(values)` for one run's concrete values: what the
  engine reads outside a trace (the algorithm's name, whether it is
  pooled or personalized, its state's shapes, its shared-frozen
  parameters). `values` are that run's values (None: the recipe has none,
  `Recipe.of`).
  """

  def __init__(self, key, make: Callable[[Any], tuple[Algorithm, Any]],
               values: Any = None, owner: Any = None, template=None):
    self.key = key
    self._make = make
    self.values = values
    self.template = template if template is not None else make(values)
    self.owner = owner if owner is not None else key

  @classmethod
  def of(cls, alg: "Algorithm | Recipe", model=None) -> "Recipe":
    """`alg` itself if it is a Recipe; else the recipe of an Algorithm
    built by hand: no values, everything a constant of its programs
    (cached per Algorithm and model object, as before recipes)."""
    if isinstance(alg, Recipe):
      return alg
    model = alg.model or model
    return cls((alg, model), lambda values: (alg, model), None, owner=alg)

  @property
  def alg(self) -> Algorithm:
    return self.template[0]

  @property
  def model(self):
    return self.template[1]

  def make(self, values) -> tuple[Algorithm, Any]:
    """(Algorithm, model) of `values` (the template where the recipe has
    none)."""
    if self.values is None:
      return self.template
    return self._make(values)

  def __hash__(self) -> int:
    return hash(self.key)

  def __eq__(self, other) -> bool:
    return isinstance(other, Recipe) and self.key == other.key

  def __repr__(self) -> str:
    return f"Recipe({self.alg.name})"
