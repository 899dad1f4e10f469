"""Where examples come from: named datasets as uint8 numpy arrays with domain labels.

`load(name)` returns a `DomainDataset` (all domains, all examples, images resized to
`image_size`). Sources:

* `rotated_fashion_mnist`: the embedded offline default, the project's own TFDS
  builder over the Debian `dataset-fashion-mnist` IDX files (DomainBed RotatedMNIST
  recipe, 6 rotation domains).
* `styled_fashion_mnist`: the same IDX files, dealt the same way to 5 colour /
  texture style domains (RGB): the embedded offline style-shift benchmark.
* `pacs`, `office_home`, `vlcs`: the project's own TFDS builders over DomainBed image
  folders `<manual_dir>/<domain>/<class>/<image>` (manual download).
* `fashion_mnist` (own builder over the same IDX files, else the TFDS catalog),
  `cifar10`, `cifar100` (TFDS catalog), `tiny_imagenet` (own builder over the
  standard `tiny-imagenet-200` folder, manual download): label-skew benchmarks
  whose *official splits are the domains* ("train" / "test"; Tiny-ImageNet
  "train" / "val"), so `target_domain="test"` holds out the official test set
  and the partitioner splits the train split among clients (`EVAL_SPLITS`).
* `domainnet` (6 domains, train + test merged per domain): the TFDS catalog.
* `mini_domainnet` (FedCCRL's miniDomainNet: 4 DomainNet domains x 126
  classes, Zhou et al.'s split files): the project's own builder over
  DomainNet's folders and `splits_mini/` (manual download).

Prepared TFDS data lives in `data_dir` (default: `data_dir_default()`, the one
rule for every entry point); the final arrays of every `load` are cached as `.npz`
next to it, so a second `load` only reads one file. `tensorflow_datasets` is
imported only when something has to be prepared or read from TFDS.

The modules below it: `registry` (what each name is), `lookup` (finding one),
`locations` (the data directory), `provenance` (the raw folder prepared data
came from), `prepared` (TFDS builders and catalog sources), `dataset` (the
in-memory `DomainDataset` and its cache), `streamed` (images read on demand),
`splits` (official splits as domains).
"""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
from fedjax_dg.data import prepared, provenance, registry, streamed
from fedjax_dg.data.dataset import (DomainDataset, cache_key, derive, load_npz,
                                    save_npz)
from fedjax_dg.data.locations import data_dir_default
from fedjax_dg.data.lookup import lookup
from fedjax_dg.data.registry import CatalogEntry, OwnEntry
from fedjax_dg.errors import ConfigError, DataError

# Datasets whose native-size arrays fit in this many bytes keep a native-size cache
# from which every other image size / subset is derived without re-reading TFDS.
NATIVE_CACHE_MAX_BYTES = 1 << 30


def _read(name: str, entry: OwnEntry | CatalogEntry, data_dir: str,
          manual_dir: str | None, image_size: int | None,
          max_per_domain: int | None, seed: int) -> DomainDataset:
  """Every image read (and decoded) from the prepared records."""
  if isinstance(entry, OwnEntry):
    return prepared.read_own(name, entry, data_dir, manual_dir, image_size,
                             max_per_domain, seed)
  return prepared.read_catalog(name, entry, data_dir, image_size,
                               max_per_domain, seed)


def _check_positive(field: str, value: int | None) -> None:
  if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
    raise ConfigError(f"{field}={value!r} is invalid: use a positive int or None")


def load(
    name: str,
    *,
    image_size: int | None = None,
    data_dir: str | None = None,
    manual_dir: str | None = None,
    max_per_domain: int | None = None,
    seed: int = 0,
    streaming: str = "off",
) -> DomainDataset:
  """Loads a named dataset (preparing it once), resized and cached as .npz.

  Args:
    name: one of `available()`.
    image_size: square side to resize to (PIL bilinear); None keeps the stored
      size (all images must then have one size).
    data_dir: prepared TFDS data and caches; default `data_dir_default()`.
    manual_dir: raw input: the image folder of pacs / office_home / vlcs, the
      tiny-imagenet-200 folder of tiny_imagenet, or the Fashion-MNIST IDX folder
      of rotated_fashion_mnist / styled_fashion_mnist / fashion_mnist.
    max_per_domain: keep at most this many seeded-random examples per domain.
    seed: seed of that subset.
    streaming: "off": every image read into memory (and cached as .npz);
      "on": the images stay in the prepared array_record files and are read
      on demand (`RecordImages`; only labels and domains are read now, and
      cached); "auto": "on" when the images would take more than
      `streamed.AUTO_STREAM_SHARE` of `streamed.host_memory()`. The same
      examples either way.

  Returns:
    A `DomainDataset`: `images` uint8 [N, H, W, ch] (H = W = `image_size`),
    `labels` int32 [N], `domains` int32 [N] (indices into `domain_names`),
    `domain_names` and `class_names`; the examples domain by domain.

  Raises:
    ConfigError: an unknown name (the message lists `available()`, the data
      directory and the rule that chose it), or a source folder changed
      since it was prepared (the message names the `prepare` to run).

  Example::

    from fedjax_dg.data import sources
    ds = sources.load("rotated_fashion_mnist", image_size=16,
                      max_per_domain=500)
    ds.images.shape      # (3000, 16, 16, 1): six domains of 500
    ds.domain_names      # ('0', '15', '30', '45', '60', '75')
  """
  _check_positive("image_size", image_size)
  _check_positive("max_per_domain", max_per_domain)
  if streaming not in streamed.STREAMING:
    raise ConfigError(f"data.streaming={streaming!r}: allowed "
                      f"{streamed.STREAMING} (auto: stream when the images "
                      f"would take more than {streamed.AUTO_STREAM_SHARE:.0%} "
                      "of the host's memory)")
  data_dir = os.path.expanduser(data_dir or data_dir_default())
  entry = lookup(name, data_dir)
  provenance.check_source(name, entry, data_dir, manual_dir)
  caches = registry.cache_dir(name, entry, data_dir)
  path = os.path.join(caches, cache_key(image_size, max_per_domain, seed) + ".npz")
  if streaming == "auto":
    size = (os.path.getsize(path) if os.path.exists(path) else
            streamed.image_bytes(name, entry, data_dir, manual_dir, image_size,
                                 max_per_domain))
    streaming = "on" if streamed.auto_streams(size) else "off"
  if streaming == "on":
    return streamed.open_dataset(name, entry, data_dir, manual_dir, image_size,
                                 max_per_domain, seed)
  if os.path.exists(path):
    return load_npz(path)
  native_path = os.path.join(caches, cache_key(None, None, 0) + ".npz")
  if entry.fixed_shape:
    if os.path.exists(native_path):
      native = load_npz(native_path)
    else:
      native = _read(name, entry, data_dir, manual_dir, None, None, 0)
      if native.images.nbytes <= NATIVE_CACHE_MAX_BYTES:
        save_npz(native_path, native)
    ds = derive(native, image_size, max_per_domain, seed)
  else:
    ds = _read(name, entry, data_dir, manual_dir, image_size, max_per_domain, seed)
  if not os.path.exists(path):
    save_npz(path, ds)
  return ds


def prepare(
    name: str, *, data_dir: str | None = None, manual_dir: str | None = None,
    dataset_name: str | None = None, force: bool = False,
) -> str:
  """Prepares a dataset once (TFDS download_and_prepare); returns a summary line.

  Datasets of fixed image shape are also decoded into the native-size cache, so
  later `load` calls at any size are fast. `name="folder"`: a DomainBed-layout
  folder of your own (`manual_dir`: <root>/<domain>/<class>/<image>) becomes
  dataset `dataset_name` (domains and classes read from the folders), loadable
  by that name (`data.name`). Data prepared from another folder, or from this
  one before it changed (`provenance.source_change`), are prepared again, and
  the line says why; `force`: prepared again whatever the records say (a catalog
  dataset: its TFDS folders and caches removed first).
  """
  data_dir = os.path.expanduser(data_dir or data_dir_default())
  reason = None
  if name == "folder":
    name, entry, reason = _user_folder(dataset_name, manual_dir, data_dir)
  else:
    if dataset_name:
      raise ConfigError(f"--name {dataset_name!r} names a folder dataset: use "
                        "`prepare folder --manual-dir DIR --name NAME`")
    entry = lookup(name, data_dir)
  start = time.perf_counter()
  if manual_dir and not os.path.isdir(manual_dir):
    raise DataError(f"{name}: --manual-dir {manual_dir!r} is not a folder")
  if isinstance(entry, OwnEntry):
    # Prepared from another (or a changed) folder, or from an unknown one while
    # a folder is named: prepare again (the caches go with the prepared data).
    done = registry.prepared_dir(entry, data_dir)
    before = provenance.recorded_source(entry, data_dir)
    folder = provenance.source_folder(name, data_dir, manual_dir, before)
    now = provenance.source_fingerprint(folder)
    if (name in registry.FASHION_MNIST_SOURCED
        and provenance.unlisted(before, now)):
      # Their labels are inside the IDX files, not in file paths: a record
      # from before the listing, equal on the rest, is completed in place.
      provenance.record_source(entry, data_dir, folder)
      before = provenance.recorded_source(entry, data_dir)
    reason = reason or provenance.stale(before, now, manual_dir)
    if force and os.path.isdir(done):
      reason = reason or "--force"
    if reason and os.path.isdir(done):
      shutil.rmtree(done)
    builder = prepared.own_builder(entry, data_dir, folder, name, prepare=True)
    where = os.fspath(builder.data_dir)
    if entry.builder == "Folder":  # loadable by its name from now on
      with open(os.path.join(where, registry.FOLDER_RECORD), "w") as f:
        json.dump({"domains": list(entry.domains),
                   "channels": entry.channels}, f)
  else:
    if force and _remove_catalog(name, entry, data_dir):
      reason = "--force"
    prepared.catalog_sources(entry, data_dir)
    where = data_dir
  if entry.fixed_shape:
    ds = load(name, data_dir=data_dir, manual_dir=manual_dir)
    summary = ds.summary()
  else:
    summary = prepared.summary_without_images(name, entry, data_dir)
  again = f"prepared again ({reason}); " if reason else ""
  return (f"{summary}; {again}ready in {time.perf_counter() - start:.1f} s at "
          f"{where}")


def _remove_catalog(name: str, entry: CatalogEntry, data_dir: str) -> bool:
  """Removes a catalog dataset's prepared TFDS folders and caches (`prepare
  --force`); whether there was anything to remove."""
  folders = [registry.cache_dir(name, entry, data_dir)] + [
      os.path.join(data_dir, *(c if isinstance(c, str) else c[0]).split("/"))
      for c in entry.configs.values()]
  found = [f for f in dict.fromkeys(folders) if os.path.isdir(f)]
  for f in found:
    shutil.rmtree(f)
  return bool(found)


def _user_folder(dataset_name: str | None, manual_dir: str | None,
                 data_dir: str) -> tuple[str, OwnEntry, str | None]:
  """(name, entry, why its prepared data must go: None if they may stay) of
  `prepare folder`. Its images are stored with one channel when every one of
  them is grayscale (`domainbed_folder.folder_channels`), else as RGB."""
  # Imported here: the builders import tensorflow_datasets (seconds).
  from fedjax_dg.data.builders.domainbed_folder import (  # pylint: disable=g-import-not-at-top
      folder_builder, folder_channels, folder_domains)
  if not dataset_name or not manual_dir:
    raise ConfigError("prepare folder needs --manual-dir DIR (the folder: "
                      "<root>/<domain>/<class>/<image>) and --name NAME (how "
                      "runs name it: --set data.name=NAME)")
  if dataset_name in registry.BUILT_IN or dataset_name == "folder":
    raise ConfigError(f"--name {dataset_name!r} is a built-in dataset; choose "
                      "another name")
  domains = folder_domains(manual_dir, dataset_name)
  cls = folder_builder(dataset_name, domains)  # validates the name
  channels = folder_channels(cls.scan_manual(manual_dir, dataset_name))
  entry = registry.folder_entry(dataset_name, domains, channels)
  reason = None
  if os.path.isdir(registry.prepared_dir(entry, data_dir)):
    known = registry.user_datasets(data_dir).get(dataset_name)
    if known is None or known.domains != entry.domains:
      reason = "other domain folders"
    elif known.channels != entry.channels:
      reason = ("every image is grayscale now: one channel" if channels == 1
                else "not every image is grayscale now: RGB")
  return dataset_name, entry, reason
