"""The streamed reader: a dataset whose images stay in their array_record files.

`load(..., streaming="on")` reads only the labels and domains (and caches them);
the images are `images.RecordImages`, read from the prepared records on demand.
"auto" streams a dataset whose images would not fit comfortably in memory
(`auto_streams`).
"""

from __future__ import annotations

import os

import numpy as np
from fedjax_dg.data.dataset import (DomainDataset, cache_key, domain_records,
                                    subset_per_domain)
from fedjax_dg.data.images import Concat, RecordImages, decode_image, read_records
from fedjax_dg.data.prepared import records_of
from fedjax_dg.data.registry import CatalogEntry, OwnEntry, cache_dir
from fedjax_dg.errors import ConfigError

STREAMING = ("auto", "on", "off")
# "auto" streams a dataset whose images (at the size asked for) take more than
# this share of the memory the process may use (`host_memory`): loaded whole,
# a run holds about three times them (the arrays, the clients' packed copies
# with the target split, and the padded view of the "device" placement).
AUTO_STREAM_SHARE = 0.25


def host_memory() -> int:
  """Bytes of memory this process may use: the host's RAM, or the cgroup's
  limit where it is lower (containers, Colab)."""
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  try:
    with open("/sys/fs/cgroup/memory.max") as f:
      limit = f.read().strip()
    return min(ram, int(limit)) if limit.isdigit() else ram
  except OSError:
    return ram


def auto_streams(image_bytes: int) -> bool:
  """Whether `streaming="auto"` streams a dataset of `image_bytes` images."""
  return image_bytes > AUTO_STREAM_SHARE * host_memory()


def plan(source, groups, max_per_domain: int | None, seed: int):
  """(records [N], labels [N], domains [N]) of the kept examples in the
  order `load` gives them (domain-major, record order within a domain): the
  labels and domains read, no image decoded."""
  if groups is None:  # own builders: every record names its domain
    meta = read_records(source, range(len(source)), fields=("label", "domain"))
    domains = np.asarray(meta["domain"], np.int32)
    keep = subset_per_domain(domains, max_per_domain, seed)
    order = keep[np.argsort(domains[keep], kind="stable")]
    return order, np.asarray(meta["label"], np.int32)[order], domains[order]
  _, records, domains = domain_records(groups, max_per_domain, seed)
  labels = read_records(source, records, fields=("label",))["label"]
  return records, np.asarray(labels, np.int32), domains


def open_dataset(name: str, entry: OwnEntry | CatalogEntry, data_dir: str,
                 manual_dir: str | None, image_size: int | None,
                 max_per_domain: int | None, seed: int) -> DomainDataset:
  """The dataset of `load` with `streaming="on"`: labels and domains in
  memory (cached beside the other caches), images `RecordImages`."""
  source, groups, class_names, domain_names = records_of(
      name, entry, data_dir, manual_dir)
  caches = cache_dir(name, entry, data_dir)
  # Which records, their labels and domains: the same at every image size.
  plan_path = os.path.join(caches, "records-" + cache_key(
      None, max_per_domain, seed) + ".npz")
  if os.path.exists(plan_path):
    with np.load(plan_path) as z:
      records, labels, domains = z["records"], z["labels"], z["domains"]
  else:
    records, labels, domains = plan(source, groups, max_per_domain, seed)
    os.makedirs(caches, exist_ok=True)
    tmp = f"{plan_path}.tmp-{os.getpid()}.npz"
    np.savez(tmp, records=records, labels=labels, domains=domains)
    os.replace(tmp, plan_path)
  if not len(records):
    raise ConfigError(f"{name}: no images were read")
  if image_size is not None:
    shape = (image_size, image_size, entry.channels)
  elif entry.fixed_shape:
    first = read_records(source, records[:1], fields=("image",))["image"][0]
    shape = decode_image(first, entry.channels, None).shape
  else:
    raise ConfigError(
        f"{name}: its images have different sizes, so streaming it needs one "
        "size to decode them to: set image_size (data.image_size)")
  images = RecordImages(source, records, channels=entry.channels,
                        image_size=image_size, image_shape=shape, name=name)
  stats = os.path.join(caches, cache_key(image_size, max_per_domain, seed)
                       + "-stats.json")
  return DomainDataset(name=name, images=images, labels=labels,
                       domains=domains, domain_names=domain_names,
                       class_names=class_names, stats_file=stats)


def image_bytes(name: str, entry: OwnEntry | CatalogEntry, data_dir: str,
                manual_dir: str | None, image_size: int | None,
                max_per_domain: int | None) -> int:
  """The bytes `load` would read into memory, from the prepared data's
  metadata (no record read): the record count (at most `max_per_domain`
  per domain) x the decoded image size; 0 where the stored images have no
  one shape and no `image_size` is given (they cannot be stacked anyway)."""
  source, _, _, domain_names = records_of(name, entry, data_dir, manual_dir)
  count = len(source)
  if max_per_domain is not None:
    count = min(count, max_per_domain * len(domain_names))
  if image_size is not None:
    return count * image_size * image_size * entry.channels
  info = (source.sources[0] if isinstance(source, Concat) else
          source).dataset_info
  shape = info.features["image"].shape
  if None in shape:
    return 0
  return count * int(np.prod(shape[:2])) * entry.channels
