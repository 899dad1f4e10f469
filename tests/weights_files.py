"""Weights files in the libraries' layouts with random values, for tests that
load them (`models.get_model(weights=...)`): MobileNetV3-Large in torchvision's
or timm's state-dict layout (names and shapes written once from both
libraries: tests/data/mobilenet_v3_large_state_shapes.json) and a ViT in
timm's or torchvision's layout (names and shapes from the converter's view of
the model, `vit_weights.expected_shapes`). Random values of the right scale:
weights normal with variance 1 / fan-in, norm scales near 1, BatchNorms with
non-trivial running statistics, so a misplaced or transposed tensor changes
what the model computes."""

import json
import os

import jax
import numpy as np

from fedjax_dg.models import vit_weights

MOBILENET_SHAPES = json.load(open(os.path.join(
    os.path.dirname(__file__), "data", "mobilenet_v3_large_state_shapes.json")))


def _tensor(rng, name: str, shape) -> np.ndarray:
  """One random tensor named as torch names it."""
  if name.endswith("num_batches_tracked"):
    return np.array(7, np.int64)
  if name.endswith("running_var"):
    return rng.uniform(0.5, 2.0, shape).astype(np.float32)
  if len(shape) == 1:
    return rng.normal(1.0 if name.endswith("weight") else 0.0, 0.2,
                      shape).astype(np.float32)
  fan_in = int(np.prod(shape[1:]))
  return rng.normal(0, np.sqrt(1 / fan_in), shape).astype(np.float32)


def mobilenet_state(layout: str = "torchvision", seed: int = 0
                    ) -> dict[str, np.ndarray]:
  """A MobileNetV3-Large state dict of the library's names and shapes (1000
  ImageNet classes): kaiming-scaled weights, BatchNorms with non-trivial
  weight, bias, running mean and variance."""
  rng = np.random.default_rng(seed)
  return {name: _tensor(rng, name, shape)
          for name, shape in MOBILENET_SHAPES[layout].items()}


def vit_state(model, layout: str = "torchvision", seed: int = 0
              ) -> dict[str, np.ndarray]:
  """A state dict of `layout` (timm / torchvision) for `model` (a
  `models.get_model` ViT without adapters: the file's head has its
  `num_classes`), random values: matrices with variance 1 / fan-in (the
  class token and position embeddings 0.02, as the releases' init), 1-d
  tensors near 0 (biases) or 1 (norm weights)."""
  template = jax.eval_shape(model.init, jax.random.key(0))
  rng = np.random.default_rng(seed)
  out = {}
  for name, shape in vit_weights.expected_shapes(template, layout).items():
    if name in ("cls_token", "class_token", "pos_embed",
                "encoder.pos_embedding"):
      out[name] = rng.normal(0, 0.02, shape).astype(np.float32)
    elif len(shape) == 1 and not name.endswith("weight"):
      out[name] = rng.normal(0, 0.02, shape).astype(np.float32)
    else:
      out[name] = _tensor(rng, name, shape)
  return out
