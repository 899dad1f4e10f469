"""TFDS builders for DomainBed image folders: `<root>/<domain>/<class>/<image>`.

PACS, VLCS and OfficeHome are distributed as image folders (DomainBed's
`domainbed/scripts/download.py` fetches and unpacks them). The builders read the
folder once into an array_record dataset with features `image` (encoded bytes, RGB;
a user's folder whose images are all grayscale: one channel), `label` (class index, class names = sorted class folder names, identical in every
domain) and `domain` (index into the DomainBed domain names).
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import types
from typing import Iterator, Sequence

from PIL import Image
import tensorflow_datasets as tfds

from fedjax_dg.errors import ConfigError, DataError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")


@dataclasses.dataclass(frozen=True)
class FolderIndex:
  """All image files of a DomainBed folder: (path, label, domain) triples."""

  root: str
  domain_names: tuple[str, ...]
  class_names: tuple[str, ...]
  files: tuple[tuple[str, int, int], ...]


def _subdirs(path: str) -> list[str]:
  return sorted(
      e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith(".")
  )


def _images(path: str) -> list[str]:
  return sorted(
      e.name for e in os.scandir(path)
      if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS)
  )


def find_root(path: str, domains: Sequence[str]) -> str | None:
  """`path` if it holds every domain folder, else its only child that does."""
  if not os.path.isdir(path):
    return None
  children = _subdirs(path)
  if set(domains) <= set(children):
    return path
  candidates = [
      os.path.join(path, c) for c in children
      if set(domains) <= set(_subdirs(os.path.join(path, c)))
  ]
  return candidates[0] if len(candidates) == 1 else None


def layout_help(name: str, domains: Sequence[str], instructions: str) -> str:
  return (
      f"Expected layout for {name!r}: <root>/<domain>/<class>/*.jpg (or .png), with "
      f"one folder per domain: {', '.join(domains)}; every domain must hold the "
      f"same class folders.\n{instructions}"
  )


def scan(
    path: str, name: str, domains: Sequence[str], instructions: str,
    same_classes: bool = True,
) -> FolderIndex:
  """Lists and validates a DomainBed folder; errors say what is missing and why.

  `same_classes=False` (a user's own folder): the classes are the union of the
  domains' class folders, and a domain may lack some.
  """
  help_text = layout_help(name, domains, instructions)
  if not os.path.isdir(path) or not os.listdir(path):
    raise DataError(
        f"{name}: the image folder {path!r} does not exist or is empty.\n{help_text}"
    )
  root = find_root(path, domains)
  if root is None:
    found = _subdirs(path)
    missing = [d for d in domains if d not in found]
    raise DataError(
        f"{name}: {path!r} lacks the domain folders {missing} (found {found}).\n"
        f"{help_text}"
    )
  classes = {d: tuple(_subdirs(os.path.join(root, d))) for d in domains}
  class_names = classes[domains[0]]
  if not same_classes:
    class_names = tuple(sorted(set().union(*classes.values())))
  for d in domains if same_classes else ():
    if classes[d] != class_names:
      only_here = sorted(set(classes[d]) - set(class_names))
      only_there = sorted(set(class_names) - set(classes[d]))
      raise ConfigError(
          f"{name}: class folders differ between domains {domains[0]!r} and {d!r} "
          f"in {root!r}: only in {d!r}: {only_here}; only in {domains[0]!r}: "
          f"{only_there}. Every domain must hold the same class folders.\n{help_text}"
      )
  if not class_names:
    raise DataError(
        f"{name}: domain folder {os.path.join(root, domains[0])!r} has no class "
        f"folders.\n{help_text}"
    )
  files = []
  for di, d in enumerate(domains):
    for ci, c in enumerate(class_names):
      folder = os.path.join(root, d, c)
      if not same_classes and c not in classes[d]:
        continue  # this domain has no such class
      images = _images(folder)
      if not images:
        raise DataError(
            f"{name}: no image files ({', '.join(IMAGE_EXTENSIONS)}) in {folder!r}."
            f"\n{help_text}"
        )
      files.extend((os.path.join(folder, f), ci, di) for f in images)
  return FolderIndex(root, tuple(domains), class_names, tuple(files))


def _unreadable(path: str, e: Exception) -> DataError:
  return DataError(f"{path}: not a readable image ({type(e).__name__}: {e}); "
                   "replace or delete the file and prepare again")


def encoded_image(path: str, channels: int = 3) -> str | bytes:
  """The file path for JPEG/PNG files already in the stored mode (RGB, or
  with `channels=1` grayscale "L"), else the image converted to it as PNG.

  Every image is decoded here, at prepare time: a broken or truncated file is
  a DataError naming it, never a crash of a later run with no file name.
  """
  mode = "L" if channels == 1 else "RGB"
  try:
    with Image.open(path) as im:
      im.load()  # decodes every pixel: a truncated file fails here
      if im.format in ("JPEG", "PNG") and im.mode == mode:
        return path
      buf = io.BytesIO()
      im.convert(mode).save(buf, format="PNG")
  except (OSError, SyntaxError, ValueError) as e:  # PIL's "cannot identify" etc.
    raise _unreadable(path, e) from e
  return buf.getvalue()


def is_grayscale(path: str) -> bool:
  """Whether an image file holds gray levels only (its mode's base is "L":
  1-bit, 8-bit or 16-bit gray, with or without alpha), from its header."""
  try:
    with Image.open(path) as im:
      return Image.getmodebase(im.mode) == "L"
  except (OSError, SyntaxError, ValueError) as e:
    raise _unreadable(path, e) from e


def folder_channels(index: FolderIndex) -> int:
  """1 when every image of a user's folder is grayscale (stored gray: a third
  of the memory of RGB, and the models' first layer sees one channel), else 3
  (grayscale files among RGB ones become RGB)."""
  return 1 if all(is_grayscale(p) for p, _, _ in index.files) else 3


def _instructions(
    name: str, key: str, url: str, homepage: str, folder: str
) -> str:
  return (
      f"Download {name} ({homepage}); DomainBed's domainbed/scripts/download.py "
      f"fetches it from {url} and unpacks it to <data>/{folder}. Pass that folder "
      f"as manual_dir, set FEDJAX_DG_{key.upper()}_DIR to it, or place it at "
      f"<data_dir>/downloads/manual/{key}."
  )


class DomainBedFolder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Base builder: one `train` split holding every image with its domain."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Initial release."}
  DOMAINS: tuple[str, ...] = ()
  CHANNELS = 3  # 1: a user's folder of grayscale images only
  HOMEPAGE = ""
  MANUAL_DOWNLOAD_INSTRUCTIONS = ""

  def __init__(self, *, class_names: Sequence[str] | None = None, **kwargs):
    self._class_names = tuple(class_names) if class_names else None
    super().__init__(**kwargs)

  @classmethod
  def scan_manual(cls, path: str, name: str) -> FolderIndex:
    """Validates the manual folder; the index has `.root` and `.class_names`."""
    return scan(path, name, cls.DOMAINS, cls.MANUAL_DOWNLOAD_INSTRUCTIONS)

  def _info(self) -> tfds.core.DatasetInfo:
    # Class names come from the folder; a prepared dataset restores them from its
    # `label.labels.txt`.
    if self._class_names:
      label = tfds.features.ClassLabel(names=self._class_names)
    else:
      label = tfds.features.ClassLabel()
    return self.dataset_info_from_configs(
        description=self.__doc__,
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(None, None, self.CHANNELS)),
            "label": label,
            "domain": tfds.features.ClassLabel(names=self.DOMAINS),
        }),
        supervised_keys=("image", "label"),
        homepage=self.HOMEPAGE,
    )

  def _split_generators(self, dl_manager):
    index = self.scan_manual(os.fspath(dl_manager.manual_dir), self.name)
    if self._class_names and index.class_names != self._class_names:
      raise ConfigError(
          f"{self.name}: builder was constructed with classes {self._class_names} "
          f"but the folder holds {index.class_names}"
      )
    return {"train": self._generate_examples(index)}

  def _generate_examples(self, index: FolderIndex) -> Iterator[tuple[str, dict]]:
    for path, label, domain in index.files:
      yield os.path.relpath(path, index.root), {
          "image": encoded_image(path, self.CHANNELS),
          "label": label,
          "domain": domain,
      }


class Pacs(DomainBedFolder, skip_registration=True):
  """PACS (Li et al., 2017): 4 domains x 7 classes, 9,991 images."""

  DOMAINS = ("art_painting", "cartoon", "photo", "sketch")
  HOMEPAGE = "https://domaingeneralization.github.io/#data"
  MANUAL_DOWNLOAD_INSTRUCTIONS = _instructions(
      "PACS", "pacs",
      "https://drive.google.com/uc?id=1JFr8f805nMUelQWWmfnJR3y4_SYoN5Pd",
      HOMEPAGE, "PACS",
  )


class Vlcs(DomainBedFolder, skip_registration=True):
  """VLCS (Fang et al., 2013): 4 domains x 5 classes, 10,729 images."""

  DOMAINS = ("Caltech101", "LabelMe", "SUN09", "VOC2007")
  HOMEPAGE = "http://www.eecs.qmul.ac.uk/~dl307/project_iccv2017"
  MANUAL_DOWNLOAD_INSTRUCTIONS = _instructions(
      "VLCS", "vlcs",
      "https://drive.google.com/uc?id=1skwblH1_okBwxWxmRsp9_qi15hyPpxg8",
      HOMEPAGE, "VLCS",
  )


class OfficeHome(DomainBedFolder, skip_registration=True):
  """OfficeHome (Venkateswara et al., 2017): 4 domains x 65 classes, 15,588 images."""

  DOMAINS = ("Art", "Clipart", "Product", "Real World")
  HOMEPAGE = "https://www.hemanthdv.org/officeHomeDataset.html"
  MANUAL_DOWNLOAD_INSTRUCTIONS = _instructions(
      "OfficeHome", "office_home",
      "https://drive.google.com/uc?id=1uY0pj7oFsjMxRwaD3Sxy0jgel0fsYXLC",
      HOMEPAGE, "office_home",
  )


FOLDER_INSTRUCTIONS = (
    "A folder of your own: <root>/<domain>/<class>/<image> with any number of "
    "domains and classes (a domain may lack a class); JPEG, PNG and the other "
    "formats PIL reads, RGB or grayscale (stored gray when every image is, "
    "else as RGB). Prepare it with "
    "`fedjax-dg prepare folder --manual-dir ROOT --name NAME`.")
NAME_PATTERN = r"[a-z][a-z0-9_]{0,63}"


def folder_domains(path: str, name: str) -> tuple[str, ...]:
  """The domain folders of a user's folder (at least two: domain
  generalization holds one out)."""
  if not os.path.isdir(path):
    raise DataError(f"{name}: the image folder {path!r} does not exist.\n"
                    f"{FOLDER_INSTRUCTIONS}")
  domains = tuple(_subdirs(path))
  if len(domains) < 2:
    raise DataError(f"{name}: {path!r} holds {len(domains)} domain folder(s) "
                    f"{list(domains)}; at least 2 are needed.\n{FOLDER_INSTRUCTIONS}")
  return domains


def folder_builder(name: str, domains: Sequence[str], channels: int = 3
                   ) -> type:
  """A DomainBed-folder builder for a user's dataset `name` (TFDS name too),
  its images stored with `channels` (1: grayscale, 3: RGB)."""
  if not re.fullmatch(NAME_PATTERN, name):
    raise ConfigError(f"dataset name {name!r}: use lowercase letters, digits and "
                      "_ (a letter first, at most 64), e.g. my_photos")

  def body(ns):
    ns.update(__module__=__name__, name=name, DOMAINS=tuple(domains),
              CHANNELS=channels,
              MANUAL_DOWNLOAD_INSTRUCTIONS=FOLDER_INSTRUCTIONS,
              __doc__=f"{name}: a user's image folder, domains {list(domains)}.")

  cls = types.new_class(f"Folder_{name}", (DomainBedFolder,),
                        {"skip_registration": True}, body)
  cls.scan_manual = classmethod(lambda c, path, n: scan(
      path, n, c.DOMAINS, FOLDER_INSTRUCTIONS, same_classes=False))
  return cls
