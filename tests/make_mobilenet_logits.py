"""Writes tests/data/mobilenet_v3_logits.npz: torchvision's logits for seeded weights.

    python tests/make_mobilenet_logits.py    # in an environment with torch + torchvision

e.g. `python3 -m venv /tmp/tv && /tmp/tv/bin/pip install numpy torch==2.14.1
torchvision==0.29.1` (beside torch 2.13.0, torchvision 0.28.0 failed to import
here: "operator torchvision::nms does not exist").

`tests/test_models_mobilenet.py::test_seeded_weights_give_torchvisions_logits`
compares the library's MobileNetV3-Large with these logits in every `make test`,
without PyTorch: the weights (`state_dict`) and inputs (`inputs`) are
deterministic functions of a numpy generator, so only the logits (12 KB) are
committed, never a weights file. The file was written with torch 2.14.1 /
torchvision 0.29.1 on CPU (versions recorded in the file). This module imports
numpy only at the top: the test imports it without torch.

The weights are in torchvision's `mobilenet_v3_large().state_dict()` layout
(names and shapes from tests/data/mobilenet_v3_large_state_shapes.json): convs
and Linears N(0, 2 / fan_in) (He: with N(0, 1 / fan_in) the signal fades over
the 15 blocks and every image gets the same logits, the biases'), every
BatchNorm with non-trivial weight, bias, running mean and running variance
(eval mode folds them into an affine map), so that no part of the network is
an identity and every block's output matters.
"""

from __future__ import annotations

import json
import os

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = os.path.join(HERE, "data", "mobilenet_v3_large_state_shapes.json")
PATH = os.path.join(HERE, "data", "mobilenet_v3_logits.npz")
SEED = 20230
# One batch, H != W (a transposed kernel or a swapped axis shows), sizes that
# are not multiples of the net's stride 32 (the stride-2 convs' padding shows).
INPUT_SHAPE = (3, 72, 56, 3)  # NHWC


def state_dict(seed: int = SEED) -> dict[str, np.ndarray]:
  """torchvision-layout MobileNetV3-Large weights drawn from `seed` (float32)."""
  rng = np.random.default_rng(seed)
  with open(SHAPES) as f:
    shapes = json.load(f)["torchvision"]
  out = {}
  for name, shape in shapes.items():
    if name.endswith("num_batches_tracked"):
      out[name] = np.array(0, np.int64)
    elif name.endswith("running_var"):
      out[name] = rng.uniform(0.5, 2.0, shape).astype(np.float32)
    elif len(shape) == 1:  # BatchNorm weight / bias / mean, Linear / SE bias
      loc = 1.0 if name.endswith(".weight") else 0.0
      out[name] = rng.normal(loc, 0.1, shape).astype(np.float32)
    else:  # He: N(0, 1 / fan_in) would fade to the biases after 15 blocks
      fan_in = int(np.prod(shape[1:]))
      out[name] = rng.normal(0.0, np.sqrt(2.0 / fan_in), shape).astype(np.float32)
  return out


def inputs(seed: int = SEED) -> np.ndarray:
  """Normalized input images, NHWC float32 (torch takes them as NCHW): per
  image a colour offset, a contrast, a linear ramp in a random direction and
  a low-frequency wave, plus pixel noise. (White noise alone would make every
  image's pooled features nearly equal: the global average pool averages it
  out.)"""
  rng = np.random.default_rng(seed + 1)
  n, h, w, c = INPUT_SHAPE
  i, j = np.meshgrid(np.linspace(-1, 1, h), np.linspace(-1, 1, w), indexing="ij")
  out = []
  for _ in range(n):
    offset, contrast = rng.normal(0, 0.7, c), rng.uniform(0.5, 1.5, c)
    a, b = rng.normal(size=2)
    fi, fj, phase = rng.uniform(1, 4), rng.uniform(1, 4), rng.uniform(0, 2 * np.pi)
    ramp = (a * i + b * j)[..., None]
    wave = np.sin(np.pi * (fi * i + fj * j) + phase)[..., None]
    out.append(offset + contrast * (ramp + wave * rng.normal(size=c))
               + rng.normal(0, 0.3, (h, w, c)))
  return np.stack(out).astype(np.float32)


def main() -> None:
  import torch  # pylint: disable=g-import-not-at-top
  import torchvision  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(1)  # no thread-count dependence of the sums
  net = torchvision.models.mobilenet_v3_large()
  net.load_state_dict({k: torch.from_numpy(v) for k, v in state_dict().items()})
  net.eval()
  with torch.no_grad():
    x = torch.from_numpy(inputs().transpose(0, 3, 1, 2).copy())
    logits = net(x).numpy().astype(np.float32)
  np.savez_compressed(
      PATH, logits=logits,
      made_with=np.array(f"torch {torch.__version__}, torchvision "
                         f"{torchvision.__version__}, numpy {np.__version__}"))
  print(f"wrote {PATH}: logits {logits.shape}, max |logit| "
        f"{np.abs(logits).max():.4g}, std {logits.std():.4g}")


if __name__ == "__main__":
  main()
