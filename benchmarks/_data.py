"""Synthetic data for the benchmarks: random images, where cost, not learning,
is measured."""

from __future__ import annotations

import functools

import numpy as np


def random_dataset(images: int, shape: tuple[int, ...], seed: int = 0):
  """One domain of `images` random uint8 images of `shape` with 10 random
  classes (a DomainDataset)."""
  from fedjax_dg.data.dataset import DomainDataset
  rng = np.random.default_rng(seed)
  return DomainDataset(
      name="bench", images=rng.integers(0, 256, (images,) + shape, np.uint8),
      labels=rng.integers(0, 10, images).astype(np.int32),
      domains=np.zeros(images, np.int32), domain_names=("all",),
      class_names=tuple(f"c{i}" for i in range(10)))


def client_sizes(total: int, num_clients: int, skew: float = 0.3,
                 seed: int = 0) -> np.ndarray:
  """int64 [num_clients]: how many of `total` examples each client holds, at
  least 1 each, summing to `total`. Shares are log-normal (sigma `skew`; 0:
  equal), rounded by largest remainder; a pure function of the arguments."""
  if not 1 <= num_clients <= total or skew < 0:
    raise ValueError(f"client_sizes: need 1 <= num_clients={num_clients} <= "
                     f"total={total} and skew={skew} >= 0")
  rng = np.random.default_rng([seed, num_clients])
  share = rng.lognormal(0.0, skew, num_clients)
  raw = share / share.sum() * (total - num_clients)  # above the 1 each
  sizes = np.floor(raw).astype(np.int64)
  left = (total - num_clients) - int(sizes.sum())
  sizes[np.argsort(sizes - raw, kind="stable")[:left]] += 1
  return sizes + 1


@functools.lru_cache(maxsize=1)
def synthetic_examples(total: int, shape: tuple[int, ...], seed: int = 0):
  """`total` random uint8 images of `shape` and int32 labels (10 classes),
  generated once per process and shared by every federation over them."""
  rng = np.random.default_rng(seed)
  x = np.frombuffer(rng.bytes(total * int(np.prod(shape))), np.uint8)
  return x.reshape((total,) + tuple(shape)), rng.integers(
      0, 10, total).astype(np.int32)


def synthetic_federation(num_clients: int, total: int = 1_000_000,
                         shape: tuple[int, ...] = (28, 28, 1),
                         skew: float = 0.3, seed: int = 0):
  """A FederatedData of `total` synthetic examples over `num_clients` clients
  of `client_sizes`, stored packed (one [total, *shape] uint8 array, shared by
  every `num_clients`, and per-client offsets; 1 M 28x28x1 images = 748 MiB),
  no id-val split and no target domain."""
  from fedjax_dg.data.federated import FederatedData, PackedClients
  x, y = synthetic_examples(total, tuple(shape), seed)
  offsets = np.concatenate([[0], np.cumsum(client_sizes(total, num_clients,
                                                        skew, seed))])
  return FederatedData(
      packed_train=PackedClients(x=x, y=y, offsets=offsets),
      packed_val=PackedClients(x=x[:0], y=y[:0],
                               offsets=np.zeros(num_clients + 1, np.int64)),
      target_x=x[:0], target_y=y[:0], num_classes=10,
      class_names=tuple(f"c{i}" for i in range(10)), domain_names=("all",),
      target_domain=None, source_domains=("all",),
      client_domains=(("all",),) * num_clients)
