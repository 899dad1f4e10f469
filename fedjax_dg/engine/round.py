"""One round, as the scan runs it (`make_round`), and the keys and cohorts it
draws, computed ahead on the host where the "host" placement needs them.

Round body (inside the scan, nothing crosses to the host):

    ids    = the cohort (all N clients, or m drawn without replacement)
    start  = algorithm.client.start(server, client_state[ids], ids)  [m, ...]
    local  = the cohort's local training (client.update: each client its
             own steps), each client with its ClientContext   [m, ...],
             then its end of round (algorithm.client.end: new state row,
             message)
    server = algorithm.server.update(server, ClientResult(...), key)

(the full contract: `algorithms.base`). How the client axis is mapped is
`layout`'s; where the round's input comes from (the whole federation, or a
`Cohort` gathered on the host) is `placement`'s.

Randomness: one root key; round key = fold_in(root, r); client key =
fold_in(round key, client id), so results do not depend on the mapping, the
placement or the number of devices (`round_keys`, `client_keys`; the host
draws the same cohorts and rows ahead: `host_schedule`, `step_rows`).
How a local pass orders a client's examples is `shuffle` ("sort", the
default, or "feistel": draws that do not grow with the largest client;
`client.update.local_training`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_dg import tree
from fedjax_dg.algorithms.base import (Algorithm, ClientContext, ClientData,
                                      ClientResult)
from fedjax_dg.client.lanes import packed_update
from fedjax_dg.client.update import local_steps, local_training, train_client
from fedjax_dg.engine.layout import Layout, group_trainer, sequential
from fedjax_dg.engine.settings import EngineConfig

# The key of a client's end of round (`ClientEnd`): fold_in(client key,
# END_STREAM), a stream the local update (split(client key)) never uses (the
# bytes of "aux", the hook's old name: the keys stay as they were).
END_STREAM = 0x617578


class Cohort(NamedTuple):
  """One round's cohort gathered on the host (the "host" placement): the round
  function's per-round input in place of the whole federation (stacked over
  the rounds of a chunk, [L, ...], as the scan's input)."""
  ids: Any    # int32 [m]: the cohort's client ids (`cohort_ids`)
  slots: Any  # int32 [m]: their rows in the chunk's client-state table
  data: Any   # ClientArrays [m, S, ...]: their examples, padded to S (the
              # largest client), or (host_gather="rows") the S = steps x B
              # rows their local steps read, in read order; n: their counts


def round_keys(root_key: jax.Array, r) -> jax.Array:
  """[3] keys of round r: the cohort's, the clients', the server's."""
  return jax.random.split(jax.random.fold_in(root_key, r), 3)


def client_keys(clients_key: jax.Array, ids: jax.Array) -> jax.Array:
  """[m] keys of the cohort's clients `ids` (their local training's)."""
  return jax.vmap(jax.random.fold_in, (None, 0))(clients_key, ids)


def cohort_ids(cohort_key: jax.Array, num_clients: int, m: int) -> jax.Array:
  """The round's cohort: m of the N clients drawn without replacement (all of
  them, in order, when m = N)."""
  if m < num_clients:
    return jax.random.choice(cohort_key, num_clients, (m,), replace=False)
  return jnp.arange(num_clients)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def cohort_schedule(root_key: jax.Array, r0, length: int, num_clients: int,
                    m: int) -> jax.Array:
  """[length, m] the cohorts of rounds r0 .. r0 + length - 1: the same draws
  (keys and calls) as the rounds themselves make, so the host can gather a
  chunk's data ahead of it."""
  return jax.vmap(lambda r: cohort_ids(round_keys(root_key, r)[0], num_clients,
                                       m))(r0 + jnp.arange(length))


def host_schedule(root_key: jax.Array, r0: int, rounds: int, num_clients: int,
                  m: int) -> np.ndarray:
  """int32 [rounds - r0, m] on the host: the cohorts of rounds r0 .. rounds-1,
  drawn in blocks of rounds of one size (one compile for every run length;
  a draw holds N random values per round)."""
  span = max(1, min(1024, (1 << 22) // num_clients))
  blocks = [np.asarray(cohort_schedule(root_key, r, span, num_clients, m))
            for r in range(r0, rounds, span)]
  return np.concatenate(blocks)[:rounds - r0].astype(np.int32)


def example_arrays(data) -> tuple:
  """(x, y) of ClientArrays-like `data` [k, S, ...], and its domains d where
  it carries them (`ClientSide.domains`): what a client's batches read,
  row by row (`Batch`)."""
  return (data.x, data.y) + (() if data.d is None else (data.d,))


def batch_reader(alg: Algorithm, cfg: EngineConfig) -> str | None:
  """Why a round of `alg` under `cfg` reads more of a client than its local
  steps' batches (a sentence), or None: it reads only those, steps x B rows
  (`placement.resolve_gather`)."""
  if not (alg.client.local_steps or cfg.local_steps):
    return ("its clients train epochs (train.local_steps=0): every example, "
            "E times")
  if alg.client.end is not None and alg.client.end.reads_data:
    return (f"{alg.name}'s client end of round reads each cohort member's "
            "whole training data after its local steps")
  return None


def training_of(alg: Algorithm, cfg: EngineConfig) -> Callable:
  """local_training(n_max=..., in_order=...) -> the clients' `LocalTraining`
  under `alg` and `cfg`."""
  return functools.partial(local_training, alg.client.loss,
                           alg.client.optimizer, batch_size=cfg.batch_size,
                           epochs=cfg.epochs,
                           steps=alg.client.local_steps or cfg.local_steps,
                           rounds=cfg.rounds, shuffle=cfg.shuffle)


def step_rows(alg: Algorithm, cfg: EngineConfig) -> Callable:
  """Jitted `rows(root_key, rounds [L], ids [L, m], n [L, m], n_max)` ->
  int32 [L, m, steps x B]: the rows (of its padded view, width `n_max`) each
  cohort member's local steps read in rounds `rounds`, in read order: the
  same keys and permutation draws as the rounds make (`client_keys`,
  `LocalTraining.rows`), so the host gathers them ahead of the chunk."""
  training = training_of(alg, cfg)

  def rows(root_key, rounds, ids, n, n_max):
    read = training(n_max=n_max).rows
    return jax.vmap(lambda r, i, c: jax.vmap(read)(
        c, client_keys(round_keys(root_key, r)[1], i)))(rounds, ids, n)

  return jax.jit(rows, static_argnums=(4,))


def make_round(alg: Algorithm, cfg: EngineConfig, num_clients: int,
               layout: Layout | None = None):
  """round(carry, r, train, root_key, frozen, rounds=None) -> (carry,
  metrics); carry = (server, clients); `frozen` = the algorithm's
  shared-frozen params; `rounds` = the run's length (traced by the chunk
  program, so one compile serves every length; None: `cfg.rounds`).

  `train` is the whole federation (ClientArrays [N, ...], the "device"
  placement: the round draws its cohort and gathers it, `clients` is the
  [N, ...] client state) or this round's `Cohort` (the "host" placement:
  gathered on the host, `clients` is the chunk's table of client-state rows,
  read and written at `Cohort.slots`). With `cfg.host_gather="rows"`
  (`placement.resolve_gather`) a Cohort holds each member's rows in read order
  (`step_rows`) and its local training reads them so (`in_order`)."""
  m = cfg.cohort_size or num_clients
  layout = layout or Layout.of(cfg, num_clients)
  steps = alg.client.local_steps or cfg.local_steps
  in_order = cfg.host_gather == "rows"
  training = functools.partial(training_of(alg, cfg), in_order=in_order)

  def context(shared, cid, start, row, extra):
    r, common, frozen = shared
    return ClientContext(id=cid, round=r, start=start, state=row, extra=extra,
                         shared=common, frozen=frozen)

  end = alg.client.end

  def end_one(shared, data, p, trained, n, key, cid, start, row, extra):
    """(row, message) of one client (`ClientEnd`); its examples only where
    the hook reads them."""
    x, y = data[:2] if end.reads_data else (None, None)
    client_data = ClientData(None if x is None else x[p],
                             None if y is None else y[p], n,
                             local_steps(n, cfg.batch_size, cfg.epochs, steps))
    return end.fn(context(shared, cid, start, row, extra), trained,
                  client_data, jax.random.fold_in(key, END_STREAM))

  def train_one(shared, data, p, start, n, key, cid, row, extra):
    trained, loss = train_client(
        training(n_max=data[0].shape[1]), start,
        lambda idx: tuple(a[p, idx] for a in data),
        n, key, context(shared, cid, start, row, extra),
        own_steps=cfg.skip_idle_steps)
    row, message = (None, None) if end is None else end_one(
        shared, data, p, trained, n, key, cid, start, row, extra)
    return trained, loss, row, message

  def packed(lanes):
    def train(shared, data, pos, start, n, key, cid, row, extra):
      trained, losses = packed_update(
          training(n_max=data[0].shape[1]), lanes, start,
          lambda c, idx: tuple(a[pos[c], idx] for a in data), n, key,
          (cid, start, row, extra), lambda r: context(shared, *r))
      row, message = (None, None) if end is None else sequential(
          end_one, lanes)(shared, data, pos, trained, n, key, cid, start,
                          row, extra)
      return trained, losses, row, message
    return train

  mapped = layout.mapper()(group_trainer(
      train_one, packed, vmapped=layout.vmapped,
      skip_idle=cfg.skip_idle_steps, map_batch_size=cfg.map_batch_size,
      lanes=cfg.vmap_lanes or layout.group(m)))

  def round_fn(carry, r, train, root_key, frozen, rounds=None):
    server, clients = carry
    rounds = cfg.rounds if rounds is None else rounds
    cohort_key, client_key, server_key = round_keys(root_key, r)
    # Client i of the cohort reads its examples at arrays[pos[i]] (in place:
    # no copy of the cohort's padded examples) and has n[i] of them.
    slots = None  # None: every client of `clients`, in order
    if in_order and not isinstance(train, Cohort):
      raise ValueError("host_gather='rows' trains on a Cohort of the rows "
                       "gathered on the host (the 'host' placement)")
    if isinstance(train, Cohort):
      ids, slots, data = train
      arrays, pos, n = example_arrays(data), jnp.arange(m), data.n
    else:
      arrays = example_arrays(train)
      if m < num_clients:
        ids = slots = cohort_ids(cohort_key, num_clients, m)
      else:
        ids = jnp.arange(num_clients)
      pos, n = ids, jnp.take(train.n, ids)
    if alg.client.domains and len(arrays) < 3:
      raise ValueError(f"{alg.name}'s objective reads each example's domain "
                       "(ClientSide.domains), but its training arrays carry "
                       "none: train on FederatedData.with_domains() (as "
                       "engine.run does)")
    rows = clients if slots is None else tree.take(clients, slots)
    start = alg.client.start(server, rows, ids)
    chex.assert_tree_shape_prefix(
        start, (m,), custom_message=f"{alg.name}'s client.start must give the "
        f"cohort's {m} clients their parameters stacked as [{m}, ...]")
    extra = alg.client.extra(start, rows, ids)
    shared = (r, alg.client.shared(server), frozen)
    keys = client_keys(client_key, ids)
    trained, losses, new_rows, message = mapped(shared, arrays, pos, start, n,
                                                keys, ids, rows, extra)
    if end is None:  # the rows stay as they are
      new_rows = rows
    clients = new_rows if slots is None else tree.put(clients, slots, new_rows)
    result = ClientResult(ids=ids, round=r, start=start, params=trained,
                          num_examples=n, loss=losses, message=message,
                          rounds=rounds)
    server, metrics = alg.server.update(server, result, server_key)
    w = n.astype(jnp.float32)
    metrics = dict(metrics, loss=jnp.sum(losses * w) / jnp.sum(w), cohort=ids)
    return (server, clients), metrics

  return round_fn
