"""Synthetic data for the benchmarks: random images, where cost, not learning,
is measured."""

from __future__ import annotations

import numpy as np


def random_dataset(images: int, shape: tuple[int, ...], seed: int = 0):
  """One domain of `images` random uint8 images of `shape` with 10 random
  classes (a DomainDataset)."""
  from fedjax_dg.data.sources import DomainDataset
  rng = np.random.default_rng(seed)
  return DomainDataset(
      name="bench", images=rng.integers(0, 256, (images,) + shape, np.uint8),
      labels=rng.integers(0, 10, images).astype(np.int32),
      domains=np.zeros(images, np.int32), domain_names=("all",),
      class_names=tuple(f"c{i}" for i in range(10)))
