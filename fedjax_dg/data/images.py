"""Where a dataset's pixels are: an in-memory uint8 array, or records read on demand.

`RecordImages` stands for uint8 [N, H, W, ch] images that stay in their TFDS
array_record files (a dataset larger than host memory: `data.streaming`).
Indexing it with rows reads and decodes those records only (each distinct
record once); it is never read whole: `np.asarray` of it is an error, so code
that would hold every image fails loudly instead of filling the memory.
`take(images, rows)` selects rows of either kind (a copy of an array, a view
of records: nothing read); `images[rows]` reads them (the same call for both).
`channel_stats` reads either in blocks.
"""

from __future__ import annotations

import io
from typing import Any, Callable, Sequence

import numpy as np
from PIL import Image

from fedjax_dg.errors import DataError

_READ_CHUNK = 1024  # records per `__getitems__` call


def decode_image(
    image: bytes | np.ndarray, channels: int, image_size: int | None
) -> np.ndarray:
  """Encoded bytes or an array -> uint8 [H, W, channels], PIL-bilinear resized."""
  if isinstance(image, np.ndarray):
    arr = image[..., 0] if image.ndim == 3 and image.shape[-1] == 1 else image
    pil = Image.fromarray(np.asarray(arr, np.uint8))
  else:
    pil = Image.open(io.BytesIO(image))
  mode = "L" if channels == 1 else "RGB"
  if pil.mode != mode:
    pil = pil.convert(mode)
  if image_size is not None and pil.size != (image_size, image_size):
    pil = pil.resize((image_size, image_size), Image.Resampling.BILINEAR)
  out = np.asarray(pil, np.uint8)
  return out[..., None] if out.ndim == 2 else out


def _getitems(source: Any, indices: Sequence[int]) -> list[Any]:
  if hasattr(source, "__getitems__"):
    return list(source.__getitems__([int(i) for i in indices]))
  return [source[int(i)] for i in indices]


def read_records(
    source: Any,
    indices: Sequence[int],
    *,
    fields: Sequence[str],
    decode: Callable[[Any], Any] | None = None,
) -> dict[str, list[Any]]:
  """Reads `fields` of records `indices` (in chunks); `decode` maps the image."""
  out: dict[str, list[Any]] = {f: [] for f in fields}
  for start in range(0, len(indices), _READ_CHUNK):
    for record in _getitems(source, indices[start:start + _READ_CHUNK]):
      for f in fields:
        value = record[f]
        out[f].append(decode(value) if f == "image" and decode else value)
  return out


class Concat:
  """Several random-access sources as one: record i of the k-th source is
  record offsets[k] + i (a catalog dataset's splits and domains)."""

  def __init__(self, sources: Sequence[Any]):
    self.sources = list(sources)
    self.offsets = np.cumsum([0] + [len(s) for s in self.sources])

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def __getitems__(self, indices: Sequence[int]) -> list[Any]:
    indices = np.asarray(indices, np.int64)
    which = np.searchsorted(self.offsets, indices, side="right") - 1
    out: list[Any] = [None] * len(indices)
    for k in np.unique(which):
      at = np.flatnonzero(which == k)
      got = _getitems(self.sources[k], indices[at] - self.offsets[k])
      for i, record in zip(at, got):
        out[i] = record
    return out


class RecordImages:
  """uint8 [N, H, W, ch] images read on demand: image i is record
  `records[i]` of `source` (random access: `__len__` and `__getitems__`, as
  `tfds.data_source` gives), decoded to `channels` and resized to
  `image_size` (None: its stored size, `image_shape`)."""

  dtype = np.dtype(np.uint8)

  def __init__(self, source: Any, records: np.ndarray, *, channels: int,
               image_size: int | None, image_shape: tuple[int, ...],
               name: str = "dataset"):
    self.source = source
    self.records = np.asarray(records, np.int64)
    self.channels, self.image_size = channels, image_size
    self.shape = (len(self.records),) + tuple(image_shape)
    self.name = name

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def nbytes(self) -> int:
    """What the images would take in memory (they are never all read)."""
    return int(np.prod(self.shape))

  def __len__(self) -> int:
    return self.shape[0]

  def __repr__(self) -> str:
    return f"RecordImages({self.name}: {self.shape}, read on demand)"

  def take(self, rows, axis: int = 0) -> RecordImages:
    """Rows `rows` (an int array) as a view: nothing is read."""
    assert axis == 0, axis
    return RecordImages(self.source, self.records[np.asarray(rows, np.int64)],
                        channels=self.channels, image_size=self.image_size,
                        image_shape=self.shape[1:], name=self.name)

  def __getitem__(self, key) -> np.ndarray:
    """Reads rows: an int, a slice or an int array of any shape [...] (->
    [..., H, W, ch]); each distinct record is read and decoded once."""
    if isinstance(key, (int, np.integer)):
      return self[np.asarray([key])][0]
    if isinstance(key, slice):
      key = np.arange(len(self))[key]
    rows = np.asarray(key)
    if rows.dtype.kind not in "iu":
      raise TypeError(f"{self!r} is indexed by rows (an int, a slice or an int "
                      f"array), not {key!r}")
    if not rows.size:
      return np.zeros(rows.shape + self.shape[1:], np.uint8)
    unique, inverse = np.unique(self.records[rows.ravel()], return_inverse=True)
    decode = lambda im: decode_image(im, self.channels, self.image_size)
    images = read_records(self.source, unique, fields=("image",),
                          decode=decode)["image"]
    shapes = {im.shape for im in images}
    if shapes != {self.shape[1:]}:
      raise DataError(f"{self.name}: records hold images of shapes "
                      f"{sorted(shapes)[:3]}, not {self.shape[1:]}: set "
                      "image_size (data.image_size) to resize them")
    return np.stack(images)[inverse].reshape(rows.shape + self.shape[1:])

  def __array__(self, dtype=None, copy=None):
    raise DataError(
        f"{self!r} is streamed: its images are read by rows, never all at once "
        f"({self.nbytes / 2**30:.2f} GiB); this code path needs the whole "
        "array: load the dataset in memory (data.streaming='off') if it fits")


def take(images, rows) -> Any:
  """Rows `rows` of an image array (a copy) or of `RecordImages` (a view)."""
  return images.take(np.asarray(rows, np.int64), axis=0)


def is_streamed(images) -> bool:
  return isinstance(images, RecordImages)


MIN_STD = 0.5 / 255  # a channel whose std is below this is constant
STATS_BLOCK_BYTES = 1 << 22  # `channel_stats` reads this many bytes at a time
# (np.bincount counts them as int64: 8x that transiently)


def channel_stats(
    x,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """Per-channel mean and (population) std in [0, 1] units of uint8 examples
  x [n, H, W, ch] (an array or `RecordImages`).

  Exact, from per-channel histograms of the uint8 values, read in blocks of
  at most STATS_BLOCK_BYTES (at least one example), so memory stays small. A constant channel (std below half a
  grey level) gets std 1: normalized, it is 0 everywhere instead of a
  division by zero (NaN from the first step).
  """
  ch = x.shape[-1]
  hist = np.zeros((ch, 256), np.float64)
  block = max(1, STATS_BLOCK_BYTES // max(1, int(np.prod(x.shape[1:]))))
  for start in range(0, x.shape[0], block):
    chunk = x[start:start + block]
    for k in range(ch):
      hist[k] += np.bincount(chunk[..., k].ravel(), minlength=256)
  values = np.arange(256) / 255.0
  total = np.maximum(hist.sum(1), 1)
  mean = hist @ values / total
  var = np.maximum(hist @ values**2 / total - mean**2, 0.0)
  std = np.sqrt(var)
  std = np.where(std < MIN_STD, 1.0, std)
  return tuple(mean.tolist()), tuple(std.tolist())
