"""ViT (models/vit.py): the backbone against independent computations, the
adapter paths (Eq. 3-4 of FedSDAF) against a plain re-computation."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_dg import models
from fedjax_dg.errors import ConfigError
from fedjax_dg.models import vit

SMALL = dict(patch=4, dim=32, depth=2, heads=4, mlp_dim=48, fusion_heads=4)


def _model(adapters="kia", **kw):
  return models.get_model("vit_tiny", input_shape=(8, 12, 3), num_classes=5,
                          **{**SMALL, "adapters": adapters, **kw})


def _x(n=3, seed=0):
  return np.random.default_rng(seed).integers(0, 256, (n, 8, 12, 3), np.uint8)


def _ln(x, p, eps=1e-6):
  m = x.mean(-1, keepdims=True)
  v = ((x - m) ** 2).mean(-1, keepdims=True)
  return (x - m) / np.sqrt(v + eps) * p["scale"] + p["bias"]


_erf = np.vectorize(math.erf)


def _gelu(x):
  """The exact GELU, x * Phi(x), in numpy (float64)."""
  return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _attn(x, p, queries=None):
  q_in = x if queries is None else x[:, :queries]
  q = np.einsum("btd,dhk->bthk", q_in, p["query"]["kernel"]) + p["query"]["bias"]
  k = np.einsum("btd,dhk->bthk", x, p["key"]["kernel"]) + p["key"].get(
      "bias", 0.0)
  v = np.einsum("btd,dhk->bthk", x, p["value"]["kernel"]) + p["value"]["bias"]
  s = np.einsum("bqhk,bthk->bhqt", q, k) / np.sqrt(q.shape[-1])
  w = np.exp(s - s.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  o = np.einsum("bhqt,bthk->bqhk", w, v)
  return np.einsum("bqhk,hkd->bqd", o, p["out"]["kernel"]) + p["out"]["bias"]


def _dense(x, p):
  return x @ p["kernel"] + p["bias"]


def _adapter(h, p):
  return _dense(_gelu(_dense(h, p["down"])), p["up"])


def _reference(params, x, path, adapters, fusion=True):
  """The ViT written out in numpy (float64): the patch embedding as the
  strided conv it is (kernel = stride = 4, VALID), summed over each patch's
  pixels."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  bb = p["backbone"]
  x = np.asarray(x, np.float64)
  b, h, w, c = x.shape
  patches = x.reshape(b, h // 4, 4, w // 4, 4, c)  # [b, gh, i, gw, j, c]
  t = np.einsum("bgihjc,ijcd->bghd", patches, bb["embedding"]["kernel"])
  t = t.reshape(b, -1, 32) + bb["embedding"]["bias"]
  cls = np.broadcast_to(bb["cls"], (x.shape[0], 1, 32))
  h = np.concatenate([cls, t], 1) + bb["pos_embedding"]
  for i in range(2):
    b = bb[f"block_{i}"]
    h = h + _attn(_ln(h, b["ln1"]), b["attn"])
    h = h + _dense(_gelu(_dense(_ln(h, b["ln2"]), b["fc1"])), b["fc2"])
    blk = f"block_{i}"
    if adapters == "di" or (adapters == "kia" and path == "di"):
      h = h + _adapter(h, p["adi"][blk])
    elif adapters == "kia":
      a = _adapter(h, p["adw"][blk])
      if fusion:
        f = p["fuse"][blk]
        a = _attn(_ln(np.concatenate([a, h], 1), f["norm"]), f["attn"],
                  queries=a.shape[1])
      h = h + 0.5 * a + 0.5 * _adapter(h, p["adi"][blk])
  h = _ln(h, bb["encoder_norm"])[:, 0]
  return _dense(h, p["head"])


@functools.lru_cache(maxsize=None)
def _moved_params():
  """The KIA model's parameters (every entry any setting has: backbone,
  head, A_di, A_dw, fusion; one init compiled), each moved off its initial
  value by N(0, 0.1^2) numpy noise (zero class token and biases would hide
  terms; jax.random would compile a program per leaf shape)."""
  params = _model("kia").init(jax.random.key(1))
  rng = np.random.default_rng(2)
  return jax.tree.map(lambda a: np.asarray(
      a + 0.1 * rng.normal(size=a.shape), np.float32), params)


@pytest.mark.parametrize("adapters,path,fusion", [
    pytest.param("none", "kia", True, marks=pytest.mark.slow),
    ("di", "kia", True), ("kia", "kia", True), ("kia", "di", True),
    pytest.param("kia", "kia", False, marks=pytest.mark.slow)])
def test_forward_matches_a_numpy_reimplementation(adapters, path, fusion):
  m = _model(adapters, fusion=fusion)
  # The setting's own entries of the moved KIA parameters (the shapes are
  # the setting's own: checked against its init's).
  wanted = jax.eval_shape(m.init, jax.random.key(1))
  params = {k: v for k, v in _moved_params().items() if k in wanted}
  assert jax.tree.map(np.shape, params) == jax.tree.map(np.shape, wanted)
  x = _x()
  got = jax.jit(lambda p, x: m.module.apply({"params": p}, m.normalize(x),
                                            path=path))(params, x)
  want = _reference(params, np.asarray(m.normalize(x)), path, adapters, fusion)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-4)


def test_parameter_entries_per_adapter_setting():
  # Entries and shapes only: traced (jax.eval_shape), never compiled.
  init = lambda a, **kw: jax.eval_shape(_model(a, **kw).init, jax.random.key(0))
  keys = lambda a, **kw: set(init(a, **kw))
  assert keys("none") == {"backbone", "head"}
  assert keys("di") == {"backbone", "head", "adi"}
  assert keys("kia") == {"backbone", "head", "adi", "adw", "fuse"}
  assert keys("kia", fusion=False) == {"backbone", "head", "adi", "adw"}
  p = init("kia")
  assert p["adi"]["block_1"]["down"]["kernel"].shape == (32, 8)  # dim // 4
  assert set(p["fuse"]["block_0"]["attn"]["key"]) == {"kernel"}  # no bias
  assert p["backbone"]["pos_embedding"].shape == (1, 1 + 2 * 3, 32)


def test_b16_shapes_and_size():
  m = models.get_model("vit_b16", input_shape=(224, 224, 3), num_classes=1000)
  shapes = jax.eval_shape(m.init, jax.random.key(0))
  n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shapes))
  assert n == 86_567_656  # ViT-B/16, 1000 classes (timm / torchvision count)


def test_head_and_features_compose():
  m = _model("kia")
  p = _moved_params()
  head, apply = jax.jit(lambda p, x: (m.head(p, m.features(p, x)),
                                      m.apply(p, x)))(p, _x())
  np.testing.assert_allclose(head, apply, rtol=1e-5, atol=1e-5)


def _named_keys_exist(message):
  """Every config key (`section.key[.sub]`) a message names is a real one."""
  import re
  from fedjax_dg.run import config
  keys = re.findall(r"\b((?:data|model|train|client|fedsdaf)(?:\.[a-z_]+)+)",
                    message)
  assert keys, message
  for key in keys:
    config.lookup(config.base_config(), key)  # ConfigError if unknown


def test_bad_settings_name_the_field():
  """Each error names the config key to change (model.vit.patch, not the
  model.patch that does not exist; FedSDAF's adapter settings)."""
  with pytest.raises(ConfigError, match=r"model.vit.patch=5 .*\(data.image_size\)"
                     ) as e:
    models.get_model("vit_tiny", input_shape=(8, 12, 3), num_classes=2,
                     patch=5)
  _named_keys_exist(str(e.value))
  with pytest.raises(ConfigError, match="adapters='both'.*fedsdaf.domain_aware"
                     ) as e:
    _model("both").init(jax.random.key(0))
  _named_keys_exist(str(e.value))
  with pytest.raises(ConfigError, match="fedsdaf.fusion_heads=5") as e:
    _model("kia", fusion_heads=5).init(jax.random.key(0))
  _named_keys_exist(str(e.value))
  with pytest.raises(ConfigError, match="fedsdaf.adapter_init='x'") as e:
    _model("kia", adapter_init="x").init(jax.random.key(0))
  _named_keys_exist(str(e.value))
  with pytest.raises(ConfigError, match="patch 5 does not divide") as e:
    vit.ViT(num_classes=2, input_hw=(8, 8), patch=5).init(
        jax.random.key(0), jnp.zeros((1, 8, 8, 3)))
  _named_keys_exist(str(e.value))
  with pytest.raises(ConfigError, match="not divisible by 5 heads") as e:
    models.get_model("vit_tiny", input_shape=(8, 8, 3), num_classes=2,
                     patch=4, dim=32, heads=5, depth=1, mlp_dim=8).init(
                         jax.random.key(0))
  _named_keys_exist(str(e.value))
  with pytest.raises(ValueError, match="path"):
    m = _model("kia")
    m.module.apply({"params": m.init(jax.random.key(0))}, _x(), path="dw")
  assert vit.SIZES["b16"] == (768, 12, 12, 3072)


def test_zero_adapter_init_starts_as_the_backbone():
  """adapter_init='zero': the up-projections are 0, so the di path computes
  the plain ViT's logits (the KIA path's fusion still adds its attention)."""
  m = _model("kia", adapter_init="zero")
  p = m.init(jax.random.key(0))
  for stack in ("adi", "adw"):
    for blk in p[stack].values():
      assert not np.any(blk["up"]["kernel"]) and not np.any(blk["up"]["bias"])
  plain = _model("none")

  @jax.jit  # one program (eagerly, a compile per op and shape)
  def logits(p, x):
    return (plain.apply({k: p[k] for k in ("backbone", "head")}, x),
            m.module.apply({"params": p}, m.normalize(x), path="di"),
            m.apply(p, x))

  want, di, kia = logits(p, _x())
  np.testing.assert_allclose(di, want, rtol=1e-5, atol=1e-6)
  assert not np.allclose(kia, want, atol=1e-4)
  with pytest.raises(ConfigError, match="adapter_init"):
    _model("di", adapter_init="ones").init(jax.random.key(0))
