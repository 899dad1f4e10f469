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

Prepared TFDS data lives in `data_dir` (default: `data_dir_default()`, the one
rule for every entry point); the final arrays of every `load` are cached as `.npz`
next to it, so a second `load` only reads one file. `tensorflow_datasets` is
imported only when something has to be prepared or read from TFDS.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
from fedjax_dg.data.images import (STATS_BLOCK_BYTES, Concat, RecordImages,
                                   channel_stats, decode_image, read_records)
from fedjax_dg.errors import ConfigError, DataError

ENV_DATA_DIR = "FEDJAX_DG_DATA_DIR"
DEFAULT_DATA_DIR = os.path.join("~", ".cache", "fedjax_dg", "tfds")
CACHE_DIRNAME = "fedjax_dg_cache"
CACHE_FORMAT = 1  # Bump when the cached arrays change meaning.
# Datasets whose native-size arrays fit in this many bytes keep a native-size cache
# from which every other image size / subset is derived without re-reading TFDS.
NATIVE_CACHE_MAX_BYTES = 1 << 30

DOMAINNET_DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")
# Domain names that are a dataset's official splits: a target domain with one of
# these names is a test split (reported as "test" accuracy, not "ood").
SPLIT_DOMAINS = ("train", "test", "val", "validation")


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


# ---------------------------------------------------------------------------
# Named datasets.


def data_dir_default() -> str:
  """Where prepared data live, one rule for every entry point (the command,
  Python, the notebooks): `$FEDJAX_DG_DATA_DIR` if set; else the checkout's
  `.data/` when fedjax_dg runs from a checkout that has one (what `make demo`
  / `make test` prepare); else `~/.cache/fedjax_dg/tfds`."""
  if os.environ.get(ENV_DATA_DIR):
    return os.path.expanduser(os.environ[ENV_DATA_DIR])
  checkout = _checkout_data_dir()
  if os.path.isdir(checkout):
    return checkout
  return os.path.expanduser(DEFAULT_DATA_DIR)


def _checkout_data_dir() -> str:
  return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))), ".data")


def data_dir_origin() -> str:
  """Which rule of `data_dir_default` chose the data directory."""
  if os.environ.get(ENV_DATA_DIR):
    return f"${ENV_DATA_DIR} is set"
  if os.path.isdir(_checkout_data_dir()):
    return f"the checkout's .data/ (no ${ENV_DATA_DIR})"
  return f"the default (no ${ENV_DATA_DIR}, no checkout .data/)"


def data_dir_line(data_dir: str | None = None) -> str:
  """"data directory: PATH (the rule that chose it)", as `fedjax-dg
  datasets` and `prepare` print it; `data_dir`: one given explicitly."""
  if data_dir:
    return f"data directory: {os.path.expanduser(data_dir)} (given)"
  return (f"data directory: {data_dir_default()} ({data_dir_origin()}; "
          "the rule: fedjax_dg.data.sources.data_dir_default)")


@dataclasses.dataclass(frozen=True)
class _Own:
  """A dataset prepared by one of the project's own TFDS builders."""

  builder: str  # Class name in fedjax_dg.data.builders ("Folder": a user's).
  tfds_name: str
  version: str
  channels: int
  fixed_shape: bool  # Stored images all have one known shape (native cache OK).
  domains: tuple[str, ...] = ()  # a user's folder dataset: its domain folders


@dataclasses.dataclass(frozen=True)
class _Catalog:
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


_DATASETS: dict[str, _Own | _Catalog] = {
    "rotated_fashion_mnist": _Own("RotatedFashionMnist", "rotated_fashion_mnist",
                                  "1.0.0", 1, True),
    "styled_fashion_mnist": _Own("StyledFashionMnist", "styled_fashion_mnist",
                                 "1.0.0", 3, True),
    "pacs": _Own("Pacs", "pacs", "1.0.0", 3, False),
    "office_home": _Own("OfficeHome", "office_home", "1.0.0", 3, False),
    "vlcs": _Own("Vlcs", "vlcs", "1.0.0", 3, False),
    "fashion_mnist": _Own("FashionMnistSplits", "fashion_mnist_splits", "1.0.0",
                          1, True),
    "cifar10": _Catalog(_splits("cifar10"), 3, True),
    "cifar100": _Catalog(_splits("cifar100"), 3, True),
    "tiny_imagenet": _Own("TinyImagenet", "tiny_imagenet", "1.0.0", 3, True),
    "domainnet": _Catalog({d: f"domainnet/{d}" for d in DOMAINNET_DOMAINS}, 3,
                          False),
}


# Datasets built from the raw Fashion-MNIST IDX files (`manual_dir`: that folder,
# default `$FEDJAX_DG_FASHION_MNIST_DIR` or the Debian package's).
FASHION_MNIST_SOURCED = ("rotated_fashion_mnist", "styled_fashion_mnist",
                         "fashion_mnist")


# The held-out evaluation split of the datasets whose domains are official splits
# (the label-skew benchmarks): `data.targets` for a test-set evaluation.
EVAL_SPLITS = {"fashion_mnist": "test", "cifar10": "test", "cifar100": "test",
               "tiny_imagenet": "val"}


FOLDER_RECORD = "fedjax_dg_folder.json"  # marks a user's prepared folder dataset


def _folder_entry(name: str, domains, channels: int = 3) -> _Own:
  return _Own("Folder", name, "1.0.0", channels, False, tuple(domains))


def user_datasets(data_dir: str | None = None) -> dict[str, _Own]:
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
        out[name] = _folder_entry(name, info["domains"],
                                  info.get("channels", 3))
  return out


def available(data_dir: str | None = None) -> tuple[str, ...]:
  """The built-in dataset names, then the user's prepared folder datasets."""
  return tuple(_DATASETS) + tuple(n for n in user_datasets(data_dir)
                                  if n not in _DATASETS)


def describe_available(data_dir: str | None = None) -> str:
  """One line per dataset: name, kind, domains, prepared or not (for
  `fedjax-dg datasets`)."""
  lines = [data_dir_line(data_dir)]
  data_dir = os.path.expanduser(data_dir or data_dir_default())
  for name in available(data_dir):
    entry = _lookup(name, data_dir)
    ready = is_prepared(name, data_dir)
    if isinstance(entry, _Own):
      kind = "your folder" if entry.builder == "Folder" else "own builder"
      domains = (f", domains {list(entry.domains)}" if entry.domains else "")
    else:
      kind, domains = "TFDS catalog", f", domains {list(entry.configs)}"
    state = {True: "prepared", False: "not prepared",
             None: "downloaded by TFDS on first use"}[ready]
    lines.append(f"  {name:24s} {kind}{domains}: {state}")
  return "\n".join(lines)


def is_prepared(name: str, data_dir: str | None = None) -> bool | None:
  """Whether `name` (one of the project's own builders or a prepared folder)
  is prepared in `data_dir`; None for a TFDS catalog dataset (downloaded by
  TFDS on first use)."""
  data_dir = os.path.expanduser(data_dir or data_dir_default())
  entry = _lookup(name, data_dir)
  if not isinstance(entry, _Own):
    return None
  return os.path.exists(os.path.join(_prepared_dir(entry, data_dir),
                                     "dataset_info.json"))


def eval_split(name: str) -> str | None:
  """The official evaluation split (a domain name) of `name`, or None if its
  domains are not splits (domain-generalization datasets)."""
  return EVAL_SPLITS.get(name)


def is_split_domain(domain: str | None) -> bool:
  """Whether a target domain name is an official split (test accuracy, not ood)."""
  return domain is not None and str(domain) in SPLIT_DOMAINS


def eval_label(targets: Iterable) -> str:
  """How to call the held-out evaluation of runs with these target domains:
  "test" when every one is an official split (label-skew benchmarks:
  fashion_mnist / cifar / tiny_imagenet with targets="test"), else "ood" (an
  unseen domain). Runs without a target (None, "None") do not count."""
  targets = [t for t in targets if t not in (None, "None")]
  return "test" if targets and all(is_split_domain(t) for t in targets) else "ood"


def _lookup(name: str, data_dir: str | None = None) -> _Own | _Catalog:
  if name in _DATASETS:
    return _DATASETS[name]
  own = user_datasets(data_dir)
  if name not in own:
    raise ConfigError(
        f"unknown dataset name {name!r}; available: "
        f"{', '.join(available(data_dir))}. {where_to_find(name, data_dir)}")
  return own[name]


def _data_dir_candidates() -> list[str]:
  """Every data directory `data_dir_default` picks in some setting:
  `$FEDJAX_DG_DATA_DIR` (if set), the checkout's `.data/`, the default."""
  env = os.environ.get(ENV_DATA_DIR)
  return ([os.path.expanduser(env)] if env else []) + [
      _checkout_data_dir(), os.path.expanduser(DEFAULT_DATA_DIR)]


def where_to_find(name: str, data_dir: str | None = None) -> str:
  """Where a dataset `name` was looked for (the data directory and the rule
  that chose it) and what to do: a folder dataset of that name prepared in
  another data directory (e.g. `~/.cache/...` before the checkout's `.data/`
  existed) is named, with its folder; else how to prepare one."""
  data_dir = os.path.expanduser(data_dir or data_dir_default())
  given = os.path.realpath(data_dir) != os.path.realpath(data_dir_default())
  origin = "given: data.data_dir" if given else data_dir_origin()
  text = f"Looked in the data directory {data_dir} ({origin})"
  here = (f"{ENV_DATA_DIR}={shlex.quote(data_dir)} " if given else "")
  for other in dict.fromkeys(_data_dir_candidates()):
    if os.path.realpath(other) == os.path.realpath(data_dir):
      continue
    entry = user_datasets(other).get(name)
    if entry is None:
      continue
    folder = (recorded_source(entry, other) or {}).get("path") or "DIR"
    return (f"{text}; a folder dataset {name!r} is prepared in another data "
            f"directory, {other} (from {folder}): run with --set "
            f"data.data_dir={shlex.quote(other)} (or set {ENV_DATA_DIR}="
            f"{shlex.quote(other)}), or prepare it here: {here}"
            f"{prepare_command(name, entry, folder)}")
  return (f"{text}; a folder of your own: {here}fedjax-dg prepare folder "
          f"--manual-dir DIR --name {name}")


def _cache_dir(name: str, entry: _Own | _Catalog, data_dir: str) -> str:
  if isinstance(entry, _Own):  # Inside the prepared dataset: removed with it.
    return os.path.join(data_dir, entry.tfds_name, entry.version, CACHE_DIRNAME)
  return os.path.join(data_dir, CACHE_DIRNAME, name + entry.cache_tag)


def manual_dir_default(name: str, data_dir: str) -> str:
  """`FEDJAX_DG_<NAME>_DIR`, else `<data_dir>/downloads/manual/<name>`."""
  if name in FASHION_MNIST_SOURCED:
    from fedjax_dg.data.builders import rotated_fashion_mnist as rfm  # pylint: disable=g-import-not-at-top
    return rfm.source_dir_default()
  env = os.environ.get(f"FEDJAX_DG_{name.upper()}_DIR")
  return env or os.path.join(data_dir, "downloads", "manual", name)


SOURCE_RECORD = "fedjax_dg_source.json"  # beside the prepared data
# The digest of the folder's file listing, in a file of its own: fedjax_dg
# before it compared SOURCE_RECORD's dict whole, so a new key there would make
# an older checkout sharing the data directory refuse data prepared here.
LISTING_RECORD = "fedjax_dg_listing.json"


def _listing(path: str) -> tuple[list[tuple[str, int, int]], float]:
  """((path relative to `path`, size, mtime in ns) of every file below it,
  sorted; the newest mtime in s): metadata only, no file is read."""
  out, newest = [], 0.0
  for root, _, names in os.walk(path):
    for n in names:
      full = os.path.join(root, n)
      st = os.stat(full)
      out.append((os.path.relpath(full, path), st.st_size, st.st_mtime_ns))
      newest = max(newest, st.st_mtime)
  return sorted(out), newest


def source_fingerprint(path: str | None) -> dict | None:
  """A cheap identity of a raw-data folder: absolute path, file count, total
  size, newest mtime, and `listing`, a digest of every file's relative path
  (in a DomainBed folder `<domain>/<class>/<image>`: its labels), size and
  mtime. Only the files' metadata is read, never their bytes: `load` checks
  it at every run (docs/data.md, "Stale prepared data"). None when there is
  no such folder (then the data came from, or will come from, a download)."""
  if not path or not os.path.isdir(path):
    return None
  files, newest = _listing(path)
  digest = hashlib.sha1()
  for rel, size, mtime in files:
    digest.update(f"{rel}\0{size}\0{mtime}\n".encode())
  return dict(path=os.path.abspath(path), files=len(files),
              bytes=sum(f[1] for f in files), mtime=round(newest, 3),
              listing=digest.hexdigest())


def _prepared_dir(entry: _Own, data_dir: str) -> str:
  return os.path.join(data_dir, entry.tfds_name, entry.version)


def recorded_source(entry: _Own, data_dir: str) -> dict | None:
  """The source the prepared data was built from ({} if unknown: prepared by
  an older fedjax_dg, or from a download), None if nothing is prepared. Data
  prepared before the listing was recorded have no `listing`."""
  prepared = _prepared_dir(entry, data_dir)
  path = os.path.join(prepared, SOURCE_RECORD)
  if not os.path.exists(path):
    return {} if os.path.isdir(prepared) else None
  with open(path) as f:
    record = json.load(f)
  listing = os.path.join(prepared, LISTING_RECORD)
  if record and os.path.exists(listing):
    with open(listing) as f:
      record["listing"] = json.load(f)["listing"]
  return record


def _record_source(entry: _Own, data_dir: str, manual_dir: str) -> None:
  prepared = _prepared_dir(entry, data_dir)
  record = source_fingerprint(manual_dir) or {}
  listing = record.pop("listing", None)
  with open(os.path.join(prepared, SOURCE_RECORD), "w") as f:
    json.dump(record, f)
  if listing:
    with open(os.path.join(prepared, LISTING_RECORD), "w") as f:
      json.dump({"listing": listing}, f)


def source_change(before: dict, now: dict) -> str | None:
  """What differs between a recorded source (`recorded_source`) and the
  folder now (`source_fingerprint`), or None. A record without `listing`
  (older data) is compared on the rest only."""
  if before["path"] != now["path"]:
    return (f"they were built from {before['path']} ({before['files']} "
            f"files), but the source folder now is {now['path']} "
            f"({now['files']} files)")
  if (before["files"], before["bytes"]) != (now["files"], now["bytes"]):
    return (f"the folder changed since: {before['files']} files of "
            f"{before['bytes']} bytes then, {now['files']} of {now['bytes']} "
            "now")
  if before["mtime"] != now["mtime"]:
    return "the folder changed since: a file in it was modified"
  if "listing" in before and before["listing"] != now["listing"]:
    return (f"the folder changed since: the same {now['files']} files and "
            "bytes, but files were moved, renamed or replaced (e.g. images "
            "moved to another class folder: relabelled)")
  return None


def source_folder(name: str, data_dir: str, manual_dir: str | None,
                  before: dict | None) -> str:
  """The folder a dataset's prepared data are checked against (and prepared
  from): `manual_dir`; else its default (`manual_dir_default`) if that
  exists; else the folder it was prepared from (a folder dataset's, or one
  given as --manual-dir), if still there."""
  if manual_dir:
    return manual_dir
  default = manual_dir_default(name, data_dir)
  if os.path.isdir(default) or not before or not before.get("path"):
    return default
  return before["path"]


def prepare_command(name: str, entry: _Own, folder: str, force=False) -> str:
  """The `fedjax-dg prepare` command line that prepares `name` from `folder`."""
  words = (["fedjax-dg", "prepare", "folder", "--manual-dir", folder, "--name",
            name] if entry.builder == "Folder" else
           ["fedjax-dg", "prepare", name, "--manual-dir", folder])
  return shlex.join(words + (["--force"] if force else []))


def check_source(name: str, data_dir: str, manual_dir: str | None) -> None:
  """Refuses prepared data built from another folder than the one given now
  (or from the same folder before it changed: files added, removed, edited,
  moved or renamed): a run would silently use the old images or labels.
  Nothing to compare when the folder is absent (prepared data outlive their
  source) or nothing is recorded."""
  entry = _lookup(name, data_dir)
  if not isinstance(entry, _Own):
    return
  before = recorded_source(entry, data_dir)
  if not before:
    return
  now = source_fingerprint(source_folder(name, data_dir, manual_dir, before))
  change = source_change(before, now) if now is not None else None
  if change:
    raise DataError(
        f"{name}: the prepared data at {_prepared_dir(entry, data_dir)} are "
        f"stale: {change}. Run `{prepare_command(name, entry, now['path'])}` "
        "to prepare it again")


def _is_prepared(builder) -> bool:
  """`builder.is_prepared()` without the warning TFDS logs for every dataset
  not prepared yet ("Variant folder ... has no dataset_info.json"), which
  `prepare` would print before every first preparation."""
  info = os.path.join(os.fspath(builder.data_path), "dataset_info.json")
  return os.path.exists(info) and builder.is_prepared()


def _own_builder(entry: _Own, data_dir: str, manual_dir: str | None,
                 name: str, prepare: bool):
  """Constructs the builder and prepares it if needed (recording the source
  folder it was built from); validates inputs first."""
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
    if prepare and not _is_prepared(builder):
      builder.download_and_prepare()
      _record_source(entry, data_dir, manual_dir)
    return builder
  builder = cls(data_dir=data_dir, file_format="array_record")
  if prepare and not _is_prepared(builder):
    # Folder builders (DomainBed folders, Tiny-ImageNet): validate the folder and
    # read the class names first; errors name the layout and the download.
    index = cls.scan_manual(manual_dir, name)
    builder = cls(data_dir=data_dir, file_format="array_record",
                  class_names=index.class_names)
    builder.download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=index.root)
    )
    _record_source(entry, data_dir, manual_dir)
    builder = cls(data_dir=data_dir, file_format="array_record")
  return builder


def _read_own(name: str, entry: _Own, data_dir: str, manual_dir: str | None,
              image_size: int | None, max_per_domain: int | None,
              seed: int) -> DomainDataset:
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  builder = _own_builder(entry, data_dir, manual_dir, name, prepare=True)
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


def _catalog_sources(entry: _Catalog, data_dir: str):
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


def _read_catalog(name: str, entry: _Catalog, data_dir: str,
                  image_size: int | None, max_per_domain: int | None,
                  seed: int) -> DomainDataset:
  sources, class_names = _catalog_sources(entry, data_dir)
  return dataset_from_sources(
      name, sources, class_names=class_names, channels=entry.channels,
      image_size=image_size, max_per_domain=max_per_domain, seed=seed,
  )


def _read(name: str, entry: _Own | _Catalog, data_dir: str,
          manual_dir: str | None, image_size: int | None,
          max_per_domain: int | None, seed: int) -> DomainDataset:
  if isinstance(entry, _Own):
    return _read_own(name, entry, data_dir, manual_dir, image_size,
                     max_per_domain, seed)
  return _read_catalog(name, entry, data_dir, image_size, max_per_domain, seed)


def _check_positive(field: str, value: int | None) -> None:
  if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
    raise ConfigError(f"{field}={value!r} is invalid: use a positive int or None")


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
      AUTO_STREAM_SHARE of `host_memory()`. The same examples either way.
  """
  _check_positive("image_size", image_size)
  _check_positive("max_per_domain", max_per_domain)
  if streaming not in STREAMING:
    raise ConfigError(f"data.streaming={streaming!r}: allowed {STREAMING} "
                      "(auto: stream when the images would take more than "
                      f"{AUTO_STREAM_SHARE:.0%} of the host's memory)")
  data_dir = os.path.expanduser(data_dir or data_dir_default())
  entry = _lookup(name, data_dir)
  check_source(name, data_dir, manual_dir)
  cache_dir = _cache_dir(name, entry, data_dir)
  path = os.path.join(cache_dir, cache_key(image_size, max_per_domain, seed) + ".npz")
  if streaming == "auto":
    size = (os.path.getsize(path) if os.path.exists(path) else
            _image_bytes(name, entry, data_dir, manual_dir, image_size,
                         max_per_domain))
    streaming = "on" if size > AUTO_STREAM_SHARE * host_memory() else "off"
  if streaming == "on":
    return _open(name, entry, data_dir, manual_dir, image_size,
                 max_per_domain, seed)
  if os.path.exists(path):
    return load_npz(path)
  native_path = os.path.join(cache_dir, cache_key(None, None, 0) + ".npz")
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


# ---------------------------------------------------------------------------
# Streaming: images read from the prepared array_record files on demand.


def _write_json(path: str, value) -> None:
  """Writes atomically (temporary file, then rename)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(value, f)
  os.replace(tmp, path)


def _records_of(name: str, entry: _Own | _Catalog, data_dir: str,
                manual_dir: str | None):
  """(one random-access source over the dataset's records, its records'
  grouping: for own builders None (records carry their `domain`), for the
  catalog {domain: [sources]}, class names, domain names)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  if isinstance(entry, _Own):
    builder = _own_builder(entry, data_dir, manual_dir, name, prepare=True)
    source = builder.as_data_source(
        decoders={"image": tfds.decode.SkipDecoding()})["train"]
    features = builder.info.features
    return (source, None, tuple(features["label"].names),
            tuple(features["domain"].names))
  groups, class_names = _catalog_sources(entry, data_dir)
  return Concat([s for g in groups.values() for s in g]), groups, \
      class_names, tuple(groups)


def _plan(source, groups, max_per_domain: int | None, seed: int):
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


def _open(name: str, entry: _Own | _Catalog, data_dir: str,
          manual_dir: str | None, image_size: int | None,
          max_per_domain: int | None, seed: int) -> DomainDataset:
  """The dataset of `load` with `streaming="on"`: labels and domains in
  memory (cached beside the other caches), images `RecordImages`."""
  source, groups, class_names, domain_names = _records_of(
      name, entry, data_dir, manual_dir)
  cache_dir = _cache_dir(name, entry, data_dir)
  # Which records, their labels and domains: the same at every image size.
  plan_path = os.path.join(cache_dir, "records-" + cache_key(
      None, max_per_domain, seed) + ".npz")
  if os.path.exists(plan_path):
    with np.load(plan_path) as z:
      records, labels, domains = z["records"], z["labels"], z["domains"]
  else:
    records, labels, domains = _plan(source, groups, max_per_domain, seed)
    os.makedirs(cache_dir, exist_ok=True)
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
  stats = os.path.join(cache_dir, cache_key(image_size, max_per_domain, seed)
                       + "-stats.json")
  return DomainDataset(name=name, images=images, labels=labels,
                       domains=domains, domain_names=domain_names,
                       class_names=class_names, stats_file=stats)


def _image_bytes(name: str, entry: _Own | _Catalog, data_dir: str,
                 manual_dir: str | None, image_size: int | None,
                 max_per_domain: int | None) -> int:
  """The bytes `load` would read into memory, from the prepared data's
  metadata (no record read): the record count (at most `max_per_domain`
  per domain) x the decoded image size; 0 where the stored images have no
  one shape and no `image_size` is given (they cannot be stacked anyway)."""
  source, _, _, domain_names = _records_of(name, entry, data_dir, manual_dir)
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
  one before it changed (`source_change`), are prepared again, and the line
  says why; `force`: prepared again whatever the records say (a catalog
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
    entry = _lookup(name, data_dir)
  start = time.perf_counter()
  if manual_dir and not os.path.isdir(manual_dir):
    raise DataError(f"{name}: --manual-dir {manual_dir!r} is not a folder")
  if isinstance(entry, _Own):
    # Prepared from another (or a changed) folder, or from an unknown one while
    # a folder is named: prepare again (the caches go with the prepared data).
    prepared = _prepared_dir(entry, data_dir)
    before = recorded_source(entry, data_dir)
    folder = source_folder(name, data_dir, manual_dir, before)
    now = source_fingerprint(folder)
    if name in FASHION_MNIST_SOURCED and _unlisted(before, now):
      # Their labels are inside the IDX files, not in file paths: a record
      # from before the listing, equal on the rest, is completed in place.
      _record_source(entry, data_dir, folder)
      before = recorded_source(entry, data_dir)
    reason = reason or _stale(before, now, manual_dir)
    if force and os.path.isdir(prepared):
      reason = reason or "--force"
    if reason and os.path.isdir(prepared):
      shutil.rmtree(prepared)
    builder = _own_builder(entry, data_dir, folder, name, prepare=True)
    where = os.fspath(builder.data_dir)
    if entry.builder == "Folder":  # loadable by its name from now on
      with open(os.path.join(where, FOLDER_RECORD), "w") as f:
        json.dump({"domains": list(entry.domains),
                   "channels": entry.channels}, f)
  else:
    if force and _remove_catalog(name, entry, data_dir):
      reason = "--force"
    _catalog_sources(entry, data_dir)
    where = data_dir
  if entry.fixed_shape:
    ds = load(name, data_dir=data_dir, manual_dir=manual_dir)
    summary = ds.summary()
  else:
    summary = _summary_without_images(name, entry, data_dir)
  again = f"prepared again ({reason}); " if reason else ""
  return (f"{summary}; {again}ready in {time.perf_counter() - start:.1f} s at "
          f"{where}")


def _unlisted(before: dict | None, now: dict | None) -> bool:
  """Whether `before` is a record from before the file listing was kept that
  matches the folder `now` on everything it has."""
  return bool(before) and now is not None and "listing" not in before and (
      source_change(before, now) is None)


def _stale(before: dict | None, now: dict | None,
           manual_dir: str | None) -> str | None:
  """Why data prepared from `before` (`recorded_source`) must be prepared
  again from the folder now (`source_fingerprint`), or None."""
  if before is None or now is None:
    return None
  if not before:  # from a download or an old fedjax_dg; a folder is named now
    return "the folder they were built from is unknown" if manual_dir else None
  change = source_change(before, now)
  if change:
    return change
  if _unlisted(before, now):
    return ("prepared by an older fedjax_dg, which did not record the file "
            "listing, so moved or renamed files went unnoticed")
  return None


def _remove_catalog(name: str, entry: _Catalog, data_dir: str) -> bool:
  """Removes a catalog dataset's prepared TFDS folders and caches (`prepare
  --force`); whether there was anything to remove."""
  folders = [_cache_dir(name, entry, data_dir)] + [
      os.path.join(data_dir, *(c if isinstance(c, str) else c[0]).split("/"))
      for c in entry.configs.values()]
  found = [f for f in dict.fromkeys(folders) if os.path.isdir(f)]
  for f in found:
    shutil.rmtree(f)
  return bool(found)


def _user_folder(dataset_name: str | None, manual_dir: str | None,
                 data_dir: str) -> tuple[str, _Own, str | None]:
  """(name, entry, why its prepared data must go: None if they may stay) of
  `prepare folder`. Its images are stored with one channel when every one of
  them is grayscale (`domainbed_folder.folder_channels`), else as RGB."""
  from fedjax_dg.data.builders.domainbed_folder import folder_builder, folder_channels, folder_domains  # pylint: disable=g-import-not-at-top
  if not dataset_name or not manual_dir:
    raise ConfigError("prepare folder needs --manual-dir DIR (the folder: "
                      "<root>/<domain>/<class>/<image>) and --name NAME (how "
                      "runs name it: --set data.name=NAME)")
  if dataset_name in _DATASETS or dataset_name == "folder":
    raise ConfigError(f"--name {dataset_name!r} is a built-in dataset; choose "
                      "another name")
  domains = folder_domains(manual_dir, dataset_name)
  cls = folder_builder(dataset_name, domains)  # validates the name
  channels = folder_channels(cls.scan_manual(manual_dir, dataset_name))
  entry = _folder_entry(dataset_name, domains, channels)
  reason = None
  if os.path.isdir(_prepared_dir(entry, data_dir)):
    known = user_datasets(data_dir).get(dataset_name)
    if known is None or known.domains != entry.domains:
      reason = "other domain folders"
    elif known.channels != entry.channels:
      reason = ("every image is grayscale now: one channel" if channels == 1
                else "not every image is grayscale now: RGB")
  return dataset_name, entry, reason


def _summary_without_images(name: str, entry: _Own | _Catalog, data_dir: str) -> str:
  """Counts per domain from the record metadata only (no image decoding)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  if isinstance(entry, _Own):
    builder = _own_builder(entry, data_dir, None, name, prepare=False)
    source = builder.as_data_source(
        decoders={"image": tfds.decode.SkipDecoding()})["train"]
    domains = np.asarray(read_records(source, range(len(source)),
                                      fields=("domain",))["domain"])
    names = builder.info.features["domain"].names
    counts = np.bincount(domains, minlength=len(names)).tolist()
    num_classes = builder.info.features["label"].num_classes
  else:
    sources, class_names = _catalog_sources(entry, data_dir)
    names = list(sources)
    counts = [sum(len(s) for s in sources[d]) for d in names]
    num_classes = len(class_names)
  per_domain = ", ".join(f"{d}: {n}" for d, n in zip(names, counts))
  colour = ", grayscale (1 channel)" if entry.channels == 1 else ", RGB"
  return (f"{name}: {sum(counts)} images{colour}, {num_classes} classes, "
          f"{len(names)} domains ({per_domain})")
