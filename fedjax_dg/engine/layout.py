"""Where a round's clients run: the devices (`use_cpu_devices`, `mesh_size`,
`client_mesh`), how the cohort axis is mapped onto them (`resolve_mapping`,
`client_mapper`, `group_trainer`), the arrays placed accordingly (`Layout`),
and how many lanes vmapped clients are packed into (`resolve_lanes`).

The client mapping (`train.client_mapping`):

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
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fedjax_dg import tree
from fedjax_dg.algorithms.base import Algorithm
from fedjax_dg.client.update import local_steps
from fedjax_dg.engine.settings import EngineConfig
from fedjax_dg.errors import ConfigError

PyTree = Any


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


def sequential(f, map_batch_size: int = 1) -> Callable:
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
  return sequential(one, map_batch_size)


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
      k = len(data)  # the example arrays: (x, y), and d where carried
      mapped = jax.shard_map(
          lambda shared, *a: trainer(shared, a[:k], *a[k:]), mesh=mesh,
          in_specs=(P(),) + (P("clients"),) * (len(args) + 1),
          out_specs=P("clients"))
      out = mapped(shared, *jax.lax.with_sharding_constraint(
          (*args[:k], local, *args[k:]), spec))
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
  steps = alg.client.local_steps or cfg.local_steps
  work = np.asarray(local_steps(np.asarray(counts), cfg.batch_size,
                                cfg.epochs, steps))
  g = layout.group(cfg.cohort_size or num_clients)
  lanes = math.ceil(g * work.mean() / work.max()) if work.max() else g
  return dataclasses.replace(cfg, vmap_lanes=min(max(lanes, 1), g))
