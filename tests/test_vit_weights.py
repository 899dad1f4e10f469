"""Pretrained ViT weights (models/vit_weights.py): the three layouts, the
position-embedding resize, the errors, and logits against timm / torchvision
(those two where they import: `PYTHONPATH=/path/to/torch/packages`)."""

import contextlib
import dataclasses
import functools
import importlib
import sys
import types

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from fedjax_dg import models
from fedjax_dg.errors import ConfigError, DataError
from fedjax_dg.models import vit_weights

LAYOUTS = vit_weights.LAYOUTS
SMALL = dict(patch=8, dim=32, depth=2, heads=4, mlp_dim=64)
D, H, DH = 32, 4, 8


def _model(num_classes=5, size=(32, 32), **kw):
  return models.get_model("vit_tiny", input_shape=(*size, 3),
                          num_classes=num_classes, **{**SMALL, **kw})


_JITTED_INIT = models._jitted_init


def _numpy_init(model):
  """Stands in for `models._jitted_init`: the model's parameter shapes
  (`init` traced, not compiled: a compile per grid, depth and head costs
  ~1 s) filled with N(0, 1) draws seeded by the key, as numpy float32."""
  shapes = jax.eval_shape(_JITTED_INIT(model), jax.random.key(0))

  def init(key):
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).tolist())
    return jax.tree.map(
        lambda s: rng.normal(size=s.shape).astype(np.float32), shapes)

  return init


@functools.lru_cache(maxsize=None)
def _params(num_classes=5, size=(32, 32), adapters="none", seed=0, depth=2):
  """Params of the model's names and shapes, every leaf a distinct random
  value (zero biases / class token would hide misplaced values; what the
  file tests check is where each value lands, so the values need not be
  the init's), as numpy float32."""
  m = _model(num_classes, size, adapters=adapters, depth=depth)
  p = _numpy_init(dataclasses.replace(m, weights=""))(jax.random.key(seed))
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda a: (0.1 * a + rng.normal(0, 0.1, a.shape)).astype(np.float32), p)


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a),
                          jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                  err_msg=jax.tree_util.keystr(path))


def _save(state, tmp_path, layout):
  if layout == "augreg":
    path = str(tmp_path / "vit.npz")
    np.savez(path, **state)
  else:
    path = str(tmp_path / "vit.safetensors")
    save_file({k: np.ascontiguousarray(v) for k, v in state.items()}, path)
  return path


# ---- the mapping ----------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_is_exact_and_adapters_are_kept(layout):
  p = _params()
  state = vit_weights.to_layout(p, layout)
  assert vit_weights.detect_layout(state) == layout
  _assert_trees_equal(vit_weights.to_flax(state, _params(seed=1)), p)
  # A template with adapters: backbone and head from the file, adapters its own.
  template = _params(adapters="kia", seed=2)
  got = vit_weights.to_flax(state, template)
  _assert_trees_equal({k: got[k] for k in ("backbone", "head")}, p)
  _assert_trees_equal({k: got[k] for k in ("adi", "adw", "fuse")},
                      {k: template[k] for k in ("adi", "adw", "fuse")})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_file_loads_through_get_model(layout, tmp_path):
  p = _params()
  path = _save(vit_weights.to_layout(p, layout), tmp_path, layout)
  got = _model(weights=path).init(jax.random.key(3))
  _assert_trees_equal(got, p)
  # skip_head: another number of classes, the head is the key's own draw.
  m = _model(num_classes=7, weights=path, skip_head=True)
  got = m.init(jax.random.key(3))
  fresh = _model(num_classes=7).init(jax.random.key(3))
  _assert_trees_equal(got["backbone"], p["backbone"])
  _assert_trees_equal(got["head"], fresh["head"])


def test_augreg_opt_target_prefix_is_stripped(tmp_path):
  p = _params()
  state = {"opt/target/" + k: v
           for k, v in vit_weights.to_layout(p, "augreg").items()}
  path = str(tmp_path / "v.npz")
  np.savez(path, **state)
  _assert_trees_equal(vit_weights.load(path, _params(seed=1)), p)


def _written(layout, name, value):
  """Params loaded from a file of `layout` whose tensor `name` is `value`."""
  state = vit_weights.to_layout(_params(), layout)
  assert state[name].shape == value.shape, (state[name].shape, value.shape)
  state[name] = value
  return vit_weights.to_flax(state, _params(seed=1))


@pytest.mark.parametrize("layout,name", [
    ("timm", "blocks.1.attn.qkv.weight"),
    ("torchvision", "encoder.layers.encoder_layer_1.self_attention.in_proj_weight")])
def test_fused_qkv_rows_are_q_k_v_head_major(layout, name):
  """Written out per element, independently of `to_layout`: row
  s * D + h * D/H + j of the fused [3D, D] weight (s = 0, 1, 2 for q, k, v)
  is feature j of head h, input column i -> kernel[i, h, j]."""
  rng = np.random.default_rng(0)
  w = rng.normal(size=(3 * D, D)).astype(np.float32)
  b = rng.normal(size=(3 * D,)).astype(np.float32)
  attn = _written(layout, name, w)["backbone"]["block_1"]["attn"]
  bias_name = name.replace("qkv.weight", "qkv.bias").replace(
      "in_proj_weight", "in_proj_bias")
  attn_b = _written(layout, bias_name, b)["backbone"]["block_1"]["attn"]
  for s, which in enumerate(("query", "key", "value")):
    for i, h, j in [(0, 0, 0), (5, 1, 3), (31, 3, 7), (17, 2, 6)]:
      assert attn[which]["kernel"][i, h, j] == w[s * D + h * DH + j, i]
      assert attn_b[which]["bias"][h, j] == b[s * D + h * DH + j]


@pytest.mark.parametrize("layout,name", [
    ("timm", "blocks.0.attn.proj.weight"),
    ("torchvision", "encoder.layers.encoder_layer_0.self_attention.out_proj.weight")])
def test_output_projection_columns_are_head_major(layout, name):
  w = np.random.default_rng(1).normal(size=(D, D)).astype(np.float32)
  k = _written(layout, name, w)["backbone"]["block_0"]["attn"]["out"]["kernel"]
  for h, j, o in [(0, 0, 0), (1, 2, 30), (3, 7, 5)]:
    assert k[h, j, o] == w[o, h * DH + j]


@pytest.mark.parametrize("layout,name", [
    ("timm", "patch_embed.proj.weight"), ("torchvision", "conv_proj.weight")])
def test_patch_conv_oihw_to_hwio(layout, name):
  w = np.random.default_rng(2).normal(size=(D, 3, 8, 8)).astype(np.float32)
  k = _written(layout, name, w)["backbone"]["embedding"]["kernel"]
  assert k.shape == (8, 8, 3, D)
  for o, c, y, x in [(0, 0, 0, 0), (31, 2, 7, 1), (4, 1, 3, 6)]:
    assert k[y, x, c, o] == w[o, c, y, x]


@pytest.mark.parametrize("layout,name,path", [
    ("timm", "blocks.1.mlp.fc1.weight", ("block_1", "fc1")),
    ("torchvision", "encoder.layers.encoder_layer_1.mlp.3.weight",
     ("block_1", "fc2"))])
def test_linear_out_in_to_in_out(layout, name, path):
  shape = (64, D) if path[1] == "fc1" else (D, 64)
  w = np.random.default_rng(3).normal(size=shape).astype(np.float32)
  k = _written(layout, name, w)["backbone"][path[0]][path[1]]["kernel"]
  np.testing.assert_array_equal(k, w.T)


def test_augreg_tensors_are_taken_as_they_are():
  w = np.random.default_rng(4).normal(size=(D, H, DH)).astype(np.float32)
  name = "Transformer/encoderblock_1/MultiHeadDotProductAttention_1/value/kernel"
  got = _written("augreg", name, w)["backbone"]["block_1"]["attn"]["value"]
  np.testing.assert_array_equal(got["kernel"], w)
  s = np.arange(D, dtype=np.float32)
  got = _written("augreg", "Transformer/encoderblock_0/LayerNorm_2/scale", s)
  np.testing.assert_array_equal(got["backbone"]["block_0"]["ln2"]["scale"], s)


@functools.lru_cache(maxsize=None)
def _b16_template():
  m = models.get_model("vit_b16", input_shape=(224, 224, 3), num_classes=1000)
  return jax.eval_shape(m.init, jax.random.key(0))


@pytest.mark.parametrize("layout,count,shapes", [
    ("timm", 152, {"cls_token": (1, 1, 768), "pos_embed": (1, 197, 768),
                   "patch_embed.proj.weight": (768, 3, 16, 16),
                   "blocks.11.attn.qkv.weight": (2304, 768),
                   "blocks.11.attn.qkv.bias": (2304,),
                   "blocks.0.attn.proj.weight": (768, 768),
                   "blocks.3.mlp.fc1.weight": (3072, 768),
                   "norm.weight": (768,), "head.weight": (1000, 768)}),
    ("torchvision", 152, {
        "class_token": (1, 1, 768), "encoder.pos_embedding": (1, 197, 768),
        "conv_proj.weight": (768, 3, 16, 16),
        "encoder.layers.encoder_layer_11.self_attention.in_proj_weight":
            (2304, 768),
        "encoder.layers.encoder_layer_0.mlp.3.weight": (768, 3072),
        "encoder.ln.bias": (768,), "heads.head.weight": (1000, 768)}),
    ("augreg", 200, {
        "embedding/kernel": (16, 16, 3, 768), "cls": (1, 1, 768),
        "Transformer/posembed_input/pos_embedding": (1, 197, 768),
        "Transformer/encoderblock_11/MultiHeadDotProductAttention_1/query/kernel":
            (768, 12, 64),
        "Transformer/encoderblock_0/MultiHeadDotProductAttention_1/out/kernel":
            (12, 64, 768),
        "Transformer/encoderblock_0/MlpBlock_3/Dense_1/kernel": (3072, 768),
        "head/kernel": (768, 1000)})])
def test_b16_names_and_shapes_are_the_releases(layout, count, shapes):
  """Hand-written from the releases' ViT-B/16 at 224 px, 1000 classes."""
  got = vit_weights.expected_shapes(_b16_template(), layout)
  assert len(got) == count
  for name, shape in shapes.items():
    assert got[name] == shape, name


# ---- position embeddings ----------------------------------------------------


def _grid_of(f, gh, gw):
  """f sampled at the patch centers of a gh x gw grid over [0, 1]^2."""
  u = (np.arange(gh) + 0.5) / gh
  v = (np.arange(gw) + 0.5) / gw
  return f(u[:, None, None], v[None, :, None])


def _smooth(u, v):
  # Three channels; zero slope at the borders (where bilinear clamps).
  return np.concatenate([np.cos(np.pi * u) * np.cos(np.pi * v),
                         np.cos(np.pi * u) + 0 * v,
                         0.5 * np.cos(2 * np.pi * v) + 0 * u], -1)


@pytest.mark.parametrize("grid,tol", [((28, 28), 0.01), ((7, 7), 0.05),
                                      ((4, 6), 0.1), ((14, 14), 1e-7)])
def test_pos_embedding_resize_samples_the_function_on_the_new_grid(grid, tol):
  """Shrinking is antialiased (a triangle filter over 2 input cells each side
  at 14 -> 7): it smooths the function by about var * f'' / 2 ~ 0.04 for the
  cos(2 pi v) channel, hence the looser tolerances there."""
  cls = np.array([[[7.0, -3.0, 0.25]]], np.float32)
  pos = np.concatenate([cls, _grid_of(_smooth, 14, 14).reshape(1, 196, 3)], 1)
  got = vit_weights.resize_pos_embedding(pos.astype(np.float32), grid)
  assert got.shape == (1, 1 + grid[0] * grid[1], 3)
  np.testing.assert_array_equal(got[:, :1], cls)
  want = _grid_of(_smooth, *grid).reshape(-1, 3)
  np.testing.assert_allclose(got[0, 1:], want, atol=tol, rtol=0)


@pytest.mark.parametrize("size", [(32, 32), (32, 48)])
def test_a_file_of_another_grid_is_resized_on_load(size, tmp_path,
                                                   monkeypatch):
  big = _params(size=(64, 64))      # 8x8 grid in the file
  path = _save(vit_weights.to_layout(big, "timm"), tmp_path, "timm")
  # Every sampled value is replaced by the file's (checked below): the
  # loading around `init` is what is tested; the real sampler's compile
  # is in test_file_loads_through_get_model.
  monkeypatch.setattr(models, "_jitted_init", _numpy_init)
  got = _model(size=size, weights=path).init(jax.random.key(0))
  grid = (size[0] // 8, size[1] // 8)
  want_pos = vit_weights.resize_pos_embedding(
      big["backbone"]["pos_embedding"], grid)
  np.testing.assert_array_equal(got["backbone"]["pos_embedding"], want_pos)
  rest = lambda p: {k: v for k, v in p["backbone"].items()
                    if k != "pos_embedding"}
  _assert_trees_equal(rest(got), rest(big))


# ---- errors -----------------------------------------------------------------


def test_wrong_shape_names_the_tensor_and_both_shapes():
  state = vit_weights.to_layout(_params(), "timm")
  state["blocks.1.mlp.fc1.weight"] = np.zeros((48, D), np.float32)
  with pytest.raises(DataError, match=r"blocks\.1\.mlp\.fc1\.weight: \(48, 32\) "
                     r"in the file, \(64, 32\) in the model"):
    vit_weights.to_flax(state, _params())


def test_missing_and_unexpected_tensors_are_listed():
  state = vit_weights.to_layout(_params(), "torchvision")
  del state["encoder.layers.encoder_layer_1.ln_2.bias"]
  state["encoder.layers.encoder_layer_1.extra"] = np.zeros(3)
  with pytest.raises(DataError) as e:
    vit_weights.to_flax(state, _params(), source="'v.pth'")
  msg = str(e.value)
  assert "'v.pth' does not fit the ViT (torchvision layout, depth 2)" in msg
  assert "missing (1): ['encoder.layers.encoder_layer_1.ln_2.bias']" in msg
  assert "unexpected (1): ['encoder.layers.encoder_layer_1.extra']" in msg


def test_deeper_file_lists_its_extra_blocks():
  deep = _params(depth=3)
  state = vit_weights.to_layout(deep, "augreg")
  with pytest.raises(DataError, match=r"unexpected \(16\): "
                     r"\['Transformer/encoderblock_2/"):
    vit_weights.to_flax(state, _params())


def test_head_of_another_size_suggests_skip_head():
  state = vit_weights.to_layout(_params(num_classes=1000), "timm")
  with pytest.raises(DataError, match=r"head\.weight: \(1000, 32\) in the "
                     r"file, \(5, 32\) in the model.*skip_head=True"):
    vit_weights.to_flax(state, _params())
  got = vit_weights.to_flax(state, _params(), skip_head=True)
  _assert_trees_equal(got["head"], _params()["head"])


def test_pre_logits_is_refused():
  state = vit_weights.to_layout(_params(), "augreg")
  state["pre_logits/kernel"] = np.zeros((D, D), np.float32)
  state["pre_logits/bias"] = np.zeros((D,), np.float32)
  with pytest.raises(DataError, match=r"pre-logits layer \(\['pre_logits/bias', "
                     r"'pre_logits/kernel'\]\).*has none"):
    vit_weights.to_flax(state, _params())


def test_unknown_layout_lists_the_layouts():
  with pytest.raises(DataError) as e:
    vit_weights.to_flax({"stem.weight": np.zeros(3)}, _params())
  msg = str(e.value)
  for layout, key in [("augreg", "embedding/kernel"),
                      ("timm", "patch_embed.proj.weight"),
                      ("torchvision", "conv_proj.weight")]:
    assert f"{layout!r} has {key!r}" in msg
  assert "['stem.weight']" in msg


def test_other_patch_size_says_which_to_set():
  state = vit_weights.to_layout(_params(), "timm")
  state["patch_embed.proj.weight"] = np.zeros((D, 3, 16, 16), np.float32)
  with pytest.raises(DataError, match=r"patch size \(16, 16\) in the file "
                     r"\('patch_embed.proj.weight' \(32, 3, 16, 16\)\), \(8, 8\) "
                     r"in the model: set model.vit.patch=16"):
    vit_weights.to_flax(state, _params())


def test_non_square_file_grid_is_an_error():
  state = vit_weights.to_layout(_params(size=(32, 48)), "timm")
  with pytest.raises(DataError, match=r"'pos_embed'.*\(1, 25, 32\): 24 patch "
                     "tokens are not a square grid"):
    vit_weights.to_flax(state, _params(), grid=(4, 4))


def test_get_model_vit_weights(tmp_path):
  with pytest.raises(DataError, match="docs/models.md, ViT"):
    _model(weights=str(tmp_path / "none.npz"))
  with pytest.raises(ConfigError, match="only"):
    models.get_model("small_cnn", input_shape=(32, 32, 3), num_classes=2,
                     weights=str(tmp_path / "x.npz"))
  with pytest.raises(DataError, match="is not a valid weights file"):
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    _model(weights=str(tmp_path / "bad.npz")).init(jax.random.key(0))


def _garbage_files(tmp_path):
  """{file: what it is}: files no weights reader can use."""
  ok = tmp_path / "ok.npz"
  np.savez(ok, a=np.zeros(3, np.float32))
  files = {
      "html.npz": b"<html><body>Quota exceeded</body></html>",  # numpy: "pickle"
      "empty.npz": b"",
      "cut.npz": ok.read_bytes()[:40],                           # cut short
      "html.safetensors": b"<html><body>Quota exceeded</body></html>",
      "cut.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":",
  }
  for name, data in files.items():
    (tmp_path / name).write_bytes(data)
  np.save(tmp_path / "array.npy", np.zeros(3))  # an .npy under an .npz name
  (tmp_path / "array.npz").write_bytes((tmp_path / "array.npy").read_bytes())
  return [str(tmp_path / n) for n in [*files, "array.npz"]]


def test_a_file_that_is_no_weights_file_says_so(tmp_path, monkeypatch):
  """Garbage under a weights name (a download cut short, an HTML error page)
  is "model.weights: file X is not a valid weights file (expected ...)", for
  each format, through `Model.init` too; never numpy's pickle message."""
  for path in _garbage_files(tmp_path):
    expected = ("a safetensors file" if path.endswith(".safetensors") else
                "a numpy .npz archive")
    with pytest.raises(DataError) as e:
      vit_weights.read_weights(path)
    msg = str(e.value)
    assert msg.startswith(f"model.weights: file {path!r} is not a valid "
                          f"weights file (expected {expected}"), msg
    assert "pickle" not in msg, msg
  with pytest.raises(DataError, match=r"model.weights: file .*html.npz' is not "
                     "a valid weights file"):
    _model(weights=str(tmp_path / "html.npz")).init(jax.random.key(0))
  # A torch file: what torch.load raises for garbage (the same
  # UnpicklingError as for a pickled model, but not a zip archive) or for a
  # file cut short.
  from fedjax_dg.models import weights
  import pickle
  fake = types.SimpleNamespace(Tensor=np.ndarray)
  monkeypatch.setitem(sys.modules, "torch", fake)
  for raised in (pickle.UnpicklingError("Weights only load failed"),
                 RuntimeError("PytorchStreamReader failed reading zip"),
                 EOFError("Ran out of input")):
    def load(*args, raised=raised, **kwargs):
      raise raised
    fake.load = load
    html = str(tmp_path / "html.pth")
    (tmp_path / "html.pth").write_bytes(b"<html>")
    with pytest.raises(DataError, match=rf"model.weights: file {html!r} is not "
                       r"a valid weights file \(expected a PyTorch state dict"):
      weights.read_state_dict(html)


# ---- logits against the source frameworks --------------------------------


def _input(seed=0):
  """A normalized NHWC float batch (what `Model.apply` feeds the module)."""
  return np.random.default_rng(seed).normal(size=(4, 32, 32, 3)).astype(
      np.float32)


def _our_logits(path, x):
  m = _model(weights=path)
  return np.asarray(m.apply(m.init(jax.random.key(0)), x, normalized=True))


@contextlib.contextmanager
def _torchvision_without_its_ops():
  """Where torchvision's compiled ops do not load (a CUDA torchvision wheel
  beside a CPU torch: "operator torchvision::nms does not exist"), import it
  without their meta registrations: the ViTs (torchvision's, and timm's, which
  imports torchvision) are pure Python. The modules imported meanwhile are
  dropped from sys.modules afterwards, so other tests import as before.
  Skips where torch or torchvision is not installed."""
  pytest.importorskip("torch")
  try:
    importlib.import_module("torchvision")
    yield
    return
  except ModuleNotFoundError as e:
    if e.name != "torchvision":
      raise
    pytest.skip("torchvision is not installed (torch is)")
  except RuntimeError:
    pass
  ours = lambda k: k.split(".")[0] in ("torchvision", "timm")
  for k in [k for k in sys.modules if ours(k)]:
    del sys.modules[k]
  stub = "torchvision._meta_registrations"
  sys.modules[stub] = types.ModuleType(stub)
  try:
    yield
  finally:
    for k in [k for k in sys.modules if ours(k)]:
      del sys.modules[k]


def _torch_logits(net, x):
  import torch
  with torch.no_grad():
    return net(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()


def _randomize(net, seed):
  """Every parameter moved off its init (zero biases / tokens show nothing)."""
  import torch
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for p in net.parameters():
      p.add_(0.2 * torch.randn(p.shape, generator=g))
  return net.eval()


def test_timm_logits(tmp_path):
  with _torchvision_without_its_ops():
    timm = pytest.importorskip("timm")
    from timm.models.vision_transformer import VisionTransformer
  from safetensors.torch import save_file as save_torch
  import torch
  torch.manual_seed(0)
  net = _randomize(VisionTransformer(
      img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4,
      mlp_ratio=2, num_classes=5), 0)
  path = str(tmp_path / "timm.safetensors")
  save_torch(net.state_dict(), path)
  x = _input()
  want, got = _torch_logits(net, x), _our_logits(path, x)
  print("timm max abs logit difference", np.abs(got - want).max(),
        "logit scale", np.abs(want).max())
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  # The names and shapes of timm's own ViT-B/16.
  b16 = timm.create_model("vit_base_patch16_224", pretrained=False)
  assert vit_weights.expected_shapes(_b16_template(), "timm") == {
      k: tuple(v.shape) for k, v in b16.state_dict().items()}


def test_torchvision_logits(tmp_path):
  torch = pytest.importorskip("torch")
  with _torchvision_without_its_ops():
    from torchvision.models import vision_transformer as tv
  VisionTransformer = tv.VisionTransformer
  torch.manual_seed(1)
  net = _randomize(VisionTransformer(
      image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32,
      mlp_dim=64, num_classes=5), 1)
  path = str(tmp_path / "tv.pth")
  torch.save(net.state_dict(), path)
  x = _input(1)
  want, got = _torch_logits(net, x), _our_logits(path, x)
  print("torchvision max abs logit difference", np.abs(got - want).max(),
        "logit scale", np.abs(want).max())
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  b16 = tv.vit_b_16()
  assert vit_weights.expected_shapes(_b16_template(), "torchvision") == {
      k: tuple(v.shape) for k, v in b16.state_dict().items()}
