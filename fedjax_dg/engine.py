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

Randomness: one root key; round key = fold_in(root, r); client key =
fold_in(round key, client id), so results do not depend on the mapping or on the
number of devices.
"""

from __future__ import annotations

import dataclasses
import functools
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
from fedjax_dg.client.update import local_steps, local_training, train_client
from fedjax_dg.errors import ConfigError, DataError, NonFiniteError

PyTree = Any
MAPPINGS = ("auto", "vmap", "map", "shard")
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
  seed: int = 0
  eval_batch_size: int = 500
  ood_eval_max: int = 2000      # target examples scored between chunks (0: all)
  features_max: int = 0         # target examples whose features the final
                                # model keeps (RunResult.features; t-SNE plot)
  progress: bool = True

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
        ("map_batch_size", self.map_batch_size >= 1, "an integer >= 1"),
        ("vmap_lanes", self.vmap_lanes >= 0,
         "0 (auto: from the clients' sizes) or an integer >= 1"),
        ("eval_batch_size", self.eval_batch_size >= 1, "an integer >= 1"),
        ("ood_eval_max", self.ood_eval_max >= 0, "0 (all) or a positive count"),
        ("features_max", self.features_max >= 0, "0 (none) or a positive count"),
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
  seconds: float
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
  padded slot; 10 on 8: 5, none)."""
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
    """Per-client arrays [N, ...] on the mesh (sharded over N if it divides)."""
    arrays = jax.tree.map(jnp.asarray, arrays)
    if self.mesh is None:
      return arrays
    n = jax.tree.leaves(arrays)[0].shape[0]
    spec = P("clients") if n % self.mesh.size == 0 else P()
    return jax.device_put(arrays, NamedSharding(self.mesh, spec))

  def to_one_device(self, tree_: PyTree) -> PyTree:
    """Evaluation runs on one device (a replicated program would run everywhere)."""
    if self.mesh is None:
      return tree_
    return jax.device_put(tree_, self.mesh.devices.flat[0])


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


def make_round(alg: Algorithm, cfg: EngineConfig, num_clients: int,
               layout: Layout | None = None):
  """round(carry, r, train, root_key, frozen) -> (carry, metrics);
  carry = (server, clients); `frozen` = the algorithm's shared-frozen params."""
  m = cfg.cohort_size or num_clients
  layout = layout or Layout.of(cfg, num_clients)
  steps = alg.local_steps or cfg.local_steps
  training = functools.partial(local_training, alg.loss, alg.optimizer,
                               batch_size=cfg.batch_size, epochs=cfg.epochs,
                               steps=steps, rounds=cfg.rounds)

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
    rkey = jax.random.fold_in(root_key, r)
    cohort_key, client_key, server_key = jax.random.split(rkey, 3)
    if m < num_clients:
      ids = jax.random.choice(cohort_key, num_clients, (m,), replace=False)
      rows, data = tree.take(clients, ids), tree.take(train, ids)
    else:
      ids, rows, data = jnp.arange(num_clients), clients, train
    start = alg.client_start(server, rows, ids)
    chex.assert_tree_shape_prefix(
        start, (m,), custom_message=f"{alg.name}.client_start must give the "
        f"cohort's {m} clients their parameters stacked as [{m}, ...]")
    extra = alg.client_ctx(start, rows, ids)
    shared = (r, alg.client_shared(server), frozen)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(client_key, ids)
    trained, losses, aux = mapped(shared, (train.x, train.y), ids, start,
                                  data.n, keys, ids, rows, extra)
    new_rows = (alg.client_end(rows, trained, aux) if alg.client_end_takes_aux
                else alg.client_end(rows, trained))
    clients = tree.put(clients, ids, new_rows) if m < num_clients else new_rows
    result = ClientResult(ids=ids, round=r, start=start, params=trained,
                          num_examples=data.n, loss=losses, aux=aux,
                          rounds=cfg.rounds if alg.needs_rounds else None)
    server, metrics = alg.server_update(server, result, server_key)
    n = data.n.astype(jnp.float32)
    metrics = dict(metrics, loss=jnp.sum(losses * n) / jnp.sum(n), cohort=ids)
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


class _Checkpointer:
  """Orbax checkpoints of the scan carry (as a flat list of leaves) + host history."""

  def __init__(self, directory: str):
    import orbax.checkpoint as ocp
    self._ocp = ocp
    self.manager = ocp.CheckpointManager(
        os.path.abspath(directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True))

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
    meta = dict(meta, layout=self.layout(carry))
    leaves = {str(i): np.asarray(x) for i, x in enumerate(jax.tree.leaves(carry))}
    # Asynchronous: the next chunk runs while this one is written.
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(leaves), meta=ocp.args.JsonSave(meta)))

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()

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
    abstract = {str(i): jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
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
    leaves = [jnp.asarray(out["state"][str(i)]) for i in range(len(flat))]
    return jax.tree.unflatten(treedef, leaves), out["meta"]


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


def run(alg: Algorithm, data, model, cfg: EngineConfig, *,
        checkpoint_dir: str | None = None,
        on_eval: Callable[[dict], None] | None = None) -> RunResult:
  """Runs `cfg.rounds` rounds of `alg` on `data` (a FederatedData).

  With `checkpoint_dir`, a checkpoint is written after every chunk and an existing
  one is resumed from (same final parameters as an uninterrupted run).
  """
  train = data.pooled().train if alg.pooled else data.train
  if alg.pooled:  # one pooled "client" trains every round
    cfg = dataclasses.replace(cfg, cohort_size=0)
  num_clients = int(np.asarray(train.n).shape[0])
  cfg.validate(num_clients)
  cfg = resolve_lanes(cfg, alg, train.n)
  model = alg.model or model
  root_key = jax.random.key(cfg.seed)
  progs = _programs(alg, model, _program_key(cfg, alg), num_clients)
  run_chunk, eval_step = progs.chunk, progs.eval
  # No id-validation examples at all (data.val_fraction = 0): no id evaluation;
  # the history then has no id_acc (reports show "-"), never a made-up 0.
  val = (tuple(map(jnp.asarray,
                   _pad_clients(data.val, _eval_batch(cfg, data.val.x.shape[1]))))
         if np.asarray(data.val.n).any() else None)
  ood_full, ood_sub = _ood_sets(data, cfg)

  train = progs.layout.put_clients(train)
  init_key = jax.random.fold_in(root_key, 2**31 - 1)
  carry = progs.init(init_key)
  frozen = progs.frozen(init_key)
  history: list[dict] = []
  round_metrics: dict[str, list] = {}
  r0 = 0
  ckpt = _Checkpointer(checkpoint_dir) if checkpoint_dir else None
  if ckpt is not None and ckpt.latest() is not None:
    carry, meta = ckpt.restore(ckpt.latest(), carry)
    carry = progs.layout.put_carry(carry)
    r0, history, round_metrics = meta["round"], meta["history"], meta["round_metrics"]

  bar = _progress(cfg, alg.name, r0)
  t0 = time.perf_counter()
  try:
    while r0 < cfg.rounds:
      length = min(cfg.eval_every, cfg.rounds - r0)
      carry, metrics = run_chunk(carry, jnp.int32(r0), train, root_key, frozen,
                                 length)
      chunk_metrics = _to_host(metrics)
      # Before anything is recorded or saved: the last good checkpoint stays.
      check_finite(alg.name, r0, chunk_metrics, carry,
                   ckpt.latest() if ckpt is not None else None, checkpoint_dir)
      r0 += length
      for k, v in chunk_metrics.items():
        round_metrics.setdefault(k, []).extend(v)
      train_loss = float(np.mean(round_metrics["loss"][-length:]))
      entry = dict(round=r0, train_loss=train_loss,
                   **eval_step(carry, frozen, val, ood_sub))
      history.append(entry)
      if on_eval is not None:
        on_eval(entry)
      if bar is not None:
        bar.update(length)
        bar.set_postfix({short: f"{entry[key]:.3f}" for short, key in
                         (("loss", "train_loss"), ("id", "id_acc"),
                          ("ood", "ood_acc")) if key in entry})
      if ckpt is not None:
        ckpt.save(r0, carry, dict(round=r0, history=history,
                                  round_metrics=round_metrics))
  finally:  # a stopped run still leaves complete checkpoints
    if bar is not None:
      bar.close()
    if ckpt is not None:
      ckpt.close()
  final = dict(round=r0, **eval_step(carry, frozen, val, ood_full, details=True))
  server, clients = carry
  feats = target_features(alg, model, progs.layout.to_one_device(carry),
                          progs.layout.to_one_device(frozen), data, cfg)
  return RunResult(alg.name, server, clients, history, round_metrics, final,
                   time.perf_counter() - t0, feats)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _features(model, params, x, batch: int):
  xb = x.reshape((-1, batch) + x.shape[1:])
  return jax.lax.map(lambda b: model.features(params, b), xb).reshape(
      x.shape[0], -1)


def target_features(alg: Algorithm, model, carry, frozen, data,
                    cfg: EngineConfig) -> dict | None:
  """Features of up to `cfg.features_max` target examples (a seeded pick) under
  the evaluated model: `RunResult.features`."""
  tx, ty = np.asarray(data.target_x), np.asarray(data.target_y)
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
                      eval_batch_size=cfg.eval_batch_size)


class Programs(NamedTuple):
  """The compiled pieces of a run (`programs`)."""
  layout: Layout
  init: Callable      # init(key) -> carry, placed on the layout
  frozen: Callable    # frozen(key) -> the shared-frozen parameters (or None)
  chunk: Callable     # chunk(carry, r0, train, root_key, frozen, length)
                      #   -> (carry, metrics)
  eval: Callable      # eval(carry, frozen, val, ood, details=False) -> dict


def programs(alg: Algorithm, model, cfg: EngineConfig,
             num_clients: int) -> Programs:
  """The jitted programs `run` uses for `alg` (for benchmarks and tools that drive
  the chunks themselves); place training data with `layout.put_clients`.
  `run` resolves `vmap_lanes` = 0 from the clients' sizes first
  (`resolve_lanes`); here 0 is one lane per client."""
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
    return jax.lax.scan(lambda c, r: round_fn(c, r, train, root_key, frozen),
                        carry, rounds)

  # One compiled program (not dozens of eager ops), and distinct output buffers
  # even where init aliases (EMA copy = params): the chunk donates its carry.
  init = jax.jit(alg.init)
  # Held once, outside the carry; replicated over the mesh like the carry.
  # Not jitted here: a pretrained file read inside a trace would become a
  # constant of the program (`Model.init` jits its own sampling).
  frozen = alg.frozen if alg.frozen is not None else lambda key: None
  evaluate_ = _make_eval(alg, model, cfg.eval_batch_size)
  return Programs(
      layout=layout, init=lambda key: layout.put_carry(init(key)),
      frozen=lambda key: layout.put_carry(frozen(key)), chunk=run_chunk,
      eval=lambda carry, frozen, *a, **kw: evaluate_(
          layout.to_one_device(carry), layout.to_one_device(frozen), *a, **kw))


def _eval_batch(cfg: EngineConfig, n: int) -> int:
  return max(1, min(cfg.eval_batch_size, n))


def _ood_sets(data, cfg: EngineConfig):
  tx, ty = np.asarray(data.target_x), np.asarray(data.target_y)
  if tx.shape[0] == 0:
    return None, None
  on_device = lambda arrays: tuple(map(jnp.asarray, arrays))
  full = on_device(evaluate.pad_to_multiple(tx, ty, _eval_batch(cfg, tx.shape[0])))
  if cfg.ood_eval_max and tx.shape[0] > cfg.ood_eval_max:
    pick = np.random.default_rng(cfg.seed).choice(tx.shape[0], cfg.ood_eval_max,
                                                  replace=False)
    sub = on_device(evaluate.pad_to_multiple(tx[pick], ty[pick],
                                             _eval_batch(cfg, cfg.ood_eval_max)))
  else:
    sub = full
  return full, sub


def _make_eval(alg: Algorithm, model, eval_batch_size: int):
  """Returns eval(carry, frozen, val, ood) -> dict of host floats/lists.

  `val` / `ood` None: that evaluation is skipped and its keys are absent. A
  client without id-validation examples is None in id_acc_per_client and left
  out of id_acc (the mean over clients).
  """
  eval_params = jax.jit(alg.eval_params)

  @functools.partial(jax.jit, static_argnums=(3, 4))
  def scores(carry, frozen, arrays, bs_val, bs_ood):
    # One copy of the frozen parameters, merged per model inside the maps.
    apply_fn = lambda p, x: model.apply(with_frozen(frozen, p), x, train=False)
    server, clients = carry
    params = alg.eval_params(server, clients)
    val, ood = arrays
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

  def run_eval(carry, frozen, val, ood, details=False):
    bs_val = None if val is None else min(eval_batch_size, val[0].shape[1])
    bs_ood = None if ood is None else min(eval_batch_size, ood[0].shape[0])
    s = jax.device_get(scores(carry, frozen, (val, ood), bs_val, bs_ood))
    out = {}
    if val is not None:
      count = np.asarray(s["id"].count)
      id_acc = np.asarray(s["id"].correct) / np.maximum(count, 1)
      out.update(id_acc=float(np.mean(id_acc[count > 0])),
                 id_acc_per_client=[float(a) if c > 0 else None
                                    for a, c in zip(id_acc, count)])
    if ood is not None:
      ood_acc = np.atleast_1d(s["ood"].correct / np.maximum(s["ood"].count, 1))
      out.update(ood_acc=float(np.mean(ood_acc)), ood_acc_per_client=ood_acc.tolist())
    if details:  # calibration over all clients' predictions, divergence, extras
      bins = lambda b: np.asarray(b).reshape(-1, *np.asarray(b).shape[-2:]).sum(0)
      out["calibration"] = {k: evaluate.calibration_summary(bins(v.bins))
                            for k, v in s.items()}
      server, clients = carry
      if alg.personalized:
        out["weight_divergence"] = evaluate.weight_divergence(
            jax.device_get(eval_params(server, clients)))
      out["extras"] = jax.tree.map(lambda a: np.asarray(a).tolist(),
                                   jax.device_get(alg.extras(server, clients)))
    return out

  return run_eval


def _progress(cfg: EngineConfig, desc: str, initial: int):
  if not cfg.progress:
    return None
  from tqdm.auto import tqdm
  return tqdm(total=cfg.rounds, initial=initial, desc=desc, unit="round",
              dynamic_ncols=True, leave=True)
