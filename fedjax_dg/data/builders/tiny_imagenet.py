"""Tiny-ImageNet (200 classes, 64x64 RGB) with its official splits as domains.

Manual download: the standard folder `tiny-imagenet-200/`

    wnids.txt                                  the 200 class ids (WordNet ids)
    train/<wnid>/images/<wnid>_<k>.JPEG         500 per class (100,000)
    val/images/val_<k>.JPEG                     10,000
    val/val_annotations.txt                     "<file>\\t<wnid>\\t<bbox...>" per line
    test/images/*.JPEG                          unlabeled: not used

Domains are the labeled splits: "train" (what the clients split) and "val" (the
evaluation split: the official test images have no labels, so papers report the
val split as the test set; `data.targets="val"`). Class names are the wnids in
sorted order (torchvision `ImageFolder`'s convention on `train/`); `words.txt`,
when present, is only used for the dataset description. Grayscale JPEGs (a few
in train) are converted to RGB PNG, as in the DomainBed folder builders.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator

import tensorflow_datasets as tfds

from fedjax_dg.data.builders.domainbed_folder import encoded_image
from fedjax_dg.errors import ConfigError, DataError

DOMAIN_NAMES = ("train", "val")
FOLDER = "tiny-imagenet-200"
HOMEPAGE = "https://www.kaggle.com/c/tiny-imagenet"
DOWNLOAD_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
ENV_DIR = "FEDJAX_DG_TINY_IMAGENET_DIR"

LAYOUT = f"""\
Expected layout (the standard {FOLDER} folder):
  <root>/wnids.txt                          one class id (wnid) per line
  <root>/train/<wnid>/images/*.JPEG         training images of each class
  <root>/val/images/*.JPEG                  validation images
  <root>/val/val_annotations.txt            "<file>\\t<wnid>\\t..." per val image"""

INSTRUCTIONS = f"""\
Download Tiny-ImageNet ({DOWNLOAD_URL}, or the Kaggle competition {HOMEPAGE})
and unzip it; pass the {FOLDER} folder (or its parent) as manual_dir, set
{ENV_DIR} to it, or place it at <data_dir>/downloads/manual/tiny_imagenet."""


@dataclasses.dataclass(frozen=True)
class TinyIndex:
  """Labeled image files of a Tiny-ImageNet folder: (path, label, domain)."""

  root: str
  class_names: tuple[str, ...]
  files: tuple[tuple[str, int, int], ...]


def _help() -> str:
  return f"{LAYOUT}\n{INSTRUCTIONS}"


def find_root(path: str) -> str | None:
  """`path` if it holds wnids.txt, train/ and val/; else its `tiny-imagenet-200`."""
  for cand in (path, os.path.join(path, FOLDER)):
    if all(os.path.exists(os.path.join(cand, p))
           for p in ("wnids.txt", "train", "val")):
      return cand
  return None


def _jpegs(folder: str) -> list[str]:
  return sorted(e.name for e in os.scandir(folder)
                if e.is_file() and e.name.lower().endswith((".jpeg", ".jpg")))


def scan(path: str, name: str = "tiny_imagenet") -> TinyIndex:
  """Lists and validates a Tiny-ImageNet folder; errors name the expected layout."""
  path = os.fspath(path)
  if not os.path.isdir(path) or not os.listdir(path):
    raise DataError(
        f"{name}: the folder {path!r} does not exist or is empty.\n{_help()}")
  root = find_root(path)
  if root is None:
    found = sorted(os.listdir(path))[:10]
    raise DataError(
        f"{name}: {path!r} holds neither wnids.txt + train/ + val/ nor a {FOLDER} "
        f"folder with them (found {found}).\n{_help()}")
  with open(os.path.join(root, "wnids.txt")) as f:
    wnids = [line.strip() for line in f if line.strip()]
  if not wnids:
    raise ConfigError(f"{name}: {os.path.join(root, 'wnids.txt')!r} is empty.\n"
                     f"{_help()}")
  class_names = tuple(sorted(wnids))
  label = {w: i for i, w in enumerate(class_names)}
  files = []
  for w in class_names:
    folder = os.path.join(root, "train", w, "images")
    images = _jpegs(folder) if os.path.isdir(folder) else []
    if not images:
      raise DataError(
          f"{name}: no training images (*.JPEG) in {folder!r} for class {w!r} "
          f"of wnids.txt.\n{_help()}")
    files.extend((os.path.join(folder, f), label[w], 0) for f in images)
  ann = os.path.join(root, "val", "val_annotations.txt")
  if not os.path.isfile(ann):
    raise DataError(f"{name}: {ann!r} is missing.\n{_help()}")
  val_dir = os.path.join(root, "val", "images")
  with open(ann) as f:
    rows = [line.split("\t") for line in f if line.strip()]
  if not rows:
    raise ConfigError(f"{name}: {ann!r} lists no images.\n{_help()}")
  for i, row in enumerate(rows):
    if len(row) < 2 or row[1].strip() not in label:
      raise ConfigError(
          f"{name}: line {i + 1} of {ann!r} does not name a class of wnids.txt "
          f"({row[:2]!r}).\n{_help()}")
    file = os.path.join(val_dir, row[0].strip())
    if not os.path.isfile(file):
      raise DataError(
          f"{name}: {file!r} (line {i + 1} of {ann!r}) does not exist.\n{_help()}")
    files.append((file, label[row[1].strip()], 1))
  return TinyIndex(root, class_names, tuple(files))


class TinyImagenet(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Tiny-ImageNet: 200 classes, 64x64; domains = official splits train / val."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  DOMAINS = DOMAIN_NAMES
  MANUAL_DOWNLOAD_INSTRUCTIONS = f"{LAYOUT}\n{INSTRUCTIONS}"

  def __init__(self, *, class_names=None, **kwargs):
    self._class_names = tuple(class_names) if class_names else None
    super().__init__(**kwargs)

  @classmethod
  def scan_manual(cls, path: str, name: str) -> TinyIndex:
    return scan(path, name)

  def _info(self) -> tfds.core.DatasetInfo:
    label = (tfds.features.ClassLabel(names=self._class_names)
             if self._class_names else tfds.features.ClassLabel())
    return self.dataset_info_from_configs(
        description=__doc__,
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(64, 64, 3)),
            "label": label,
            "domain": tfds.features.ClassLabel(names=DOMAIN_NAMES),
        }),
        supervised_keys=("image", "label"),
        homepage=HOMEPAGE,
    )

  def _split_generators(self, dl_manager):
    index = scan(os.fspath(dl_manager.manual_dir), self.name)
    if self._class_names and index.class_names != self._class_names:
      raise ConfigError(
          f"{self.name}: builder was constructed with {len(self._class_names)} "
          f"classes that differ from the folder's {len(index.class_names)}")
    return {"train": self._generate_examples(index)}

  def _generate_examples(self, index: TinyIndex) -> Iterator[tuple[str, dict]]:
    for path, label, domain in index.files:
      yield os.path.relpath(path, index.root), {
          "image": encoded_image(path),
          "label": label,
          "domain": domain,
      }
