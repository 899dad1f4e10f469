"""Styled Fashion-MNIST: each style on small arrays, the builder on fake IDX files."""

from __future__ import annotations

import gzip
import os

import numpy as np
import pytest
from scipy import ndimage

from fedjax_dg import cli
from fedjax_dg.report import plots
from fedjax_dg.data import sources
from fedjax_dg.data.builders import fashion_mnist_base as fmb
from fedjax_dg.data.builders import styled_fashion_mnist as sfm

RNG = np.random.default_rng(0)
RANDOM = RNG.integers(0, 256, (9, 11), dtype=np.uint8)
SQUARE = np.zeros((16, 16), np.uint8)
SQUARE[4:12, 4:12] = 255  # An 8x8 white object on black.


def _rgb(c):
  return np.asarray(c, np.uint8)


# ---------------------------------------------------------------------------
# The styles, one by one.


def test_gray_repeats_the_grey_levels_in_three_channels():
  out = sfm.gray(RANDOM)
  assert out.shape == (9, 11, 3) and out.dtype == np.uint8
  for c in range(3):
    np.testing.assert_array_equal(out[..., c], RANDOM)


def test_tint_is_the_linear_blend_of_object_and_background_colours():
  out = sfm.tint(RANDOM)
  assert out.shape == (9, 11, 3) and out.dtype == np.uint8
  for (y, x), g in np.ndenumerate(RANDOM):  # Plain loop, in Python floats.
    for c in range(3):
      fg, bg = sfm.TINT_OBJECT[c], sfm.TINT_BACKGROUND[c]
      assert out[y, x, c] == round(bg + (fg - bg) * int(g) / 255)
  np.testing.assert_array_equal(sfm.tint(np.zeros((2, 2), np.uint8))[1, 1],
                                sfm.TINT_BACKGROUND)
  np.testing.assert_array_equal(sfm.tint(np.full((2, 2), 255, np.uint8))[0, 0],
                                sfm.TINT_OBJECT)


def test_inverse_is_255_minus_tint():
  np.testing.assert_array_equal(sfm.inverse(RANDOM),
                                255 - sfm.tint(RANDOM).astype(np.int32))
  np.testing.assert_array_equal(sfm.inverse(SQUARE)[0, 0],
                                255 - _rgb(sfm.TINT_BACKGROUND))


def test_edges_are_the_sobel_magnitude():
  g = RANDOM.astype(np.float64)
  magnitude = np.hypot(ndimage.sobel(g, axis=1, mode="nearest"),
                       ndimage.sobel(g, axis=0, mode="nearest"))
  want = np.clip(magnitude / sfm.EDGE_FULL, 0, 1)
  np.testing.assert_allclose(sfm.edges(RANDOM), want, atol=1e-5)


def test_sketch_inks_the_outline_and_leaves_the_inside_blank():
  out = sfm.sketch(SQUARE)
  paper, ink = _rgb(sfm.SKETCH_PAPER), _rgb(sfm.SKETCH_INK)
  is_ink = (out == ink).all(-1)
  is_paper = (out == paper).all(-1)
  # The 3x3 Sobel window marks the pixel rings either side of the border
  # (full strokes along the sides, partial ones at the corners), nothing else.
  box = np.ones((3, 3), bool)
  outline = (ndimage.binary_dilation(SQUARE > 0, box)
             & ~ndimage.binary_erosion(SQUARE > 0, box))
  assert is_paper[~outline].all()  # The inside and the outside.
  assert is_paper[6:10, 6:10].all() and is_paper[0].all()
  assert is_ink[4, 5:11].all() and is_ink[3, 5:11].all()  # The top edge.
  assert is_ink[5:11, 11].all() and is_ink[5:11, 12].all()  # The right edge.
  assert not is_paper[outline].any()
  for flat in (0, 128, 255):  # No edges: all paper, whatever the grey level.
    blank = sfm.sketch(np.full((5, 5), flat, np.uint8))
    assert (blank == paper).all()


def test_texture_keeps_the_object_over_a_seeded_background():
  a, b = sfm.texture(SQUARE, 7), sfm.texture(SQUARE, 7)
  np.testing.assert_array_equal(a, b)  # Deterministic for one source index.
  assert not np.array_equal(a, sfm.texture(SQUARE, 8))  # Per-image texture.
  assert (a[4:12, 4:12] == 255).all()  # The white object stays white.
  background = a[SQUARE == 0].astype(np.float64)
  assert background.std(0).min() > 10  # Stripes and noise, not a flat colour.
  # Grey level g blends: g + (1 - g / 255) * background.
  half = np.full((16, 16), 51, np.uint8)
  back = sfm.texture(np.zeros((16, 16), np.uint8), 7).astype(np.float64)
  want = 51 + (1 - 51 / 255) * back
  assert np.abs(sfm.texture(half, 7) - want).max() <= 1.0  # Rounding.


def test_render_dispatches_by_domain_and_is_deterministic():
  image = RANDOM
  funcs = {"gray": sfm.gray, "tint": sfm.tint, "inverse": sfm.inverse,
           "sketch": sfm.sketch, "texture": lambda im: sfm.texture(im, 3)}
  assert tuple(funcs) == sfm.DOMAIN_NAMES
  outs = []
  for d, name in enumerate(sfm.DOMAIN_NAMES):
    out = sfm.render(image, d, 3)
    assert out.shape == (9, 11, 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(out, funcs[name](image))
    np.testing.assert_array_equal(out, sfm.render(image.copy(), d, 3))
    outs.append(out)
  for i in range(len(outs)):  # Five different looks.
    for j in range(i):
      assert not np.array_equal(outs[i], outs[j])
  stacked = sfm.render_all(np.stack([image, image]), [1, 4], [0, 3])
  np.testing.assert_array_equal(stacked[1], outs[4])


# ---------------------------------------------------------------------------
# The builder on fake IDX files.


def _write_idx(path, array):
  header = bytes([0, 0, 8, array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
  with gzip.open(path, "wb") as f:
    f.write(header + np.ascontiguousarray(array, np.uint8).tobytes())


def _write_fake_fashion_mnist(folder, n_train=40, n_test=10):
  rng = np.random.default_rng(1)
  images = rng.integers(0, 256, (n_train + n_test, 28, 28), dtype=np.uint8)
  labels = rng.permutation(np.arange(n_train + n_test) % 10).astype(np.uint8)
  os.makedirs(folder)
  for (image_file, label_file), part in zip(
      fmb.IDX_FILES, (slice(0, n_train), slice(n_train, None))):
    _write_idx(os.path.join(folder, image_file), images[part])
    _write_idx(os.path.join(folder, label_file), labels[part])
  return images, labels


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  """`fedjax-dg prepare styled_fashion_mnist`, offline, from fake IDX files."""
  tmp = tmp_path_factory.mktemp("styled")
  raw, labels = _write_fake_fashion_mnist(str(tmp / "idx"))
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("FEDJAX_DG_FASHION_MNIST_DIR", str(tmp / "idx"))
    mp.setenv("FEDJAX_DG_DATA_DIR", str(tmp / "data"))
    mp.setattr(fmb, "read_tfds_catalog", None)  # No download: IDX files only.
    assert cli.main(["prepare", "styled_fashion_mnist"]) == 0
  return raw, labels, str(tmp / "data"), str(tmp / "idx")


def test_prepare_and_records(prepared):
  raw, raw_labels, data_dir, _ = prepared
  builder = sfm.StyledFashionMnist(data_dir=data_dir, file_format="array_record")
  source = builder.as_data_source()["train"]
  records = source.__getitems__(list(range(len(source))))
  assert len(records) == 50
  order = np.random.default_rng(fmb.SHUFFLE_SEED).permutation(50)
  position = np.argsort(order)  # Shuffled position of each raw image.
  seen = set()
  for r in records:
    i, d = int(r["source_index"]), int(r["domain"])
    seen.add(i)
    assert d == position[i] % 5  # Round robin after the seeded shuffle.
    assert r["label"] == raw_labels[i]  # Labels untouched.
    assert r["image"].shape == (28, 28, 3)
    np.testing.assert_array_equal(r["image"], sfm.render(raw[i], d, i))
  assert seen == set(range(50))


def test_load_holds_the_records_domain_by_domain(prepared):
  raw, raw_labels, data_dir, idx_dir = prepared
  ds = sources.load("styled_fashion_mnist", data_dir=data_dir, manual_dir=idx_dir)
  assert ds.domain_names == sfm.DOMAIN_NAMES
  assert ds.class_names == fmb.CLASS_NAMES
  assert ds.images.shape == (50, 28, 28, 3)
  assert ds.domain_counts() == {d: 10 for d in sfm.DOMAIN_NAMES}
  order = np.random.default_rng(fmb.SHUFFLE_SEED).permutation(50)
  for d in range(5):  # Same images and labels as rendering domain d's raw ones.
    idx = order[d::5]
    want = {(sfm.render(raw[i], d, i).tobytes(), int(raw_labels[i]))
            for i in idx}
    got = {(im.tobytes(), int(y)) for im, y in
           zip(ds.images[ds.domains == d], ds.labels[ds.domains == d])}
    assert got == want


def test_example_grid_picks_one_class_per_column(prepared, tmp_path):
  _, _, data_dir, idx_dir = prepared
  ds = sources.load("styled_fashion_mnist", data_dir=data_dir, manual_dir=idx_dir)
  idx = plots.example_indices(ds.labels, ds.domains, 5, 10, 12, seed=0)
  assert idx.shape == (5, 12)
  for (d, j), i in np.ndenumerate(idx):
    if i >= 0:
      assert ds.domains[i] == d and ds.labels[i] == j % 10
    else:  # Only where the domain has no example of that class.
      assert not ((ds.domains == d) & (ds.labels == j % 10)).any()
  path = plots.domain_examples(ds, str(tmp_path / "grid.png"), per_domain=4)
  assert os.path.getsize(path) > 1000


# ---------------------------------------------------------------------------
# The real embedded dataset (only where the Debian package is installed).

FMNIST_DIR = "/usr/share/datasets/fashion-mnist"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(os.path.join(
    FMNIST_DIR, "train-images-idx3-ubyte.gz")), reason="no dataset-fashion-mnist")
def test_real_styled_fashion_mnist(tmp_path):
  line = sources.prepare("styled_fashion_mnist", data_dir=str(tmp_path),
                         manual_dir=FMNIST_DIR)
  assert "70000 images 28x28x3" in line
  ds = sources.load("styled_fashion_mnist", data_dir=str(tmp_path),
                    manual_dir=FMNIST_DIR)
  assert ds.domain_counts() == {d: 14000 for d in sfm.DOMAIN_NAMES}
  raw, labels = fmb.load_raw(FMNIST_DIR)
  order = np.random.default_rng(fmb.SHUFFLE_SEED).permutation(70000)
  for d in range(5):  # The first image of each domain, as rendered from raw.
    i = order[d]
    want = sfm.render(raw[i], d, i)
    got = ds.images[ds.domains == d]
    assert any(np.array_equal(im, want) for im in got[ds.labels[ds.domains == d]
                                                       == labels[i]])
