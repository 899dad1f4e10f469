"""The Fashion-MNIST family's shared base: the raw images and the builder.

Rotated, Styled and plain Fashion-MNIST (`rotated_fashion_mnist`,
`styled_fashion_mnist`, `fashion_mnist`) are built from the same raw images:
the IDX files of the Debian package `dataset-fashion-mnist` (or any folder
holding the four `.gz` files: `$FEDJAX_DG_FASHION_MNIST_DIR`, `manual_dir`),
else the TFDS catalog `fashion_mnist` (download). This module reads them
(`load_raw_splits`), deals them to domains the DomainBed way
(`deal_round_robin`) and holds the TFDS builder they share
(`FashionMnistBuilder`, `DealtFashionMnist`), so each builder module keeps only
what is its own: its domains and how an image looks in each.
"""

from __future__ import annotations

import gzip
import io
import os
import sys
from typing import Iterator

import numpy as np
from PIL import Image
import tensorflow_datasets as tfds

from fedjax_dg.errors import ConfigError, DataError

CLASS_NAMES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
SHUFFLE_SEED = 0
ENV_SOURCE_DIR = "FEDJAX_DG_FASHION_MNIST_DIR"
DEFAULT_SOURCE_DIR = "/usr/share/datasets/fashion-mnist"
IDX_FILES = (
    ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
)
ZALANDO_URL = (
    "https://github.com/zalandoresearch/fashion-mnist/tree/master/data/fashion"
)
TFDS_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"

MISSING_SOURCE_HELP = f"""\
Fashion-MNIST (and Rotated Fashion-MNIST) need the raw images. Do one of:
  1. sudo apt-get install dataset-fashion-mnist   (IDX files in {DEFAULT_SOURCE_DIR})
  2. export {ENV_SOURCE_DIR}=/path/to/folder holding the four IDX files
     {', '.join(f for pair in IDX_FILES for f in pair)}
     (download them from {ZALANDO_URL})
  3. allow network access so TFDS can download `fashion_mnist` (the TFDS catalog
     builder also needs `pip install tensorflow-cpu` to prepare it)."""


def source_dir_default() -> str:
  return os.environ.get(ENV_SOURCE_DIR) or DEFAULT_SOURCE_DIR


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
  """Reads an IDX file (gzipped or not) of unsigned bytes into a numpy array."""
  opener = gzip.open if os.fspath(path).endswith(".gz") else open
  with opener(path, "rb") as f:
    data = f.read()
  zero, dtype_code, ndim = data[0] * 256 + data[1], data[2], data[3]
  if zero != 0 or dtype_code != 0x08:
    raise ConfigError(f"{path}: not an IDX file of unsigned bytes")
  dims = np.frombuffer(data, dtype=">u4", count=ndim, offset=4).astype(int)
  offset = 4 + 4 * ndim
  return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(dims)


def has_idx_files(source_dir: str | os.PathLike[str]) -> bool:
  return all(
      os.path.isfile(os.path.join(source_dir, f)) for pair in IDX_FILES for f in pair
  )


SPLITS = ("train", "test")


def read_idx_splits(
    source_dir: str | os.PathLike[str],
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """{"train": (images, labels), "test": ...}: [N, 28, 28] uint8 and [N] int64."""
  out = {}
  for split, (image_file, label_file) in zip(SPLITS, IDX_FILES):
    x = read_idx(os.path.join(source_dir, image_file))
    y = read_idx(os.path.join(source_dir, label_file))
    if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
      raise ConfigError(
          f"{source_dir}: {image_file} has shape {x.shape} and {label_file} has "
          f"shape {y.shape}; expected [N, 28, 28] images and [N] labels"
      )
    out[split] = (x, y.astype(np.int64))
  return out


def _concat(
    splits: dict[str, tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray]:
  return (np.concatenate([splits[s][0] for s in SPLITS]),
          np.concatenate([splits[s][1] for s in SPLITS]))


def read_idx_dir(source_dir: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray]:
  """Train then test images [N, 28, 28] uint8 and labels [N] int64."""
  return _concat(read_idx_splits(source_dir))


def read_tfds_catalog(
    data_dir: str | None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Raw splits from the TFDS catalog `fashion_mnist` (downloads on first use)."""
  sources = tfds.data_source("fashion_mnist", data_dir=data_dir)
  out = {}
  for split in SPLITS:
    ds = sources[split]
    records = ds.__getitems__(list(range(len(ds))))
    out[split] = (np.stack([r["image"][..., 0] for r in records]),
                  np.array([r["label"] for r in records], np.int64))
  return out


def load_raw_splits(
    source_dir: str | None, data_dir: str | None = None
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Raw Fashion-MNIST by official split: IDX files first, else the TFDS
  catalog; a `$FEDJAX_DG_FASHION_MNIST_DIR` without them is an error at once
  (no download: offline, TFDS would retry for minutes before failing)."""
  env = os.environ.get(ENV_SOURCE_DIR)
  from_env = bool(env) and (not source_dir or os.path.abspath(source_dir)
                            == os.path.abspath(env))
  source_dir = source_dir or source_dir_default()
  if has_idx_files(source_dir):
    return read_idx_splits(source_dir)
  if from_env:
    missing = [f for pair in IDX_FILES for f in pair
               if not os.path.isfile(os.path.join(source_dir, f))]
    where = ("does not exist" if not os.path.isdir(source_dir)
             else f"lacks {', '.join(missing)}")
    raise DataError(
        f"{ENV_SOURCE_DIR}={source_dir!r} {where}: point it at the folder "
        "holding the four Fashion-MNIST IDX files, or unset it (then the "
        f"Debian package's {DEFAULT_SOURCE_DIR}, else a TFDS download). No "
        f"download was tried.\n{MISSING_SOURCE_HELP}")
  try:
    return read_tfds_catalog(data_dir)
  except Exception as e:  # pylint: disable=broad-except
    raise DataError(
        f"No Fashion-MNIST IDX files in {source_dir!r} and the TFDS download "
        f"failed ({type(e).__name__}: {e}).\n{MISSING_SOURCE_HELP}"
    ) from e


def load_raw(
    source_dir: str | None, data_dir: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """Raw Fashion-MNIST (train then test, concatenated): see `load_raw_splits`."""
  return _concat(load_raw_splits(source_dir, data_dir))


def deal_round_robin(
    num_examples: int, num_domains: int, seed: int = SHUFFLE_SEED
) -> tuple[np.ndarray, np.ndarray]:
  """DomainBed's shuffle-and-deal: (order, domain) with domain[p] = p % num_domains.

  `order[p]` is the raw index placed at shuffled position p; domain i holds
  `order[i::num_domains]`.
  """
  order = np.random.default_rng(seed).permutation(num_examples)
  return order, np.arange(num_examples) % num_domains


def encode_png(image: np.ndarray) -> bytes:
  buf = io.BytesIO()
  Image.fromarray(image).save(buf, format="PNG", compress_level=0)
  return buf.getvalue()


class FashionMnistBuilder(tfds.core.GeneratorBasedBuilder,
                          skip_registration=True):
  """Base of the Fashion-MNIST family: one `train` split of 28x28 images.

  Features `image` (28 x 28 x `CHANNELS`, PNG), `label` (`CLASS_NAMES`),
  `domain` (`DOMAINS`) and `source_index`; the raw images come from
  `load_raw_splits` (the IDX files in `source_dir`, else the TFDS catalog).
  The description is the docstring of the subclass's module. A subclass
  names its `DOMAINS` (and `CHANNELS`) and yields its examples from the raw
  splits (`_generate_examples`).
  """

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  MANUAL_DOWNLOAD_INSTRUCTIONS = MISSING_SOURCE_HELP
  DOMAINS: tuple[str, ...] = ()
  CHANNELS = 1

  def __init__(self, *, source_dir: str | None = None, **kwargs):
    self._source_dir = source_dir
    super().__init__(**kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        description=sys.modules[type(self).__module__].__doc__,
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(28, 28, self.CHANNELS)),
            "label": tfds.features.ClassLabel(names=CLASS_NAMES),
            "domain": tfds.features.ClassLabel(names=self.DOMAINS),
            "source_index": tfds.features.Scalar(np.int64),
        }),
        supervised_keys=("image", "label"),
        homepage="https://github.com/zalandoresearch/fashion-mnist",
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # Raw data comes from IDX files (or the TFDS catalog).
    splits = load_raw_splits(self._source_dir, os.fspath(self.data_dir_root))
    return {"train": self._generate_examples(splits)}

  def _generate_examples(
      self, splits: dict[str, tuple[np.ndarray, np.ndarray]]
  ) -> Iterator[tuple[str, dict]]:
    raise NotImplementedError


class DealtFashionMnist(FashionMnistBuilder, skip_registration=True):
  """DomainBed's recipe: train then test (70k) shuffled once, dealt
  round-robin to `DOMAINS` (`deal_round_robin`), each image drawn in its
  domain by `render`; keyed by its raw index."""

  def render(self, image: np.ndarray, domain: int, index: int) -> np.ndarray:
    """Raw [28, 28] uint8 image `index` as stored in domain `domain`."""
    raise NotImplementedError

  def _generate_examples(
      self, splits: dict[str, tuple[np.ndarray, np.ndarray]]
  ) -> Iterator[tuple[str, dict]]:
    images, labels = _concat(splits)
    order, domains = deal_round_robin(len(images), len(self.DOMAINS))
    for i, d in zip(order, domains):
      yield str(i), {
          "image": encode_png(self.render(images[i], int(d), int(i))),
          "label": int(labels[i]),
          "domain": int(d),
          "source_index": int(i),
      }
