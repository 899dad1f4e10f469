"""Pretrained ViT weights (AugReg `.npz`, timm, torchvision) -> `vit.ViT` params.

    state = read_weights("ViT-B_16.npz")         # .npz, .safetensors or .pth
    layout = detect_layout(state)                # "augreg" | "timm" | "torchvision"
    params = to_flax(state, template, layout=layout, grid=(14, 14))
    state = to_layout(params, "timm")            # the inverse, numpy float32

Three layouts of the same network (pre-LN blocks, LayerNorm eps 1e-6, exact
GELU, class token, learned position embeddings including the class token's):

* ``"augreg"``: the `.npz` of the original ViT / AugReg releases
  (google-research/vision_transformer, `gs://vit_models/augreg/*.npz`):
  `embedding/kernel` [p, p, C, D], `cls`, `Transformer/posembed_input/
  pos_embedding`, `Transformer/encoderblock_<i>/{LayerNorm_0,
  MultiHeadDotProductAttention_1/{query,key,value,out}, LayerNorm_2,
  MlpBlock_3/Dense_0, MlpBlock_3/Dense_1}`, `Transformer/encoder_norm`,
  `head`. Our parameter shapes are this release's, so every tensor is taken as
  is (an `opt/target/` prefix, as in some of those files, is stripped).
* ``"timm"``: `timm.create_model("vit_base_patch16_224").state_dict()`:
  `cls_token`, `pos_embed`, `patch_embed.proj` (a conv, OIHW -> HWIO),
  `blocks.<i>.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}`, `norm`,
  `head`.
* ``"torchvision"``: `torchvision.models.vit_b_16().state_dict()`:
  `class_token`, `conv_proj`, `encoder.pos_embedding`,
  `encoder.layers.encoder_layer_<i>.{ln_1, self_attention.in_proj_weight /
  in_proj_bias, self_attention.out_proj, ln_2, mlp.0, mlp.3}`, `encoder.ln`,
  `heads.head`.

Torch Linear weights [out, in] -> kernels [in, out]. The fused q/k/v
projection ([3D, D] weight, [3D] bias; rows q, then k, then v, each head-major:
row h * D/H + j is head h's feature j, as both libraries split it) -> three
kernels [D, H, D/H] and biases [H, D/H]; the output projection [D, D] ->
kernel [H, D/H, D]. A `pre_logits` layer (the in21k files of the original
release, torchvision's `representation_size`) is refused: this ViT has none.

**Position embeddings** of another grid (a 224-px file in a 32-px or 384-px
model) are resized: the class token's entry is kept, the file's square
g x g grid (g^2 = tokens - 1) is resized to the model's gh x gw by
`jax.image.resize(method="bilinear")` (half-pixel centers: each entry sits at
its patch's center; antialiased when shrinking, so a 14x14 grid squeezed to
2x2 averages its neighbourhoods instead of picking 4 of them). Bilinear, not
timm's bicubic: it is what the original release (`scipy.ndimage.zoom`, order
1) and big_vision use, and it never overshoots (each new entry is a convex
combination of learned ones). The patch size must match the file's (a
`DataError` says which to set). Fine-tuning at the new grid recovers what the
interpolation loses, as in the releases.

`skip_head=True` keeps the template's `head` (another number of classes) and
ignores the file's; the template's adapters (`adi`, `adw`, `fuse`) are never
in a file and are kept. Every tensor is checked before any is converted
(`weights.compare_shapes`): a `DataError` names each mismatched tensor with
both shapes, and the missing and unexpected names.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Mapping
import zipfile

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_dg.errors import DataError
from fedjax_dg.models import weights as weights_lib

Params = Any

LAYOUTS = ("augreg", "timm", "torchvision")
# The tensor whose presence tells the layout (also the patch embedding).
_MARKER = {"augreg": "embedding/kernel", "timm": "patch_embed.proj.weight",
           "torchvision": "conv_proj.weight"}
_POS = {"augreg": "Transformer/posembed_input/pos_embedding",
        "timm": "pos_embed", "torchvision": "encoder.pos_embedding"}
_AUGREG_PREFIX = "opt/target/"


def _entries(layout: str, depth: int) -> list[tuple[str, str, tuple]]:
  """(file name, kind, flax paths) of every tensor, in the network's order.

  kind: "same" (taken as is), "conv" (OIHW), "linear_w" ([out, in]), "qkv_w"
  ([3D, D] -> three [D, H, D/H]), "qkv_b" ([3D] -> three [H, D/H]), "out_w"
  ([D, D] -> [H, D/H, D]), "bias_hd" ([D] -> [H, D/H])."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  bb = lambda *p: ("backbone",) + p
  qkv = lambda blk, leaf: tuple(bb(blk, "attn", n, leaf)
                                for n in ("query", "key", "value"))

  def norm(name, *path):
    if layout == "augreg":
      return [(f"{name}/scale", "same", (bb(*path, "scale"),)),
              (f"{name}/bias", "same", (bb(*path, "bias"),))]
    return [(f"{name}.weight", "same", (bb(*path, "scale"),)),
            (f"{name}.bias", "same", (bb(*path, "bias"),))]

  def dense(name, path, kind_w="linear_w"):
    if layout == "augreg":
      return [(f"{name}/kernel", "same", (path + ("kernel",),)),
              (f"{name}/bias", "same", (path + ("bias",),))]
    return [(f"{name}.weight", kind_w, (path + ("kernel",),)),
            (f"{name}.bias", "same", (path + ("bias",),))]

  if layout == "augreg":
    out = dense("embedding", bb("embedding"))
    out += [("cls", "same", (bb("cls"),)), (_POS[layout], "same",
                                            (bb("pos_embedding"),))]
  else:
    tv = layout == "torchvision"
    out = dense("conv_proj" if tv else "patch_embed.proj", bb("embedding"),
                "conv")
    out += [("class_token" if tv else "cls_token", "same", (bb("cls"),)),
            (_POS[layout], "same", (bb("pos_embedding"),))]
  for i in range(depth):
    blk = f"block_{i}"
    if layout == "augreg":
      pre = f"Transformer/encoderblock_{i}"
      out += norm(f"{pre}/LayerNorm_0", blk, "ln1")
      for n in ("query", "key", "value", "out"):
        out += dense(f"{pre}/MultiHeadDotProductAttention_1/{n}",
                     bb(blk, "attn", n))
      out += norm(f"{pre}/LayerNorm_2", blk, "ln2")
      out += dense(f"{pre}/MlpBlock_3/Dense_0", bb(blk, "fc1"))
      out += dense(f"{pre}/MlpBlock_3/Dense_1", bb(blk, "fc2"))
      continue
    if layout == "timm":
      pre = f"blocks.{i}"
      names = (f"{pre}.norm1", f"{pre}.attn.qkv.weight", f"{pre}.attn.qkv.bias",
               f"{pre}.attn.proj", f"{pre}.norm2", f"{pre}.mlp.fc1",
               f"{pre}.mlp.fc2")
    else:
      pre = f"encoder.layers.encoder_layer_{i}"
      att = f"{pre}.self_attention"
      names = (f"{pre}.ln_1", f"{att}.in_proj_weight", f"{att}.in_proj_bias",
               f"{att}.out_proj", f"{pre}.ln_2", f"{pre}.mlp.0", f"{pre}.mlp.3")
    ln1, qkv_w, qkv_b, proj, ln2, fc1, fc2 = names
    out += norm(ln1, blk, "ln1")
    out += [(qkv_w, "qkv_w", qkv(blk, "kernel")),
            (qkv_b, "qkv_b", qkv(blk, "bias")),
            (f"{proj}.weight", "out_w", (bb(blk, "attn", "out", "kernel"),)),
            (f"{proj}.bias", "same", (bb(blk, "attn", "out", "bias"),))]
    out += norm(ln2, blk, "ln2")
    out += dense(fc1, bb(blk, "fc1")) + dense(fc2, bb(blk, "fc2"))
  final = {"augreg": "Transformer/encoder_norm", "timm": "norm",
           "torchvision": "encoder.ln"}[layout]
  out += norm(final, "encoder_norm")
  head = {"augreg": "head", "timm": "head", "torchvision": "heads.head"}[layout]
  out += dense(head, ("head",))
  return out


def _head_names(layout: str) -> set[str]:
  return {name for name, _, paths in _entries(layout, 0)
          if paths[0][0] == "head"}


def _get(tree, path):
  for p in path:
    tree = tree[p]
  return tree


def _copy_dicts(tree):
  """The nested dicts of `tree` copied (its arrays shared)."""
  if isinstance(tree, Mapping):
    return {k: _copy_dicts(v) for k, v in tree.items()}
  return tree


def _depth(template: Params) -> int:
  """The number of blocks of a `vit.ViT` parameter tree."""
  if not isinstance(template, Mapping):
    raise ValueError(f"a ViT parameter tree is a dict, got {type(template)}")
  backbone = template.get("backbone", {})
  if "block_0" not in backbone or "head" not in template:
    raise ValueError("not a vit.ViT parameter tree (it needs `backbone` with "
                     f"`block_0` and `head`); top-level keys: {sorted(template)}")
  return sum(1 for k in backbone if re.fullmatch(r"block_\d+", k))


def _from_file(kind: str, a: np.ndarray, heads: int) -> list[np.ndarray]:
  """One file tensor -> the flax leaves of its entry (float32)."""
  a = np.asarray(a, np.float32)
  if kind == "same":
    return [a]
  if kind == "conv":
    return [weights_lib.conv_kernel(a).astype(np.float32)]
  if kind == "linear_w":
    return [a.T]
  d = a.shape[-1] if kind != "qkv_b" else a.shape[0] // 3
  dh = d // heads
  if kind == "qkv_w":
    return [w.T.reshape(d, heads, dh) for w in np.split(a, 3, axis=0)]
  if kind == "qkv_b":
    return [b.reshape(heads, dh) for b in np.split(a, 3)]
  if kind == "out_w":
    return [a.T.reshape(heads, dh, d)]
  raise ValueError(f"unknown kind {kind!r}")


def _to_file(kind: str, leaves: list) -> np.ndarray:
  """The inverse of `_from_file`."""
  a = [np.asarray(x, np.float32) for x in leaves]
  if kind == "same":
    return a[0]
  if kind == "conv":
    return a[0].transpose(3, 2, 0, 1)
  if kind == "linear_w":
    return a[0].T
  if kind == "qkv_w":
    return np.concatenate([k.reshape(k.shape[0], -1).T for k in a], axis=0)
  if kind == "qkv_b":
    return np.concatenate([b.reshape(-1) for b in a])
  if kind == "out_w":
    h, dh, d = a[0].shape
    return a[0].reshape(h * dh, d).T
  raise ValueError(f"unknown kind {kind!r}")


def to_layout(params: Params, layout: str) -> dict[str, np.ndarray]:
  """A numpy state dict of `layout`'s names computing what `params`' backbone
  and head compute (adapters are left out: no release has them)."""
  return {name: _to_file(kind, [_get(params, p) for p in paths])
          for name, kind, paths in _entries(layout, _depth(params))}


def expected_shapes(template: Params, layout: str) -> dict[str, tuple]:
  """{file name: shape} a file for `template`'s model must have (its own
  position-embedding grid)."""
  views = jax.tree.map(lambda a: np.broadcast_to(np.float32(0), np.shape(a)),
                       template)
  return {k: v.shape for k, v in to_layout(views, layout).items()}


def detect_layout(state: Mapping[str, Any]) -> str:
  """"augreg", "timm" or "torchvision", from the patch embedding's name."""
  for layout in LAYOUTS:
    if _MARKER[layout] in state:
      return layout
  markers = ", ".join(f"{lay!r} has {k!r}" for lay, k in _MARKER.items())
  raise DataError(f"not a ViT weights file of a known layout ({markers}); the "
                  f"file's first keys: {sorted(state)[:6]}")


def read_weights(path: str) -> dict[str, np.ndarray]:
  """An AugReg `.npz` (numpy) or a state dict (`.safetensors`, `.pth`) as
  {name: numpy array}."""
  if not path.endswith(".npz"):
    return weights_lib.read_state_dict(path)
  if not os.path.isfile(path):
    raise DataError(f"{weights_lib.FIELD}: weights file {path!r} does not "
                    "exist")
  try:
    # Not a zip archive: numpy would try it as a pickle ("Cannot load file
    # containing pickled data"), a message about something else.
    if not zipfile.is_zipfile(path):
      raise ValueError("not a zip archive (an .npz is one)")
    with np.load(path, allow_pickle=False) as z:
      state = {k: z[k] for k in z.files}
  except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
    raise weights_lib.invalid_file(path, e) from None
  if state and all(k.startswith(_AUGREG_PREFIX) for k in state):
    state = {k[len(_AUGREG_PREFIX):]: v for k, v in state.items()}
  return state


def resize_pos_embedding(pos, grid: tuple[int, int]) -> np.ndarray:
  """[1, 1 + g * g, D] -> [1, 1 + gh * gw, D]: the class token's entry kept,
  the g x g grid resized bilinearly (module docstring)."""
  pos = np.asarray(pos, np.float32)
  n, d = pos.shape[1] - 1, pos.shape[2]
  g = math.isqrt(n)
  if g * g != n:
    raise DataError(f"position embeddings {pos.shape}: {n} patch tokens are "
                    "not a square grid, so the file's grid is unknown")
  gh, gw = grid
  if (g, g) == (gh, gw):
    return pos
  tokens = jax.image.resize(jnp.asarray(pos[0, 1:].reshape(g, g, d)),
                            (gh, gw, d), method="bilinear")
  return np.concatenate(
      [pos[:, :1], np.asarray(tokens, np.float32).reshape(1, gh * gw, d)], 1)


def _fit_grid(state: dict, template: Params, layout: str, grid, source: str
              ) -> dict:
  """The state with its position embeddings resized to `grid` (where the
  file's width matches; `compare_shapes` reports the rest)."""
  name, marker = _POS[layout], _MARKER[layout]
  want = template["backbone"]["embedding"]["kernel"].shape    # [p, p, C, D]
  have = np.shape(state[marker])
  p_file = have[:2] if layout == "augreg" else have[2:]
  if tuple(p_file) != tuple(want[:2]):
    raise DataError(
        f"{source}: patch size {tuple(p_file)} in the file ({marker!r} "
        f"{tuple(have)}), {tuple(want[:2])} in the model: set "
        f"model.vit.patch={p_file[0]} (patch= in get_model)")
  pos = state.get(name)
  want_pos = template["backbone"]["pos_embedding"].shape
  if pos is None or np.ndim(pos) != 3 or tuple(np.shape(pos)) == tuple(want_pos):
    return state
  if np.shape(pos)[0] != 1 or np.shape(pos)[2] != want_pos[2]:
    return state
  if grid is None:
    g = math.isqrt(want_pos[1] - 1)
    if g * g != want_pos[1] - 1:
      raise ValueError("a non-square model grid: pass grid=(gh, gw)")
    grid = (g, g)
  try:
    resized = resize_pos_embedding(pos, grid)
  except DataError as e:
    raise DataError(f"{source}: {name!r}: {e}") from None
  return {**state, name: resized}


def _check(state: Mapping, template: Params, layout: str, skip_head: bool,
           source: str) -> None:
  pre = sorted(k for k in state if "pre_logits" in k)
  if pre:
    raise DataError(
        f"{source} has a pre-logits layer ({pre}) between the class token and "
        "the head; this ViT has none (its head reads the final norm's class "
        "token): use a file without one (the AugReg / fine-tuned releases), "
        "not the original in21k `.npz`")
  head = _head_names(layout)
  expected = {k: v for k, v in expected_shapes(template, layout).items()
              if not (skip_head and k in head)}
  mismatched, missing, unexpected = weights_lib.compare_shapes(
      state, expected, extra_ok=lambda n: skip_head and n in head)
  if not (mismatched or missing or unexpected):
    return
  message = weights_lib.mismatch_message(
      f"{source} does not fit the ViT ({layout} layout, depth "
      f"{_depth(template)})", mismatched, missing, unexpected)
  if any(m.split(":")[0] in head for m in mismatched):
    message += ("; the file's head has another number of classes: "
                "skip_head=True (config: --set model.skip_head=True) starts "
                "the head fresh")
  raise DataError(message)


def to_flax(state: Mapping[str, Any], template: Params, *,
            layout: str | None = None, grid: tuple[int, int] | None = None,
            skip_head: bool = False, source: str = "the weights") -> Params:
  """Params with `template`'s structure from a file's tensors.

  `layout`: detected when None. `grid`: the model's (gh, gw) patch grid, for
  resizing the file's position embeddings (None: the template's, square).
  Everything is checked before anything is converted; the template's adapters
  (and its head, with `skip_head`) are kept.
  """
  layout = layout or detect_layout(state)
  depth = _depth(template)
  heads = template["backbone"]["block_0"]["attn"]["query"]["kernel"].shape[1]
  state = _fit_grid(dict(state), template, layout, grid, source)
  _check(state, template, layout, skip_head, source)
  params = dict(template)
  params["backbone"] = _copy_dicts(template["backbone"])
  params["head"] = _copy_dicts(template["head"])
  for name, kind, paths in _entries(layout, depth):
    if paths[0][0] == "head" and skip_head:
      continue
    for path, leaf in zip(paths, _from_file(kind, state[name], heads)):
      _get(params, path[:-1])[path[-1]] = leaf
  return params


def load(path: str, template: Params, *, grid: tuple[int, int] | None = None,
         skip_head: bool = False) -> Params:
  """`to_flax` of the file at `path` (`.npz`, `.safetensors` or `.pth`), its
  layout detected."""
  return to_flax(read_weights(path), template, grid=grid, skip_head=skip_head,
                 source=repr(path))
