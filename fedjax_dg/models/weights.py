"""Pretrained MobileNetV3-Large weights: PyTorch state dicts <-> flax params.

    state = read_state_dict("mnv3.pth")          # or .safetensors (torch-free)
    params = to_flax(state, model.init(key), layout=detect_layout(state))
    state = to_torch(params)                     # torchvision names, numpy

Two layouts of the same network (312 tensors, 5,483,032 parameters with 1000
classes, checked against both libraries):

* ``"torchvision"`` (`torchvision.models.mobilenet_v3_large().state_dict()`):
  `features.0` stem, `features.1..15` inverted residuals
  (`block.<j>.0` conv, `block.<j>.1` BatchNorm, `block.<j>.fc1/fc2` SE),
  `features.16` last conv, `classifier.0` / `classifier.3` Linears. BatchNorm
  eps 1e-3.
* ``"timm"`` (`timm.create_model("mobilenetv3_large_100").state_dict()`):
  `conv_stem`/`bn1`, `blocks.<stage>.<j>` (the first a depthwise-separable
  block `conv_dw`/`bn1`/`conv_pw`/`bn2`; the others `conv_pw`/`bn1`,
  `conv_dw`/`bn2`, `se.conv_reduce`/`se.conv_expand`, `conv_pwl`/`bn3`),
  `blocks.6.0.conv`/`bn1` the last conv, `conv_head` a 1x1 conv with bias on
  the pooled vector (= torchvision's `classifier.0`), `classifier`. BatchNorm
  eps 1e-5.

Conv kernels OIHW -> HWIO (depthwise [C, 1, k, k] -> [k, k, 1, C]), Linear
[out, in] -> [in, out], a 1x1 conv used as a Linear [out, in, 1, 1] -> [in, out].
Each eval-mode BatchNorm is folded into the model's per-channel affine norm:
`scale = weight / sqrt(running_var + eps)`, `bias = bias - running_mean * scale`
(float64, then float32); `num_batches_tracked` is accepted and ignored.
`skip_head=True` keeps the template's last Linear (`fc2`, freshly initialized)
and ignores the file's, for fine-tuning on another number of classes.

`read_state_dict`, `conv_kernel` and `compare_shapes` / `mismatch_message`
serve any network's torch state dict (`models/adain.py` reads the AdaIN
reference release with them).
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Mapping
import zipfile

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from fedjax_dg.errors import ConfigError, DataError
from fedjax_dg.models import mobilenet

Params = Any

BN_EPS = {"torchvision": 1e-3, "timm": 1e-5}
LAYOUTS = tuple(BN_EPS)
# Blocks per stage of timm's `mobilenetv3_large_100` arch_def (ds, ir x2,
# ir x3 with SE, ir x4, ir x2 with SE, ir x3 with SE); `blocks.6` is the last conv.
TIMM_STAGES = (1, 2, 3, 4, 2, 3)
_BN = ("weight", "bias", "running_mean", "running_var")
_TRACKED = "num_batches_tracked"


def _block_parts(setting) -> list[str]:
  cin, _, expanded, _, use_se, _, _ = setting
  return ((["expand"] if expanded != cin else []) + ["depthwise"]
          + (["se"] if use_se else []) + ["project"])


def entries(layout: str = "torchvision") -> list[tuple[str, str, tuple]]:
  """(kind, torch prefix, flax path) of every layer, in the network's order.

  kind: "conv" (`.weight` OIHW), "bn" (`.weight/.bias/.running_mean/
  .running_var`), "linear" (`.weight` [out, in], `.bias`), "conv_linear"
  (`.weight` [out, in, 1, 1], `.bias`, a flax Dense).
  """
  if layout not in LAYOUTS:
    raise ConfigError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  tv = layout == "torchvision"
  out = [("conv", "features.0.0" if tv else "conv_stem", ("stem", "conv")),
         ("bn", "features.0.1" if tv else "bn1", ("stem", "norm"))]
  timm_blocks = [f"blocks.{s}.{j}" for s, n in enumerate(TIMM_STAGES)
                 for j in range(n)]
  for i, setting in enumerate(mobilenet.INVERTED_RESIDUAL_SETTING):
    parts = _block_parts(setting)
    block = f"block{i + 1}"
    for j, part in enumerate(parts):
      if part == "se":
        pre = f"features.{i + 1}.block.{j}" if tv else f"{timm_blocks[i]}.se"
        out += [("conv_linear", f"{pre}.{'fc1' if tv else 'conv_reduce'}",
                 (block, "se", "fc1")),
                ("conv_linear", f"{pre}.{'fc2' if tv else 'conv_expand'}",
                 (block, "se", "fc2"))]
        continue
      if tv:
        conv, bn = f"features.{i + 1}.block.{j}.0", f"features.{i + 1}.block.{j}.1"
      else:
        k = [p for p in parts if p != "se"].index(part) + 1
        name = {"expand": "conv_pw", "depthwise": "conv_dw",
                "project": "conv_pwl" if "expand" in parts else "conv_pw"}[part]
        conv, bn = f"{timm_blocks[i]}.{name}", f"{timm_blocks[i]}.bn{k}"
      out += [("conv", conv, (block, part, "conv")),
              ("bn", bn, (block, part, "norm"))]
  last = f"features.{len(mobilenet.INVERTED_RESIDUAL_SETTING) + 1}"
  out += [("conv", f"{last}.0" if tv else "blocks.6.0.conv", ("last", "conv")),
          ("bn", f"{last}.1" if tv else "blocks.6.0.bn1", ("last", "norm")),
          ("linear" if tv else "conv_linear",
           "classifier.0" if tv else "conv_head", ("fc1",)),
          ("linear", "classifier.3" if tv else "classifier", ("fc2",))]
  return out


def _get(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def _torch_shapes(kind: str, prefix: str, leaf: Mapping) -> dict[str, tuple]:
  """Names and shapes of the torch tensors of one layer, from its flax leaves."""
  if kind == "conv":
    h, w, i, o = leaf["kernel"].shape
    return {f"{prefix}.weight": (o, i, h, w)}
  if kind == "bn":
    (ch,) = leaf["scale"].shape
    return dict({f"{prefix}.{n}": (ch,) for n in _BN},
                **{f"{prefix}.{_TRACKED}": ()})
  i, o = leaf["kernel"].shape
  return {f"{prefix}.weight": (o, i) if kind == "linear" else (o, i, 1, 1),
          f"{prefix}.bias": (o,)}


def expected_shapes(template: Params, layout: str = "torchvision"
                    ) -> dict[str, tuple]:
  """{torch name: shape} a state dict for `template`'s model must have."""
  out = {}
  for kind, prefix, path in entries(layout):
    out.update(_torch_shapes(kind, prefix, _get(template, path)))
  return out


def detect_layout(state: Mapping[str, Any]) -> str:
  """"torchvision" or "timm", from the stem's tensor name."""
  for layout in LAYOUTS:
    if entries(layout)[0][1] + ".weight" in state:
      return layout
  raise DataError(
      "not a MobileNetV3-Large state dict: it has neither torchvision's "
      "'features.0.0.weight' nor timm's 'conv_stem.weight' (first keys: "
      f"{sorted(state)[:5]})")


def compare_shapes(state: Mapping[str, Any], expected: Mapping[str, tuple], *,
                   optional=lambda name: False,
                   extra_ok=lambda name: False
                   ) -> tuple[list[str], list[str], list[str]]:
  """(mismatched, missing, unexpected) names of a state dict against
  {torch name: shape}: each mismatch as "name: (file shape) in the file,
  (shape) in the model"; a missing name for which `optional(name)` holds and
  an extra name for which `extra_ok(name)` holds are not reported."""
  mismatched, missing = [], []
  for name, shape in expected.items():
    if name not in state:
      if not optional(name):
        missing.append(name)
    elif tuple(np.shape(state[name])) != tuple(shape):
      mismatched.append(f"{name}: {tuple(np.shape(state[name]))} in the file, "
                        f"{tuple(shape)} in the model")
  unexpected = sorted(k for k in set(state) - set(expected) if not extra_ok(k))
  return mismatched, missing, unexpected


def mismatch_message(what: str, mismatched, missing, unexpected) -> str:
  """One message listing `compare_shapes`'s findings after `what`."""
  parts = [what]
  if mismatched:
    parts.append("shape mismatches: " + "; ".join(mismatched))
  if missing:
    parts.append(f"missing ({len(missing)}): {missing}")
  if unexpected:
    parts.append(f"unexpected ({len(unexpected)}): {unexpected}")
  return "; ".join(parts)


def _check(state: Mapping[str, Any], template: Params, layout: str,
           skip_head: bool, source: str) -> None:
  expected = expected_shapes(template, layout)
  head_kind, head_prefix, _ = entries(layout)[-1]
  head = set(_torch_shapes(head_kind, head_prefix, template["fc2"]))
  if skip_head:
    expected = {k: v for k, v in expected.items() if k not in head}
  mismatched, missing, unexpected = compare_shapes(
      state, expected, optional=lambda name: name.endswith(_TRACKED),
      extra_ok=lambda name: skip_head and name in head)
  if not (mismatched or missing or unexpected):
    return
  message = mismatch_message(
      f"{source} does not fit mobilenet_v3_large ({layout} layout)",
      mismatched, missing, unexpected)
  if any(m.split(":")[0] in head for m in mismatched):
    message += ("; the file's classifier has another number of classes: "
                "skip_head=True (config: --set model.skip_head=True) starts "
                "the last Linear fresh")
  raise DataError(message)


def conv_kernel(weight) -> np.ndarray:
  """A torch Conv2d weight [out, in, kh, kw] as a flax kernel [kh, kw, in, out]
  (float64)."""
  return np.asarray(weight, np.float64).transpose(2, 3, 1, 0)


def _to_flax(kind: str, prefix: str, state: Mapping, eps: float) -> dict:
  w = lambda n: np.asarray(state[f"{prefix}.{n}"], np.float64)
  if kind == "conv":
    return {"kernel": conv_kernel(state[f"{prefix}.weight"])}
  if kind == "bn":
    scale = w("weight") / np.sqrt(w("running_var") + eps)
    return {"scale": scale, "bias": w("bias") - w("running_mean") * scale}
  weight = w("weight")
  return {"kernel": weight.reshape(weight.shape[:2]).T, "bias": w("bias")}


def _to_torch(kind: str, prefix: str, leaf: Mapping, eps: float) -> dict:
  a = lambda n: np.asarray(leaf[n], np.float32)
  if kind == "conv":
    return {f"{prefix}.weight": a("kernel").transpose(3, 2, 0, 1)}
  if kind == "bn":
    ch = a("scale").shape
    return {f"{prefix}.weight": a("scale"), f"{prefix}.bias": a("bias"),
            f"{prefix}.running_mean": np.zeros(ch, np.float32),
            f"{prefix}.running_var": np.full(ch, 1.0 - eps, np.float32),
            f"{prefix}.{_TRACKED}": np.zeros((), np.int64)}
  kernel = a("kernel").T
  if kind == "conv_linear":
    kernel = kernel[:, :, None, None]
  return {f"{prefix}.weight": kernel, f"{prefix}.bias": a("bias")}


def to_flax(state: Mapping[str, Any], template: Params, *,
            layout: str = "torchvision", skip_head: bool = False,
            source: str = "the state dict") -> Params:
  """Params with `template`'s structure from a torch-named state dict.

  Every tensor is checked first (a `DataError` names each mismatched tensor
  with both shapes, the missing and the unexpected names). `skip_head`: the
  template's `fc2` is kept and the file's last Linear ignored.
  """
  _check(state, template, layout, skip_head, source)
  params = {k: dict(v) for k, v in template.items()}
  for kind, prefix, path in entries(layout):
    if skip_head and path == ("fc2",):
      continue
    converted = {k: v.astype(np.float32)
                 for k, v in _to_flax(kind, prefix, state, BN_EPS[layout]).items()}
    parent = params
    for p in path[:-1]:
      parent[p] = dict(parent[p])
      parent = parent[p]
    parent[path[-1]] = converted
  return params


def to_torch(params: Params, layout: str = "torchvision"
             ) -> dict[str, np.ndarray]:
  """A torch-named numpy state dict computing what `params` compute (norm
  "affine"): each norm as a BatchNorm with mean 0 and variance 1 - eps."""
  out = {}
  for kind, prefix, path in entries(layout):
    out.update(_to_torch(kind, prefix, _get(params, path), BN_EPS[layout]))
  return out


FIELD = "model.weights"  # the config field that names a weights file
# What a weights file must hold, by its name's ending ("": any other).
EXPECTED = {
    ".safetensors": "a safetensors file of tensors, as "
                    "safetensors.torch.save_file(model.state_dict(), path) "
                    "writes",
    ".npz": "a numpy .npz archive of arrays, as the AugReg ViT releases and "
            "np.savez write",
    "": "a PyTorch state dict, as torch.save(model.state_dict(), path) writes",
}


def invalid_file(path: str, error: Exception) -> DataError:
  """"file X is not a valid weights file (expected ...)": what the reader
  said, what to do; for a file no reader could make sense of (cut short, an
  HTML error page saved under the file's name, another format)."""
  kind = next((e for e in EXPECTED if e and path.endswith(e)), "")
  detail = (str(error).strip().splitlines() or [""])[0][:200]
  return DataError(
      f"{FIELD}: file {path!r} is not a valid weights file (expected "
      f"{EXPECTED[kind]}; reading it failed with {type(error).__name__}: "
      f"{detail}). Download it again (a transfer cut short or an HTML error "
      f"page saved under its name looks like this), or set {FIELD} to "
      "another file")


def read_state_dict(path: str) -> dict[str, np.ndarray]:
  """A state dict from `.safetensors` (no torch needed) or a torch pickle
  (`torch.save(model.state_dict(), path)`, needs torch) as numpy arrays."""
  if not os.path.isfile(path):
    raise DataError(f"{FIELD}: weights file {path!r} does not exist")
  if path.endswith(".safetensors"):
    try:
      return dict(load_file(path))
    except (SafetensorError, OSError, ValueError) as e:
      raise invalid_file(path, e) from None
  try:
    import torch
  except ImportError:
    raise DataError(
        f"reading {path!r} (a torch pickle) needs PyTorch: pip install torch; "
        "or save the state dict as .safetensors (safetensors.torch.save_file) "
        "where torch is installed") from None
  try:
    state = torch.load(path, map_location="cpu", weights_only=True)
  except pickle.UnpicklingError as e:
    if not zipfile.is_zipfile(path):  # not what torch.save writes at all
      raise invalid_file(path, e) from None
    raise DataError(f"{FIELD}: {path!r} is not a plain state dict (save "
                    f"model.state_dict(), not the model): {e}") from None
  except (RuntimeError, EOFError, ValueError, OSError) as e:  # cut short etc.
    raise invalid_file(path, e) from None
  if not isinstance(state, Mapping) or not all(
      isinstance(v, torch.Tensor) for v in state.values()):
    raise DataError(f"{FIELD}: {path!r} holds a {type(state).__name__}, not a "
                    "state dict of tensors (torch.save(model.state_dict(), "
                    "path))")
  return {k: v.detach().numpy() for k, v in state.items()}


def load(path: str, template: Params, *, skip_head: bool = False) -> Params:
  """`to_flax` of the state dict in `path`, its layout detected."""
  state = read_state_dict(path)
  return to_flax(state, template, layout=detect_layout(state),
                 skip_head=skip_head, source=repr(path))
