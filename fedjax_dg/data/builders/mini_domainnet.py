"""miniDomainNet: FedCCRL's third benchmark, 4 DomainNet domains x 126 classes.

miniDomainNet is Zhou et al.'s subset of DomainNet ("Domain adaptive ensemble
learning", TIP 2021; Dassl.pytorch's `mini_domainnet`): 140,006 images of the
domains clipart, painting, real and sketch and 126 of DomainNet's 345 classes,
listed by its split files. FedCCRL's code (`data/partition_data.py`) reads it
exactly so: for each domain the lines of `splits_mini/<domain>_train.txt` and
`<domain>_test.txt`, both merged into the domain (its own 90 / 10 split comes
later), each line `<domain>/<class>/<file> <label>` relative to the DomainNet
root, the label an integer in 0..125. The paper's text names Infograph as the
fourth domain; the split files (and so the code's numbers) have sketch: we
follow the files (docs/faithfulness.md, "miniDomainNet").

Manual download: DomainNet's images (http://ai.bu.edu/M3SDA/, one zip per
domain, unpacked to `<root>/<domain>/<class>/<file>`) and the split files
(`splits_mini.zip` of Dassl.pytorch's DATASETS.md, unpacked to
`<root>/splits_mini/`). Images are stored as they are, as in the DomainBed
folder builders; FedCCRL resizes them to 128x128 (`data.image_size=128`).
"""

from __future__ import annotations

import os

from fedjax_dg.data.builders.domainbed_folder import (DomainBedFolder,
                                                      FolderIndex, find_root)
from fedjax_dg.errors import DataError

DOMAINS = ("clipart", "painting", "real", "sketch")
SPLITS = ("train", "test")
SPLIT_DIR = "splits_mini"
NUM_CLASSES = 126

INSTRUCTIONS = f"""\
Expected layout (DomainNet's images and Zhou et al.'s mini-DomainNet split files):
  <root>/<domain>/<class>/<file>.jpg        DomainNet images, domains {', '.join(DOMAINS)}
  <root>/{SPLIT_DIR}/<domain>_train.txt       "<domain>/<class>/<file>.jpg <label>" per line
  <root>/{SPLIT_DIR}/<domain>_test.txt        (the same; both are used)
Download the domains' zips from http://ai.bu.edu/M3SDA/ and splits_mini.zip from
Dassl.pytorch's DATASETS.md (https://github.com/KaiyangZhou/Dassl.pytorch);
pass <root> as manual_dir, set FEDJAX_DG_MINI_DOMAINNET_DIR to it, or place it
at <data_dir>/downloads/manual/mini_domainnet."""


def _lines(path: str, name: str) -> list[tuple[str, int]]:
  """(relative image path, label) of each line of one split file."""
  if not os.path.exists(path):
    raise DataError(f"{name}: the split file {path!r} is missing.\n"
                    f"{INSTRUCTIONS}")
  out = []
  with open(path) as f:
    for k, line in enumerate(f, 1):
      if not line.strip():
        continue
      parts = line.split()
      if len(parts) != 2 or not parts[1].isdigit():
        raise DataError(f"{name}: {path}, line {k}: {line.strip()!r} is not "
                        f"'<domain>/<class>/<file> <label>'.\n{INSTRUCTIONS}")
      out.append((parts[0], int(parts[1])))
  return out


def scan(path: str, name: str) -> FolderIndex:
  """Every listed image with its label and domain, checked: each file
  exists, lies in its line's domain, and each label names one class folder
  (the class names, in label order, are those folders)."""
  root = find_root(path, DOMAINS + (SPLIT_DIR,))
  if root is None:
    raise DataError(f"{name}: {path!r} does not hold the folders "
                    f"{list(DOMAINS + (SPLIT_DIR,))}.\n{INSTRUCTIONS}")
  classes: dict[int, str] = {}
  files = []
  for di, domain in enumerate(DOMAINS):
    for split in SPLITS:
      listed = os.path.join(root, SPLIT_DIR, f"{domain}_{split}.txt")
      for rel, label in _lines(listed, name):
        parts = rel.split("/")
        if len(parts) != 3 or parts[0] != domain:
          raise DataError(f"{name}: {listed} lists {rel!r}, not an image of "
                          f"{domain}/<class>/.\n{INSTRUCTIONS}")
        if classes.setdefault(label, parts[1]) != parts[1]:
          raise DataError(f"{name}: {listed}: label {label} is class "
                          f"{classes[label]!r} elsewhere but {parts[1]!r} "
                          f"for {rel!r}")
        full = os.path.join(root, rel)
        if not os.path.exists(full):
          raise DataError(f"{name}: {listed} lists {rel!r}, which is not in "
                          f"{root!r}.\n{INSTRUCTIONS}")
        files.append((full, label, di))
  if sorted(classes) != list(range(len(classes))):
    raise DataError(f"{name}: the split files' labels are not 0..K-1 (found "
                    f"{len(classes)} labels up to {max(classes)})")
  class_names = tuple(classes[k] for k in range(len(classes)))
  return FolderIndex(root, DOMAINS, class_names, tuple(files))


class MiniDomainnet(DomainBedFolder, skip_registration=True):
  """miniDomainNet (Zhou et al., 2021): 4 DomainNet domains x 126 classes,
  140,006 images, as FedCCRL reads it."""

  DOMAINS = DOMAINS
  HOMEPAGE = "http://ai.bu.edu/M3SDA/"
  MANUAL_DOWNLOAD_INSTRUCTIONS = INSTRUCTIONS

  @classmethod
  def scan_manual(cls, path: str, name: str) -> FolderIndex:
    return scan(path, name)
