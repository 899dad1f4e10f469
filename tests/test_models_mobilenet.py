"""MobileNetV3-Large: torchvision's architecture, the weights converter, loops.

Torch-free except `test_torchvision_and_timm_weights_give_their_logits`, which
runs where PyTorch and torchvision (and optionally timm) are installed;
`test_seeded_weights_give_torchvisions_logits` compares with torchvision's
logits committed once (tests/make_mobilenet_logits.py), in every run. The
names and shapes of both libraries' state dicts were written once to
tests/data/mobilenet_v3_large_state_shapes.json (torchvision 0.28.0, timm
1.0.31: `{k: list(v.shape) for k, v in model.state_dict().items()}`).
"""

import functools
import importlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import make_mobilenet_logits
import weights_files
from fedjax_dg import models
from fedjax_dg.errors import ConfigError, DataError
from fedjax_dg.models import layers, mobilenet, weights

SHAPES = weights_files.MOBILENET_SHAPES
TORCHVISION_PARAMS = 5_483_032  # sum(p.numel() for p in mobilenet_v3_large().parameters())


@functools.lru_cache(maxsize=None)
def _model(num_classes=1000, size=32, **kw):
  return models.get_model("mobilenet_v3_large", input_shape=(size, size, 3),
                          num_classes=num_classes, **kw)


@functools.lru_cache(maxsize=None)
def _template(num_classes=1000):
  return jax.eval_shape(_model(num_classes).init, jax.random.key(0))


_random_state = weights_files.mobilenet_state


def _num_params(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def test_param_count_equals_torchvision():
  assert _num_params(_template(1000)) == TORCHVISION_PARAMS
  assert _num_params(_template(7)) == TORCHVISION_PARAMS - 993 * 1281
  assert mobilenet.squeeze_channels(72) == 24  # not 72 // 4 = 18
  assert [mobilenet.squeeze_channels(c) for c in (120, 480, 672, 960)] == [
      32, 120, 168, 240]


@pytest.mark.parametrize("layout", weights.LAYOUTS)
def test_expected_names_and_shapes_are_the_libraries(layout):
  """The converter's view of the model (from the flax module's own shapes)
  equals each library's state dict: the SE squeeze widths, the expand convs
  that exist, the depthwise [C, 1, k, k] kernels, the 1x1 conv_head of timm."""
  expected = weights.expected_shapes(_template(1000), layout)
  assert list(expected.items()) == [(k, tuple(v))
                                    for k, v in SHAPES[layout].items()]


@pytest.mark.parametrize("layout", weights.LAYOUTS)
def test_converter_round_trips_and_places_each_value(layout):
  state = _random_state(layout)
  params = weights.to_flax(state, _template(1000), layout=layout)
  assert jax.tree.structure(params) == jax.tree.structure(_template(1000))
  back = weights.to_torch(params, layout)
  assert list(back) == list(SHAPES[layout])
  again = weights.to_flax(back, _template(1000), layout=layout)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6,
                                                       atol=1e-7), params, again)
  # Each kind of tensor lands where torch has it: a transposed or flipped
  # layout keeps the shapes of square kernels, so check single elements.
  tv = layout == "torchvision"
  stem = state["features.0.0.weight" if tv else "conv_stem.weight"]
  np.testing.assert_array_equal(params["stem"]["conv"]["kernel"][0, 2, 1, 5],
                                stem[5, 1, 0, 2])
  dw = state["features.4.block.1.0.weight" if tv else "blocks.2.0.conv_dw.weight"]
  np.testing.assert_array_equal(
      params["block4"]["depthwise"]["conv"]["kernel"][1, 4, 0, 9], dw[9, 0, 1, 4])
  se = state["features.4.block.2.fc1.weight" if tv
             else "blocks.2.0.se.conv_reduce.weight"]
  np.testing.assert_array_equal(params["block4"]["se"]["fc1"]["kernel"][3, 7],
                                se[7, 3, 0, 0])
  head = state["classifier.3.weight" if tv else "classifier.weight"]
  np.testing.assert_array_equal(params["fc2"]["kernel"][11, 2], head[2, 11])
  # Eval-mode BatchNorm folded with the library's eps (1e-3 / 1e-5).
  bn = "features.16.1" if tv else "blocks.6.0.bn1"
  eps = 1e-3 if tv else 1e-5
  g, b, m, v = (state[f"{bn}.{n}"].astype(np.float64)
                for n in ("weight", "bias", "running_mean", "running_var"))
  np.testing.assert_allclose(params["last"]["norm"]["scale"], g / np.sqrt(v + eps),
                             rtol=1e-6)
  np.testing.assert_allclose(params["last"]["norm"]["bias"],
                             b - m * g / np.sqrt(v + eps), rtol=1e-5, atol=1e-7)


def test_a_file_that_does_not_fit_is_named():
  state = _random_state("torchvision")
  template = _template(1000)
  bad = dict(state)
  bad["features.4.block.2.fc1.weight"] = np.zeros((18, 72, 1, 1), np.float32)
  del bad["features.16.1.running_var"]
  bad["features.17.0.weight"] = np.zeros((3,), np.float32)
  with pytest.raises(DataError) as e:
    weights.to_flax(bad, template)
  msg = str(e.value)
  assert ("features.4.block.2.fc1.weight: (18, 72, 1, 1) in the file, "
          "(24, 72, 1, 1) in the model") in msg
  assert "missing (1): ['features.16.1.running_var']" in msg
  assert "unexpected (1): ['features.17.0.weight']" in msg
  # The ImageNet head on a 7-class model: the error says what to do.
  with pytest.raises(DataError, match=r"classifier.3.weight: \(1000, 1280\) in "
                     r"the file, \(7, 1280\) in the model.*skip_head=True"):
    weights.to_flax(state, _template(7))
  params = weights.to_flax(state, _template(7), skip_head=True)
  assert params["fc2"]["kernel"] is _template(7)["fc2"]["kernel"]
  with pytest.raises(DataError, match="neither torchvision's"):
    weights.detect_layout({"conv1.weight": np.zeros(3)})
  timm_state = _random_state("timm")
  assert weights.detect_layout(timm_state) == "timm"
  with pytest.raises(DataError, match="timm layout.*missing.*conv_head.bias"):
    weights.to_flax({k: v for k, v in timm_state.items()
                     if k != "conv_head.bias"}, template, layout="timm")


_JITTED_INIT = models._jitted_init


@functools.lru_cache(maxsize=None)
def _numpy_init(model):
  """Stands in for `models._jitted_init`: the model's parameter shapes
  (`init` traced, not compiled) filled with normal draws seeded by the key."""
  shapes = jax.eval_shape(_JITTED_INIT(model), jax.random.key(0))

  def init(key):
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).tolist())
    return jax.tree.map(lambda s: rng.normal(size=s.shape).astype(s.dtype),
                        shapes)

  return init


# "numpy": Model.init's sampling by `_numpy_init` (the loading around it is
# the code under test); "compiled": the real jitted init, slow (compiling
# MobileNetV3's init, 146 threefry draws, takes 10-20 s).
@pytest.mark.parametrize("sampler", [
    "numpy", pytest.param("compiled", marks=pytest.mark.slow)])
def test_safetensors_file_loads_through_get_model(tmp_path, monkeypatch,
                                                  sampler):
  from safetensors.numpy import save_file
  _template(7)   # traced with the real init
  if sampler == "numpy":
    monkeypatch.setattr(models, "_jitted_init", _numpy_init)
  state = _random_state("torchvision")
  path = str(tmp_path / "mnv3.safetensors")
  save_file(state, path)
  model = _model(7, weights=path, skip_head=True)
  assert model.module.norm == "affine" and _model(7).module.norm == "group"
  key = jax.random.key(3)
  params = model.init(key)
  expected = weights.to_flax(state, _template(7), skip_head=True)
  for path_, leaf in jax.tree_util.tree_leaves_with_path(params):
    if path_[0].key != "fc2":
      np.testing.assert_array_equal(leaf, functools.reduce(
          lambda t, k: t[k.key], path_, expected))
  fresh = _model(7, norm="affine").init(key)["fc2"]  # the key's own draw
  jax.tree.map(np.testing.assert_array_equal, params["fc2"], fresh)
  with pytest.raises(DataError, match="no such file"):
    _model(7, weights=str(tmp_path / "none.pth"))
  with pytest.raises(ConfigError, match="only .*mobilenet_v3_large"):
    models.get_model("inception_cnn", input_shape=(32, 32, 3), num_classes=7,
                     weights=path)
  with pytest.raises(ConfigError, match="norm='affine'"):
    _model(7, weights=path, norm="group")
  with pytest.raises(DataError, match="skip_head=True"):
    _model(7, weights=path).init(key)
  pth = tmp_path / "mnv3.pth"
  pth.write_bytes(b"not read")
  monkeypatch.setitem(sys.modules, "torch", None)  # torch not installed
  with pytest.raises(DataError, match="pip install torch"):
    weights.read_state_dict(str(pth))


def test_group_norm_is_flax_group_norm_and_depthwise_conv_is_lax():
  """Both in one jitted program (eagerly, every shifted slice of the im2col
  sum and of its gradient compiled on its own: 180 programs); the depthwise
  conv also vmapped over two clients' kernels."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(2, 5, 6, 24)), jnp.float32)
  norm = mobilenet.Norm("group", 8)
  p = {"scale": jnp.asarray(rng.normal(size=24), jnp.float32),
       "bias": jnp.asarray(rng.normal(size=24), jnp.float32)}
  cases = ((3, 1), (5, 2))
  kernels = [jnp.asarray(rng.normal(size=(k, k, 1, 24)), jnp.float32)
             for k, _ in cases]

  @jax.jit
  def run(x, p, kernels):
    out = dict(norm=norm.apply({"params": p}, x),
               ref=nn.GroupNorm(num_groups=8, epsilon=1e-5).apply(
                   {"params": p}, x))
    for (k, s), kernel in zip(cases, kernels):
      fns = {impl: functools.partial(layers.depthwise_conv2d, strides=s,
                                     padding=(k - 1) // 2, impl=impl)
             for impl in ("im2col", "xla")}
      out[f"k{k}"] = dict(
          lax=lax.conv_general_dilated(
              x, kernel, (s, s), [((k - 1) // 2,) * 2] * 2,
              dimension_numbers=("NHWC", "HWIO", "NHWC"),
              feature_group_count=24),
          out={impl: fn(x, kernel) for impl, fn in fns.items()},
          grads={impl: jax.grad(lambda a, b, fn=fn: jnp.sum(jnp.sin(fn(a, b))),
                                argnums=(0, 1))(x, kernel)
                 for impl, fn in fns.items()})
    return out

  # Two clients' depthwise kernels in one vmap (a MobileNet's clients in the
  # engine's loop): each client's values and kernel gradients are its own
  # lax conv's.
  k, s = cases[0]
  two = jnp.stack([kernels[0], jnp.asarray(rng.normal(size=(k, k, 1, 24)),
                                           jnp.float32)])

  @jax.jit
  def clients(x, two):
    lax_conv = lambda kernel: lax.conv_general_dilated(
        x, kernel, (s, s), [((k - 1) // 2,) * 2] * 2,
        dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=24)
    ours = lambda kernel: layers.depthwise_conv2d(
        x, kernel, strides=s, padding=(k - 1) // 2, impl="im2col")
    grads = lambda f: jax.grad(lambda kernel: jnp.sum(jnp.sin(f(kernel))))
    return (jax.vmap(ours)(two), jax.vmap(grads(ours))(two),
            [lax_conv(kernel) for kernel in two],
            [grads(lax_conv)(kernel) for kernel in two])

  values, grads, want_values, want_grads = clients(x, two)
  for i in range(2):
    np.testing.assert_allclose(values[i], want_values[i], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads[i], want_grads[i], rtol=1e-4, atol=1e-4)
  assert not np.allclose(values[0], values[1])

  out = run(x, p, kernels)
  np.testing.assert_allclose(out["norm"], out["ref"], rtol=1e-5, atol=1e-5)
  for k, _ in cases:
    for got in out[f"k{k}"]["out"].values():
      np.testing.assert_allclose(got, out[f"k{k}"]["lax"], rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                         atol=1e-4),
                 out[f"k{k}"]["grads"]["im2col"], out[f"k{k}"]["grads"]["xla"])


def _two_clients():
  model = _model(7, weights="", norm="affine")
  sets = [weights.to_flax(_random_state("torchvision", seed), _template(7),
                          skip_head=True) for seed in (0, 1)]
  sets = [dict(p, fc2=jax.tree.map(
      lambda a, i=i: np.full(a.shape, 0.01 * (i + 1), np.float32), p["fc2"]))
          for i, p in enumerate(sets)]
  # numpy (jnp.stack compiles a program per leaf shape: ~100 of them).
  stacked = jax.tree.map(lambda *a: np.stack(a), *sets)
  x = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 32, 32, 3)),
                  jnp.uint8)
  return model, sets, stacked, x


# Slow (~8 s: MobileNetV3 compiled four times): the network's forward is
# pinned by test_seeded_weights_give_torchvisions_logits (which also checks
# features + head), its layers under vmap / lax.map by tests/test_models_
# layers.py (convolutions inside lax.map x lax.scan and vmapped over client
# kernels) and test_group_norm_is_flax_group_norm_and_depthwise_conv_is_lax
# (the depthwise conv vmapped over clients' kernels).
@pytest.mark.slow
def test_loop_safe_vmap_and_lax_map_equal_separate_applies():
  """Two clients' parameters stacked: vmap and lax.map give what separate
  applies give; features + head is the forward pass."""
  model, sets, stacked, x = _two_clients()

  @jax.jit
  def run(first, stacked):
    return dict(
        vmap=jax.vmap(model.apply, (0, None))(stacked, x),
        map=lax.map(lambda p: model.apply(p, x), stacked),
        features=model.features(first, x))

  out = run(sets[0], stacked)
  apply = jax.jit(model.apply)   # one program for both clients
  out["separate"] = np.stack([apply(p, x) for p in sets])
  np.testing.assert_allclose(out["vmap"], out["separate"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out["map"], out["separate"], rtol=1e-5, atol=1e-6)
  assert out["features"].shape == (2, mobilenet.LAST_CHANNEL)
  np.testing.assert_allclose(model.head(sets[0], out["features"]),
                             out["separate"][0], rtol=1e-5, atol=1e-6)
  assert not np.allclose(out["separate"][0], out["separate"][1])


@pytest.mark.slow
def test_gradient_steps_in_scan_inside_lax_map_dropout_and_group_norm():
  """The engine's shape: lax.scan of gradient steps inside lax.map over
  clients runs and lowers the loss; dropout acts in training; the GroupNorm
  variant runs."""
  model, sets, stacked, x = _two_clients()
  group = _model(7)

  @jax.jit
  def run(sets, stacked):
    loss = lambda p: jnp.mean(model.apply(p, x) ** 2)
    step = lambda p, _: (jax.tree.map(lambda a, g: a - 0.1 * g, p,
                                      jax.grad(loss)(p)), loss(p))
    return dict(
        separate=model.apply(sets[0], x),
        losses=lax.map(lambda p: lax.scan(step, p, None, length=2)[1], stacked),
        train=model.apply(sets[0], x, train=True, rng=jax.random.key(0)),
        group=group.apply(sets[1], x))

  out = run(sets, stacked)
  assert np.all(np.isfinite(out["losses"])) and out["losses"][0, 1] < out[
      "losses"][0, 0]
  assert not np.allclose(out["train"], out["separate"])  # dropout 0.2
  assert out["group"].shape == (2, 7) and np.all(np.isfinite(out["group"]))


def _import(name):
  """The library, or a skip: not installed, or installed but not importable
  (a CUDA torchvision wheel beside a CPU torch raises RuntimeError)."""
  try:
    return importlib.import_module(name)
  except (ImportError, RuntimeError, OSError) as e:
    pytest.skip(f"{name} not importable: {type(e).__name__}: {e}")


def _randomize_batch_norms(torch, net):
  gen = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for m in net.modules():
      if isinstance(m, torch.nn.BatchNorm2d):
        n = m.num_features
        m.weight.copy_(1 + 0.2 * torch.randn(n, generator=gen))
        m.bias.copy_(0.2 * torch.randn(n, generator=gen))
        m.running_mean.copy_(0.2 * torch.randn(n, generator=gen))
        m.running_var.copy_(0.5 + 1.5 * torch.rand(n, generator=gen))
  return net.eval()


def test_torchvision_and_timm_weights_give_their_logits(tmp_path):
  """Runs where PyTorch and torchvision are installed (timm optional): a
  randomly initialized network with random BatchNorm statistics, eval mode,
  saved as .pth and .safetensors, loaded by `get_model(weights=...)`, gives
  the library's logits at 64x64 (to 1e-4 of the logit scale)."""
  torch = _import("torch")
  torchvision = _import("torchvision")
  from safetensors.torch import save_file
  torch.manual_seed(0)
  nets = {"torchvision": torchvision.models.mobilenet_v3_large()}
  try:
    timm = importlib.import_module("timm")
    nets["timm"] = timm.create_model("mobilenetv3_large_100", pretrained=False)
  except ImportError:
    pass
  x = np.random.default_rng(3).normal(size=(2, 64, 64, 3)).astype(np.float32)
  for layout, net in nets.items():
    net = _randomize_batch_norms(torch, net)
    with torch.no_grad():
      ref = net(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()
    state = net.state_dict()
    pth, st = tmp_path / f"{layout}.pth", tmp_path / f"{layout}.safetensors"
    torch.save(state, pth)
    save_file({k: v.contiguous() for k, v in state.items()}, str(st))
    for path in (pth, st):
      model = _model(1000, 64, weights=str(path))
      params = model.init(jax.random.key(0))
      logits = np.asarray(jax.jit(functools.partial(
          model.apply, normalized=True))(params, x))
      scale = np.abs(ref).max()
      assert scale > 1e-3, (layout, scale)
      np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-4 * scale,
                                 err_msg=f"{layout} {path.suffix}")


def test_seeded_weights_give_torchvisions_logits():
  """The architecture against torchvision without PyTorch: weights drawn from a
  seeded numpy generator in torchvision's layout (He-scaled convs, BatchNorms
  with random statistics), loaded by the converter, give the logits that
  torchvision's `mobilenet_v3_large` computed for them in eval mode on three
  72x56 images (tests/data/mobilenet_v3_logits.npz, 12 KB). Regenerate with
  `python tests/make_mobilenet_logits.py` in an environment with torch and
  torchvision (e.g. `pip install torch==2.14.1 torchvision==0.29.1 numpy`).

  Measured: max |difference| 1.3e-6 with logits up to 1.25 (torch 2.14.1 /
  torchvision 0.29.1 against XLA:CPU); the tolerance 1e-4 leaves 75x for
  another CPU's rounding. Every block counts: the SE gate's sigmoid in place
  of the hard sigmoid moves logits by ~0.1, a dropped residual by ~1."""
  data = np.load(make_mobilenet_logits.PATH)
  want = data["logits"]
  x = make_mobilenet_logits.inputs()
  assert x.shape == make_mobilenet_logits.INPUT_SHAPE and want.shape == (3, 1000)
  # The images differ in their logits (pooling has not averaged them away).
  assert np.abs(want[0] - want[1]).max() > 0.1
  model = models.get_model("mobilenet_v3_large", input_shape=x.shape[1:],
                           num_classes=1000, norm="affine")
  params = weights.to_flax(make_mobilenet_logits.state_dict(),
                           jax.eval_shape(model.init, jax.random.key(0)),
                           layout="torchvision")

  @jax.jit
  def run(p, x):
    feats = model.features(p, x, normalized=True)
    return model.apply(p, x, normalized=True), model.head(p, feats), feats

  got, composed, feats = run(params, x)
  np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-4,
                             err_msg=str(data["made_with"]))
  # features + head is the forward pass.
  assert feats.shape == (3, mobilenet.LAST_CHANNEL)
  np.testing.assert_allclose(composed, got, rtol=1e-5, atol=1e-6)


def test_config_keys_reach_get_model(tmp_path):
  from fedjax_dg.run import assemble, checks, config
  path = tmp_path / "mnv3.safetensors"
  path.write_bytes(b"")
  cfg = config.apply_overrides(config.base_config(), [
      "model.name=mobilenet_v3_large", f"model.weights={path}",
      "model.skip_head=True", "data.name=pacs"])
  assert (cfg.model.weights, cfg.model.skip_head) == (str(path), True)
  with pytest.raises(ConfigError, match="model.skip_head"):
    config.apply_overrides(config.base_config(), ["model.skiphead=True"])
  fed = type("Fed", (), {"num_classes": 7, "image_shape": (32, 32, 3)})
  model = assemble.make_model(cfg, fed, (0.5,) * 3, (0.5,) * 3)
  assert (model.weights, model.skip_head, model.module.norm) == (
      str(path), True, "affine")
  cfg.model.weights = str(tmp_path / "missing.pth")
  with pytest.raises(DataError, match="missing.pth.*no such file"):
    checks.validate(cfg)
