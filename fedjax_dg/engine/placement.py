"""Where client data and per-client state live (`train.placement`), decided
once per run (`resolve_placement`, `resolve_gather`) and kept by one of two
stores that the loop drives chunk by chunk:

* "device" (`DeviceStore`): the padded federation and the [N, ...] client
  state on the devices for the whole run; every round draws and gathers its
  cohort there;
* "host" (`HostStore`): packed on the host; per chunk of rounds the cohorts, a
  pure function of the key (`round.host_schedule`), are gathered and sent
  while the previous chunk runs, the cohorts' state rows go to the devices
  and back (`take_rows`, `put_rows`). With fixed local steps "host" gathers
  only the rows the steps read, their permutations drawn ahead on the host
  like the cohorts (`host_gather`, `resolve_gather`, `round.step_rows`).

"auto" picks (`resolve_placement`). Both give the same numbers
(docs/architecture.md). Whether the data are streamed is the packed data's
own answer (`PackedClients.streamed`): the engine imports no data module.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.engine.checkpoint import checkpoint_bytes
from fedjax_dg.engine.layout import Layout
from fedjax_dg.engine.round import Cohort, batch_reader, host_schedule
from fedjax_dg.engine.settings import EngineConfig, eval_batch
from fedjax_dg.errors import ConfigError

# "auto" keeps the whole run on the device while the padded federation and
# the scan carry take at most this share of one device's memory (the host's
# on CPU): the rest is for the round's activations, the cohort's gathered
# copies, the carry's donated copy and evaluation.
AUTO_DEVICE_SHARE = 0.25


def device_capacity() -> int:
  """Bytes of memory of one device: its allocator's limit on GPU / TPU, the
  host's physical memory on CPU (XLA:CPU devices share it)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_placement_bytes(alg: Algorithm, train, val) -> int:
  """What the "device" placement holds for the whole run: the padded training
  and id-validation examples (`PackedClients.nbytes(padded=True)`) and the
  scan carry (server and [N, ...] client state)."""
  return (train.nbytes(padded=True) + val.nbytes(padded=True)
          + checkpoint_bytes(alg))


def resolve_placement(placement: str, alg: Algorithm, train, val) -> str:
  """"auto": "device" while `device_placement_bytes` is at most
  AUTO_DEVICE_SHARE of `device_capacity()`, else "host". Streamed data
  (`PackedClients.streamed`) always run on the host: "device" would hold
  every example."""
  if train.streamed:
    if placement == "device":
      raise ConfigError(
          "train.placement='device' holds every client's examples on the "
          "device for the whole run, but the data are streamed "
          "(data.streaming: read per chunk of rounds, never all at once): use "
          "train.placement='host' (or 'auto'), or data.streaming='off' if "
          "the data fit in memory")
    if alg.client.pooled:
      raise ConfigError(
          f"{alg.name} trains one client holding every training example, so "
          "each of its rounds would read the whole streamed dataset "
          "(data.streaming) into memory: leave it out of a streamed run, or "
          "use data.streaming='off' if the data fit in memory")
    return "host"
  if placement != "auto":
    return placement
  need = device_placement_bytes(alg, train, val)
  return "device" if need <= AUTO_DEVICE_SHARE * device_capacity() else "host"


def resolve_gather(cfg: EngineConfig, alg: Algorithm, placement: str,
                   width: int) -> EngineConfig:
  """`cfg` with `host_gather` resolved for a run on `placement` (resolved)
  whose clients are padded to `width` examples: "rows" (the host gathers only
  the rows each cohort member's local steps read, steps x B in read order,
  `PackedClients.gather(rows=...)`) or "clients" (its whole client, padded to
  `width`).

  A round reads only its batches' rows when the steps are fixed
  (`alg.client.local_steps` or `train.local_steps`) and nothing else reads the
  client's examples: the loss sees batches, a `ClientEnd` that reads data
  (SCAFFOLD's option I, FedDG-GA, FedIIR, FedSDAF's GA, FedCCRL's CCDT,
  CCST's and ELCFS's bank refresh) the whole client (`round.batch_reader`). "auto": "rows" there, on the
  host, where steps x B < `width` (fewer rows); else "clients". "rows"
  where a round reads more: a ConfigError. The "device" placement gathers
  nothing on the host: "clients"."""
  why = batch_reader(alg, cfg)
  if cfg.host_gather == "rows" and why is not None:
    raise ConfigError(
        f"train.host_gather='rows' gathers only the rows a round's local "
        f"steps read, but {why}: use train.host_gather='auto' or 'clients'")
  steps = alg.client.local_steps or cfg.local_steps
  rows = placement == "host" and why is None and (
      cfg.host_gather == "rows" or (cfg.host_gather == "auto"
                                    and steps * cfg.batch_size < width))
  return dataclasses.replace(cfg, host_gather="rows" if rows else "clients")


def take_rows(clients, idx):
  """Rows `idx` of every leaf of the host (numpy) client state."""
  return jax.tree.map(lambda a: a[idx], clients)


def put_rows(clients, idx, table) -> None:
  """clients[idx] = table[:len(idx)], in place (host numpy)."""
  for a, t in zip(jax.tree.leaves(clients), jax.tree.leaves(table)):
    a[idx] = np.asarray(t)[:len(idx)]


def host_rows(init_rows: Callable, key, num_clients: int, block: int):
  """The initial [N, ...] client state on the host (numpy), built on the
  device `block` rows at a time (the last block padded: one compile)."""
  shapes = jax.eval_shape(init_rows, key, jnp.arange(block))
  out = jax.tree.map(lambda s: np.empty((num_clients,) + s.shape[1:], s.dtype),
                     shapes)
  for start in range(0, num_clients if jax.tree.leaves(out) else 0, block):
    ids = np.minimum(np.arange(start, start + block), num_clients - 1)
    put_rows(out, np.arange(start, min(start + block, num_clients)),
             jax.device_get(init_rows(key, jnp.asarray(ids))))
  return out


def pad_clients(arrays, multiple: int):
  """Pads the per-client example axis of ClientArrays-like (x, y, n) to a
  multiple: (x, y, mask) numpy arrays (id-validation examples to evaluate)."""
  x, y, n = (np.asarray(a) for a in (arrays.x, arrays.y, arrays.n))
  v = x.shape[1]
  total = max(multiple, -(-v // multiple) * multiple)
  x = np.pad(x, [(0, 0), (0, total - v)] + [(0, 0)] * (x.ndim - 2))
  y = np.pad(y, [(0, 0), (0, total - v)])
  mask = (np.arange(total)[None, :] < n[:, None]).astype(np.float32)
  return x, y, mask


def put_cohorts(layout: Layout, ids: np.ndarray, slots: np.ndarray,
                gather: Callable) -> Cohort:
  """A chunk's per-round cohorts (the "host" placement) on the devices:
  `ids`, `slots` int [L, m] and their examples `gather(members)` ->
  ClientArrays [L, len(members), ...] of the cohort positions `members`
  (a slice). Sharded over the cohort axis where m divides the mesh: each
  device's share is gathered on its own (`jax.make_array_from_callback`),
  so with several processes each one reads only the examples of the
  cohort members its devices train; else every device gets the whole
  cohort."""
  mesh = layout.mesh
  index = Cohort(np.asarray(ids, np.int32), np.asarray(slots, np.int32),
                 None)
  m = index.ids.shape[1]
  if mesh is None or m % mesh.size:
    whole = index._replace(data=gather(slice(None)))
    return jax.device_put(whole, None if mesh is None
                          else NamedSharding(mesh, P()))
  sharding = NamedSharding(mesh, P(None, "clients"))
  probe = gather(slice(0, 0))  # the leaves' shapes with 0 members
  parts = {}

  def part(members: slice):
    key = members.indices(m)
    if key not in parts:  # one gather per member slice, for every leaf
      parts[key] = gather(members)
    return parts[key]

  leaves, structure = jax.tree.flatten(probe)

  def place(leaf: int):
    shape = (*leaves[leaf].shape[:1], m, *leaves[leaf].shape[2:])
    return jax.make_array_from_callback(
        shape, sharding, lambda i: jax.tree.leaves(part(i[1]))[leaf])

  data = jax.tree.unflatten(structure, [place(k) for k in range(len(leaves))])
  return jax.device_put(index, NamedSharding(mesh, P()))._replace(data=data)


class EvalBlocks(NamedTuple):
  """The "host" placement's evaluation input: clients in blocks of `size`,
  their id-validation examples gathered per block from `val` (None: none)."""
  val: Any          # PackedClients, or None without id-validation examples
  num_clients: int
  size: int
  multiple: int     # examples per client padded to a multiple of it


class DeviceStore:
  """The "device" placement: the padded federation ([N, N_max, ...]) and the
  [N, ...] client state (in the scan carry) on the devices for the whole run;
  every round draws and gathers its cohort there."""

  def __init__(self, progs, train, val, cfg: EngineConfig, values=None):
    """`progs`: the run's `programs.Programs`; `train` / `val`: the padded
    views (ClientArrays [N, N_max, ...]); `values`: the run's recipe
    values (`algorithms.base.Recipe`)."""
    self.progs, self.values = progs, values
    self.train = progs.layout.put_clients(train)
    # No id-validation examples at all (data.val_fraction = 0): no id
    # evaluation; the history then has no id_acc (reports show "-").
    self.val = (tuple(map(jnp.asarray, pad_clients(
        val, eval_batch(cfg, val.x.shape[1])))) if np.any(val.n) else None)

  def initial(self, key):
    return self.progs.init(key, self.values)

  def placed(self, restored):
    return self.progs.layout.put_carry(jax.tree.map(jnp.asarray, restored))

  def begin(self, state, r0, length):
    del r0, length
    return state, self.train

  def prefetch(self, r0, length):
    del r0, length

  def end(self, state, carry):
    del state
    return carry

  def on_device(self, state):
    """(server, client state) as a global model's evaluation reads it."""
    return state

  def evaluate(self, state, frozen, ood, details=False):
    return self.progs.eval(state, frozen, self.val, ood, details=details,
                           values=self.values)


class HostStore:
  """The "host" placement: client examples stay packed on the host and the
  [N, ...] client state is numpy there. Per chunk of L rounds the host reads
  the chunk's cohorts from the schedule (`round.host_schedule`, computed
  once), gathers their examples ([L, m, S, ...], S = the largest client; with
  `host_gather="rows"` S = steps x B: the rows their steps read, from
  `round.step_rows`) and the rows of their union's state (a table of min(N,
  eval_every * m) rows) for the devices (`put_cohorts`); the scan reads and
  writes the table at `Cohort.slots`, and the rows go back to the host after
  the chunk. The next chunk's examples are gathered and sent while the
  current chunk runs (`prefetch`)."""

  def __init__(self, progs, train, val, cfg: EngineConfig,
               root_key: jax.Array, r0: int, values=None):
    """`progs`: the run's `programs.Programs`; `train` / `val`: the packed
    clients (`PackedClients`); the schedule from round `r0`; `values`: the
    run's recipe values."""
    self.progs, self.train, self.values = progs, train, values
    n = train.num_clients
    m = cfg.cohort_size or n
    self.table_rows = min(n, cfg.eval_every * m)
    self.schedule = host_schedule(root_key, r0, cfg.rounds, n, m)
    self.r_first = r0
    self.by_rows = cfg.host_gather == "rows"
    # The rows are drawn on the host's CPU (the key's device), not queued
    # on an accelerator behind the chunk that runs while the next is read.
    self.rows_key = jax.device_put(root_key,
                                   jax.local_devices(backend="cpu")[0])
    # Evaluation: as many clients at a time as a chunk's table holds (all of
    # them for a pooled run, whose one training "client" is not val's).
    v = val.num_clients
    self.blocks = EvalBlocks(val if val.n.any() else None, v,
                             min(v, cfg.eval_every * (cfg.cohort_size or v)),
                             eval_batch(cfg, val.width))
    self.ahead = None  # (r0, length, Cohort on the devices, union)
    self.union = None

  def initial(self, key):
    return (self.progs.server_init(key, self.values),
            host_rows(lambda k, ids: self.progs.init_rows(k, ids, self.values),
                      key, self.train.num_clients, self.table_rows))

  def placed(self, restored):
    server, clients = restored
    writable = lambda a: a if a.flags.writeable else a.copy()
    return (self.progs.layout.put_carry(jax.tree.map(jnp.asarray, server)),
            jax.tree.map(writable, clients))

  def _gather(self, r0: int, length: int):
    ids = self.schedule[r0 - self.r_first:r0 - self.r_first + length]
    union, slots = np.unique(ids, return_inverse=True)
    rows = None
    if self.by_rows:  # the rows the chunk's local steps read, in read order
      rows = np.asarray(self.progs.step_rows(
          self.rows_key, np.arange(r0, r0 + length, dtype=np.int32), ids,
          self.train.n[ids], self.train.width))
    gather = lambda members: self.train.gather(
        ids[:, members], None if rows is None else rows[:, members])
    return r0, length, put_cohorts(
        self.progs.layout, ids, slots.reshape(ids.shape), gather), union

  def prefetch(self, r0, length):
    """Gathers and sends the chunk from r0 while the devices run the current
    one (JAX dispatch is asynchronous)."""
    self.ahead = self._gather(r0, length) if length > 0 else None

  def begin(self, state, r0, length):
    ahead, self.ahead = self.ahead, None
    if ahead is None or ahead[:2] != (r0, length):
      ahead = self._gather(r0, length)
    _, _, cohorts, self.union = ahead
    pad = np.full(self.table_rows - len(self.union), self.union[0])
    rows = take_rows(state[1], np.concatenate([self.union, pad]))
    return (state[0], self.progs.layout.put_carry(jax.device_put(rows))), cohorts

  def end(self, state, carry):
    server, table = carry
    put_rows(state[1], self.union, jax.device_get(table))
    return server, state[1]

  def on_device(self, state):
    """(server, None): a global model's evaluation reads no client state."""
    return state[0], None

  def evaluate(self, state, frozen, ood, details=False):
    return self.progs.eval_blocks(state, frozen, self.blocks, ood,
                                  details=details, values=self.values)
