"""Styled Fashion-MNIST: the embedded offline style-shift dataset (5 domains, RGB).

Rotated Fashion-MNIST shifts geometry; FedCCRL, CCST and ELCFS act on colour and
texture statistics. This dataset keeps the geometry and changes the style: the
same raw images (the Debian package's IDX files, train then test, 70k) are
shuffled once and dealt round-robin to the domains exactly as in
`rotated_fashion_mnist` (`deal_round_robin`: shuffled position p goes to domain
p % 5), and domain d renders its images in style `DOMAIN_NAMES[d]`, 28x28x3:

  gray     the original grey levels in all three channels (white object on black)
  tint     an amber object on a navy background: bg + (fg - bg) * g / 255
  inverse  255 - tint (a dark blue object on a pale yellow background)
  sketch   Sobel edges of the object as dark ink lines on cream paper; the filled
           interior and the background are both paper
  texture  the object's grey levels over a seeded, per-image background of
           coloured stripes and noise: g + (1 - g / 255) * stripes

With g the raw grey level, every style but sketch is `blend(g, fg, bg)`: the
object colour `fg` where g = 255 and the background `bg` (a colour or a per-pixel
texture) where g = 0. tint is a per-channel affine map of g (what AdaIN / MixStyle
style statistics can express); inverse flips its sign, sketch and texture change
the image's structure beyond per-channel statistics. Rendering is deterministic:
texture draws from `np.random.default_rng((TEXTURE_SEED, source_index))`, so an
image looks the same whatever order it is rendered in.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from fedjax_dg.data.builders.fashion_mnist_base import DealtFashionMnist

DOMAIN_NAMES = ("gray", "tint", "inverse", "sketch", "texture")
TINT_OBJECT = (255, 176, 32)       # amber
TINT_BACKGROUND = (16, 32, 96)     # navy
SKETCH_INK = (32, 32, 64)
SKETCH_PAPER = (244, 236, 216)
# Sobel gradient magnitude (of [0, 255] grey levels) that counts as a full
# stroke; a 0 -> 255 step gives 4 * 255 = 1020.
EDGE_FULL = 510.0
TEXTURE_SEED = 1


def blend(gray: np.ndarray, fg, bg) -> np.ndarray:
  """[H, W] uint8 grey levels -> [H, W, 3] uint8: `fg` where 255, `bg` where 0.

  `fg`, `bg`: RGB triples or [H, W, 3] arrays; linear in between, rounded.
  """
  a = gray.astype(np.float32)[..., None] / 255.0
  fg = np.asarray(fg, np.float32)
  bg = np.asarray(bg, np.float32)
  return np.clip(np.rint(bg + (fg - bg) * a), 0, 255).astype(np.uint8)


def gray(image: np.ndarray) -> np.ndarray:
  return np.repeat(image[..., None], 3, axis=-1)


def tint(image: np.ndarray) -> np.ndarray:
  return blend(image, TINT_OBJECT, TINT_BACKGROUND)


def inverse(image: np.ndarray) -> np.ndarray:
  return 255 - tint(image)


def edges(image: np.ndarray) -> np.ndarray:
  """Sobel gradient magnitude of [H, W] grey levels (borders replicated), / EDGE_FULL,
  clipped to [0, 1]: 0 on flat regions, inside the object as outside."""
  p = np.pad(image.astype(np.float32), 1, mode="edge")
  h, w = image.shape
  s = lambda dy, dx: p[1 + dy:1 + dy + h, 1 + dx:1 + dx + w]
  gx = (s(-1, 1) + 2 * s(0, 1) + s(1, 1)) - (s(-1, -1) + 2 * s(0, -1) + s(1, -1))
  gy = (s(1, -1) + 2 * s(1, 0) + s(1, 1)) - (s(-1, -1) + 2 * s(-1, 0) + s(-1, 1))
  return np.clip(np.hypot(gx, gy) / EDGE_FULL, 0.0, 1.0)


def sketch(image: np.ndarray) -> np.ndarray:
  """Ink where the object has edges, paper elsewhere."""
  strokes = np.rint(edges(image) * 255).astype(np.uint8)
  return blend(strokes, SKETCH_INK, SKETCH_PAPER)


def stripes(shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
  """[H, W, 3] float background: two random colours in random-angle stripes
  (period 3-8 pixels), plus Gaussian noise (std 24)."""
  h, w = shape
  yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
  angle = rng.uniform(0, np.pi)
  period = rng.uniform(3, 8)
  phase = rng.uniform(0, 2 * np.pi)
  wave = 0.5 + 0.5 * np.sin(
      2 * np.pi * (xx * np.cos(angle) + yy * np.sin(angle)) / period + phase)
  c0, c1 = rng.uniform(0, 200, (2, 3)).astype(np.float32)
  noise = rng.normal(0, 24, (h, w, 3)).astype(np.float32)
  return np.clip(c0 + (c1 - c0) * wave[..., None] + noise, 0, 255)


def texture(image: np.ndarray, index: int) -> np.ndarray:
  """The object's grey levels over the striped background of raw image `index`."""
  rng = np.random.default_rng((TEXTURE_SEED, int(index)))
  return blend(image, (255, 255, 255), stripes(image.shape, rng))


def render(image: np.ndarray, domain: int, index: int) -> np.ndarray:
  """Raw [H, W] uint8 image `index` in style DOMAIN_NAMES[domain]: [H, W, 3] uint8."""
  name = DOMAIN_NAMES[domain]
  if name == "texture":
    return texture(image, index)
  return {"gray": gray, "tint": tint, "inverse": inverse, "sketch": sketch}[name](
      image)


def render_all(images: np.ndarray, domains: Sequence[int],
               indices: Sequence[int]) -> np.ndarray:
  """`render` of each of `images` [N, H, W]: [N, H, W, 3] uint8."""
  return np.stack([render(im, int(d), int(i))
                   for im, d, i in zip(images, domains, indices)])


class StyledFashionMnist(DealtFashionMnist, skip_registration=True):
  """Fashion-MNIST in five colour / texture styles (round-robin domains)."""

  DOMAINS = DOMAIN_NAMES
  CHANNELS = 3

  def render(self, image: np.ndarray, domain: int, index: int) -> np.ndarray:
    return render(image, domain, index)
