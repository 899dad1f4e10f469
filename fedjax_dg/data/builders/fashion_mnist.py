"""Fashion-MNIST with its official splits as domains ("train", "test").

For label-skew experiments (HyperGenFL): `data.targets="test"` holds out the
official test set as the evaluation split and the partitioner splits the official
train split among the clients. The raw images are read exactly as for Rotated
Fashion-MNIST (`fashion_mnist_base.load_raw_splits`): the IDX files of the
Debian package `dataset-fashion-mnist` (or `$FEDJAX_DG_FASHION_MNIST_DIR`, or
`manual_dir`), else the TFDS catalog `fashion_mnist` (download).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from fedjax_dg.data.builders.fashion_mnist_base import (SPLITS,
                                                        FashionMnistBuilder,
                                                        encode_png)

DOMAIN_NAMES = SPLITS  # ("train", "test")


class FashionMnistSplits(FashionMnistBuilder, skip_registration=True):
  """Fashion-MNIST, 60k train + 10k test, the official split as the `domain`."""

  DOMAINS = DOMAIN_NAMES

  def _generate_examples(
      self, splits: dict[str, tuple[np.ndarray, np.ndarray]]
  ) -> Iterator[tuple[str, dict]]:
    for d, split in enumerate(DOMAIN_NAMES):
      images, labels = splits[split]
      for i in range(len(images)):
        yield f"{split}-{i}", {
            "image": encode_png(images[i]),
            "label": int(labels[i]),
            "domain": d,
            "source_index": i,  # Index within the official split.
        }
