"""The in-memory form of a dataset: `DomainDataset`, assembled from records.

Every named dataset (`sources.load`) ends as one `DomainDataset`: uint8 images,
int32 labels and domains, domain-major. This module holds that record, the pure
steps that assemble it from random-access record sources (tested with fake
sources, no TFDS), and its `.npz` cache file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from fedjax_dg.data.images import (STATS_BLOCK_BYTES, Concat, RecordImages,
                                   channel_stats, decode_image, read_records)
from fedjax_dg.errors import ConfigError

CACHE_FORMAT = 1  # Bump when the cached arrays change meaning.


@dataclasses.dataclass(frozen=True, eq=False)
class DomainDataset:
  """All examples of a multi-domain image dataset: labels and domains as host
  numpy arrays, images as one too, or streamed (`RecordImages`: read from
  their records on demand, `load(..., streaming=...)`)."""

  name: str
  images: Any  # uint8 [N, H, W, ch]: an array, or RecordImages (streamed)
  labels: np.ndarray  # int32 [N]
  domains: np.ndarray  # int32 [N], index into domain_names
  domain_names: tuple[str, ...]
  class_names: tuple[str, ...]
  # A streamed dataset's channel statistics, once computed (a pass over its
  # records): a JSON file beside its caches.
  stats_file: str | None = None

  @property
  def streamed(self) -> bool:
    return isinstance(self.images, RecordImages)

  def channel_stats(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel (mean, std) of every image (`images.channel_stats`); a
    streamed dataset's are computed once and kept in `stats_file`."""
    if self.stats_file and os.path.exists(self.stats_file):
      with open(self.stats_file) as f:
        stats = json.load(f)
      return tuple(stats["mean"]), tuple(stats["std"])
    mean, std = channel_stats(self.images)
    if self.stats_file:
      _write_json(self.stats_file, dict(mean=mean, std=std))
    return mean, std

  @property
  def num_classes(self) -> int:
    return len(self.class_names)

  def fingerprint(self) -> str:
    """A cheap identity of the examples: names, shapes, every label and domain,
    and ~1,000 evenly spaced images (a resumed run refuses other data)."""
    h = hashlib.sha1(repr((self.name, self.images.shape, self.domain_names,
                           self.class_names)).encode())
    for a in (self.labels, self.domains):
      h.update(np.ascontiguousarray(a).tobytes())
    rows = np.arange(0, len(self.images), max(1, len(self.images) // 1024))
    block = max(1, STATS_BLOCK_BYTES // max(1, int(np.prod(self.image_shape))))
    for start in range(0, len(rows), block):  # streamed: read in blocks
      h.update(np.ascontiguousarray(
          self.images[rows[start:start + block]]).tobytes())
    return h.hexdigest()[:16]

  @property
  def num_domains(self) -> int:
    return len(self.domain_names)

  @property
  def num_examples(self) -> int:
    return int(self.labels.shape[0])

  @property
  def image_shape(self) -> tuple[int, ...]:
    return tuple(self.images.shape[1:])

  def domain_counts(self) -> dict[str, int]:
    counts = np.bincount(self.domains, minlength=self.num_domains)
    return dict(zip(self.domain_names, counts.tolist()))

  def summary(self) -> str:
    h, w, ch = self.image_shape
    counts = ", ".join(f"{d}: {n}" for d, n in self.domain_counts().items())
    return (
        f"{self.name}: {self.num_examples} images {h}x{w}x{ch}, "
        f"{self.num_classes} classes, {self.num_domains} domains ({counts})"
    )


# ---------------------------------------------------------------------------
# Decoding and assembling records (pure; tested with fake data sources).


def stack_images(images: Sequence[np.ndarray], name: str) -> np.ndarray:
  """Stacks equally sized images; says to pass `image_size` when they differ."""
  if not images:
    raise ConfigError(f"{name}: no images were read")
  shapes = {im.shape for im in images}
  if len(shapes) > 1:
    some = sorted(shapes)[:3]
    raise ConfigError(
        f"{name}: images have different sizes (e.g. {some}); pass image_size=... "
        "to load() to resize them to one square size"
    )
  return np.stack(images)


def subset_per_domain(
    domains: np.ndarray, max_per_domain: int | None, seed: int
) -> np.ndarray:
  """Sorted indices keeping at most `max_per_domain` seeded-random examples/domain."""
  if max_per_domain is None:
    return np.arange(len(domains))
  rng = np.random.default_rng(seed)
  keep = []
  for d in np.unique(domains):
    idx = np.flatnonzero(domains == d)
    if len(idx) > max_per_domain:
      idx = np.sort(rng.choice(idx, max_per_domain, replace=False))
    keep.append(idx)
  return np.sort(np.concatenate(keep))


def _finalize(
    name: str,
    images: np.ndarray,
    labels: Iterable[int],
    domains: Iterable[int],
    domain_names: Sequence[str],
    class_names: Sequence[str],
) -> DomainDataset:
  labels = np.asarray(list(labels), np.int32)
  domains = np.asarray(list(domains), np.int32)
  order = np.argsort(domains, kind="stable")  # Domain-major, record order within.
  return DomainDataset(
      name=name,
      images=np.ascontiguousarray(images[order]),
      labels=labels[order],
      domains=domains[order],
      domain_names=tuple(domain_names),
      class_names=tuple(class_names),
  )


def dataset_from_domain_field(
    name: str,
    source: Any,
    *,
    domain_names: Sequence[str],
    class_names: Sequence[str],
    channels: int,
    image_size: int | None = None,
    max_per_domain: int | None = None,
    seed: int = 0,
) -> DomainDataset:
  """One data source whose records hold `image`, `label` and `domain`."""
  decode = lambda im: decode_image(im, channels, image_size)
  all_idx = range(len(source))
  if max_per_domain is None:
    rec = read_records(source, all_idx, fields=("image", "label", "domain"),
                       decode=decode)
  else:  # Two passes: domains of every record first, then decode only the subset.
    meta = read_records(source, all_idx, fields=("domain",))
    keep = subset_per_domain(np.asarray(meta["domain"]), max_per_domain, seed)
    rec = read_records(source, keep.tolist(), fields=("image", "label", "domain"),
                       decode=decode)
  return _finalize(name, stack_images(rec["image"], name), rec["label"],
                   rec["domain"], domain_names, class_names)


def domain_records(
    domain_sources: Mapping[str, Sequence[Any]],
    max_per_domain: int | None,
    seed: int,
) -> tuple[Concat, np.ndarray, np.ndarray]:
  """(one source over all of them, the kept records [N] in it, their domains
  [N]): every record of each domain, or a seeded-random `max_per_domain` of
  them, domain by domain in record order."""
  rng = np.random.default_rng(seed)
  every = Concat([s for group in domain_sources.values() for s in group])
  records, domains, base = [], [], 0
  for d, group in enumerate(domain_sources.values()):
    total = sum(len(s) for s in group)
    picks = np.arange(total)
    if max_per_domain is not None and total > max_per_domain:
      picks = np.sort(rng.choice(picks, max_per_domain, replace=False))
    records.append(base + picks)
    domains.append(np.full(len(picks), d, np.int32))
    base += total
  return every, np.concatenate(records), np.concatenate(domains)


def dataset_from_sources(
    name: str,
    domain_sources: Mapping[str, Sequence[Any]],
    *,
    class_names: Sequence[str],
    channels: int,
    image_size: int | None = None,
    max_per_domain: int | None = None,
    seed: int = 0,
) -> DomainDataset:
  """Data sources grouped by domain (e.g. the train and test split of each domain).

  Records hold `image` (encoded bytes or an array) and `label`. With
  `max_per_domain`, only the seeded-random subset of each domain is decoded.
  """
  source, records, domains = domain_records(domain_sources, max_per_domain, seed)
  rec = read_records(source, records, fields=("image", "label"),
                     decode=lambda im: decode_image(im, channels, image_size))
  return _finalize(name, stack_images(rec["image"], name), rec["label"],
                   domains, tuple(domain_sources), class_names)


def derive(
    ds: DomainDataset, image_size: int | None, max_per_domain: int | None, seed: int
) -> DomainDataset:
  """Subsets (seeded, per domain) and resizes an already loaded dataset."""
  keep = subset_per_domain(ds.domains, max_per_domain, seed)
  images = ds.images[keep]
  if image_size is not None and images.shape[1:3] != (image_size, image_size):
    ch = images.shape[-1]
    images = np.stack([decode_image(im, ch, image_size) for im in images])
  return dataclasses.replace(
      ds, images=images, labels=ds.labels[keep], domains=ds.domains[keep]
  )


# ---------------------------------------------------------------------------
# The npz cache.


def save_npz(path: str, ds: DomainDataset) -> None:
  """Writes atomically (temporary file, then rename)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp-{os.getpid()}.npz"
  np.savez(
      tmp, images=ds.images, labels=ds.labels, domains=ds.domains,
      domain_names=np.array(ds.domain_names), class_names=np.array(ds.class_names),
      name=np.array(ds.name), format=np.array(CACHE_FORMAT),
  )
  os.replace(tmp, path)


def load_npz(path: str) -> DomainDataset:
  with np.load(path, allow_pickle=False) as z:
    return DomainDataset(
        name=str(z["name"]),
        images=z["images"],
        labels=z["labels"],
        domains=z["domains"],
        domain_names=tuple(str(s) for s in z["domain_names"]),
        class_names=tuple(str(s) for s in z["class_names"]),
    )


def cache_key(
    image_size: int | None, max_per_domain: int | None, seed: int
) -> str:
  key = f"v{CACHE_FORMAT}-size{image_size or 'native'}-max{max_per_domain or 'all'}"
  return key + (f"-seed{seed}" if max_per_domain is not None else "")


def _write_json(path: str, value) -> None:
  """Writes atomically (temporary file, then rename)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(value, f)
  os.replace(tmp, path)
