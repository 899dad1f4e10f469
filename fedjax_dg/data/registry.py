"""The named datasets: what each name is and where its prepared data and caches go.

A name is either one of the project's own TFDS builders (`OwnEntry`: the
embedded Fashion-MNIST datasets, the DomainBed folders, Tiny-ImageNet, a user's
folder prepared with `prepare folder`) or a TFDS catalog dataset
(`CatalogEntry`). `BUILT_IN` lists the built-in names; `user_datasets` finds the
user's folder datasets in a data directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Mapping

from fedjax_dg.data.locations import data_dir_default

CACHE_DIRNAME = "fedjax_dg_cache"
DOMAINNET_DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")


@dataclasses.dataclass(frozen=True)
class OwnEntry:
  """A dataset prepared by one of the project's own TFDS builders."""

  builder: str  # Class name in fedjax_dg.data.builders ("Folder": a user's).
  tfds_name: str
  version: str
  channels: int
  fixed_shape: bool  # Stored images all have one known shape (native cache OK).
  domains: tuple[str, ...] = ()  # a user's folder dataset: its domain folders


@dataclasses.dataclass(frozen=True)
class CatalogEntry:
  """A TFDS catalog dataset read through `tfds.data_source`.

  `configs` maps a domain name to a TFDS name (with config), whose splits are all
  merged into that domain, or to a (TFDS name, split) pair: the official split
  alone is the domain.
  """

  configs: Mapping[str, str | tuple[str, str]]
  channels: int
  fixed_shape: bool

  @property
  def cache_tag(self) -> str:
    """Separates caches of the splits-as-domains layout from the merged one."""
    split = any(isinstance(v, tuple) for v in self.configs.values())
    return "-splits" if split else ""


def _splits(tfds_name: str) -> dict[str, tuple[str, str]]:
  """The official train and test split of a catalog dataset as two domains."""
  return {"train": (tfds_name, "train"), "test": (tfds_name, "test")}


BUILT_IN: dict[str, OwnEntry | CatalogEntry] = {
    "rotated_fashion_mnist": OwnEntry("RotatedFashionMnist",
                                      "rotated_fashion_mnist", "1.0.0", 1, True),
    "styled_fashion_mnist": OwnEntry("StyledFashionMnist", "styled_fashion_mnist",
                                     "1.0.0", 3, True),
    "pacs": OwnEntry("Pacs", "pacs", "1.0.0", 3, False),
    "office_home": OwnEntry("OfficeHome", "office_home", "1.0.0", 3, False),
    "vlcs": OwnEntry("Vlcs", "vlcs", "1.0.0", 3, False),
    "fashion_mnist": OwnEntry("FashionMnistSplits", "fashion_mnist_splits",
                              "1.0.0", 1, True),
    "cifar10": CatalogEntry(_splits("cifar10"), 3, True),
    "cifar100": CatalogEntry(_splits("cifar100"), 3, True),
    "tiny_imagenet": OwnEntry("TinyImagenet", "tiny_imagenet", "1.0.0", 3, True),
    "domainnet": CatalogEntry({d: f"domainnet/{d}" for d in DOMAINNET_DOMAINS},
                              3, False),
    "mini_domainnet": OwnEntry("MiniDomainnet", "mini_domainnet", "1.0.0", 3,
                               False),
}


# Datasets built from the raw Fashion-MNIST IDX files (`manual_dir`: that folder,
# default `$FEDJAX_DG_FASHION_MNIST_DIR` or the Debian package's).
FASHION_MNIST_SOURCED = ("rotated_fashion_mnist", "styled_fashion_mnist",
                         "fashion_mnist")


FOLDER_RECORD = "fedjax_dg_folder.json"  # marks a user's prepared folder dataset


def folder_entry(name: str, domains, channels: int = 3) -> OwnEntry:
  """The entry of a user's folder dataset `name` (`prepare folder`)."""
  return OwnEntry("Folder", name, "1.0.0", channels, False, tuple(domains))


def user_datasets(data_dir: str | None = None) -> dict[str, OwnEntry]:
  """The folder datasets prepared with `prepare folder --name NAME` in
  `data_dir` (default: `data_dir_default()`)."""
  data_dir = os.path.expanduser(data_dir or data_dir_default())
  out = {}
  if os.path.isdir(data_dir):
    for name in sorted(os.listdir(data_dir)):
      record = os.path.join(data_dir, name, "1.0.0", FOLDER_RECORD)
      if os.path.exists(record):
        with open(record) as f:
          info = json.load(f)  # prepared before "channels" was kept: RGB
        out[name] = folder_entry(name, info["domains"],
                                 info.get("channels", 3))
  return out


def available(data_dir: str | None = None) -> tuple[str, ...]:
  """The built-in dataset names, then the user's prepared folder datasets."""
  return tuple(BUILT_IN) + tuple(n for n in user_datasets(data_dir)
                                 if n not in BUILT_IN)


def cache_dir(name: str, entry: OwnEntry | CatalogEntry, data_dir: str) -> str:
  """Where `load` caches the dataset's arrays."""
  if isinstance(entry, OwnEntry):  # Inside the prepared dataset: removed with it.
    return os.path.join(data_dir, entry.tfds_name, entry.version, CACHE_DIRNAME)
  return os.path.join(data_dir, CACHE_DIRNAME, name + entry.cache_tag)


def manual_dir_default(name: str, data_dir: str) -> str:
  """`FEDJAX_DG_<NAME>_DIR`, else `<data_dir>/downloads/manual/<name>`."""
  if name in FASHION_MNIST_SOURCED:
    # Imported here: the builders import tensorflow_datasets.
    from fedjax_dg.data.builders import fashion_mnist_base  # pylint: disable=g-import-not-at-top
    return fashion_mnist_base.source_dir_default()
  env = os.environ.get(f"FEDJAX_DG_{name.upper()}_DIR")
  return env or os.path.join(data_dir, "downloads", "manual", name)


def prepared_dir(entry: OwnEntry, data_dir: str) -> str:
  """Where an own builder's prepared array_record files are."""
  return os.path.join(data_dir, entry.tfds_name, entry.version)
