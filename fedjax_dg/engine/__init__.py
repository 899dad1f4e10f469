"""The engine: a whole federated run as chunks of one jitted `lax.scan` over rounds.

Round body (inside the scan, nothing crosses to the host):

    ids    = the cohort (all N clients, or m drawn without replacement)
    start  = algorithm.client_start(server, client_state[ids], ids)   [m, ...]
    local  = the cohort's local training (client.update: each client its
             own steps), each client with its ClientContext   [m, ...]
             (+ algorithm.client_aux)
    server = algorithm.server_update(server, ClientResult(...), key)

(the full contract: `algorithms.base`).
Between chunks of `eval_every` rounds (and only there) the host evaluates, logs,
moves the progress bar and writes an orbax checkpoint. How the client axis is mapped
is a setting (`client_mapping`):

* "vmap": the cohort's clients batched (accelerators), packed into
  `vmap_lanes` lanes that each train several clients one after another, so
  unequal clients cost their real steps (`client.lanes`; 0 = from the
  clients' sizes, `resolve_lanes`);
* "map": `lax.map` over the clients, one at a time, each a loop of its own
  steps (the fast choice on XLA:CPU, where vmapped per-client convolutions
  become slow grouped convolutions); `map_batch_size` > 1 trains that many
  lanes side by side instead (bounded memory);
* "shard": the cohort axis sharded over a 1-D device mesh named "clients" with
  `jax.shard_map` (`lax.map` inside each shard on CPU, `vmap` on accelerators);
* "auto": "shard" with more than one device (a cohort that does not divide evenly
  is padded with copies of its first clients, whose results are dropped), else
  "vmap" on GPU/TPU and "map" on CPU.

On CPU, `use_cpu_devices` (called by the `fedjax-dg` command) splits the host into
one XLA device per core, so that "auto" runs clients on the cores concurrently:
on 2 cores a FedAvg round of the hFedF CNN ran 1.29x faster than one device
(docs/benchmarks.md).

Where client data and state live is `placement`: "device" (the padded
federation and the [N, ...] client state on the devices for the whole run) or
"host" (packed on the host; per chunk of rounds the cohorts, a pure function
of the key, are gathered and sent while the previous chunk runs, the cohorts'
state rows go to the devices and back; `_OnHost`); "auto" picks
(`resolve_placement`). Both give the same numbers (docs/architecture.md).
With fixed local steps "host" gathers only the rows the steps read, their
permutations drawn ahead on the host like the cohorts (`host_gather`,
`resolve_gather`, `step_rows`).
How a local pass orders a client's examples is `shuffle` ("sort", the
default, or "feistel": draws that do not grow with the largest client;
`client.update.local_training`).

Randomness: one root key; round key = fold_in(root, r); client key =
fold_in(round key, client id), so results do not depend on the mapping, the
placement or the number of devices.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import os
import time
from typing import Any, Callable, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fedjax_dg import evaluate, tree
from fedjax_dg.algorithms.base import (Algorithm, ClientContext, ClientData,
                                      ClientResult, with_frozen)
from fedjax_dg.client.lanes import packed_update
from fedjax_dg.client.update import (SHUFFLES, local_steps, local_training,
                                     train_client)
from fedjax_dg.data.images import is_streamed
from fedjax_dg.errors import (ConfigError, DataError, DiskFull, NonFiniteError,
                              is_disk_full)

PyTree = Any
MAPPINGS = ("auto", "vmap", "map", "shard")
PLACEMENTS = ("auto", "device", "host")
HOST_GATHERS = ("auto", "clients", "rows")
# "auto" keeps the whole run on the device while the padded federation and
# the scan carry take at most this share of one device's memory (the host's
# on CPU): the rest is for the round's activations, the cohort's gathered
# copies, the carry's donated copy and evaluation.
AUTO_DEVICE_SHARE = 0.25
# A streamed target split (data.streaming) is scored in blocks of at most
# this many bytes of images, read at each evaluation; an in-memory one (or a
# streamed one that fits in one block) is read and placed once.
OOD_BLOCK_BYTES = 1 << 28
# The final weight divergence of personalized models (all client pairs, an
# [n, n] Gram matrix per tensor) over at most this many clients: a seeded
# sample of them in larger federations.
DIVERGENCE_CLIENTS = 1000
# `client_aux`'s key: fold_in(client key, AUX_STREAM), a stream the local
# update (split(client key)) never uses.
AUX_STREAM = 0x617578


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """How a run is executed (the config's `train` section, plus `seed`)."""
  rounds: int = 200             # the hFedF papers' 200 rounds
  eval_every: int = 5
  epochs: int = 2
  local_steps: int = 0          # > 0: this many local steps instead of epochs
  batch_size: int = 64
  cohort_size: int = 0          # 0: every client every round
  client_mapping: str = "auto"
  map_batch_size: int = 1
  skip_idle_steps: bool = True  # a client's steps past its own count are not
                                # computed (False: computed and discarded)
  vmap_lanes: int = 0           # vmapped clients: lanes per device (0: auto,
                                # `resolve_lanes`)
  placement: str = "auto"       # where client data and state live: "device"
                                # (the whole run), "host" (gathered per chunk
                                # of rounds), "auto" (`resolve_placement`)
  host_gather: str = "auto"     # what "host" gathers per cohort member: its
                                # whole client ("clients") or only the rows
                                # its local steps read ("rows"); "auto"
                                # (`resolve_gather`)
  shuffle: str = "sort"         # each pass's order of a client's examples:
                                # "sort" (uniform draws over its padded
                                # width, sorted) or "feistel" (a keyed
                                # permutation evaluated only at the
                                # positions the steps read; other numbers)
                                # (`client.update.local_training`)
  seed: int = 0
  eval_batch_size: int = 500
  ood_eval_max: int = 2000      # target examples scored between chunks (0: all)
  features_max: int = 0         # target examples whose features the final
                                # model keeps (RunResult.features; t-SNE plot)
  progress: bool = True
  checkpoints_to_keep: int = 1  # the latest checkpoints kept on disk while a
                                # run goes (orbax max_to_keep; with
                                # checkpoint_dir)

  def validate(self, num_clients: int | None) -> None:
    """Every setting; the cohort against `num_clients` (None: not known yet,
    before the data is read)."""
    checks = [
        ("rounds", self.rounds >= 1, "an integer >= 1"),
        ("eval_every", self.eval_every >= 1, "an integer >= 1"),
        ("epochs", self.epochs >= 1, "an integer >= 1"),
        ("local_steps", self.local_steps >= 0, "0 (use epochs) or an integer >= 1"),
        ("batch_size", self.batch_size >= 1, "an integer >= 1"),
        ("cohort_size", 0 <= self.cohort_size <= (num_clients or
                                                  self.cohort_size),
         "0 (all clients) or " + (f"1..{num_clients}" if num_clients
                                  else "a positive count")),
        ("client_mapping", self.client_mapping in MAPPINGS, f"one of {MAPPINGS}"),
        ("placement", self.placement in PLACEMENTS, f"one of {PLACEMENTS}"),
        ("host_gather", self.host_gather in HOST_GATHERS,
         f"one of {HOST_GATHERS}"),
        ("shuffle", self.shuffle in SHUFFLES,
         f"one of {SHUFFLES} (docs/scale.md, \"Permutation draws\")"),
        ("map_batch_size", self.map_batch_size >= 1, "an integer >= 1"),
        ("vmap_lanes", self.vmap_lanes >= 0,
         "0 (auto: from the clients' sizes) or an integer >= 1"),
        ("eval_batch_size", self.eval_batch_size >= 1, "an integer >= 1"),
        ("ood_eval_max", self.ood_eval_max >= 0, "0 (all) or a positive count"),
        ("features_max", self.features_max >= 0, "0 (none) or a positive count"),
        ("checkpoints_to_keep", self.checkpoints_to_keep >= 1,
         "an integer >= 1 (the latest checkpoints kept)"),
    ]
    if self.seed < 0:
      raise ConfigError(f"invalid setting seed={self.seed!r}: allowed values are "
                        "integers >= 0")
    for field, ok, allowed in checks:
      if not ok:
        raise ConfigError(f"invalid setting train.{field}={getattr(self, field)!r}: "
                         f"allowed values are {allowed}")
    if num_clients is not None and num_clients < 1:
      raise ConfigError("the federation has zero clients: check the partition "
                       "settings (num_clients / d)")


@dataclasses.dataclass
class RunResult:
  algorithm: str
  server: PyTree
  clients: PyTree
  history: list[dict]            # one entry per evaluation (between chunks)
  round_metrics: dict[str, list] # per-round training metrics
  final: dict                    # last evaluation on the full target split
  seconds: float                 # wall time, every resumed part included
  # `features_max` target examples: {"features": [n, F], "labels": [n]} of
  # the evaluated model (`Model.features`); None when not asked for, without
  # a target split, or for a personalized algorithm (one model per client).
  features: dict | None = None


def checkpoint_bytes(alg: Algorithm) -> int:
  """Bytes of one checkpoint of `alg` (its scan carry: server and per-client
  state; shared-frozen parameters are not saved), from shapes alone."""
  carry = jax.eval_shape(alg.init, jax.random.key(0))
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(carry))


def checkpoints_held(keep: int) -> int:
  """The most checkpoints of one run on disk at once with `keep` kept: orbax
  deletes the oldest only after the next one is written and finalized, so
  `keep` + the one being written (tests/test_safety.py measures it)."""
  return keep + 1


def use_cpu_devices(count: int | None = None) -> None:
  """Splits the host CPU into `count` XLA devices (call before JAX runs anything).

  One XLA:CPU device runs one client at a time and keeps ~1.5 of 2 cores busy;
  with one device per core the "auto" mapping shards the cohort over them and
  clients run concurrently. `count` defaults to `$FEDJAX_DG_CPU_DEVICES`, else the
  cores this process may use. Changes nothing where XLA_FLAGS already sets
  `--xla_force_host_platform_device_count`, or once JAX has started (the device
  count is fixed then). Only the CPU backend is affected.
  """
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return
  if count is None:
    count = (int(os.environ.get("FEDJAX_DG_CPU_DEVICES") or 0)
             or len(os.sched_getaffinity(0)))
  if count < 1:
    raise ConfigError(f"use_cpu_devices(count={count}): allowed values are >= 1 "
                     "(FEDJAX_DG_CPU_DEVICES)")
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:  # JAX already started: keep its devices
    pass


def mesh_size(cohort: int) -> int:
  """Devices to shard a cohort over: as few as reach the least number of clients
  per device, ceil(cohort / min(cohort, devices)) (5 clients on 2 devices: 2, one
  padded slot; 10 on 8: 5, none). With several processes: every device (each
  process then takes part in the round and holds a copy of its results)."""
  if jax.process_count() > 1:
    return jax.device_count()
  per_device = -(-cohort // min(cohort, jax.device_count()))
  return min(k for k in range(1, cohort + 1) if -(-cohort // k) == per_device)


def resolve_mapping(mapping: str, cohort: int | None = None) -> str:
  if mapping != "auto":
    return mapping
  if cohort is not None and cohort > 1 and jax.device_count() > 1:
    return "shard"
  return "map" if jax.default_backend() == "cpu" else "vmap"


def client_mesh(size: int | None = None) -> jax.sharding.Mesh:
  """A 1-D mesh named "clients" over the first `size` devices (default: all)."""
  size = size or jax.device_count()
  return jax.make_mesh((size,), ("clients",),
                       axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:size])


def _sequential(f, map_batch_size: int = 1) -> Callable:
  """`lax.map` of `f(shared, data, *rows)` over the clients (the leading
  axis of `args`), `map_batch_size` of them vmapped at a time; `shared` and
  the training `data` are closed over."""
  batch = map_batch_size if map_batch_size > 1 else None
  return lambda shared, data, *args: jax.lax.map(
      lambda a: f(shared, data, *a), args, batch_size=batch)


def _batched(f) -> Callable:
  """vmap of `f(shared, data, *rows)` over the leading axis of `args`."""
  return lambda shared, data, *args: jax.vmap(
      f, in_axes=(None, None) + (0,) * len(args))(shared, data, *args)


def group_trainer(one: Callable, packed: Callable, *, vmapped: bool,
                  skip_idle: bool, map_batch_size: int,
                  lanes: int) -> Callable:
  """How one device's clients train: `(shared, data, pos, *args) -> outputs
  [g, ...]`, client i reading its rows at `data[pos[i]]`.

  `one(shared, data, *rows)` trains one client (a loop of its own steps with
  `skip_idle`, else the padded masked scan); `packed(lanes)(shared, data,
  *args)` trains them all in vmapped lanes (`client.lanes`). Clients
  `vmapped` (the "vmap" mapping, "shard" on accelerators): lanes with
  `skip_idle`, else every client vmapped and masked. Else (`lax.map`): one
  client at a time, or `map_batch_size` lanes (with `skip_idle`) /
  `map_batch_size` vmapped masked clients at a time."""
  if vmapped:
    return packed(lanes) if skip_idle else _batched(one)
  if skip_idle and map_batch_size > 1:
    return packed(map_batch_size)
  return _sequential(one, map_batch_size)


def client_mapper(mapping: str, mesh: jax.sharding.Mesh | None = None
                  ) -> Callable:
  """Returns `mapper(trainer)`: `mapper(trainer)(shared, data, pos, *args)`
  runs `trainer` (`group_trainer`) on the cohort (the leading axis of `pos`
  and `args`; client i's rows are `data[pos[i]]`, read in place) as one
  group, or, for "shard", on each device's share of the cohort (`mesh`,
  `client_mesh`; the cohort's rows gathered and sharded with it); `shared`
  is one copy for every client (replicated over the mesh)."""
  if mapping != "shard":
    return lambda trainer: trainer
  spec = NamedSharding(mesh, P("clients"))

  def sharded(trainer):
    def call(shared, data, pos, *args):
      m = pos.shape[0]
      args = (*tree.take(data, pos), *args)
      pad = -m % mesh.size  # padded slots repeat the first clients
      if pad:
        args = jax.tree.map(lambda a: jnp.concatenate([a, a[:pad]]), args)
      local = jnp.arange(m + pad) % ((m + pad) // mesh.size)
      mapped = jax.shard_map(
          lambda shared, x, y, *a: trainer(shared, (x, y), *a), mesh=mesh,
          in_specs=(P(),) + (P("clients"),) * (len(args) + 1),
          out_specs=P("clients"))
      out = mapped(shared, *jax.lax.with_sharding_constraint(
          (*args[:2], local, *args[2:]), spec))
      return jax.tree.map(lambda a: a[:m], out) if pad else out

    return call

  return sharded


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where a run's arrays live: the resolved client mapping and, for "shard", the
  mesh. Scan carries are replicated over the mesh (their sharding then stays the
  same from chunk to chunk: one compile per run); the training data is sharded
  over clients where the client count divides evenly."""
  mapping: str
  mesh: jax.sharding.Mesh | None = None

  @classmethod
  def of(cls, cfg: EngineConfig, num_clients: int) -> "Layout":
    m = cfg.cohort_size or num_clients
    mapping = resolve_mapping(cfg.client_mapping, m)
    if mapping != "shard":
      return cls(mapping)
    return cls(mapping, client_mesh(mesh_size(m)))

  def mapper(self) -> Callable:
    return client_mapper(self.mapping, self.mesh)

  @property
  def vmapped(self) -> bool:
    """Whether each device's clients are vmapped ("vmap"; "shard" off CPU)."""
    return self.mapping == "vmap" or (self.mapping == "shard" and
                                      jax.default_backend() != "cpu")

  def group(self, cohort: int) -> int:
    """Clients per device: the cohort, or its share of the mesh."""
    return cohort if self.mesh is None else -(-cohort // self.mesh.size)

  def put_carry(self, carry: PyTree) -> PyTree:
    if self.mesh is None:
      return carry
    return jax.device_put(carry, NamedSharding(self.mesh, P()))

  def put_clients(self, arrays: PyTree) -> PyTree:
    """Per-client arrays [N, ...] on the mesh (sharded over N if it divides).
    Each process fills only its own devices' shards from its host copy
    (`jax.make_array_from_callback`): no client data crosses processes here."""
    if self.mesh is None:
      return jax.tree.map(jnp.asarray, arrays)
    n = np.shape(jax.tree.leaves(arrays)[0])[0]
    sharding = NamedSharding(self.mesh,
                             P("clients") if n % self.mesh.size == 0 else P())

    def place(a):
      a = np.asarray(a)
      return jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])
    return jax.tree.map(place, arrays)

  def put_cohorts(self, ids: np.ndarray, slots: np.ndarray,
                  gather: Callable) -> Cohort:
    """A chunk's per-round cohorts (the "host" placement) on the devices:
    `ids`, `slots` int [L, m] and their examples `gather(members)` ->
    ClientArrays [L, len(members), ...] of the cohort positions `members`
    (a slice). Sharded over the cohort axis where m divides the mesh: each
    device's share is gathered on its own (`jax.make_array_from_callback`),
    so with several processes each one reads only the examples of the
    cohort members its devices train; else every device gets the whole
    cohort."""
    index = Cohort(np.asarray(ids, np.int32), np.asarray(slots, np.int32),
                   None)
    m = index.ids.shape[1]
    if self.mesh is None or m % self.mesh.size:
      whole = index._replace(data=gather(slice(None)))
      return jax.device_put(whole, None if self.mesh is None
                            else NamedSharding(self.mesh, P()))
    sharding = NamedSharding(self.mesh, P(None, "clients"))
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
    return jax.device_put(index, NamedSharding(self.mesh, P()))._replace(
        data=data)

  def to_one_device(self, tree_: PyTree) -> PyTree:
    """Evaluation runs on one device (a replicated program would run everywhere):
    this process's first device of the mesh. With several processes each one
    takes its own copy of the (replicated) carry and evaluates it alone: every
    process gets the same numbers without communicating."""
    if self.mesh is None:
      return tree_
    device = next(d for d in self.mesh.devices.flat
                  if d.process_index == jax.process_index())
    return jax.tree.map(lambda x: _local_copy(x, device), tree_)


def _local_copy(x, device) -> jax.Array:
  """`x` on `device`; a replicated array spread over several processes gives
  this process's copy (no transfer between processes)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return jax.device_put(x, device)
  assert x.is_fully_replicated, x.sharding
  return next(s.data for s in x.addressable_shards if s.device == device)


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


def resolve_lanes(cfg: EngineConfig, alg: Algorithm, counts) -> EngineConfig:
  """`cfg` with `vmap_lanes` = 0 (auto) resolved from the clients' example
  `counts` [N] where clients are vmapped (else unchanged): W = ceil(g * mean
  / max) of their local steps, g the clients per device. The packed loop then
  runs about as many iterations as the largest client has steps (what the
  masked scan runs) while it computes about the steps the cohort really
  takes (docs/architecture.md, "Unequal clients"); W = g, one lane per
  client, where all clients are equal."""
  num_clients = len(counts)
  layout = Layout.of(cfg, num_clients)
  if cfg.vmap_lanes or not cfg.skip_idle_steps or not layout.vmapped:
    return cfg
  steps = alg.local_steps or cfg.local_steps
  work = np.asarray(local_steps(np.asarray(counts), cfg.batch_size,
                                cfg.epochs, steps))
  g = layout.group(cfg.cohort_size or num_clients)
  lanes = math.ceil(g * work.mean() / work.max()) if work.max() else g
  return dataclasses.replace(cfg, vmap_lanes=min(max(lanes, 1), g))


def batch_reader(alg: Algorithm, cfg: EngineConfig) -> str | None:
  """Why a round of `alg` under `cfg` reads more of a client than its local
  steps' batches (a sentence), or None: it reads only those, steps x B rows
  (`resolve_gather`)."""
  if not (alg.local_steps or cfg.local_steps):
    return ("its clients train epochs (train.local_steps=0): every example, "
            "E times")
  if alg.client_aux is not None:
    return (f"{alg.name}'s client_aux reads each cohort member's whole "
            "training data after its local steps")
  return None


def resolve_gather(cfg: EngineConfig, alg: Algorithm, placement: str,
                   width: int) -> EngineConfig:
  """`cfg` with `host_gather` resolved for a run on `placement` (resolved)
  whose clients are padded to `width` examples: "rows" (the host gathers only
  the rows each cohort member's local steps read, steps x B in read order,
  `PackedClients.gather(rows=...)`) or "clients" (its whole client, padded to
  `width`).

  A round reads only its batches' rows when the steps are fixed
  (`alg.local_steps` or `train.local_steps`) and nothing else reads the
  client's examples: the loss sees batches, `client_aux` (SCAFFOLD,
  FedDG-GA, FedIIR, FedSDAF's GA, FedCCRL's CCDT, CCST's and ELCFS's bank
  refresh) the whole client (`batch_reader`). "auto": "rows" there, on the
  host, where steps x B < `width` (fewer rows); else "clients". "rows"
  where a round reads more: a ConfigError. The "device" placement gathers
  nothing on the host: "clients"."""
  why = batch_reader(alg, cfg)
  if cfg.host_gather == "rows" and why is not None:
    raise ConfigError(
        f"train.host_gather='rows' gathers only the rows a round's local "
        f"steps read, but {why}: use train.host_gather='auto' or 'clients'")
  steps = alg.local_steps or cfg.local_steps
  rows = placement == "host" and why is None and (
      cfg.host_gather == "rows" or (cfg.host_gather == "auto"
                                    and steps * cfg.batch_size < width))
  return dataclasses.replace(cfg, host_gather="rows" if rows else "clients")


def training_of(alg: Algorithm, cfg: EngineConfig) -> Callable:
  """local_training(n_max=..., in_order=...) -> the clients' `LocalTraining`
  under `alg` and `cfg`."""
  return functools.partial(local_training, alg.loss, alg.optimizer,
                           batch_size=cfg.batch_size, epochs=cfg.epochs,
                           steps=alg.local_steps or cfg.local_steps,
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
  """round(carry, r, train, root_key, frozen) -> (carry, metrics);
  carry = (server, clients); `frozen` = the algorithm's shared-frozen params.

  `train` is the whole federation (ClientArrays [N, ...], the "device"
  placement: the round draws its cohort and gathers it, `clients` is the
  [N, ...] client state) or this round's `Cohort` (the "host" placement:
  gathered on the host, `clients` is the chunk's table of client-state rows,
  read and written at `Cohort.slots`). With `cfg.host_gather="rows"`
  (`resolve_gather`) a Cohort holds each member's rows in read order
  (`step_rows`) and its local training reads them so (`in_order`)."""
  m = cfg.cohort_size or num_clients
  layout = layout or Layout.of(cfg, num_clients)
  steps = alg.local_steps or cfg.local_steps
  in_order = cfg.host_gather == "rows"
  training = functools.partial(training_of(alg, cfg), in_order=in_order)

  def context(shared, cid, start, row, extra):
    r, common, frozen = shared
    return ClientContext(id=cid, round=r, start=start, state=row, extra=extra,
                         shared=common, frozen=frozen)

  def aux_one(shared, data, p, trained, n, key, cid, start, row, extra):
    x, y = data
    return alg.client_aux(context(shared, cid, start, row, extra), trained,
                          ClientData(x[p], y[p], n, local_steps(
                              n, cfg.batch_size, cfg.epochs, steps)),
                          jax.random.fold_in(key, AUX_STREAM))

  def train_one(shared, data, p, start, n, key, cid, row, extra):
    x, y = data
    trained, loss = train_client(
        training(n_max=x.shape[1]), start, lambda idx: (x[p, idx], y[p, idx]),
        n, key, context(shared, cid, start, row, extra),
        own_steps=cfg.skip_idle_steps)
    aux = (None if alg.client_aux is None else
           aux_one(shared, data, p, trained, n, key, cid, start, row, extra))
    return trained, loss, aux

  def packed(lanes):
    def train(shared, data, pos, start, n, key, cid, row, extra):
      x, y = data
      trained, losses = packed_update(
          training(n_max=x.shape[1]), lanes, start,
          lambda c, idx: (x[pos[c], idx], y[pos[c], idx]), n, key,
          (cid, start, row, extra), lambda r: context(shared, *r))
      aux = None if alg.client_aux is None else _sequential(aux_one, lanes)(
          shared, data, pos, trained, n, key, cid, start, row, extra)
      return trained, losses, aux
    return train

  mapped = layout.mapper()(group_trainer(
      train_one, packed, vmapped=layout.vmapped,
      skip_idle=cfg.skip_idle_steps, map_batch_size=cfg.map_batch_size,
      lanes=cfg.vmap_lanes or layout.group(m)))

  def round_fn(carry, r, train, root_key, frozen):
    server, clients = carry
    cohort_key, client_key, server_key = round_keys(root_key, r)
    # Client i of the cohort reads its examples at arrays[pos[i]] (in place:
    # no copy of the cohort's padded examples) and has n[i] of them.
    slots = None  # None: every client of `clients`, in order
    if in_order and not isinstance(train, Cohort):
      raise ValueError("host_gather='rows' trains on a Cohort of the rows "
                       "gathered on the host (the 'host' placement)")
    if isinstance(train, Cohort):
      ids, slots, data = train
      arrays, pos, n = (data.x, data.y), jnp.arange(m), data.n
    else:
      arrays = (train.x, train.y)
      if m < num_clients:
        ids = slots = cohort_ids(cohort_key, num_clients, m)
      else:
        ids = jnp.arange(num_clients)
      pos, n = ids, jnp.take(train.n, ids)
    rows = clients if slots is None else tree.take(clients, slots)
    start = alg.client_start(server, rows, ids)
    chex.assert_tree_shape_prefix(
        start, (m,), custom_message=f"{alg.name}.client_start must give the "
        f"cohort's {m} clients their parameters stacked as [{m}, ...]")
    extra = alg.client_ctx(start, rows, ids)
    shared = (r, alg.client_shared(server), frozen)
    keys = client_keys(client_key, ids)
    trained, losses, aux = mapped(shared, arrays, pos, start, n, keys, ids,
                                  rows, extra)
    new_rows = (alg.client_end(rows, trained, aux) if alg.client_end_takes_aux
                else alg.client_end(rows, trained))
    clients = new_rows if slots is None else tree.put(clients, slots, new_rows)
    result = ClientResult(ids=ids, round=r, start=start, params=trained,
                          num_examples=n, loss=losses, aux=aux,
                          rounds=cfg.rounds if alg.needs_rounds else None)
    server, metrics = alg.server_update(server, result, server_key)
    w = n.astype(jnp.float32)
    metrics = dict(metrics, loss=jnp.sum(losses * w) / jnp.sum(w), cohort=ids)
    return (server, clients), metrics

  return round_fn


def _pad_clients(arrays, multiple: int):
  """Pads the per-client example axis of ClientArrays-like (x, y, n) to a multiple."""
  x, y, n = (np.asarray(a) for a in (arrays.x, arrays.y, arrays.n))
  v = x.shape[1]
  total = max(multiple, -(-v // multiple) * multiple)
  x = np.pad(x, [(0, 0), (0, total - v)] + [(0, 0)] * (x.ndim - 2))
  y = np.pad(y, [(0, 0), (0, total - v)])
  mask = (np.arange(total)[None, :] < n[:, None]).astype(np.float32)
  return x, y, mask


class _QuietDiskFull(logging.Filter):
  """Drops the tracebacks orbax logs (absl) from its writer threads when a
  write fails for want of space: the run ends with one `DiskFull` message
  naming the directory instead of hundreds of lines."""

  def filter(self, record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    return not (error is not None and is_disk_full(error))


class _Checkpointer:
  """Orbax checkpoints of the scan carry (as a flat list of leaves) + host
  history. A write that fails for want of space (ENOSPC, however orbax
  wraps it) is a `DiskFull` naming the directory."""

  def __init__(self, directory: str, keep: int = 1):
    import orbax.checkpoint as ocp
    self._ocp = ocp
    self._dir = os.path.abspath(directory)
    self._quiet = _QuietDiskFull()
    logging.getLogger("absl").addFilter(self._quiet)
    try:
      self.manager = ocp.CheckpointManager(
          self._dir,
          options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))
    except Exception as e:  # pylint: disable=broad-except
      logging.getLogger("absl").removeFilter(self._quiet)
      if is_disk_full(e):
        raise self._full(e, "creating the") from None
      raise

  def _full(self, error: Exception, doing: str) -> DiskFull:
    return DiskFull(
        f"{doing} checkpoint in {self._dir} failed: no space left on device "
        f"({type(error).__name__}). Free space on that disk; the complete "
        "checkpoints written before are kept")

  def latest(self) -> int | None:
    return self.manager.latest_step()

  @staticmethod
  def layout(carry) -> str:
    """The carry's structure, shapes and dtypes: a checkpoint is restored only
    into the same (leaves are stored as a flat list)."""
    leaves, treedef = jax.tree.flatten(carry)
    shapes = [f"{np.dtype(x.dtype)}{list(x.shape)}" for x in leaves]
    return f"{treedef} {shapes}"

  def save(self, step: int, carry, meta: dict) -> None:
    ocp = self._ocp
    # A copy of the meta too: the engine goes on appending to the history and
    # round metrics lists while the asynchronous write may not have read them
    # (a round-1 checkpoint holding round 2's entry doubled it on resume).
    meta = copy.deepcopy(dict(meta, layout=self.layout(carry)))
    # A copy of host (numpy) leaves: the write is asynchronous and the "host"
    # placement updates its client state in place.
    leaves = {str(i): np.array(x) if isinstance(x, np.ndarray) else np.asarray(x)
              for i, x in enumerate(jax.tree.leaves(carry))}
    # Asynchronous: the next chunk runs while this one is written (an
    # earlier write's failure surfaces here or at `close`).
    try:
      self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(leaves), meta=ocp.args.JsonSave(meta)))
    except Exception as e:  # pylint: disable=broad-except
      if is_disk_full(e):
        raise self._full(e, f"writing round {step}'s") from None
      raise

  def close(self, failing: bool = False) -> None:
    """Waits for the last write and closes; `failing` (an error is already
    on its way out): a failure here is not raised over it."""
    error = None
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      error = e
    try:
      self.manager.close()
    except Exception as e:  # pylint: disable=broad-except
      error = error or e
    finally:
      logging.getLogger("absl").removeFilter(self._quiet)
    if error is None or failing:
      return
    if is_disk_full(error):
      raise self._full(error, "finishing the last") from None
    raise error

  def _damaged(self, step: int, error: Exception) -> DataError:
    return DataError(
        f"the checkpoint of round {step} in {self.manager.directory} cannot be "
        f"read ({type(error).__name__}: {str(error)[:300]}): it is damaged, e.g. "
        "by a run killed while writing it or a full disk; delete that folder to "
        "start this algorithm's run over (the run directory's finished runs "
        "stay), or start a new run directory")

  def restore(self, step: int, like):
    ocp = self._ocp
    flat, treedef = jax.tree.flatten(like)
    abstract = {str(i): jax.ShapeDtypeStruct(np.shape(x), x.dtype)
                for i, x in enumerate(flat)}
    try:
      meta = self.manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # pylint: disable=broad-except
      raise self._damaged(step, e) from e
    if meta.get("layout") != self.layout(like):
      raise ConfigError(
          f"the checkpoint in {self.manager.directory} holds another state "
          "than this algorithm's (its structure, shapes or dtypes differ: a "
          "different algorithm, model or settings, or a checkpoint of an older "
          "fedjax_dg); resume with the settings it was written with, or start "
          "a new run directory")
    try:
      out = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract),
          meta=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      raise self._damaged(step, e) from e
    leaves = [np.asarray(out["state"][str(i)]) for i in range(len(flat))]
    return jax.tree.unflatten(treedef, leaves), out["meta"]  # on the host


@jax.jit
def _finite_leaves(tree_) -> jax.Array:
  """[leaves] bool: every value of the leaf is finite (integer leaves are)."""
  return jnp.stack([jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
                    else jnp.bool_(True) for x in jax.tree.leaves(tree_)])


LIKELY_CAUSES = ("a learning rate too large for the model (client.lr, the "
                 "algorithm's server_lr), a temperature of 0, or an input whose "
                 "normalization divides by ~0")


def check_finite(name: str, r0: int, metrics: dict[str, list], carry,
                 last_good: int | None, checkpoint_dir: str | None) -> None:
  """Stops a run whose chunk from round `r0` went non-finite (NonFiniteError):
  the first round whose training loss or a round metric is NaN / inf, or the
  server / client state leaf that is."""
  bad = []
  for key, values in metrics.items():
    arr = np.asarray(values, np.float64)
    rows = ~np.isfinite(arr.reshape(arr.shape[0], -1)).all(axis=1)
    if rows.any():
      label = "training loss" if key == "loss" else f"round metric {key!r}"
      bad.append((r0 + int(np.argmax(rows)), label))
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(carry)[0]]
  finite = np.asarray(_finite_leaves(carry)) if paths else np.ones(0, bool)
  where = ("server state", "client state")
  for path, ok in zip(paths, finite):
    if not ok:
      part = where[int(path.startswith("[1]"))]
      bad.append((r0 + len(metrics.get("loss", [0])) - 1,
                  f"{part} {path[3:] or '(whole)'}"))
      break
  if not bad:
    return
  round_, what = min(bad)
  kept = (f" The last good checkpoint (round {last_good}) is kept in "
          f"{checkpoint_dir}." if last_good is not None else "")
  raise NonFiniteError(
      f"{name}: the {what} went non-finite (NaN / inf) by round {round_}; the run "
      f"is stopped.{kept} Likely: {LIKELY_CAUSES}.")


def _to_host(metrics: dict) -> dict[str, list]:
  return {k: np.asarray(v).tolist() for k, v in metrics.items()}


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
  (`data.images.RecordImages`) always run on the host: "device" would hold
  every example."""
  if is_streamed(train.x):
    if placement == "device":
      raise ConfigError(
          "train.placement='device' holds every client's examples on the "
          "device for the whole run, but the data are streamed "
          "(data.streaming: read per chunk of rounds, never all at once): use "
          "train.placement='host' (or 'auto'), or data.streaming='off' if "
          "the data fit in memory")
    if alg.pooled:
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


class _OnDevice:
  """The "device" placement: the padded federation ([N, N_max, ...]) and the
  [N, ...] client state (in the scan carry) on the devices for the whole run;
  every round draws and gathers its cohort there."""

  def __init__(self, progs: Programs, train, val, cfg: EngineConfig):
    """`train` / `val`: the padded views (ClientArrays [N, N_max, ...])."""
    self.progs = progs
    self.train = progs.layout.put_clients(train)
    # No id-validation examples at all (data.val_fraction = 0): no id
    # evaluation; the history then has no id_acc (reports show "-").
    self.val = (tuple(map(jnp.asarray, _pad_clients(
        val, _eval_batch(cfg, val.x.shape[1])))) if np.any(val.n) else None)

  def initial(self, key):
    return self.progs.init(key)

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
    return self.progs.eval(state, frozen, self.val, ood, details=details)


class _OnHost:
  """The "host" placement: client examples stay packed on the host and the
  [N, ...] client state is numpy there. Per chunk of L rounds the host reads
  the chunk's cohorts from the schedule (`host_schedule`, computed once),
  gathers their examples ([L, m, S, ...], S = the largest client; with
  `host_gather="rows"` S = steps x B: the rows their steps read, from
  `step_rows`) and the rows of their union's state (a table of min(N,
  eval_every * m) rows) for the devices; the scan reads and writes the table at `Cohort.slots`, and the
  rows go back to the host after the chunk. The next chunk's examples are
  gathered and sent while the current chunk runs (`prefetch`)."""

  def __init__(self, progs: Programs, train, val, cfg: EngineConfig,
               root_key: jax.Array, r0: int):
    self.progs, self.train = progs, train
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
    self.blocks = _Blocks(val if val.n.any() else None, v,
                          min(v, cfg.eval_every * (cfg.cohort_size or v)),
                          _eval_batch(cfg, val.width))
    self.ahead = None  # (r0, length, Cohort on the devices, union)
    self.union = None

  def initial(self, key):
    return (self.progs.server_init(key),
            _host_rows(self.progs.init_rows, key, self.train.num_clients,
                       self.table_rows))

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
    return r0, length, self.progs.layout.put_cohorts(
        ids, slots.reshape(ids.shape), gather), union

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
    rows = _take_rows(state[1], np.concatenate([self.union, pad]))
    return (state[0], self.progs.layout.put_carry(jax.device_put(rows))), cohorts

  def end(self, state, carry):
    server, table = carry
    _put_rows(state[1], self.union, jax.device_get(table))
    return server, state[1]

  def on_device(self, state):
    """(server, None): a global model's evaluation reads no client state."""
    return state[0], None

  def evaluate(self, state, frozen, ood, details=False):
    return self.progs.eval_blocks(state, frozen, self.blocks, ood,
                                  details=details)


def _take_rows(clients, idx):
  return jax.tree.map(lambda a: a[idx], clients)


def _put_rows(clients, idx, table) -> None:
  """clients[idx] = table[:len(idx)], in place (host numpy)."""
  for a, t in zip(jax.tree.leaves(clients), jax.tree.leaves(table)):
    a[idx] = np.asarray(t)[:len(idx)]


def _host_rows(init_rows: Callable, key, num_clients: int, block: int):
  """The initial [N, ...] client state on the host (numpy), built on the
  device `block` rows at a time (the last block padded: one compile)."""
  shapes = jax.eval_shape(init_rows, key, jnp.arange(block))
  out = jax.tree.map(lambda s: np.empty((num_clients,) + s.shape[1:], s.dtype),
                     shapes)
  for start in range(0, num_clients if jax.tree.leaves(out) else 0, block):
    ids = np.minimum(np.arange(start, start + block), num_clients - 1)
    _put_rows(out, np.arange(start, min(start + block, num_clients)),
              jax.device_get(init_rows(key, jnp.asarray(ids))))
  return out


def run(alg: Algorithm, data, model, cfg: EngineConfig, *,
        checkpoint_dir: str | None = None,
        on_eval: Callable[[dict], None] | None = None) -> RunResult:
  """Runs `cfg.rounds` rounds of `alg` on `data` (a FederatedData).

  With `checkpoint_dir`, a checkpoint is written after every chunk (the latest
  `cfg.checkpoints_to_keep` stay) and the latest existing one is resumed from
  (same final parameters as an uninterrupted run).
  `cfg.placement` says where client data and state live (`_OnDevice`,
  `_OnHost`); both give the same numbers.
  """
  train = data.pooled().packed_train if alg.pooled else data.packed_train
  if alg.pooled:  # one pooled "client" trains every round
    cfg = dataclasses.replace(cfg, cohort_size=0)
  num_clients = train.num_clients
  cfg.validate(num_clients)
  cfg = resolve_lanes(cfg, alg, train.n)
  placement = resolve_placement(cfg.placement, alg, train, data.packed_val)
  cfg = resolve_gather(cfg, alg, placement, train.width)
  model = alg.model or model
  root_key = jax.random.key(cfg.seed)
  progs = _programs(alg, model, _program_key(cfg, alg), num_clients)
  run_chunk = progs.chunk
  ood_full, ood_sub = _ood_sets(data, cfg)

  init_key = jax.random.fold_in(root_key, 2**31 - 1)
  frozen = progs.frozen(init_key)
  history: list[dict] = []
  round_metrics: dict[str, list] = {}
  r0 = 0
  ckpt = (_Checkpointer(checkpoint_dir, cfg.checkpoints_to_keep)
          if checkpoint_dir else None)
  restored = None
  spent = 0.0  # seconds of the parts before a resume (the checkpoint's)
  if ckpt is not None and ckpt.latest() is not None:
    like = jax.eval_shape(alg.init, init_key)
    restored, meta = ckpt.restore(ckpt.latest(), like)
    r0, history, round_metrics = meta["round"], meta["history"], meta["round_metrics"]
    spent = float(meta.get("seconds", 0.0))
  if placement == "host":
    feed = _OnHost(progs, train, data.packed_val, cfg, root_key, r0)
  else:
    feed = _OnDevice(progs, data.pooled().train if alg.pooled else data.train,
                     data.val, cfg)
  state = feed.initial(init_key) if restored is None else feed.placed(restored)

  bar = _progress(cfg, alg.name, r0)
  t0 = time.perf_counter()
  failing = False
  try:
    while r0 < cfg.rounds:
      length = min(cfg.eval_every, cfg.rounds - r0)
      carry, inputs = feed.begin(state, r0, length)
      carry, metrics = run_chunk(carry, jnp.int32(r0), inputs, root_key,
                                 frozen, length)
      feed.prefetch(r0 + length, min(cfg.eval_every, cfg.rounds - r0 - length))
      chunk_metrics = _to_host(metrics)
      # Before anything is recorded or saved: the last good checkpoint stays.
      check_finite(alg.name, r0, chunk_metrics, carry,
                   ckpt.latest() if ckpt is not None else None, checkpoint_dir)
      state = feed.end(state, carry)
      r0 += length
      for k, v in chunk_metrics.items():
        round_metrics.setdefault(k, []).extend(v)
      train_loss = float(np.mean(round_metrics["loss"][-length:]))
      entry = dict(round=r0, train_loss=train_loss,
                   **feed.evaluate(state, frozen, ood_sub))
      history.append(entry)
      if on_eval is not None:
        on_eval(entry)
      if bar is not None:
        bar.update(length)
        bar.set_postfix({short: f"{entry[key]:.3f}" for short, key in
                         (("loss", "train_loss"), ("id", "id_acc"),
                          ("ood", "ood_acc")) if key in entry})
      if ckpt is not None:
        ckpt.save(r0, state, dict(round=r0, history=history,
                                  round_metrics=round_metrics,
                                  seconds=spent + time.perf_counter() - t0))
  except BaseException:
    failing = True
    raise
  finally:  # a stopped run still leaves complete checkpoints
    if bar is not None:
      bar.close()
    if ckpt is not None:
      ckpt.close(failing)
  final = dict(round=r0, **feed.evaluate(state, frozen, ood_full, details=True))
  server, clients = state
  feats = target_features(alg, model,
                          progs.layout.to_one_device(feed.on_device(state)),
                          progs.layout.to_one_device(frozen), data, cfg)
  return RunResult(alg.name, server, clients, history, round_metrics, final,
                   spent + time.perf_counter() - t0, feats)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _features(model, params, x, batch: int):
  xb = x.reshape((-1, batch) + x.shape[1:])
  return jax.lax.map(lambda b: model.features(params, b), xb).reshape(
      x.shape[0], -1)


def target_features(alg: Algorithm, model, carry, frozen, data,
                    cfg: EngineConfig) -> dict | None:
  """Features of up to `cfg.features_max` target examples (a seeded pick) under
  the evaluated model: `RunResult.features`."""
  tx, ty = data.target_x, np.asarray(data.target_y)  # tx: read at `pick`
  if cfg.features_max == 0 or tx.shape[0] == 0 or alg.personalized:
    return None
  n = min(cfg.features_max, tx.shape[0])
  pick = np.sort(np.random.default_rng(cfg.seed).choice(tx.shape[0], n,
                                                        replace=False))
  batch = _eval_batch(cfg, n)
  x, y, _ = evaluate.pad_to_multiple(tx[pick], ty[pick], batch)
  server, clients = carry
  params = with_frozen(frozen, jax.jit(alg.eval_params)(server, clients))
  feats = np.asarray(_features(model, params, jnp.asarray(x), batch))[:n]
  return dict(features=feats.astype(np.float32), labels=np.asarray(y[:n]))


def _program_key(cfg: EngineConfig, alg: Algorithm) -> EngineConfig:
  """The fields of `cfg` that shape the compiled programs (not the seed, ...;
  the rounds only where `alg.needs_rounds`)."""
  return EngineConfig(rounds=cfg.rounds if alg.needs_rounds else 1,
                      epochs=cfg.epochs, local_steps=cfg.local_steps,
                      batch_size=cfg.batch_size,
                      cohort_size=cfg.cohort_size, client_mapping=cfg.client_mapping,
                      map_batch_size=cfg.map_batch_size,
                      skip_idle_steps=cfg.skip_idle_steps,
                      vmap_lanes=cfg.vmap_lanes,
                      # only the row gather changes a program
                      host_gather=("rows" if cfg.host_gather == "rows"
                                   else "clients"),
                      shuffle=cfg.shuffle,
                      eval_batch_size=cfg.eval_batch_size)


class Programs(NamedTuple):
  """The compiled pieces of a run (`programs`)."""
  layout: Layout
  init: Callable      # init(key) -> carry, placed on the layout
  frozen: Callable    # frozen(key) -> the shared-frozen parameters (or None)
  chunk: Callable     # chunk(carry, r0, train, root_key, frozen, length)
                      #   -> (carry, metrics); `train`: ClientArrays [N, ...]
                      #   or Cohort [length, m, ...] (`make_round`)
  eval: Callable      # eval(carry, frozen, val, ood, details=False) -> dict
  # The "host" placement's pieces (`_OnHost`):
  server_init: Callable  # server_init(key) -> the server state, placed
  init_rows: Callable    # init_rows(key, ids) -> initial client-state rows
  step_rows: Callable    # step_rows(root_key, rounds, ids, n, n_max) -> the
                         #   rows the cohorts' steps read (`step_rows`)
  eval_blocks: Callable  # eval_blocks((server, host client state), frozen,
                         #   _Blocks, ood, details=False) -> dict


def programs(alg: Algorithm, model, cfg: EngineConfig,
             num_clients: int) -> Programs:
  """The jitted programs `run` uses for `alg` (for benchmarks and tools that drive
  the chunks themselves); place training data with `layout.put_clients`.
  `run` resolves `vmap_lanes` = 0 from the clients' sizes first
  (`resolve_lanes`); here 0 is one lane per client. The same for
  `host_gather` (`resolve_gather`): here only "rows" is the row gather."""
  return _programs(alg, alg.model or model, _program_key(cfg, alg),
                   num_clients)


@functools.lru_cache(maxsize=32)
def _programs(alg: Algorithm, model, cfg: EngineConfig,
              num_clients: int) -> Programs:
  """Jitted (init, chunk, eval) of one algorithm, shared by every run that uses the
  same Algorithm and model objects: other target domains with equal shapes, other
  seeds and resumed runs reuse the traced and compiled programs."""
  layout = Layout.of(cfg, num_clients)
  round_fn = make_round(alg, cfg, num_clients, layout)

  # Sharded: the carry stays replicated (the same sharding in and out, so the
  # second chunk reuses the first chunk's compiled program).
  placed = ({} if layout.mesh is None
            else dict(out_shardings=NamedSharding(layout.mesh, P())))

  @functools.partial(jax.jit, static_argnums=(5,), donate_argnums=(0,), **placed)
  def run_chunk(carry, r0, train, root_key, frozen, length):
    rounds = r0 + jnp.arange(length)
    if isinstance(train, Cohort):  # one cohort per round: the scan's input
      return jax.lax.scan(
          lambda c, xs: round_fn(c, xs[0], xs[1], root_key, frozen), carry,
          (rounds, train))
    return jax.lax.scan(lambda c, r: round_fn(c, r, train, root_key, frozen),
                        carry, rounds)

  # One compiled program (not dozens of eager ops), and distinct output buffers
  # even where init aliases (EMA copy = params): the chunk donates its carry.
  init = jax.jit(alg.init)
  # Held once, outside the carry; replicated over the mesh like the carry.
  # Not jitted here: a pretrained file read inside a trace would become a
  # constant of the program (`Model.init` jits its own sampling).
  frozen = alg.frozen if alg.frozen is not None else lambda key: None
  evaluate_, eval_blocks = _make_eval(alg, model, cfg.eval_batch_size)
  # Compiled without the client state (XLA drops what the output does not use).
  server_init = jax.jit(lambda key: alg.init(key)[0])
  return Programs(
      layout=layout, init=lambda key: layout.put_carry(init(key)),
      frozen=lambda key: layout.put_carry(frozen(key)), chunk=run_chunk,
      eval=lambda carry, frozen, *a, **kw: evaluate_(
          layout.to_one_device(carry), layout.to_one_device(frozen), *a, **kw),
      server_init=lambda key: layout.put_carry(server_init(key)),
      init_rows=jax.jit(alg.init_rows), step_rows=step_rows(alg, cfg),
      eval_blocks=lambda state, frozen, *a, **kw: eval_blocks(
          (layout.to_one_device(state[0]), state[1]),
          layout.to_one_device(frozen), *a, **kw))


def _eval_batch(cfg: EngineConfig, n: int) -> int:
  return max(1, min(cfg.eval_batch_size, n))


class _Ood:
  """Target examples `rows` of (x, y) to score, in blocks of at most `block`
  examples, each padded to a multiple of `batch` (`evaluate.pad_to_multiple`)
  and placed as (x, y, mask) device arrays. One block is read and placed
  once; more (a streamed target split, `OOD_BLOCK_BYTES`) are read at each
  iteration, and their scores add up (`_make_eval`)."""

  def __init__(self, x, y, rows, batch: int, block: int):
    self.x, self.y, self.rows, self.batch = x, y, rows, batch
    self.starts = range(0, len(rows), block)
    self.block = block
    self.kept = [self._read(rows)] if len(self.starts) == 1 else None

  def _read(self, rows):
    return tuple(map(jnp.asarray, evaluate.pad_to_multiple(
        self.x[rows], self.y[rows], self.batch)))

  def __iter__(self):
    if self.kept is not None:
      return iter(self.kept)
    return (self._read(self.rows[s:s + self.block]) for s in self.starts)


def _ood_sets(data, cfg: EngineConfig):
  """(every target example, the `ood_eval_max` scored between chunks) as
  `_Ood`; (None, None) without a target split."""
  tx, ty = data.target_x, np.asarray(data.target_y)
  n = len(ty)
  if n == 0:
    return None, None
  block = n
  if is_streamed(tx):
    per_block = OOD_BLOCK_BYTES // max(1, int(np.prod(tx.shape[1:])))
    batch = _eval_batch(cfg, n)
    block = max(batch, per_block // batch * batch)
  full = _Ood(tx, ty, np.arange(n), _eval_batch(cfg, n), block)
  if cfg.ood_eval_max and n > cfg.ood_eval_max:
    pick = np.random.default_rng(cfg.seed).choice(n, cfg.ood_eval_max,
                                                  replace=False)
    return full, _Ood(tx, ty, pick, _eval_batch(cfg, cfg.ood_eval_max), block)
  return full, full


def divergence_ids(num_clients: int) -> np.ndarray:
  """The clients the final weight divergence is measured over: all of them,
  or a seeded sample of DIVERGENCE_CLIENTS (sorted)."""
  if num_clients <= DIVERGENCE_CLIENTS:
    return np.arange(num_clients)
  return np.sort(np.random.default_rng(0).choice(
      num_clients, DIVERGENCE_CLIENTS, replace=False))


class _Blocks(NamedTuple):
  """The "host" placement's evaluation input: clients in blocks of `size`,
  their id-validation examples gathered per block from `val` (None: none)."""
  val: Any          # PackedClients, or None without id-validation examples
  num_clients: int
  size: int
  multiple: int     # examples per client padded to a multiple of it


def _make_eval(alg: Algorithm, model, eval_batch_size: int):
  """Returns (eval, eval_blocks), each -> dict of host floats/lists.

  eval(carry, frozen, val, ood): every client at once (the "device"
  placement; `val` the padded [N, V, ...] arrays). eval_blocks((server,
  host client state), frozen, _Blocks, ood): the same numbers, clients a
  block at a time (the "host" placement: no [N, ...] device array).
  `val` / `ood` None: that evaluation is skipped and its keys are absent. A
  client without id-validation examples is None in id_acc_per_client and left
  out of id_acc (the mean over clients).
  """
  eval_params = jax.jit(alg.eval_params)
  eval_rows = jax.jit(alg.eval_rows)

  def client_scores(frozen, params, val, ood, bs_val, bs_ood):
    # One copy of the frozen parameters, merged per model inside the maps.
    apply_fn = lambda p, x: model.apply(with_frozen(frozen, p), x, train=False)
    stacked, shared = (params, None) if alg.personalized else (None, params)
    out = {}
    if val is not None:
      vx, vy, vm = val
      out["id"] = evaluate.per_client_scores(apply_fn, stacked, shared, vx, vy, vm,
                                             bs_val)
    if ood is not None:
      ox, oy, om = ood
      if alg.personalized:
        out["ood"] = evaluate.models_on_shared_data(apply_fn, params, ox, oy, om,
                                                    bs_ood)
      else:
        out["ood"] = evaluate.scores(apply_fn, params, ox, oy, om, bs_ood)
    return out

  @functools.partial(jax.jit, static_argnums=(3, 4))
  def scores(carry, frozen, arrays, bs_val, bs_ood):
    server, clients = carry
    return client_scores(frozen, alg.eval_params(server, clients), *arrays,
                         bs_val, bs_ood)

  @functools.partial(jax.jit, static_argnums=(5, 6))
  def block_scores(server, rows, ids, frozen, arrays, bs_val, bs_ood):
    params = (alg.eval_rows(server, rows, ids) if alg.personalized
              else alg.eval_params(server, None))
    return client_scores(frozen, params, *arrays, bs_val, bs_ood)

  batch = lambda arrays, axis: (None if arrays is None else
                                min(eval_batch_size, arrays[0].shape[axis]))

  def over_blocks(score, val, ood):
    """score(val, ood block, ood batch) -> host scores, over every block of
    `ood` (an `_Ood`, or None): val scored with the first, the blocks' "ood"
    scores added up."""
    blocks = iter(ood) if ood is not None else iter(())
    bs_ood = None if ood is None else ood.batch
    s = score(val, next(blocks, None), bs_ood)
    for block in blocks:
      s["ood"] = jax.tree.map(np.add, s["ood"], score(None, block, bs_ood)["ood"])
    return s

  def summary(s, details, personal, extras):
    """The evaluation's dict from host scores `s`; `personal()` the
    evaluated models of `divergence_ids(N)` (weight divergence), `extras()`
    the algorithm's."""
    out = {}
    if "id" in s:
      count = np.asarray(s["id"].count)
      id_acc = np.asarray(s["id"].correct) / np.maximum(count, 1)
      out.update(id_acc=float(np.mean(id_acc[count > 0])),
                 id_acc_per_client=[float(a) if c > 0 else None
                                    for a, c in zip(id_acc, count)])
    if "ood" in s:
      ood_acc = np.atleast_1d(s["ood"].correct / np.maximum(s["ood"].count, 1))
      out.update(ood_acc=float(np.mean(ood_acc)), ood_acc_per_client=ood_acc.tolist())
    if details:  # calibration over all clients' predictions, divergence, extras
      bins = lambda b: np.asarray(b).reshape(-1, *np.asarray(b).shape[-2:]).sum(0)
      out["calibration"] = {k: evaluate.calibration_summary(bins(v.bins))
                            for k, v in s.items()}
      if alg.personalized:
        out["weight_divergence"] = evaluate.weight_divergence(personal())
      out["extras"] = jax.tree.map(lambda a: np.asarray(a).tolist(),
                                   jax.device_get(extras()))
    return out

  def run_eval(carry, frozen, val, ood, details=False):
    s = over_blocks(lambda v, o, bs: jax.device_get(scores(
        carry, frozen, (v, o), batch(v, 1), bs)), val, ood)
    server, clients = carry

    def personal():
      models = jax.device_get(eval_params(server, clients))
      pick = divergence_ids(jax.tree.leaves(models)[0].shape[0])
      return jax.tree.map(lambda a: a[pick], models)

    return summary(s, details, personal, lambda: alg.extras(server, clients))

  def blocks_of(num_clients, size):
    """The ids of each block, the last padded to `size` with the last id."""
    for start in range(0, num_clients, size):
      yield np.minimum(np.arange(start, start + size), num_clients - 1)

  def run_eval_blocks(state, frozen, blocks: _Blocks, ood, details=False):
    server, clients = state
    per_client_ood = ood if alg.personalized else None
    parts = []
    if blocks.val is not None or per_client_ood is not None:
      for ids in blocks_of(blocks.num_clients, blocks.size):
        val = (None if blocks.val is None else tuple(map(jnp.asarray, _pad_clients(
            blocks.val.gather(ids), blocks.multiple))))
        rows = jax.device_put(_take_rows(clients, ids))
        parts.append(over_blocks(lambda v, o, bs: jax.device_get(block_scores(
            server, rows, jnp.asarray(ids), frozen, (v, o), batch(v, 1), bs)),
                                 val, per_client_ood))
    n = blocks.num_clients
    s = jax.tree.map(lambda *a: np.concatenate(a)[:n], *parts) if parts else {}
    if ood is not None and not alg.personalized:
      s["ood"] = over_blocks(lambda v, o, bs: jax.device_get(scores(
          (server, None), frozen, (v, o), None, bs)), None, ood)["ood"]

    def personal():
      pick = divergence_ids(n)
      got = [jax.device_get(eval_rows(server, jax.device_put(
          _take_rows(clients, pick[ids])), jnp.asarray(pick[ids])))
             for ids in blocks_of(len(pick), blocks.size)]
      return jax.tree.map(lambda *a: np.concatenate(a)[:len(pick)], *got)

    return summary(s, details, personal, lambda: alg.extras(server, clients))

  return run_eval, run_eval_blocks


def _progress(cfg: EngineConfig, desc: str, initial: int):
  if not cfg.progress or jax.process_index() != 0:  # one bar: process 0's
    return None
  from tqdm.auto import tqdm
  return tqdm(total=cfg.rounds, initial=initial, desc=desc, unit="round",
              dynamic_ncols=True, leave=True)
