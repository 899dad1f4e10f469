"""FederatedData: stacked, zero-padded per-client arrays plus the ood target split.

`build(dataset, spec, target_domain=...)` holds out the target domain
(leave-one-domain-out), splits the source examples among clients with
`partition.make_partition`, holds out `val_fraction` of every client's examples as
its id-validation split, optionally injects `few_shot_k` target examples into each
client's training data, and stacks everything as

    train.x uint8 [C, N_max, H, W, ch]   zero padded
    train.y int32 [C, N_max]             padded with 0
    train.n int32 [C]                    true counts

With `server_fraction > 0` a seeded, (domain, label)-stratified share of the
SOURCE examples is carved out first, before the client partition, as the
server's split `server_x` uint8 [S, H, W, ch] / `server_y` int32 [S] (the
unlabeled transfer set of FedDF / FedBE, the labeled proxy set of FedLAW); no
client ever sees those examples.

Arrays stay on the host (numpy; jitted functions accept them as they are);
`FederatedData.device_put` moves the client arrays to devices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import flax
import jax
import numpy as np

from fedjax_dg.data import partition
from fedjax_dg.data.sources import DomainDataset
from fedjax_dg.errors import ConfigError


@flax.struct.dataclass
class ClientArrays:
  """Per-client examples stacked along a leading client axis (a pytree)."""

  x: Any  # uint8 [C, N_max, H, W, ch], zero padded
  y: Any  # int32 [C, N_max], padded with 0
  n: Any  # int32 [C], true counts

  @property
  def num_clients(self) -> int:
    return int(self.n.shape[0])

  @property
  def max_examples(self) -> int:
    return int(self.x.shape[1])


def stack_clients(
    images: np.ndarray, labels: np.ndarray, parts: Sequence[np.ndarray]
) -> ClientArrays:
  """Gathers `parts` (index arrays) into zero-padded [C, N_max, ...] arrays."""
  n = np.array([len(p) for p in parts], np.int32)
  n_max = int(n.max()) if len(n) else 0
  x = np.zeros((len(parts), n_max) + images.shape[1:], np.uint8)
  y = np.zeros((len(parts), n_max), np.int32)
  for c, p in enumerate(parts):
    x[c, :len(p)] = images[p]
    y[c, :len(p)] = labels[p]
  return ClientArrays(x=x, y=y, n=n)


MIN_STD = 0.5 / 255  # a channel whose std is below this is constant


def channel_stats(
    x: np.ndarray, n: np.ndarray
) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """Per-channel mean and (population) std in [0, 1] units of the real examples.

  Exact, from per-channel histograms of the uint8 values, so memory stays small.
  A constant channel (std below half a grey level) gets std 1: normalized, it is
  0 everywhere instead of a division by zero (NaN from the first step).
  """
  ch = x.shape[-1]
  hist = np.zeros((ch, 256), np.float64)
  for c in range(x.shape[0]):
    for start in range(0, int(n[c]), 512):
      chunk = x[c, start:min(start + 512, int(n[c]))]
      for k in range(ch):
        hist[k] += np.bincount(chunk[..., k].ravel(), minlength=256)
  values = np.arange(256) / 255.0
  total = np.maximum(hist.sum(1), 1)
  mean = hist @ values / total
  var = np.maximum(hist @ values**2 / total - mean**2, 0.0)
  std = np.sqrt(var)
  std = np.where(std < MIN_STD, 1.0, std)
  return tuple(mean.tolist()), tuple(std.tolist())


@dataclasses.dataclass(frozen=True, eq=False)
class FederatedData:
  """A federation: per-client train / id-val arrays and the ood target split."""

  train: ClientArrays
  val: ClientArrays  # Each client's id-validation split.
  target_x: Any  # uint8 [N_t, H, W, ch]; N_t = 0 without a target domain.
  target_y: Any  # int32 [N_t]
  num_classes: int
  class_names: tuple[str, ...]
  domain_names: tuple[str, ...]
  target_domain: str | None
  source_domains: tuple[str, ...]
  client_domains: tuple[tuple[str, ...], ...]  # Domains in each client's train.
  mean: tuple[float, ...]  # Per channel, [0, 1] units, over the train examples.
  std: tuple[float, ...]
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

  @property
  def server_size(self) -> int:
    """Examples held by the server (0: none)."""
    return 0 if self.server_y is None else int(np.shape(self.server_y)[0])

  @property
  def num_clients(self) -> int:
    return self.train.num_clients

  @property
  def image_shape(self) -> tuple[int, ...]:
    return tuple(self.target_x.shape[1:])

  def pooled(self) -> FederatedData:
    """All clients' training data as ONE client (Central); val stays per client."""
    n = np.asarray(self.train.n)
    x = np.concatenate([np.asarray(self.train.x[c, :n[c]]) for c in range(len(n))])
    y = np.concatenate([np.asarray(self.train.y[c, :n[c]]) for c in range(len(n))])
    train = ClientArrays(x=x[None], y=y[None], n=np.array([len(y)], np.int32))
    held = {d for c in self.client_domains for d in c}
    domains = tuple(d for d in self.domain_names if d in held)
    indices = (np.concatenate(self.train_indices),) if self.train_indices else ()
    return dataclasses.replace(
        self, train=train, client_domains=(domains,), train_indices=indices
    )

  def device_put(self, sharding: Any = None) -> FederatedData:
    """Moves train / val / target arrays to devices (optionally sharded)."""
    put = lambda t: jax.device_put(t, sharding)
    return dataclasses.replace(
        self, train=put(self.train), val=put(self.val),
        target_x=jax.device_put(self.target_x), target_y=jax.device_put(self.target_y),
    )

  def summary(self) -> str:
    n_train, n_val = np.asarray(self.train.n), np.asarray(self.val.n)
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
    raise ConfigError(f"{setting} produced zero clients; use num_partitions >= 1")
  for c, p in enumerate(parts):
    if len(p) == 0:
      raise ConfigError(
          f"client {c} got no training example from {setting} on "
          f"{len(source_idx)} source examples; lower num_partitions (or k), or "
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
  train = stack_clients(dataset.images, dataset.labels, train_parts)
  mean, std = channel_stats(train.x, train.n)
  names = dataset.domain_names
  client_domains = tuple(
      tuple(names[j] for j in np.unique(domains[p])) for p in train_parts
  )
  return FederatedData(
      train=train,
      val=stack_clients(dataset.images, dataset.labels, val_parts),
      target_x=dataset.images[target_idx],
      target_y=dataset.labels[target_idx].astype(np.int32),
      num_classes=dataset.num_classes,
      class_names=dataset.class_names,
      domain_names=names,
      target_domain=None if target is None else names[target],
      source_domains=tuple(names[j] for j in source_ids),
      client_domains=client_domains,
      mean=mean,
      std=std,
      train_indices=tuple(train_parts),
      val_indices=tuple(val_parts),
      target_indices=target_idx,
      server_x=dataset.images[server_idx],
      server_y=dataset.labels[server_idx].astype(np.int32),
      server_indices=server_idx,
  )
