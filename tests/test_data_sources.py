"""Data sources: own TFDS builders on tiny generated data, conversion, caching."""

import gzip
import math
import io
import os
import types

import numpy as np
from PIL import Image
import pytest

from fedjax_dg.data import (dataset, images, locations, lookup, prepared,
                             provenance, registry, sources, splits)
from fedjax_dg.data.builders import domainbed_folder
from fedjax_dg.data.builders import fashion_mnist_base as fmb
from fedjax_dg.data.builders import rotated_fashion_mnist as rfm
from fedjax_dg.data.builders import mini_domainnet
from fedjax_dg.data.builders import tiny_imagenet
from fedjax_dg.errors import ConfigError, DataError

PACS_DOMAINS = ("art_painting", "cartoon", "photo", "sketch")
CLASSES = ("giraffe", "dog", "house")  # Deliberately unsorted on disk creation.
FMNIST_DIR = "/usr/share/datasets/fashion-mnist"


# ---------------------------------------------------------------------------
# Helpers that write tiny datasets.


def _class_color(c):
  """A colour per class, distinct for the first 7 (the tests' class counts);
  wrapped into 0..255 for the protocol tests' hundreds of classes."""
  return ((40 * c + 10) % 256, (200 - 30 * c) % 256, 77)


def write_pacs_tree(root, classes=CLASSES, domains=PACS_DOMAINS, per_class=2):
  """domains x classes x per_class images of different sizes and formats."""
  for d_i, d in enumerate(domains):
    for c in classes:
      c_i = sorted(classes).index(c)
      folder = os.path.join(root, d, c)
      os.makedirs(folder, exist_ok=True)
      for i in range(per_class):
        h, w = 12 + 3 * i + d_i, 17 - i
        rgb = np.broadcast_to(np.array(_class_color(c_i), np.uint8), (h, w, 3))
        if d == "sketch" and i == 0:  # RGBA PNG: converted to RGB when prepared.
          rgba = np.concatenate([rgb, np.full((h, w, 1), 255, np.uint8)], -1)
          Image.fromarray(rgba).save(os.path.join(folder, f"{i}.png"))
        elif i == 1:
          Image.fromarray(rgb).save(os.path.join(folder, f"{i}.png"))
        else:
          Image.fromarray(np.ascontiguousarray(rgb)).save(
              os.path.join(folder, f"{i}.jpg"), quality=100)
  return root


def write_idx(path, array):
  header = bytes([0, 0, 8, array.ndim])
  header += np.asarray(array.shape, ">u4").tobytes()
  with gzip.open(path, "wb") as f:
    f.write(header + np.ascontiguousarray(array, np.uint8).tobytes())


def write_fake_fashion_mnist(folder, n_train=48, n_test=12, seed=1):
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (n_train + n_test, 28, 28), dtype=np.uint8)
  labels = (np.arange(n_train + n_test) % 10).astype(np.uint8)
  os.makedirs(folder, exist_ok=True)
  write_idx(os.path.join(folder, "train-images-idx3-ubyte.gz"), images[:n_train])
  write_idx(os.path.join(folder, "train-labels-idx1-ubyte.gz"), labels[:n_train])
  write_idx(os.path.join(folder, "t10k-images-idx3-ubyte.gz"), images[n_train:])
  write_idx(os.path.join(folder, "t10k-labels-idx1-ubyte.gz"), labels[n_train:])
  return images, labels


# ---------------------------------------------------------------------------
# Names and errors.


def test_available_and_unknown_name():
  names = registry.available()
  for n in ("rotated_fashion_mnist", "pacs", "office_home", "vlcs",
            "fashion_mnist", "cifar10", "cifar100", "tiny_imagenet", "domainnet",
            "mini_domainnet"):
    assert n in names
  with pytest.raises(ValueError, match="available: rotated_fashion_mnist"):
    sources.load("mnist_typo")


@pytest.mark.parametrize("field", ["image_size", "max_per_domain"])
def test_invalid_sizes_are_rejected(tmp_path, field):
  with pytest.raises(ValueError, match=field):
    sources.load("pacs", data_dir=str(tmp_path), **{field: 0})


# ---------------------------------------------------------------------------
# DomainBed folders.


def test_pacs_folder_prepare_load_resize(tmp_path):
  root = write_pacs_tree(str(tmp_path / "PACS"))
  data_dir = str(tmp_path / "data")
  ds = sources.load("pacs", data_dir=data_dir, manual_dir=root, image_size=8)
  assert ds.images.shape == (24, 8, 8, 3) and ds.images.dtype == np.uint8
  assert ds.labels.dtype == np.int32 and ds.domains.dtype == np.int32
  assert ds.class_names == ("dog", "giraffe", "house")
  assert ds.domain_names == PACS_DOMAINS
  assert ds.domain_counts() == {d: 6 for d in PACS_DOMAINS}
  for c in range(3):  # Labels follow the class folders (constant class colors).
    colors = ds.images[ds.labels == c].reshape(-1, 3).mean(0)
    np.testing.assert_allclose(colors, _class_color(c), atol=2)
  # Second load comes from the npz cache, without TFDS or the image folder.
  again = sources.load("pacs", data_dir=data_dir, image_size=8)
  np.testing.assert_array_equal(again.images, ds.images)
  np.testing.assert_array_equal(again.labels, ds.labels)
  assert again.class_names == ds.class_names
  # Another size reads the prepared TFDS data (the image folder may be gone).
  other = sources.load("pacs", data_dir=data_dir, image_size=5,
                       manual_dir=str(tmp_path / "gone"))
  assert other.images.shape == (24, 5, 5, 3)
  assert "24 images" in sources.prepare("pacs", data_dir=data_dir)


def test_prepare_from_another_folder_prepares_again_and_runs_refuse_stale_data(
    tmp_path):
  data_dir = str(tmp_path / "data")
  a = write_pacs_tree(str(tmp_path / "A"))
  b = write_pacs_tree(str(tmp_path / "B"), per_class=3)
  assert "24 images" in sources.prepare("pacs", data_dir=data_dir, manual_dir=a)
  assert sources.load("pacs", data_dir=data_dir, manual_dir=a,
                      image_size=8).images.shape[0] == 24
  # Another folder: prepared again, its images (not the old ones, not "ready").
  assert "36 images" in sources.prepare("pacs", data_dir=data_dir, manual_dir=b)
  assert sources.load("pacs", data_dir=data_dir, manual_dir=b,
                      image_size=8).images.shape[0] == 36
  # A run naming the old folder is refused (it would get B's images).
  with pytest.raises(DataError, match=r"built from .*B.*prepare pacs --manual-dir"):
    sources.load("pacs", data_dir=data_dir, manual_dir=a, image_size=8)
  # The same folder, changed (a file added): refused as well, even from cache.
  Image.fromarray(np.zeros((9, 9, 3), np.uint8)).save(
      os.path.join(b, "photo", "dog", "new.png"))
  with pytest.raises(DataError, match="changed"):
    sources.load("pacs", data_dir=data_dir, manual_dir=b, image_size=8)
  assert "37 images" in sources.prepare("pacs", data_dir=data_dir, manual_dir=b)
  # A folder that does not exist is an error, never "ready".
  with pytest.raises(DataError, match="is not a folder"):
    sources.prepare("pacs", data_dir=data_dir, manual_dir=str(tmp_path / "nope"))
  # Prepared data outlive their source folder: no folder, nothing to compare.
  assert sources.load("pacs", data_dir=data_dir, image_size=8).images.shape[0] == 37


def test_a_truncated_image_is_named_at_prepare_time(tmp_path):
  root = write_pacs_tree(str(tmp_path / "PACS"))
  broken = os.path.join(root, "cartoon", "house", "0.jpg")
  data = open(broken, "rb").read()
  open(broken, "wb").write(data[:len(data) // 2])
  with pytest.raises(DataError, match=r"cartoon/house/0.jpg: not a readable image"):
    sources.prepare("pacs", data_dir=str(tmp_path / "data"), manual_dir=root)


def test_pacs_different_sizes_need_image_size(tmp_path):
  root = write_pacs_tree(str(tmp_path / "PACS"))
  with pytest.raises(ValueError, match="pass image_size"):
    sources.load("pacs", data_dir=str(tmp_path / "data"), manual_dir=root)


def test_pacs_max_per_domain_env_var_and_nested_root(tmp_path, monkeypatch):
  write_pacs_tree(str(tmp_path / "download" / "PACS"))
  monkeypatch.setenv("FEDJAX_DG_PACS_DIR", str(tmp_path / "download"))
  kw = dict(data_dir=str(tmp_path / "data"), image_size=4, max_per_domain=2)
  a = sources.load("pacs", seed=3, **kw)
  assert a.domain_counts() == {d: 2 for d in PACS_DOMAINS}
  b = sources.load("pacs", seed=3, **kw)
  np.testing.assert_array_equal(a.images, b.images)
  c = sources.load("pacs", seed=4, **kw)
  assert c.num_examples == 8


def test_missing_folder_error_names_layout(tmp_path):
  with pytest.raises(DataError) as e:
    sources.load("office_home", data_dir=str(tmp_path), image_size=8)
  msg = str(e.value)
  assert "<root>/<domain>/<class>/*.jpg" in msg
  assert "Art, Clipart, Product, Real World" in msg
  assert "drive.google.com" in msg and "FEDJAX_DG_OFFICE_HOME_DIR" in msg
  assert os.path.join(str(tmp_path), "downloads", "manual", "office_home") in msg


def test_missing_domain_and_inconsistent_classes(tmp_path):
  root = write_pacs_tree(str(tmp_path / "a"), domains=PACS_DOMAINS[:3])
  with pytest.raises(DataError, match=r"lacks the domain folders \['sketch'\]"):
    sources.load("pacs", data_dir=str(tmp_path / "d"), manual_dir=root,
                 image_size=4)
  root = write_pacs_tree(str(tmp_path / "b"))
  os.makedirs(os.path.join(root, "photo", "zebra"))
  Image.new("RGB", (5, 5)).save(os.path.join(root, "photo", "zebra", "z.jpg"))
  with pytest.raises(ValueError, match=r"only in 'photo': \['zebra'\]"):
    sources.load("pacs", data_dir=str(tmp_path / "d"), manual_dir=root,
                 image_size=4)


def test_scan_reports_empty_class_folder(tmp_path):
  root = write_pacs_tree(str(tmp_path / "PACS"))
  for d in PACS_DOMAINS:
    os.makedirs(os.path.join(root, d, "empty"))
  with pytest.raises(DataError, match="no image files"):
    domainbed_folder.scan(root, "pacs", PACS_DOMAINS, "")


# ---------------------------------------------------------------------------
# Rotated Fashion-MNIST on fake IDX files.


def test_read_idx_roundtrip(tmp_path):
  a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
  write_idx(str(tmp_path / "x.gz"), a)
  np.testing.assert_array_equal(fmb.read_idx(str(tmp_path / "x.gz")), a)


def test_rotation_is_counter_clockwise_like_pil():
  image = np.zeros((28, 28), np.uint8)
  image[2:6, 10:20] = 255  # A bar near the top edge.
  np.testing.assert_array_equal(rfm.rotate(image, 90), np.rot90(image))
  assert rfm.rotate(image, 0) is image
  want = np.asarray(Image.fromarray(image).rotate(
      15, resample=Image.Resampling.BILINEAR, fillcolor=0))
  np.testing.assert_array_equal(rfm.rotate(image, 15), want)


def test_rotated_fashion_mnist_builder(tmp_path):
  raw, raw_labels = write_fake_fashion_mnist(str(tmp_path / "idx"))
  data_dir = str(tmp_path / "data")
  ds = sources.load("rotated_fashion_mnist", data_dir=data_dir,
                    manual_dir=str(tmp_path / "idx"))
  assert ds.domain_names == ("0", "15", "30", "45", "60", "75")
  assert ds.class_names[0] == "T-shirt/top" and ds.num_classes == 10
  assert ds.images.shape == (60, 28, 28, 1)
  assert ds.domain_counts() == {d: 10 for d in ds.domain_names}
  # Round robin after one seeded shuffle, checked on the stored source indices.
  builder = rfm.RotatedFashionMnist(data_dir=data_dir, file_format="array_record")
  source = builder.as_data_source()["train"]
  records = source.__getitems__(list(range(len(source))))
  order = np.random.default_rng(0).permutation(60)
  position = np.argsort(order)
  for r in records:
    i = r["source_index"]
    assert r["domain"] == position[i] % 6
    assert r["label"] == raw_labels[i]
    want = rfm.rotate(raw[i], rfm.ANGLES[r["domain"]])
    np.testing.assert_array_equal(r["image"][..., 0], want)
    if r["domain"] == 0:
      np.testing.assert_array_equal(r["image"][..., 0], raw[i])
  # The DomainDataset holds the same images, domain by domain.
  zero = {raw[r["source_index"]].tobytes() for r in records if r["domain"] == 0}
  assert {im[..., 0].tobytes() for im in ds.images[ds.domains == 0]} == zero


def test_rotated_fashion_mnist_cache_and_resize(tmp_path, monkeypatch):
  write_fake_fashion_mnist(str(tmp_path / "idx"))
  monkeypatch.setenv("FEDJAX_DG_FASHION_MNIST_DIR", str(tmp_path / "idx"))
  monkeypatch.setenv("FEDJAX_DG_DATA_DIR", str(tmp_path / "data"))
  line = sources.prepare("rotated_fashion_mnist")
  assert "60 images 28x28x1" in line and "6 domains" in line
  first = sources.load("rotated_fashion_mnist", image_size=32, max_per_domain=4)
  assert first.images.shape == (24, 32, 32, 1)

  def no_tfds(*args, **kwargs):
    raise AssertionError("should have been served from the cache")

  monkeypatch.setattr(sources, "_read", no_tfds)
  second = sources.load("rotated_fashion_mnist", image_size=32, max_per_domain=4)
  np.testing.assert_array_equal(first.images, second.images)
  np.testing.assert_array_equal(first.labels, second.labels)
  np.testing.assert_array_equal(first.domains, second.domains)
  # New sizes are derived from the native-size cache, still without TFDS.
  full = sources.load("rotated_fashion_mnist")
  small = sources.load("rotated_fashion_mnist", image_size=14)
  assert small.images.shape == (60, 14, 14, 1)
  want = images.decode_image(full.images[7], 1, 14)
  np.testing.assert_array_equal(small.images[7], want)


def test_rotated_fashion_mnist_missing_source_says_what_to_do(tmp_path, monkeypatch):
  def offline(data_dir):
    raise ConnectionError("no network")

  monkeypatch.setattr(fmb, "read_tfds_catalog", offline)
  with pytest.raises(DataError) as e:
    sources.load("rotated_fashion_mnist", data_dir=str(tmp_path / "data"),
                 manual_dir=str(tmp_path / "nothing"))
  msg = str(e.value)
  assert "sudo apt-get install dataset-fashion-mnist" in msg
  assert "FEDJAX_DG_FASHION_MNIST_DIR" in msg
  assert "github.com/zalandoresearch/fashion-mnist" in msg
  assert "network" in msg and "no network" in msg


# ---------------------------------------------------------------------------
# TFDS catalog passthrough, with fake data sources.


def _png(array):
  buf = io.BytesIO()
  Image.fromarray(array).save(buf, format="PNG")
  return buf.getvalue()


class FakeSource:
  """Quacks like an ArrayRecordDataSource (len, __getitems__, dataset_info)."""

  def __init__(self, records, class_names):
    self.records = records
    label = types.SimpleNamespace(names=list(class_names))
    self.dataset_info = types.SimpleNamespace(features={"label": label})

  def __len__(self):
    return len(self.records)

  def __getitems__(self, indices):
    return [self.records[i] for i in indices]


def _fake_split(n, value, encoded):
  recs = []
  for i in range(n):
    im = np.full((6, 6, 3), value + i, np.uint8)
    recs.append({"image": _png(im) if encoded else im, "label": i % 3})
  return recs


def test_dataset_from_sources_with_fake_sources():
  domain_sources = {
      "clipart": [_fake_split(5, 0, True), _fake_split(3, 100, False)],
      "real": [_fake_split(4, 200, True)],
  }
  ds = dataset.dataset_from_sources(
      "fake", domain_sources, class_names=("a", "b", "c"), channels=3)
  assert ds.domain_names == ("clipart", "real")
  assert ds.images.shape == (12, 6, 6, 3)
  np.testing.assert_array_equal(ds.domains, [0] * 8 + [1] * 4)
  np.testing.assert_array_equal(ds.images[5, 0, 0], [100, 100, 100])
  np.testing.assert_array_equal(ds.labels[:8], [0, 1, 2, 0, 1, 0, 1, 2])
  sub = dataset.dataset_from_sources(
      "fake", domain_sources, class_names=("a", "b", "c"), channels=1,
      image_size=3, max_per_domain=2, seed=5)
  assert sub.images.shape == (4, 3, 3, 1)
  assert sub.domain_counts() == {"clipart": 2, "real": 2}


def test_catalog_passthrough_with_fake_tfds(tmp_path, monkeypatch):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  calls = []

  def fake_data_source(name, data_dir=None, decoders=None):
    calls.append(name)
    domain = name.split("/")[1]
    value = registry.DOMAINNET_DOMAINS.index(domain) * 20
    names = [f"class{i}" for i in range(3)]
    return {"train": FakeSource(_fake_split(3, value, True), names),
            "test": FakeSource(_fake_split(2, value + 10, True), names)}

  monkeypatch.setattr(tfds, "data_source", fake_data_source)
  ds = sources.load("domainnet", data_dir=str(tmp_path), image_size=4)
  assert calls == [f"domainnet/{d}" for d in registry.DOMAINNET_DOMAINS]
  assert ds.domain_names == registry.DOMAINNET_DOMAINS
  assert ds.class_names == ("class0", "class1", "class2")
  assert ds.images.shape == (30, 4, 4, 3)
  assert "30 images" in sources.prepare("domainnet", data_dir=str(tmp_path))
  # --force: the TFDS folders of every config and the caches go first.
  cache = os.path.join(str(tmp_path), registry.CACHE_DIRNAME, "domainnet")
  assert os.listdir(cache)
  folders = [tmp_path / "domainnet" / d / "1.0.0" for d in ("clipart", "real")]
  for folder in folders:
    folder.mkdir(parents=True)
  line = sources.prepare("domainnet", data_dir=str(tmp_path), force=True)
  assert "30 images" in line and "prepared again (--force)" in line
  assert not os.path.exists(cache)
  assert not any(folder.exists() for folder in folders)


def test_catalog_error_explains_tensorflow():
  missing = ModuleNotFoundError("No module named 'tensorflow'")
  err = prepared.catalog_error("cifar10", missing)
  assert "pip install tensorflow-cpu" in str(err) and "cifar10" in str(err)


# ---------------------------------------------------------------------------
# Label-skew benchmarks: official splits as domains.


def test_fashion_mnist_splits_are_domains(tmp_path):
  raw, raw_labels = write_fake_fashion_mnist(str(tmp_path / "idx"), n_train=30,
                                             n_test=10)
  ds = sources.load("fashion_mnist", data_dir=str(tmp_path / "data"),
                    manual_dir=str(tmp_path / "idx"))
  assert ds.domain_names == ("train", "test")
  assert ds.domain_counts() == {"train": 30, "test": 10}
  assert ds.images.shape == (40, 28, 28, 1) and ds.num_classes == 10
  # Exactly the official split's images (as sets: TFDS shuffles record order).
  for d, sl in ((0, slice(0, 30)), (1, slice(30, 40))):
    want = sorted((im.tobytes(), int(y)) for im, y in zip(raw[sl], raw_labels[sl]))
    got = sorted((im[..., 0].tobytes(), int(y)) for im, y in
                 zip(ds.images[ds.domains == d], ds.labels[ds.domains == d]))
    assert got == want
  assert splits.eval_split("fashion_mnist") == "test"
  assert splits.eval_split("pacs") is None
  assert splits.is_split_domain("test") and not splits.is_split_domain("photo")


def test_fashion_mnist_uses_the_rotated_builders_reader(tmp_path, monkeypatch):
  """No IDX files: the same fallback (TFDS catalog) and error as the rotated set."""
  calls = []

  def offline(data_dir):
    calls.append(data_dir)
    raise ConnectionError("no network")

  monkeypatch.setattr(fmb, "read_tfds_catalog", offline)
  with pytest.raises(DataError) as e:
    sources.load("fashion_mnist", data_dir=str(tmp_path / "data"),
                 manual_dir=str(tmp_path / "nothing"))
  assert calls and "dataset-fashion-mnist" in str(e.value)
  assert "FEDJAX_DG_FASHION_MNIST_DIR" in str(e.value)


def test_split_target_gives_test_set_evaluation(tmp_path):
  """targets='test': clients split the train split (Dirichlet), test = eval set."""
  from fedjax_dg.data import federated, partition  # pylint: disable=g-import-not-at-top
  write_fake_fashion_mnist(str(tmp_path / "idx"), n_train=100, n_test=20)
  ds = sources.load("fashion_mnist", data_dir=str(tmp_path / "data"),
                    manual_dir=str(tmp_path / "idx"))
  spec = partition.PartitionSpec("dirichlet", num_clients=4, alpha=0.5,
                                 min_partition_size=5)
  fed = federated.build(ds, spec, target_domain="test", val_fraction=0.0)
  assert fed.target_domain == "test" and fed.source_domains == ("train",)
  assert len(fed.target_y) == 20 and int(np.sum(fed.train.n)) == 100
  assert set(np.concatenate(fed.train_indices)) == set(
      np.flatnonzero(ds.domains == 0))


def write_tiny_imagenet(root, wnids=("n02", "n01", "n03"), per_class=3, val=4,
                        gray=True):
  """A tiny `tiny-imagenet-200` folder: 64x64 JPEGs, one class color each."""
  base = os.path.join(root, "tiny-imagenet-200")
  os.makedirs(os.path.join(base, "val", "images"))
  with open(os.path.join(base, "wnids.txt"), "w") as f:
    f.write("\n".join(wnids) + "\n")
  sorted_ids = sorted(wnids)
  for w in wnids:
    folder = os.path.join(base, "train", w, "images")
    os.makedirs(folder)
    color = _class_color(sorted_ids.index(w))
    for k in range(per_class):
      im = np.broadcast_to(np.array(color, np.uint8), (64, 64, 3))
      if gray and k == 0 and w == wnids[0]:  # Tiny-ImageNet has a few of these.
        Image.fromarray(np.ascontiguousarray(im[..., 0])).save(
            os.path.join(folder, f"{w}_{k}.JPEG"), quality=100)
      else:
        Image.fromarray(np.ascontiguousarray(im)).save(
            os.path.join(folder, f"{w}_{k}.JPEG"), quality=100)
    with open(os.path.join(base, "train", w, f"{w}_boxes.txt"), "w") as f:
      f.write("")
  lines = []
  for k in range(val):
    w = wnids[k % len(wnids)]
    im = np.broadcast_to(np.array(_class_color(sorted_ids.index(w)), np.uint8),
                         (64, 64, 3))
    Image.fromarray(np.ascontiguousarray(im)).save(
        os.path.join(base, "val", "images", f"val_{k}.JPEG"), quality=100)
    lines.append(f"val_{k}.JPEG\t{w}\t0\t0\t63\t63")
  with open(os.path.join(base, "val", "val_annotations.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")
  return base


def write_domainnet_tree(root, listed=(("zebra", 0), ("apple", 1))):
  """A DomainNet folder (the 4 mini domains plus infograph, which no split
  lists) with 3 images per class, of which the split files list 2 per
  (domain, class): one in _train.txt, one in _test.txt; labels follow
  `listed`, not the sorted class folders."""
  os.makedirs(os.path.join(root, mini_domainnet.SPLIT_DIR))
  for d_i, domain in enumerate(mini_domainnet.DOMAINS + ("infograph",)):
    lines = {"train": [], "test": []}
    for cls, label in listed + (("unlisted", 7),):
      folder = os.path.join(root, domain, cls)
      os.makedirs(folder)
      for i in range(3):
        rgb = np.full((9 + d_i, 11, 3), 20 + 60 * min(label, 2), np.uint8)
        Image.fromarray(rgb).save(os.path.join(folder, f"{domain}_{i}.jpg"),
                                  quality=100)
        if cls != "unlisted" and i < 2:
          lines[("train", "test")[i]].append(
              f"{domain}/{cls}/{domain}_{i}.jpg {label}\n")
    if domain != "infograph":
      for split, ls in lines.items():
        with open(os.path.join(root, mini_domainnet.SPLIT_DIR,
                               f"{domain}_{split}.txt"), "w") as f:
          f.writelines(ls)
  return root


def test_mini_domainnet_reads_the_split_files_as_fedccrl_does(tmp_path):
  """Only the listed images, train and test lists merged per domain, the
  four mini domains in order, labels and class names from the split files."""
  root = write_domainnet_tree(str(tmp_path / "domainnet"))
  ds = sources.load("mini_domainnet", data_dir=str(tmp_path / "data"),
                    manual_dir=root, image_size=8)
  assert ds.domain_names == mini_domainnet.DOMAINS
  assert ds.class_names == ("zebra", "apple")  # label order, not sorted
  assert ds.domain_counts() == {d: 4 for d in mini_domainnet.DOMAINS}
  for label in (0, 1):  # pixel value 20 + 60 * label
    np.testing.assert_allclose(ds.images[ds.labels == label].mean(),
                               20 + 60 * label, atol=2)


@pytest.mark.parametrize("damage,match", [
    ("missing_split", "split file .*painting_test.txt.* is missing"),
    ("missing_image", "lists 'real/apple/real_1.jpg', which is not in"),
    ("other_domain", "not an image of sketch/<class>/"),
    ("two_classes", "label 0 is class 'zebra' elsewhere but 'apple'"),
    ("bad_line", "line 1: .* is not '<domain>/<class>/<file> <label>'"),
    ("no_splits", "does not hold the folders"),
])
def test_mini_domainnet_errors_name_what_is_wrong(tmp_path, damage, match):
  root = write_domainnet_tree(str(tmp_path / "domainnet"))
  split = lambda name: os.path.join(root, mini_domainnet.SPLIT_DIR, name)
  if damage == "missing_split":
    os.remove(split("painting_test.txt"))
  elif damage == "missing_image":
    os.remove(os.path.join(root, "real", "apple", "real_1.jpg"))
  elif damage == "other_domain":
    with open(split("sketch_train.txt"), "a") as f:
      f.write("clipart/zebra/clipart_0.jpg 0\n")
  elif damage == "two_classes":
    with open(split("clipart_test.txt"), "a") as f:
      f.write("clipart/apple/clipart_2.jpg 0\n")
  elif damage == "bad_line":
    with open(split("real_train.txt"), "w") as f:
      f.write("real/zebra/real_0.jpg zero\n")
  else:
    import shutil
    shutil.rmtree(os.path.join(root, mini_domainnet.SPLIT_DIR))
  with pytest.raises(DataError, match=match):
    mini_domainnet.scan(root, "mini_domainnet")


def test_tiny_imagenet_folder_builder(tmp_path):
  write_tiny_imagenet(str(tmp_path / "raw"))
  # The parent of tiny-imagenet-200 is accepted as well.
  ds = sources.load("tiny_imagenet", data_dir=str(tmp_path / "data"),
                    manual_dir=str(tmp_path / "raw"))
  assert ds.domain_names == ("train", "val")
  assert ds.class_names == ("n01", "n02", "n03")  # sorted wnids
  assert ds.images.shape == (13, 64, 64, 3)
  assert ds.domain_counts() == {"train": 9, "val": 4}
  # Every image has its class's color (JPEG: within a few levels); the grayscale
  # JPEG became RGB (three equal channels).
  for im, y in zip(ds.images, ds.labels):
    color = np.array(_class_color(int(y)), float)
    mean = im.reshape(-1, 3).mean(0)
    assert np.all(np.abs(mean - color) < 4) or np.allclose(mean, mean[0], atol=1)
  np.testing.assert_array_equal(np.bincount(ds.labels[ds.domains == 1]), [1, 2, 1])
  assert splits.eval_split("tiny_imagenet") == "val"
  small = sources.load("tiny_imagenet", data_dir=str(tmp_path / "data"),
                       image_size=32)
  assert small.images.shape == (13, 32, 32, 3)


def test_tiny_imagenet_missing_or_broken_folder(tmp_path, monkeypatch):
  with pytest.raises(DataError) as e:
    sources.load("tiny_imagenet", data_dir=str(tmp_path / "data"),
                 manual_dir=str(tmp_path / "nothing"))
  msg = str(e.value)
  assert "train/<wnid>/images/*.JPEG" in msg and "val_annotations.txt" in msg
  assert tiny_imagenet.DOWNLOAD_URL in msg and "FEDJAX_DG_TINY_IMAGENET_DIR" in msg
  # The default manual dir comes from the env var.
  monkeypatch.setenv("FEDJAX_DG_TINY_IMAGENET_DIR", str(tmp_path / "env"))
  with pytest.raises(DataError, match="env"):
    sources.load("tiny_imagenet", data_dir=str(tmp_path / "data"))
  base = write_tiny_imagenet(str(tmp_path / "raw"))
  os.remove(os.path.join(base, "train", "n03", "images", "n03_0.JPEG"))
  for k in (1, 2):
    os.remove(os.path.join(base, "train", "n03", "images", f"n03_{k}.JPEG"))
  with pytest.raises(DataError, match="class 'n03'"):
    tiny_imagenet.scan(base)
  base2 = write_tiny_imagenet(str(tmp_path / "raw2"))
  with open(os.path.join(base2, "val", "val_annotations.txt"), "a") as f:
    f.write("val_9.JPEG\tn99\t0\t0\t1\t1\n")
  with pytest.raises(ValueError, match="line 5 .*wnids.txt"):
    tiny_imagenet.scan(base2)


def test_cifar_catalog_splits_are_domains(tmp_path, monkeypatch):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  calls = []

  def fake_data_source(name, data_dir=None, decoders=None):
    calls.append(name)
    names = [f"class{i}" for i in range(3)]
    return {"train": FakeSource(_fake_split(5, 0, True), names),
            "test": FakeSource(_fake_split(2, 100, True), names)}

  monkeypatch.setattr(tfds, "data_source", fake_data_source)
  for name in ("cifar10", "cifar100"):
    calls.clear()
    ds = sources.load(name, data_dir=str(tmp_path))
    assert calls == [name]  # one data_source call for both domains
    assert ds.domain_names == ("train", "test")
    assert ds.domain_counts() == {"train": 5, "test": 2}
    np.testing.assert_array_equal(ds.images[ds.domains == 1][:, 0, 0, 0], [100, 101])
    assert splits.eval_split(name) == "test"


def test_cifar_catalog_error_names_the_dataset(tmp_path, monkeypatch):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  def offline(name, data_dir=None, decoders=None):
    raise ConnectionError("no network")

  monkeypatch.setattr(tfds, "data_source", offline)
  with pytest.raises(DataError, match="'cifar100'.*no network.*network access"):
    sources.load("cifar100", data_dir=str(tmp_path))


# ---------------------------------------------------------------------------
# The real embedded dataset (only where the Debian package is installed).


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(os.path.join(
    FMNIST_DIR, "train-images-idx3-ubyte.gz")), reason="no dataset-fashion-mnist")
def test_real_rotated_fashion_mnist(tmp_path):
  line = sources.prepare("rotated_fashion_mnist", data_dir=str(tmp_path),
                         manual_dir=FMNIST_DIR)
  assert "70000 images 28x28x1" in line
  ds = sources.load("rotated_fashion_mnist", data_dir=str(tmp_path), image_size=32)
  assert ds.images.shape == (70000, 32, 32, 1)
  assert ds.domain_counts() == {
      "0": 11667, "15": 11667, "30": 11667, "45": 11667, "60": 11666, "75": 11666}


def _write_own_folder(root, domains, classes, missing=(), gray=True):
  """A user's folder: mixed sizes, grayscale and RGB files (RGB ones with blue
  77). Grayscale files load as RGB with three equal channels, so blue varies
  over the dataset; `gray=False`: every file RGB, blue constant over the whole
  dataset."""
  rng = np.random.default_rng(0)
  for d_i, d in enumerate(domains):
    for c_i, c in enumerate(classes):
      if (d, c) in missing:
        continue
      folder = os.path.join(root, d, c)
      os.makedirs(folder)
      for i in range(2):
        h, w = 10 + 2 * i + d_i, 9 + c_i
        if gray and (c_i + i) % 2:  # grayscale
          Image.fromarray(rng.integers(0, 255, (h, w), np.uint8), "L").save(
              os.path.join(folder, f"{i}.png"))
        else:
          rgb = rng.integers(0, 255, (h, w, 3), np.uint8)
          rgb[..., 2] = 77
          Image.fromarray(rgb).save(os.path.join(folder, f"{i}.png"))
  return root


@pytest.mark.parametrize("n_domains,n_classes", [(2, 2), (3, 5), (6, 10)])
def test_a_folder_of_your_own_becomes_a_named_dataset(tmp_path, n_domains,
                                                      n_classes):
  domains = [f"site_{k}" for k in range(n_domains)]
  classes = [f"class{k}" for k in range(n_classes)]
  missing = {(domains[-1], classes[0])}  # a domain may lack a class
  root = _write_own_folder(str(tmp_path / "mine"), domains, classes, missing)
  data_dir = str(tmp_path / "data")
  line = sources.prepare("folder", data_dir=data_dir, manual_dir=root,
                         dataset_name="my_sites")
  total = 2 * (n_domains * n_classes - 1)
  assert f"{total} images" in line
  assert "my_sites" in registry.available(data_dir)
  assert "my_sites" in lookup.describe_available(data_dir)
  ds = sources.load("my_sites", data_dir=data_dir, image_size=8)
  assert ds.images.shape == (total, 8, 8, 3)
  assert ds.domain_names == tuple(domains) and ds.class_names == tuple(classes)
  counts = ds.domain_counts()
  assert counts[domains[-1]] == 2 * (n_classes - 1)
  assert all(counts[d] == 2 * n_classes for d in domains[:-1])
  for c in range(n_classes):  # every label present where its folder is
    assert (ds.labels == c).sum() == 2 * (n_domains - (c == 0))


def test_a_folder_dataset_with_a_constant_channel_trains_end_to_end(tmp_path):
  """Blue is 77 in every image of the dataset: its std is 0, guarded
  (`channel_stats`: std 1, so it normalizes to 0, not 0 / 0 = NaN)."""
  from fedjax_dg.run import assemble, config, experiment
  root = _write_own_folder(str(tmp_path / "mine"),
                           ["a", "b", "c"], ["x", "y"], gray=False)
  data_dir = str(tmp_path / "data")
  sources.prepare("folder", data_dir=data_dir, manual_dir=root,
                  dataset_name="abc")
  ds = sources.load("abc", data_dir=data_dir, image_size=8)
  assert np.all(ds.images[..., 2] == 77) and ds.images[..., 0].std() > 0
  cfg = config.base_config()
  mean, std = assemble.normalization(cfg, ds, None)  # data.normalization
  assert std[2] == 1.0 and abs(mean[2] - 77 / 255) < 1e-9 and std[0] < 1.0
  cfg = config.apply_overrides(config.base_config(), [
      "data.name=abc", f"data.data_dir={data_dir}", "data.image_size=8",
      "data.targets=c", "model.name=mlp", "algorithms=fedavg",
      "train.rounds=1", "train.eval_every=1", "train.epochs=1",
      "train.batch_size=4", "train.progress=False", "data.val_fraction=0.25",
      f"output_dir={tmp_path / 'runs'}"])
  results = experiment.run(cfg, echo=lambda *a: None)
  (run,) = results["runs"]
  assert run["target"] == "c" and math.isfinite(run["history"][-1]["train_loss"])
  assert 0.0 <= run["final"]["ood_acc"] <= 1.0  # a number, not NaN


def test_prepare_folder_and_datasets_from_the_command_line(tmp_path, monkeypatch,
                                                          capsys):
  from fedjax_dg import cli
  data_dir = tmp_path / "data"
  monkeypatch.setenv("FEDJAX_DG_DATA_DIR", str(data_dir))
  root = _write_own_folder(str(tmp_path / "mine"), ["north", "south", "east"],
                           ["cat", "dog", "owl"])
  assert cli.main(["datasets"]) == 0
  before = capsys.readouterr().out
  assert "my_sites" not in before and "rotated_fashion_mnist" in before
  assert cli.main(["prepare", "folder", "--manual-dir", root, "--name",
                   "my_sites"]) == 0
  assert "18 images" in capsys.readouterr().out.splitlines()[-1]
  assert cli.main(["datasets"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].startswith(f"data directory: {data_dir} ")
  (line,) = [l for l in out if l.split()[0] == "my_sites"]
  assert line.split(None, 1)[1] == ("your folder, domains ['east', 'north', "
                                    "'south']: prepared")
  for name in registry.available():  # every built-in dataset is listed too
    assert any(l.split()[0] == name for l in out[1:]), name
  ds = sources.load("my_sites", image_size=8)
  assert ds.class_names == ("cat", "dog", "owl") and len(ds.images) == 18
  # Errors: a one-line message and exit code 2, no traceback.
  assert cli.main(["prepare", "folder", "--manual-dir", root]) == 2
  assert "--name NAME" in capsys.readouterr().err
  assert cli.main(["prepare", "folder", "--manual-dir", str(tmp_path / "no"),
                   "--name", "other"]) == 2
  assert str(tmp_path / "no") in capsys.readouterr().err


def test_folder_dataset_errors_name_what_to_fix(tmp_path):
  root = _write_own_folder(str(tmp_path / "mine"), ["a", "b"], ["x", "y"])
  data_dir = str(tmp_path / "data")
  for kw, needle in ((dict(dataset_name="pacs"), "built-in"),
                     (dict(dataset_name="My Data"), "lowercase"),
                     (dict(dataset_name=None), "--name NAME")):
    with pytest.raises(ConfigError, match=needle):
      sources.prepare("folder", data_dir=data_dir, manual_dir=root, **kw)
  one = _write_own_folder(str(tmp_path / "one"), ["a"], ["x"])
  with pytest.raises(DataError, match="at least 2"):
    sources.prepare("folder", data_dir=data_dir, manual_dir=one,
                    dataset_name="single")
  with pytest.raises(ConfigError, match="prepare folder --manual-dir DIR --name nope"):
    sources.load("nope", data_dir=data_dir)


def test_one_data_dir_rule(monkeypatch, tmp_path):
  monkeypatch.setenv("FEDJAX_DG_DATA_DIR", str(tmp_path / "env"))
  assert locations.data_dir_default() == str(tmp_path / "env")
  monkeypatch.delenv("FEDJAX_DG_DATA_DIR")
  checkout = os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(locations.__file__))), "..", ".data")
  want = (os.path.abspath(checkout) if os.path.isdir(checkout)
          else os.path.expanduser("~/.cache/fedjax_dg/tfds"))
  assert os.path.abspath(locations.data_dir_default()) == want


def test_prepare_prints_the_data_dir_and_the_rule_that_chose_it(
    monkeypatch, tmp_path, capsys):
  from fedjax_dg import cli
  rule = "; the rule: fedjax_dg.data.locations.data_dir_default)"
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.delenv("FEDJAX_DG_DATA_DIR", raising=False)
  checkout = tmp_path / "checkout" / ".data"
  monkeypatch.setattr(locations, "_checkout_data_dir", lambda: str(checkout))
  home = tmp_path / "home" / ".cache" / "fedjax_dg" / "tfds"
  assert locations.data_dir_line() == (
      f"data directory: {home} (the default (no $FEDJAX_DG_DATA_DIR, no "
      "checkout .data/)" + rule)
  checkout.mkdir(parents=True)
  assert locations.data_dir_line() == (
      f"data directory: {checkout} (the checkout's .data/ (no "
      "$FEDJAX_DG_DATA_DIR)" + rule)
  assert locations.data_dir_line("/x") == "data directory: /x (given)"
  monkeypatch.setenv("FEDJAX_DG_DATA_DIR", str(tmp_path / "env"))
  root = _write_own_folder(str(tmp_path / "mine"), ["a", "b"], ["x", "y"])
  assert cli.main(["prepare", "folder", "--manual-dir", root, "--name",
                   "mine"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == (f"data directory: {tmp_path / 'env'} ($FEDJAX_DG_DATA_DIR "
                      "is set" + rule)
  assert "8 images" in lines[-1] and str(tmp_path / "env") in lines[-1]


# ---------------------------------------------------------------------------
# Stale prepared data, where a dataset was looked for, grayscale folders.


def _class_counts(ds):
  return {c: int((ds.labels == i).sum()) for i, c in enumerate(ds.class_names)}


def test_relabelled_images_are_noticed_and_force_prepares_again(
    tmp_path, monkeypatch, capsys):
  """50 files moved from one class folder to another keep the file count,
  the total size and the newest mtime (what a fingerprint of those alone
  sees): the file listing tells them apart. A run is refused with the command to run;
  `prepare` prepares again (the new labels); `--force` always does."""
  from fedjax_dg import cli
  monkeypatch.setenv("FEDJAX_DG_DATA_DIR", str(tmp_path / "data"))
  root = _write_own_folder(str(tmp_path / "mine"), ["a", "b"], ["x", "y"],
                           gray=False)
  assert cli.main(["prepare", "folder", "--manual-dir", root, "--name",
                   "mine"]) == 0
  assert _class_counts(sources.load("mine", image_size=8)) == {"x": 4, "y": 4}
  before = provenance.source_fingerprint(root)
  os.rename(os.path.join(root, "a", "x", "0.png"),
            os.path.join(root, "a", "y", "moved.png"))  # relabelled x -> y
  now = provenance.source_fingerprint(root)
  assert {k: before[k] for k in ("path", "files", "bytes", "mtime")} == {
      k: now[k] for k in ("path", "files", "bytes", "mtime")}
  with pytest.raises(DataError, match=r"stale: .*moved, renamed or replaced.*"
                     r"fedjax-dg prepare folder --manual-dir .*mine --name mine"):
    sources.load("mine", image_size=8)  # even from the npz cache
  capsys.readouterr()
  assert cli.main(["prepare", "folder", "--manual-dir", root, "--name",
                   "mine"]) == 0
  assert "prepared again (the folder changed since" in capsys.readouterr().out
  assert _class_counts(sources.load("mine", image_size=8)) == {"x": 3, "y": 5}
  # Current data stay; --force prepares again anyway (the caches go too).
  cache = os.path.join(str(tmp_path / "data"), "mine", "1.0.0",
                       registry.CACHE_DIRNAME)
  assert os.listdir(cache)
  assert cli.main(["prepare", "folder", "--manual-dir", root, "--name",
                   "mine"]) == 0
  assert "prepared again" not in capsys.readouterr().out and os.listdir(cache)
  assert cli.main(["prepare", "folder", "--manual-dir", root, "--name", "mine",
                   "--force"]) == 0
  assert "prepared again (--force)" in capsys.readouterr().out
  assert not os.path.exists(cache)
  assert _class_counts(sources.load("mine", image_size=8)) == {"x": 3, "y": 5}


def test_a_run_is_told_where_a_folder_dataset_was_prepared(tmp_path,
                                                           monkeypatch):
  """Prepared before the checkout's .data/ existed, a folder dataset lands in
  ~/.cache/...; once .data/ exists, the lookup names the directory it looked
  in, the one that holds the dataset and both ways out."""
  from fedjax_dg.run import checks, config
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.delenv("FEDJAX_DG_DATA_DIR", raising=False)
  checkout = tmp_path / "checkout" / ".data"
  monkeypatch.setattr(locations, "_checkout_data_dir", lambda: str(checkout))
  home = str(tmp_path / "home" / ".cache" / "fedjax_dg" / "tfds")
  root = _write_own_folder(str(tmp_path / "mine"), ["a", "b"], ["x", "y"])
  sources.prepare("folder", manual_dir=root, dataset_name="mine")
  assert locations.data_dir_default() == home
  checkout.mkdir(parents=True)  # e.g. `make demo` made it since
  want = [f"Looked in the data directory {checkout} (the checkout's .data/",
          f"'mine' is prepared in another data directory, {home} (from {root})",
          f"--set data.data_dir={home}", f"FEDJAX_DG_DATA_DIR={home}",
          f"fedjax-dg prepare folder --manual-dir {root} --name mine"]
  with pytest.raises(ConfigError, match="unknown dataset name 'mine'") as e:
    sources.load("mine", image_size=8)
  for text in want:
    assert text in str(e.value), text
  cfg = config.apply_overrides(config.base_config(), [
      "data.name=mine", "algorithms=fedavg", "model.name=mlp"])
  with pytest.raises(ConfigError, match="unknown dataset data.name='mine'") as e:
    checks.validate(cfg)
  for text in want:
    assert text in str(e.value), text
  # The advice works: that data directory has it.
  assert len(sources.load("mine", data_dir=home, image_size=8).labels) == 8
  # A name prepared nowhere: where it looked and how to prepare one (with the
  # data directory to prepare into, when it was given).
  with pytest.raises(ConfigError) as e:
    sources.load("other", data_dir=str(tmp_path / "given"))
  assert (f"Looked in the data directory {tmp_path / 'given'} (given: "
          "data.data_dir); a folder of your own: FEDJAX_DG_DATA_DIR="
          f"{tmp_path / 'given'} fedjax-dg prepare folder --manual-dir DIR "
          "--name other") in str(e.value)


def test_prepare_logs_no_tfds_warning_about_a_missing_dataset_info(
    tmp_path, caplog):
  """TFDS's `is_prepared` warns "Variant folder ... has no
  dataset_info.json" for every dataset not prepared yet: expected before a
  first `prepare`, so not shown."""
  import logging
  root = _write_own_folder(str(tmp_path / "mine"), ["a", "b"], ["x", "y"])
  with caplog.at_level(logging.WARNING):
    sources.prepare("folder", data_dir=str(tmp_path / "data"), manual_dir=root,
                    dataset_name="mine")
    sources.load("mine", data_dir=str(tmp_path / "data"), image_size=8)
  assert not [r for r in caplog.records if "dataset_info" in r.getMessage()]


def _write_gray_folder(root):
  """2 domains x 2 classes x 3 grayscale files of one size (12x10): 8-bit
  PNG, 8-bit JPEG and an L+alpha PNG; returns {(domain, class): [arrays]} as
  PIL reads them in gray."""
  rng = np.random.default_rng(3)
  want = {}
  for d in ("a", "b"):
    for c in ("x", "y"):
      folder = os.path.join(root, d, c)
      os.makedirs(folder)
      gray = [rng.integers(0, 255, (12, 10), np.uint8) for _ in range(3)]
      Image.fromarray(gray[0], "L").save(os.path.join(folder, "0.png"))
      Image.fromarray(gray[1], "L").save(os.path.join(folder, "1.jpg"),
                                         quality=95)
      alpha = np.full((12, 10), 255, np.uint8)
      Image.fromarray(np.stack([gray[2], alpha], -1), "LA").save(
          os.path.join(folder, "2.png"))
      want[d, c] = [np.asarray(Image.open(os.path.join(folder, n)).convert("L"))
                    for n in ("0.png", "1.jpg", "2.png")]
  return want


def test_a_grayscale_folder_stays_gray(tmp_path):
  """Every image grayscale: stored and loaded with one channel, the pixels
  PIL reads (not RGB with three equal channels: 3x the memory)."""
  root = str(tmp_path / "gray")
  want = _write_gray_folder(root)
  data_dir = str(tmp_path / "data")
  line = sources.prepare("folder", data_dir=data_dir, manual_dir=root,
                         dataset_name="gray")
  assert "12 images, grayscale (1 channel)" in line
  ds = sources.load("gray", data_dir=data_dir)  # native size: 12x10
  assert ds.images.shape == (12, 12, 10, 1)
  for (d, c), arrays in want.items():
    rows = (ds.domains == ds.domain_names.index(d)) & (
        ds.labels == ds.class_names.index(c))
    got = sorted(im[..., 0].tobytes() for im in ds.images[rows])
    assert got == sorted(a.tobytes() for a in arrays), (d, c)
  # One RGB image among them: the folder is RGB, prepared again as such.
  Image.fromarray(np.zeros((12, 10, 3), np.uint8)).save(
      os.path.join(root, "a", "x", "rgb.png"))
  line = sources.prepare("folder", data_dir=data_dir, manual_dir=root,
                         dataset_name="gray")
  assert "13 images, RGB" in line
  assert sources.load("gray", data_dir=data_dir).images.shape == (13, 12, 10, 3)


def test_the_own_folder_config_uses_every_image_and_says_what_to_set(
    tmp_path):
  """experiments/own_folder.py: no subset, no demo settings inherited; a run
  without data.name stops and says to set it; with it, every image of the
  folder is in the federation (clients' training and validation + target),
  gray kept gray."""
  from fedjax_dg.run import assemble, checks, config
  path = os.path.join(os.path.dirname(os.path.dirname(__file__)),
                      "experiments", "own_folder.py")
  cfg = config.load(path)
  assert cfg.data.max_per_domain == 0 and cfg.data.name == ""
  assert cfg.model.name == "inception_cnn" and cfg.data.image_size == 32
  with pytest.raises(ConfigError, match="data.name is not set.*prepare folder"):
    checks.validate(cfg)
  root = str(tmp_path / "gray")
  _write_gray_folder(root)
  data_dir = str(tmp_path / "data")
  sources.prepare("folder", data_dir=data_dir, manual_dir=root,
                  dataset_name="gray")
  cfg = config.apply_overrides(cfg, ["data.name=gray",
                                     f"data.data_dir={data_dir}",
                                     "data.image_size=8", "data.targets=b",
                                     "data.val_fraction=0.2"])
  checks.validate(cfg)
  ds = assemble.load_dataset(cfg)
  files = sum(len(names) for _, _, names in os.walk(root))
  assert ds.images.shape == (files, 8, 8, 1)
  fed = assemble.federate(cfg, ds, "b")
  assert (int(np.sum(fed.packed_train.n)) + int(np.sum(fed.packed_val.n))
          + len(fed.target_y)) == files


def test_data_prepared_before_the_file_listing_was_kept(tmp_path, monkeypatch):
  """A record without the listing (an older fedjax_dg) cannot tell a
  relabelled folder: `prepare` prepares a folder dataset again; the
  Fashion-MNIST ones, whose labels are inside their IDX files, get the
  listing added in place (no rebuild). `load` compares what was recorded."""
  data_dir = str(tmp_path / "data")
  root = _write_own_folder(str(tmp_path / "mine"), ["a", "b"], ["x", "y"])
  sources.prepare("folder", data_dir=data_dir, manual_dir=root,
                  dataset_name="mine")
  listing = os.path.join(data_dir, "mine", "1.0.0", provenance.LISTING_RECORD)
  os.remove(listing)
  assert sources.load("mine", data_dir=data_dir, image_size=8).labels.size == 8
  line = sources.prepare("folder", data_dir=data_dir, manual_dir=root,
                         dataset_name="mine")
  assert "prepared again (prepared by an older fedjax_dg" in line
  assert os.path.exists(listing)
  write_fake_fashion_mnist(str(tmp_path / "idx"))
  monkeypatch.setenv("FEDJAX_DG_FASHION_MNIST_DIR", str(tmp_path / "idx"))
  sources.prepare("rotated_fashion_mnist", data_dir=data_dir)
  done = os.path.join(data_dir, "rotated_fashion_mnist", "1.0.0")
  os.remove(os.path.join(done, provenance.LISTING_RECORD))
  marker = os.path.join(done, registry.CACHE_DIRNAME, "marker")
  open(marker, "w").close()
  line = sources.prepare("rotated_fashion_mnist", data_dir=data_dir)
  assert "prepared again" not in line and os.path.exists(marker)
  assert "listing" in provenance.recorded_source(
      lookup.lookup("rotated_fashion_mnist"), data_dir)
