"""Rotated Fashion-MNIST: the embedded offline dataset (DomainBed RotatedMNIST recipe).

DomainBed's RotatedMNIST concatenates the train and test sets (70k images), shuffles
them once, deals them round-robin to the six domains (`images[i::6]`) and rotates
domain i by `ANGLES[i]` degrees (torchvision `rotate`, bilinear, fill 0, which is
PIL's `Image.rotate`: counter-clockwise for positive angles, same size). Here the
raw images are Fashion-MNIST, read from the IDX files of the Debian package
`dataset-fashion-mnist` (or any folder holding the four `.gz` files).
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from fedjax_dg.data.builders.fashion_mnist_base import DealtFashionMnist

ANGLES = (0, 15, 30, 45, 60, 75)
DOMAIN_NAMES = tuple(str(a) for a in ANGLES)


def rotate(image: np.ndarray, angle: float) -> np.ndarray:
  """Rotates an [H, W] uint8 image counter-clockwise (PIL bilinear, fill 0)."""
  if angle == 0:
    return image
  pil = Image.fromarray(image).rotate(
      angle, resample=Image.Resampling.BILINEAR, fillcolor=0
  )
  return np.asarray(pil)


class RotatedFashionMnist(DealtFashionMnist, skip_registration=True):
  """Fashion-MNIST rotated by 0..75 degrees: six domains (DomainBed recipe)."""

  DOMAINS = DOMAIN_NAMES

  def render(self, image: np.ndarray, domain: int, index: int) -> np.ndarray:
    del index  # A rotation depends on the domain only.
    return rotate(image, ANGLES[domain])
