"""FederatedData: packed per-client examples plus the ood target split.

`build(dataset, spec, target_domain=...)` holds out the target domain
(leave-one-domain-out), splits the source examples among clients with
`partition.make_partition`, holds out `val_fraction` of every client's examples as
its id-validation split, optionally injects `few_shot_k` target examples into each
client's training data, and stores each split packed (`PackedClients`: every
client's examples back to back, no padding)

    packed_train.x       uint8 [total, H, W, ch]   (streamed: RecordImages)
    packed_train.y       int32 [total]
    packed_train.offsets int64 [C + 1]   client c: rows offsets[c]:offsets[c+1]

`train_domains` (int32 [total]) is each training row's domain; `with_domains()`
carries it as `packed_train.d` (and `train.d`) for an algorithm whose
objective reads it (`Batch.d`); otherwise the arrays are x, y and n only.

`train` / `val` are the padded view the whole-run-on-device placement uses,
built from the packed form on first use (`engine.run` with
`train.placement="host"` never builds it: it gathers each round's cohort):

    train.x uint8 [C, N_max, H, W, ch]   zero padded
    train.y int32 [C, N_max]             padded with 0
    train.n int32 [C]                    true counts

With `server_fraction > 0` a seeded, (domain, label)-stratified share of the
SOURCE examples is carved out first, before the client partition, as the
server's split `server_x` uint8 [S, H, W, ch] / `server_y` int32 [S] (the
unlabeled transfer set of FedDF / FedBE, the labeled proxy set of FedLAW); no
client ever sees those examples.

A streamed dataset (`sources.load(..., streaming=...)`: images that stay in
their TFDS records) gives a streamed federation (`streamed`): `packed_train.x`,
`packed_val.x` and `target_x` are views of the records, read when gathered
(`PackedClients.gather`, a chunk's cohorts); the server's split is read at
build; the padded view is refused (it would hold every example).

Arrays stay on the host (numpy; jitted functions accept them as they are); the
engine places them (`engine.layout.Layout`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

import flax
import jax
import numpy as np

from fedjax_dg.data import partition
from fedjax_dg.data.images import channel_stats, is_streamed, take
from fedjax_dg.data.dataset import DomainDataset
from fedjax_dg.errors import ConfigError


@flax.struct.dataclass
class ClientArrays:
  """Per-client examples stacked along a leading client axis (a pytree)."""

  x: Any  # uint8 [C, N_max, H, W, ch], zero padded
  y: Any  # int32 [C, N_max], padded with 0
  n: Any  # int32 [C], true counts
  d: Any = None  # int32 [C, N_max]: each example's domain, padded with 0;
                 # None: not carried (`FederatedData.with_domains`)

  @property
  def num_clients(self) -> int:
    return int(self.n.shape[0])

  @property
  def max_examples(self) -> int:
    return int(self.x.shape[1])


@dataclasses.dataclass(frozen=True, eq=False)
class PackedClients:
  """Every client's examples back to back (no padding): client c holds rows
  `offsets[c]:offsets[c + 1]` of `x` / `y`. `width` is the per-client length
  of the padded view (`padded`, `gather`): at least the largest client."""

  x: Any              # uint8 [total, H, W, ch]: an array, or RecordImages
                      # (streamed: rows read on demand, `gather`)
  y: np.ndarray        # int32 [total]
  offsets: np.ndarray  # int64 [C + 1], offsets[0] = 0, non-decreasing
  width: int = -1      # padded length per client; -1: the largest client
  d: np.ndarray | None = None  # int32 [total]: each row's domain (an index
                               # into `FederatedData.domain_names`), gathered
                               # with x and y; None: not carried

  def __post_init__(self):
    offsets = np.asarray(self.offsets, np.int64)
    object.__setattr__(self, "offsets", offsets)
    largest = int(np.diff(offsets).max()) if len(offsets) > 1 else 0
    if self.width == -1:
      object.__setattr__(self, "width", largest)
    if self.width < largest:
      raise ValueError(f"PackedClients: width={self.width} is below the "
                       f"largest client's {largest} examples")
    if offsets[0] != 0 or offsets[-1] != len(self.y) or np.any(
        np.diff(offsets) < 0):
      raise ValueError(f"PackedClients: offsets must rise from 0 to the "
                       f"{len(self.y)} examples, got {offsets[0]}..{offsets[-1]}")
    if self.d is not None and np.shape(self.d) != np.shape(self.y):
      raise ValueError(f"PackedClients: d has shape {np.shape(self.d)}, y "
                       f"{np.shape(self.y)}: one domain per row")

  @property
  def n(self) -> np.ndarray:
    """int32 [C]: each client's number of examples."""
    return np.diff(self.offsets).astype(np.int32)

  @property
  def num_clients(self) -> int:
    return len(self.offsets) - 1

  @property
  def streamed(self) -> bool:
    """Whether `x` stays in its records (`data.streaming`): rows read on
    demand (`gather`), never all at once."""
    return is_streamed(self.x)

  def gather(self, ids, rows=None) -> ClientArrays:
    """Clients `ids` (an int array of any shape [...]) padded to `width`:
    x [..., width, H, W, ch], y [..., width], n [...]. Only the clients'
    own rows of `x` are read (from records, for streamed data: each once).

    `rows` (int [..., K], a client's row indices into its padded view): only
    those rows, in that order and with repeats, x [..., K, H, W, ch]; a row
    at or past the client's count is padding (zeros). The engine's
    `train.host_gather="rows"`: the rows a round's local steps read."""
    ids = np.asarray(ids)
    n = self.n[ids]
    local = (np.arange(self.width) if rows is None
             else np.asarray(rows, np.int64))
    valid = local < n[..., None]
    rows = self.offsets[ids][..., None] + local
    x = np.zeros(rows.shape + self.x.shape[1:], self.x.dtype)
    y = np.zeros(rows.shape, np.int32)
    d = None if self.d is None else np.zeros(rows.shape, np.int32)
    if valid.any():
      x[valid] = self.x[rows[valid]]
      y[valid] = self.y[rows[valid]]
      if d is not None:
        d[valid] = self.d[rows[valid]]
    return ClientArrays(x=x, y=y, n=n, d=d)

  def padded(self) -> ClientArrays:
    """Every client, padded: x [C, width, ...]."""
    return self.gather(np.arange(self.num_clients))

  def nbytes(self, padded: bool = False) -> int:
    """Bytes of the packed arrays, or of the padded view (`padded`)."""
    per = (int(np.prod(self.x.shape[1:])) * self.x.dtype.itemsize
           + self.y.dtype.itemsize
           + (0 if self.d is None else self.d.dtype.itemsize))
    return per * (self.num_clients * self.width if padded else len(self.y))


def pack_clients(images: np.ndarray, labels: np.ndarray,
                 parts: Sequence[np.ndarray]) -> PackedClients:
  """The examples of `parts` (index arrays into `images` / `labels`), packed
  (streamed images: a view of their records, nothing read)."""
  index = (np.concatenate([np.asarray(p, np.int64) for p in parts]) if parts
           else np.zeros(0, np.int64))
  offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])])
  return PackedClients(x=take(images, index),
                       y=labels[index].astype(np.int32), offsets=offsets)


def pack_padded(arrays: ClientArrays) -> PackedClients:
  """Padded per-client arrays (x [C, W, ...], n [C], and d where carried)
  packed, keeping the width W of the padded view."""
  x, y, n = (np.asarray(a) for a in (arrays.x, arrays.y, arrays.n))
  keep = np.arange(x.shape[1])[None, :] < n[:, None]
  d = None if arrays.d is None else np.asarray(arrays.d)[keep].astype(np.int32)
  return PackedClients(x=x[keep], y=y[keep].astype(np.int32),
                       offsets=np.concatenate([[0], np.cumsum(n)]),
                       width=x.shape[1], d=d)


@dataclasses.dataclass(frozen=True, eq=False)
class FederatedData:
  """A federation: per-client train / id-val examples and the ood target split."""

  packed_train: PackedClients
  packed_val: PackedClients  # Each client's id-validation split.
  target_x: Any  # uint8 [N_t, H, W, ch]; N_t = 0 without a target domain
                 # (streamed: RecordImages, read in blocks)
  target_y: Any  # int32 [N_t]
  num_classes: int
  class_names: tuple[str, ...]
  domain_names: tuple[str, ...]
  target_domain: str | None
  source_domains: tuple[str, ...]
  client_domains: tuple[tuple[str, ...], ...]  # Domains in each client's train.
  # Provenance: indices into the DomainDataset.
  train_indices: tuple[np.ndarray, ...] = ()
  val_indices: tuple[np.ndarray, ...] = ()
  target_indices: np.ndarray | None = None
  # The server's split (`server_fraction` of the source examples, carved out
  # before the client partition); S = 0 without one. None only for data built
  # by hand.
  server_x: Any = None  # uint8 [S, H, W, ch]
  server_y: Any = None  # int32 [S]
  server_indices: np.ndarray | None = None
  # int32 [total]: the domain of each row of `packed_train` (an index into
  # `domain_names`; a few-shot example's is the target's). None only for data
  # built by hand. `with_domains` hands them to the clients' batches.
  train_domains: np.ndarray | None = None

  @property
  def server_size(self) -> int:
    """Examples held by the server (0: none)."""
    return 0 if self.server_y is None else int(np.shape(self.server_y)[0])

  @property
  def streamed(self) -> bool:
    """Whether the examples stay in their records (`data.streaming`): read
    per chunk of rounds, never all at once."""
    return is_streamed(self.packed_train.x)

  @property
  def target_streamed(self) -> bool:
    """Whether the target split stays in its records: scored in blocks."""
    return is_streamed(self.target_x)

  @functools.cached_property
  def _stats(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
    return channel_stats(self.packed_train.x)

  @property
  def mean(self) -> tuple[float, ...]:
    """Per channel, [0, 1] units, over the training examples (computed on
    first use: streamed, a pass over them)."""
    return self._stats[0]

  @property
  def std(self) -> tuple[float, ...]:
    return self._stats[1]

  def _padded(self, packed: PackedClients, what: str) -> ClientArrays:
    if self.streamed:
      raise ConfigError(
          f"the {what} examples of every client at once (the padded view "
          f"[C, N_max, ...], {packed.nbytes(padded=True) / 2**30:.2f} GiB) were "
          "asked for, but this federation is streamed (data.streaming): its "
          "examples are read per chunk of rounds, never all at once. Run with "
          "train.placement='host' (or 'auto'), and algorithms that do not read "
          "every client's data when built (not fedccrl, ccst, elcfs, hfedf "
          "with embeddings='autoencoder'), or load the data in memory "
          "(data.streaming='off') if it fits")
    return packed.padded()

  @functools.cached_property
  def train(self) -> ClientArrays:
    """The training examples padded, [C, N_max, ...] (built on first use)."""
    return self._padded(self.packed_train, "training")

  @functools.cached_property
  def val(self) -> ClientArrays:
    """The id-validation examples padded, [C, V_max, ...] (built on first use)."""
    return self._padded(self.packed_val, "id-validation")

  @property
  def num_clients(self) -> int:
    return self.packed_train.num_clients

  @property
  def image_shape(self) -> tuple[int, ...]:
    return tuple(self.target_x.shape[1:])

  def pooled(self) -> FederatedData:
    """All clients' training data as ONE client (Central); val stays per client."""
    t = self.packed_train
    train = PackedClients(x=t.x, y=t.y, offsets=np.array([0, len(t.y)]),
                          d=t.d)
    held = {d for c in self.client_domains for d in c}
    domains = tuple(d for d in self.domain_names if d in held)
    indices = (np.concatenate(self.train_indices),) if self.train_indices else ()
    return dataclasses.replace(
        self, packed_train=train, client_domains=(domains,),
        train_indices=indices
    )

  def with_domains(self) -> FederatedData:
    """This federation with each training example's domain carried
    (`packed_train.d`, the padded view's `train.d`): what an algorithm whose
    objective reads `Batch.d` trains on (`ClientSide.domains`). Without it
    the arrays hold x, y and n only, as every other algorithm's programs
    take them."""
    if self.packed_train.d is not None:
      return self
    if self.train_domains is None:
      raise ConfigError(
          "this federation holds no domain of its training examples "
          "(FederatedData.train_domains is None: built by hand), but the "
          "algorithm's objective reads each example's domain: build it with "
          "data.federated.build, or pass train_domains (int32, one per row "
          "of packed_train)")
    return dataclasses.replace(self, packed_train=dataclasses.replace(
        self.packed_train, d=np.asarray(self.train_domains, np.int32)))

  def summary(self) -> str:
    n_train, n_val = self.packed_train.n, self.packed_val.n
    target = (f"target {self.target_domain!r} with {len(self.target_y)} examples"
              if self.target_domain is not None else "no target domain")
    server = (f", server split {self.server_size} examples"
              if self.server_size else ", no server split")
    return (
        f"{self.num_clients} clients, train {int(n_train.sum())} examples "
        f"(per client {int(n_train.min())}..{int(n_train.max())}), id-val "
        f"{int(n_val.sum())}, {target}{server}; images {self.image_shape}, "
        f"{self.num_classes} classes"
    )


def resolve_domain(dataset: DomainDataset, domain: str | int) -> int:
  """A domain name or index -> index; unknown names list the allowed ones."""
  names = dataset.domain_names
  if isinstance(domain, (int, np.integer)) and not isinstance(domain, bool):
    if 0 <= domain < len(names):
      return int(domain)
  elif isinstance(domain, str) and domain in names:
    return names.index(domain)
  raise ConfigError(
      f"target_domain={domain!r} is not a domain of {dataset.name!r}: allowed "
      f"{', '.join(repr(d) for d in names)} (or their index 0..{len(names) - 1}, "
      "or None for no ood split)"
  )


def _val_split(
    parts: Sequence[np.ndarray], val_fraction: float, seed: int, setting: str
) -> tuple[list[np.ndarray], list[np.ndarray]]:
  rng = np.random.default_rng(seed)
  train, val = [], []
  for c, p in enumerate(parts):
    n_val = max(1, int(round(len(p) * val_fraction))) if val_fraction > 0 else 0
    if len(p) - n_val < 1:
      raise ConfigError(
          f"client {c} has {len(p)} example(s): too few to keep a training "
          f"example after the id-validation split (val_fraction={val_fraction}) "
          f"under {setting}; use fewer partitions, more data (max_per_domain) "
          "or val_fraction=0"
      )
    perm = rng.permutation(p)
    val.append(perm[:n_val])
    train.append(perm[n_val:])
  return train, val


def server_split(
    domains: np.ndarray, labels: np.ndarray, indices: np.ndarray,
    fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
  """(server, rest): round(fraction * len(indices)) of `indices` for the server.

  Stratified by (domain, label): every stratum gives its proportional share,
  the rounding remainders going to the strata with the largest fractional
  parts (ties broken by the seeded draw), so the server split follows the
  source distribution, as FedLAW's proxy set and FedBE's held-out server set
  follow their training distribution. Seeded; `server` sorted, `rest` in the
  order of `indices` (all of them when the share rounds to 0).
  """
  indices = np.asarray(indices)
  total = int(round(fraction * len(indices)))
  if total == 0:
    return np.zeros(0, np.int64), indices
  rng = np.random.default_rng([seed, 0x5E])
  keys = np.asarray(domains)[indices].astype(np.int64) * (
      int(np.max(labels)) + 1) + np.asarray(labels)[indices]
  strata = [indices[keys == k] for k in np.unique(keys)]
  share = np.array([len(s) for s in strata], np.float64) * fraction
  quota = np.floor(share).astype(np.int64)
  left = total - int(quota.sum())
  order = np.lexsort((rng.random(len(strata)), -(share - quota)))
  quota[order[:left]] += 1
  server = np.concatenate([rng.permutation(s)[:q]
                           for s, q in zip(strata, quota)])
  return np.sort(server), indices[~np.isin(indices, server)]


def build(
    dataset: DomainDataset,
    spec: partition.PartitionSpec | Mapping[str, Any],
    *,
    target_domain: str | int | None,
    val_fraction: float = 0.1,
    seed: int = 0,
    server_fraction: float = 0.0,
) -> FederatedData:
  """Builds the federation: LODO target, client partitions, id-val split.

  Args:
    dataset: all examples with their domains.
    spec: how to split the source examples (`partition.PartitionSpec` or a
      mapping of its fields); `spec.seed` seeds the split and the few-shot draw.
    target_domain: the unseen domain (name or index), or None for no ood split
      (e.g. Dirichlet label skew on a one-domain dataset).
    val_fraction: share of each client's examples held out for id-validation
      (at least 1 example when > 0); in [0, 1).
    seed: seed of the id-validation split and of the server split.
    server_fraction: share of the source examples carved out (stratified by
      domain and label, before the client partition) as the server's split
      `server_x` / `server_y` (FedDF, FedBE, FedLAW); in [0, 1), 0 = none.

  Returns:
    A `FederatedData` of C clients: `packed_train` / `packed_val` (every
    client's examples back to back, uint8 [sum n_i, H, W, ch], with
    per-client `offsets` [C + 1]), their padded view `train` / `val` (x
    uint8 [C, N_max, H, W, ch], y int32 [C, N_max], n int32 [C], built on
    first use), the target split `target_x` uint8 [N_t, H, W, ch] /
    `target_y` int32 [N_t], and `mean` / `std`, the training examples'
    per-channel statistics in [0, 1] units.

  Raises:
    ConfigError: an unknown target domain (the message lists the names), a
      client left without a training example, settings the partition cannot
      meet (`d` above the source domains, few-shot without a target).

  Example::

    from fedjax_dg.data import federated, partition, sources
    ds = sources.load("rotated_fashion_mnist", image_size=16,
                      max_per_domain=500)
    fed = federated.build(
        ds, partition.PartitionSpec("domain_split", num_clients=5, d=1),
        target_domain="0")
    fed.num_clients, fed.train.x.shape   # 5, (5, 450, 16, 16, 1)
    fed.target_x.shape                   # (500, 16, 16, 1): the held-out 0°
  """
  spec = partition.as_spec(spec)
  if not 0 <= val_fraction < 1:
    raise ConfigError(f"val_fraction={val_fraction!r}: allowed [0, 1)")
  if not 0 <= server_fraction < 1:
    raise ConfigError(f"server_fraction={server_fraction!r}: allowed [0, 1)")
  domains = dataset.domains
  if target_domain is None:
    target = None
    source_idx, target_idx = np.arange(dataset.num_examples), np.zeros(0, np.int64)
  else:
    target = resolve_domain(dataset, target_domain)
    source_idx, target_idx = partition.leave_one_domain_out(domains, target)
  source_ids = np.unique(domains[source_idx])
  spec.validate(len(source_ids))
  if spec.few_shot_k and target is None:
    raise ConfigError(
        f"PartitionSpec.few_shot_k={spec.few_shot_k} needs a target_domain to "
        "draw the few-shot examples from; set target_domain or few_shot_k=0"
    )
  setting = spec.describe()
  server_idx, source_idx = server_split(domains, dataset.labels, source_idx,
                                        server_fraction, seed)
  parts = partition.make_partition(
      spec, domains=domains, labels=dataset.labels, indices=source_idx
  )
  if not parts:
    raise ConfigError(f"{setting} produced zero clients; use num_clients >= 1")
  for c, p in enumerate(parts):
    if len(p) == 0:
      raise ConfigError(
          f"client {c} got no training example from {setting} on "
          f"{len(source_idx)} source examples; lower num_clients (or k_per_domain), or "
          "load more data (max_per_domain)"
      )
  train_parts, val_parts = _val_split(parts, val_fraction, seed, setting)
  if spec.few_shot_k:
    shots, target_idx = partition.few_shot_target(
        target_idx, len(parts), spec.few_shot_k, spec.seed
    )
    rng = np.random.default_rng([spec.seed, 1])
    train_parts = [rng.permutation(np.concatenate([t, s]))
                   for t, s in zip(train_parts, shots)]
  train = pack_clients(dataset.images, dataset.labels, train_parts)
  train_rows = (np.concatenate([np.asarray(p, np.int64) for p in train_parts])
                if train_parts else np.zeros(0, np.int64))
  names = dataset.domain_names
  client_domains = tuple(
      tuple(names[j] for j in np.unique(domains[p])) for p in train_parts
  )
  return FederatedData(
      packed_train=train,
      packed_val=pack_clients(dataset.images, dataset.labels, val_parts),
      target_x=take(dataset.images, target_idx),
      target_y=dataset.labels[target_idx].astype(np.int32),
      num_classes=dataset.num_classes,
      class_names=dataset.class_names,
      domain_names=names,
      target_domain=None if target is None else names[target],
      source_domains=tuple(names[j] for j in source_ids),
      client_domains=client_domains,
      train_indices=tuple(train_parts),
      val_indices=tuple(val_parts),
      target_indices=target_idx,
      server_x=dataset.images[server_idx],  # read (streamed: from records)
      server_y=dataset.labels[server_idx].astype(np.int32),
      server_indices=server_idx,
      train_domains=np.asarray(domains)[train_rows].astype(np.int32),
  )
