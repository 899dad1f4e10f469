"""Prepared array_record data through TFDS: build (once) and open a dataset's records.

An own builder is constructed, validated against its raw folder and prepared
the first time (`own_builder`, recording its source: `provenance`); a catalog
dataset is opened with `tfds.data_source` (`catalog_sources`). Images are read
undecoded (`SkipDecoding`) and decoded by `images.decode_image`.
`tensorflow_datasets` is imported only inside these functions: importing
fedjax_dg does not import it (it is only needed to prepare or read data).
"""

from __future__ import annotations

import os

import numpy as np
from fedjax_dg.data.dataset import (DomainDataset, dataset_from_domain_field,
                                    dataset_from_sources)
from fedjax_dg.data.images import Concat, read_records
from fedjax_dg.data.provenance import record_source
from fedjax_dg.data.registry import (FASHION_MNIST_SOURCED, CatalogEntry,
                                     OwnEntry, manual_dir_default)
from fedjax_dg.errors import ConfigError, DataError


def _builder_prepared(builder) -> bool:
  """`builder.is_prepared()` without the warning TFDS logs for every dataset
  not prepared yet ("Variant folder ... has no dataset_info.json"), which
  `prepare` would print before every first preparation."""
  info = os.path.join(os.fspath(builder.data_path), "dataset_info.json")
  return os.path.exists(info) and builder.is_prepared()


def own_builder(entry: OwnEntry, data_dir: str, manual_dir: str | None,
                name: str, prepare: bool):
  """Constructs the builder and prepares it if needed (recording the source
  folder it was built from); validates inputs first."""
  # Imported here: tensorflow_datasets (and the builders, which import it)
  # take seconds to import, and only preparing needs them.
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from fedjax_dg.data import builders  # pylint: disable=g-import-not-at-top
  if entry.builder == "Folder":
    from fedjax_dg.data.builders.domainbed_folder import folder_builder  # pylint: disable=g-import-not-at-top
    cls = folder_builder(entry.tfds_name, entry.domains, entry.channels)
  else:
    cls = getattr(builders, entry.builder)
  manual_dir = manual_dir or manual_dir_default(name, data_dir)
  if name in FASHION_MNIST_SOURCED:
    builder = cls(data_dir=data_dir, file_format="array_record",
                  source_dir=manual_dir)
    if prepare and not _builder_prepared(builder):
      builder.download_and_prepare()
      record_source(entry, data_dir, manual_dir)
    return builder
  builder = cls(data_dir=data_dir, file_format="array_record")
  if prepare and not _builder_prepared(builder):
    # Folder builders (DomainBed folders, Tiny-ImageNet): validate the folder and
    # read the class names first; errors name the layout and the download.
    index = cls.scan_manual(manual_dir, name)
    builder = cls(data_dir=data_dir, file_format="array_record",
                  class_names=index.class_names)
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=index.root)
    )
    record_source(entry, data_dir, manual_dir)
    builder = cls(data_dir=data_dir, file_format="array_record")
  return builder


def read_own(name: str, entry: OwnEntry, data_dir: str, manual_dir: str | None,
             image_size: int | None, max_per_domain: int | None,
             seed: int) -> DomainDataset:
  """Every example of an own builder's dataset (prepared first if needed)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  builder = own_builder(entry, data_dir, manual_dir, name, prepare=True)
  source = builder.as_data_source(
      decoders={"image": tfds.decode.SkipDecoding()}
  )["train"]
  features = builder.info.features
  return dataset_from_domain_field(
      name, source,
      domain_names=features["domain"].names,
      class_names=features["label"].names,
      channels=entry.channels, image_size=image_size,
      max_per_domain=max_per_domain, seed=seed,
  )


def catalog_error(tfds_name: str, error: Exception) -> DataError:
  """Explains why a TFDS catalog dataset could not be prepared."""
  hint = ""
  if isinstance(error, ModuleNotFoundError) and "tensorflow" in str(error):
    hint = (
        "The TFDS catalog builder needs TensorFlow to *prepare* the data (reading "
        "prepared array_record data does not): pip install tensorflow-cpu, or "
        "prepare it on another machine and copy the data_dir here. "
    )
  return DataError(
      f"could not prepare the TFDS catalog dataset {tfds_name!r} "
      f"({type(error).__name__}: {error}). {hint}It downloads on first use, so "
      "network access is needed once."
  )


def catalog_sources(entry: CatalogEntry, data_dir: str):
  """({domain: [TFDS data sources]}, class names) of a catalog dataset
  (downloaded and prepared by TFDS on first use)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  sources, class_names, opened = {}, None, {}
  for domain, config in entry.configs.items():
    tfds_name, split = config if isinstance(config, tuple) else (config, None)
    if tfds_name not in opened:
      try:
        opened[tfds_name] = tfds.data_source(
            tfds_name, data_dir=data_dir,
            decoders={"image": tfds.decode.SkipDecoding()},
        )
      except Exception as e:  # pylint: disable=broad-except
        raise catalog_error(tfds_name, e) from e
    splits = opened[tfds_name]
    if split is None:
      sources[domain] = [splits[s] for s in sorted(splits)]
    elif split in splits:
      sources[domain] = [splits[split]]
    else:
      raise ConfigError(f"TFDS dataset {tfds_name!r} has no split {split!r} "
                       f"(it has {sorted(splits)})")
    info = sources[domain][0].dataset_info
    class_names = tuple(info.features["label"].names)
  return sources, class_names


def read_catalog(name: str, entry: CatalogEntry, data_dir: str,
                 image_size: int | None, max_per_domain: int | None,
                 seed: int) -> DomainDataset:
  """Every example of a catalog dataset."""
  sources, class_names = catalog_sources(entry, data_dir)
  return dataset_from_sources(
      name, sources, class_names=class_names, channels=entry.channels,
      image_size=image_size, max_per_domain=max_per_domain, seed=seed,
  )


def records_of(name: str, entry: OwnEntry | CatalogEntry, data_dir: str,
               manual_dir: str | None):
  """(one random-access source over the dataset's records, its records'
  grouping: for own builders None (records carry their `domain`), for the
  catalog {domain: [sources]}, class names, domain names)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  if isinstance(entry, OwnEntry):
    builder = own_builder(entry, data_dir, manual_dir, name, prepare=True)
    source = builder.as_data_source(
        decoders={"image": tfds.decode.SkipDecoding()})["train"]
    features = builder.info.features
    return (source, None, tuple(features["label"].names),
            tuple(features["domain"].names))
  groups, class_names = catalog_sources(entry, data_dir)
  return Concat([s for g in groups.values() for s in g]), groups, \
      class_names, tuple(groups)


def summary_without_images(name: str, entry: OwnEntry | CatalogEntry,
                           data_dir: str) -> str:
  """Counts per domain from the record metadata only (no image decoding)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  if isinstance(entry, OwnEntry):
    builder = own_builder(entry, data_dir, None, name, prepare=False)
    source = builder.as_data_source(
        decoders={"image": tfds.decode.SkipDecoding()})["train"]
    domains = np.asarray(read_records(source, range(len(source)),
                                      fields=("domain",))["domain"])
    names = builder.info.features["domain"].names
    counts = np.bincount(domains, minlength=len(names)).tolist()
    num_classes = builder.info.features["label"].num_classes
  else:
    sources, class_names = catalog_sources(entry, data_dir)
    names = list(sources)
    counts = [sum(len(s) for s in sources[d]) for d in names]
    num_classes = len(class_names)
  per_domain = ", ".join(f"{d}: {n}" for d, n in zip(names, counts))
  colour = ", grayscale (1 channel)" if entry.channels == 1 else ", RGB"
  return (f"{name}: {sum(counts)} images{colour}, {num_classes} classes, "
          f"{len(names)} domains ({per_domain})")
