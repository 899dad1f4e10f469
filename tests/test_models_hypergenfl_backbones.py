"""HyperGenFL's backbones: the CIFAR-10 simple CNN and a GroupNorm ResNet-50.

Parameter counts are computed independently of the modules (closed forms from the
layer sizes); the full ResNet-50 is only traced (eval_shape) and run once, batched
over two clients with vmap at 32x32, batch 2; the loop-shape and vmap-equality
checks use a tiny ResNet (same code, one block per stage, width 8).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from conftest import sgd_in_client_loop

from fedjax_dg import models
from fedjax_dg.models import layers
from fedjax_dg.models import resnet

_RNG = np.random.default_rng(0)


def _num_params(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _images(*shape):
  return jnp.asarray(_RNG.integers(0, 256, shape, dtype=np.uint8))


def _random_params(shapes, seed=0):
  """Params of the right shapes without compiling `init` (fast for ResNet-50)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda s: rng.normal(0, 0.05, s.shape).astype(np.float32), shapes)


def _stack(*trees):
  """Clients' params stacked on a new leading axis, in numpy (jnp.stack
  compiles one program per leaf shape: dozens for a ResNet)."""
  return jax.tree.map(lambda *a: np.stack(a), *trees)


def _cifar_cnn_count(cin, hw, num_classes):
  """conv5x5-6, pool, conv5x5-16, pool (valid convs), 120, 84, classes."""
  conv = lambda i, o: 25 * i * o + o
  side = ((hw - 4) // 2 - 4) // 2
  dense = lambda i, o: i * o + o
  return (conv(cin, 6) + conv(6, 16) + dense(16 * side * side, 120)
          + dense(120, 84) + dense(84, num_classes))


@pytest.mark.parametrize("shape,classes", [((32, 32, 3), 10), ((28, 28, 1), 10),
                                            ((32, 32, 3), 100)])
def test_cifar_cnn_shapes_and_param_count(shape, classes):
  model = models.get_model("cifar_cnn", input_shape=shape, num_classes=classes)
  params = jax.eval_shape(model.init, jax.random.key(0))
  assert _num_params(params) == _cifar_cnn_count(shape[-1], shape[0], classes)
  assert set(params) == {"conv1", "conv2", "dense1", "dense2", "fc2"}
  assert params["conv1"]["kernel"].shape == (5, 5, shape[-1], 6)
  assert params["fc2"]["kernel"].shape == (84, classes)
  x = _images(3, *shape)
  assert jax.eval_shape(model.apply, params, x).shape == (3, classes)
  assert jax.eval_shape(model.features, params, x).shape == (3, 84)
  if shape == (32, 32, 3) and classes == 10:
    assert _num_params(params) == 62006  # the MOON / LeNet-5 CIFAR CNN


@functools.lru_cache(maxsize=None)
def _cifar_cnn():
  model = models.get_model("cifar_cnn", input_shape=(32, 32, 3), num_classes=10,
                           conv_impl="im2col")
  return model, model.init(jax.random.key(1))


def test_cifar_cnn_matches_reference():
  """The forward pass equals a plain-lax one (PyTorch's flatten order)."""
  model, params = _cifar_cnn()
  x = _images(4, 32, 32, 3)

  def reference(p, x):
    conv = lambda h, q: lax.conv_general_dilated(
        h, q["kernel"], (1, 1), "VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC")) + q["bias"]
    pool = lambda h: lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1),
                                       (1, 2, 2, 1), "VALID")
    h = model.normalize(x)
    h = pool(jax.nn.relu(conv(h, p["conv1"])))
    h = pool(jax.nn.relu(conv(h, p["conv2"])))
    h = h.transpose(0, 3, 1, 2).reshape(len(x), -1)  # PyTorch's view order
    for k in ("dense1", "dense2"):
      h = jax.nn.relu(h @ p[k]["kernel"] + p[k]["bias"])
    return h @ p["fc2"]["kernel"] + p["fc2"]["bias"]

  np.testing.assert_allclose(jax.jit(model.apply)(params, x),
                             jax.jit(reference)(params, x), rtol=1e-4, atol=1e-4)


# Slow (~2-3 s: compiling the CNN's gradient inside lax.map x lax.scan): the
# convolutions' gradients inside lax.map x lax.scan are pinned by
# tests/test_models_layers.py::test_conv_inside_scan_and_map_matches_xla (every
# implementation), this CNN's forward by test_cifar_cnn_matches_reference.
@pytest.mark.slow
def test_cifar_cnn_trains_in_client_loop():
  """lax.map over clients x lax.scan over steps runs and keeps the structure."""
  model, params = _cifar_cnn()
  stacked = _stack(params, params)
  xs = _images(2, 3, 4, 32, 32, 3)
  ys = jnp.asarray(_RNG.integers(0, 10, (2, 3, 4)))
  new, losses = sgd_in_client_loop(model, stacked, xs, ys, lr=0.05)
  assert losses.shape == (2, 3) and np.all(np.isfinite(losses))
  assert jax.tree.structure(new) == jax.tree.structure(stacked)


def test_resnet50_param_count_closed_form():
  # torchvision.models.resnet50() (BatchNorm, 7x7 stem, 1000 classes): 25,557,032;
  # GroupNorm has the same per-channel scale and bias.
  assert resnet.resnet50_param_count(1000, 3, "imagenet") == 25_557_032
  # Without the head: the familiar 23.5M backbone.
  assert resnet.resnet50_param_count(0, 3, "imagenet") == 23_508_032


@pytest.mark.parametrize("shape,classes,stem", [
    ((32, 32, 3), 100, "cifar"),        # CIFAR-100
    # Tiny-ImageNet: slow (~1.5-5 s of tracing ResNet-50 four times). The
    # CIFAR stem at 32x32 (above), 64x64 (the ImageNet case), 200 classes:
    # what the other cases check.
    pytest.param((64, 64, 3), 200, "cifar", marks=pytest.mark.slow),
    ((28, 28, 1), 10, "cifar"),         # Fashion-MNIST
    ((64, 64, 3), 1000, "imagenet"),    # torchvision's layout
])
def test_resnet50_shapes_and_param_count(shape, classes, stem):
  model = models.get_model("resnet50", input_shape=shape, num_classes=classes,
                           stem=stem)
  params = jax.eval_shape(model.init, jax.random.key(0))
  # Independent count: 3 + 4 + 6 + 3 bottlenecks, see resnet50_param_count's
  # derivation; cross-checked against torchvision above.
  assert _num_params(params) == resnet.resnet50_param_count(classes, shape[-1],
                                                            stem)
  blocks = [k for k in params if k.startswith("stage")]
  assert len(blocks) == 16
  assert params["fc2"]["kernel"].shape == (2048, classes)
  # No mutable collections: 'params' is all there is (pure-functional Model).
  variables = jax.eval_shape(
      lambda k: model.module.init({"params": k}, jnp.zeros((1,) + shape)),
      jax.random.key(0))
  assert set(variables) == {"params"}
  x = _images(2, *shape)
  assert jax.eval_shape(model.apply, params, x).shape == (2, classes)
  assert jax.eval_shape(model.features, params, x).shape == (2, 2048)


# Slow (~7 s: compiling the full network): the same code runs under vmap,
# against a loop, in test_tiny_resnet_vmap_equals_loop (one block per stage;
# trains in test_tiny_resnet_trains_in_scan, slow); the full ResNet-50 is
# traced in test_resnet50_shapes_and_param_count.
@pytest.mark.slow
def test_resnet50_vmap_over_two_clients():
  """The full ResNet-50 at 32x32, batch 2, two clients' params in one vmap."""
  model = models.get_model("resnet50", input_shape=(32, 32, 3), num_classes=100,
                           conv_impl="xla")
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  stacked = _stack(_random_params(shapes, 0), _random_params(shapes, 1))
  x = _images(2, 2, 32, 32, 3)
  out = jax.jit(jax.vmap(model.apply))(stacked, x)
  assert out.shape == (2, 2, 100) and np.all(np.isfinite(np.asarray(out)))
  assert not np.allclose(out[0], out[1])


@functools.lru_cache(maxsize=None)
def _tiny_resnet(stem="cifar"):
  model = models.get_model("resnet50", input_shape=(16, 16, 3), num_classes=5,
                           stages=(1, 1, 1, 1), width=8, norm_groups=4, stem=stem,
                           conv_impl="auto")
  return model, model.init(jax.random.key(0))


def test_tiny_resnet_vmap_equals_loop():
  """(The ImageNet stem is traced in test_resnet50_shapes_and_param_count.)"""
  model, params = _tiny_resnet()
  other = jax.tree.map(lambda p: np.asarray(p) + np.float32(0.01), params)
  stacked = _stack(params, other)
  x = np.asarray(_images(2, 3, 16, 16, 3))
  batched = jax.jit(jax.vmap(model.apply))(stacked, x)
  apply = jax.jit(model.apply)
  np.testing.assert_allclose(batched[0], apply(params, x[0]), rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(batched[1], apply(other, x[1]), rtol=2e-4, atol=2e-5)
  # GroupNorm: an example's logits do not depend on the rest of its batch
  # (the others replaced; the same batch shape, so the same program).
  others = np.concatenate([x[0, :1], x[1, 1:]])
  np.testing.assert_allclose(apply(params, x[0])[:1], apply(params, others)[:1],
                             rtol=1e-4, atol=1e-5)


# Slow (~4-5 s: compiling the ResNet's gradient inside lax.map x lax.scan):
# the convolutions' gradients inside lax.map x lax.scan are pinned by
# tests/test_models_layers.py::test_conv_inside_scan_and_map_matches_xla (every
# implementation), this network's forward under vmap by
# test_tiny_resnet_vmap_equals_loop.
@pytest.mark.slow
def test_tiny_resnet_trains_in_scan():
  model, params = _tiny_resnet()
  other = jax.tree.map(lambda p: np.asarray(p) + np.float32(0.01), params)
  stacked = _stack(params, other)
  ys = jnp.asarray(_RNG.integers(0, 5, (2, 2, 3)))
  xs = _images(2, 2, 3, 16, 16, 3)
  new, losses = sgd_in_client_loop(model, stacked, xs, ys, lr=0.05)
  assert losses.shape == (2, 2) and np.all(np.isfinite(losses))
  assert jax.tree.structure(new) == jax.tree.structure(stacked)


def test_resnet_init_and_errors():
  model, params = _tiny_resnet()
  # torchvision's conv init: normal with std sqrt(2 / fan_out); GN scale 1, bias 0.
  k = params["stage4_block1"]["conv2"]["kernel"]  # 3x3x32x32... fan_out = 9 * out
  std = np.sqrt(2.0 / (9 * k.shape[-1]))
  assert abs(float(jnp.std(k)) / std - 1) < 0.15
  np.testing.assert_array_equal(params["stem_gn"]["scale"], 1.0)
  np.testing.assert_array_equal(params["stem_gn"]["bias"], 0.0)
  assert "kaiming_out" in layers.INITS
  with pytest.raises(ValueError, match="stem"):
    bad = models.get_model("resnet50", input_shape=(16, 16, 3), num_classes=2,
                           stem="nope")
    jax.eval_shape(bad.init, jax.random.key(0))
  zero = models.get_model("resnet50", input_shape=(16, 16, 3), num_classes=2,
                          stages=(1, 1, 1, 1), width=8, norm_groups=4,
                          zero_init_residual=True)
  p = jax.eval_shape(zero.init, jax.random.key(0))
  assert p["stage1_block1"]["gn3"]["scale"].shape == (32,)
