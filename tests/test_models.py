"""Client models: registry, Table 9 shapes and parameter count, normalization."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import sgd_in_client_loop

from fedjax_dg import models

_RNG = np.random.default_rng(0)


def _images(b, shape=(32, 32, 3)):
  return jnp.asarray(_RNG.integers(0, 256, (b,) + shape, dtype=np.uint8))


@functools.lru_cache(maxsize=None)
def _inception(num_classes=7, **kw):
  model = models.get_model("inception_cnn", input_shape=(32, 32, 3),
                           num_classes=num_classes, mean=(0.4, 0.5, 0.6),
                           std=(0.2, 0.25, 0.3), **kw)
  return model, model.init(jax.random.key(0))


def _num_params(tree):
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _table9_param_count(cin, num_classes):
  """Independent count of hFedF Table 9 (naive Inception modules, with biases)."""
  conv = lambda k, i, o: k * k * i * o + o
  inception = lambda i: conv(1, i, 32) + conv(3, i, 64) + conv(5, i, 16)
  return (conv(3, cin, 32) + conv(1, 32, 32) + conv(3, 32, 64)
          + inception(64) + inception(64 + 112)
          + (288 * 3 * 3) * 256 + 256 + 256 * num_classes + num_classes)


def test_registry():
  assert set(models.available()) == {"inception_cnn", "small_cnn", "mlp",
                                     "cifar_cnn", "resnet50",
                                     "mobilenet_v3_large", "vit_b16",
                                     "vit_tiny"}
  with pytest.raises(ValueError, match="inception_cnn"):
    models.get_model("resnet", input_shape=(32, 32, 3), num_classes=3)
  with pytest.raises(ValueError):
    models.get_model("small_cnn", input_shape=(30, 30, 3), num_classes=3)
  with pytest.raises(ValueError):
    models.get_model("mlp", input_shape=(4, 4, 3), num_classes=3, mean=(0.1, 0.2))


@functools.lru_cache(maxsize=None)
def _inception_outputs():
  """Everything the InceptionCNN tests look at, from ONE jitted program."""
  model, params = _inception()
  x = _images(4)

  @jax.jit
  def run(params, x):
    xn = ((x.astype(jnp.float32) / 255 - jnp.array([0.4, 0.5, 0.6]))
          / jnp.array([0.2, 0.25, 0.3]))
    logits, state = model.module.apply({"params": params}, xn, train=False,
                                       capture_intermediates=True)
    return dict(
        module_logits=logits,
        shapes=jax.tree.map(lambda a: jnp.zeros(a.shape[1:], jnp.int8),
                            state["intermediates"]),
        apply=model.apply(params, x),
        apply_float=model.apply(params, x.astype(jnp.float32) / 255),
        train1=model.apply(params, x, train=True, rng=jax.random.key(1)),
        train2=model.apply(params, x, train=True, rng=jax.random.key(2)),
        features=model.features(params, x),
        apply_normalized=model.apply(params, xn, normalized=True))

  return model, params, run(params, x)


def test_inception_table9_shapes_and_param_count():
  model, params, out = _inception_outputs()
  assert _num_params(params) == _table9_param_count(3, 7) == 928_199
  print("inception_cnn params (3 channels, 7 classes):", _num_params(params))
  assert params["fc1"]["kernel"].shape == (2592, 256)
  shape = lambda name: out["shapes"][name]["__call__"][0].shape
  assert shape("conv1") == (32, 32, 32)
  assert shape("conv3") == (16, 16, 64)
  assert shape("inception1") == (8, 8, 176)
  assert shape("inception2") == (8, 8, 288)
  assert shape("fc1") == (256,)
  assert out["apply"].shape == (4, model.num_classes)


def test_inception_one_channel_and_other_sizes():
  model = models.get_model("inception_cnn", input_shape=(16, 12, 1),
                           num_classes=10, conv_impl="im2col")
  params = jax.eval_shape(model.init, jax.random.key(0))
  assert _num_params(params) == _table9_param_count(1, 10)
  out = jax.eval_shape(model.apply, params, jax.ShapeDtypeStruct((5, 16, 12, 1),
                                                                 jnp.uint8))
  assert out.shape == (5, 10)


def test_apply_normalizes_uint8_inside():
  _, _, out = _inception_outputs()
  np.testing.assert_allclose(out["apply"], out["module_logits"], rtol=1e-4,
                             atol=1e-5)
  np.testing.assert_allclose(out["apply_normalized"], out["module_logits"],
                             rtol=1e-6, atol=1e-6)
  # Floats are taken as already in [0, 1].
  np.testing.assert_allclose(out["apply_float"], out["module_logits"], rtol=1e-4,
                             atol=1e-5)


def test_dropout_only_in_training_and_features():
  model, params, out = _inception_outputs()
  t1, t2, ev = out["train1"], out["train2"], out["apply"]
  assert not np.allclose(t1, t2) and not np.allclose(t1, ev)
  with pytest.raises(Exception, match="dropout"):  # dropout needs an rng
    jax.eval_shape(functools.partial(model.apply, train=True), params, _images(4))
  f = out["features"]
  assert f.shape == (4, 256)
  np.testing.assert_allclose(model.head(params, f), ev, rtol=1e-5, atol=1e-5)


def test_hidden_relu_switch_and_flax_init():
  model = models.get_model("inception_cnn", input_shape=(32, 32, 3),
                           num_classes=5, hidden_relu=True, init="flax")
  assert model.module.hidden_relu and model.module.weight_init == "flax"
  params = jax.eval_shape(model.init, jax.random.key(0))
  f = jax.eval_shape(model.features, params, _images(2))
  assert f.shape == (2, 256)


def test_small_cnn_and_mlp_train_in_client_loop():
  """lax.map over clients x lax.scan over steps: the engine's loop shape."""
  for name, shape, feat in (("small_cnn", (8, 8, 1), 16), ("mlp", (4, 4, 3), 16)):
    kw = {"hidden": 16}
    model = models.get_model(name, input_shape=shape, num_classes=3, **kw)
    params = model.init(jax.random.key(0))
    assert type(params) is dict
    stacked = jax.tree.map(lambda a: jnp.stack([a, a]), params)
    xs = jnp.asarray(_RNG.integers(0, 256, (2, 3, 4) + shape, dtype=np.uint8))
    ys = jnp.asarray(_RNG.integers(0, 3, (2, 3, 4)))

    new, losses = sgd_in_client_loop(model, stacked, xs, ys, lr=0.1,
                                     rng=jax.random.key(0))
    assert losses.shape == (2, 3) and np.all(np.isfinite(losses))
    assert jax.tree.structure(new) == jax.tree.structure(stacked)
    assert jax.eval_shape(model.features, params, xs[0, 0]).shape == (4, feat)
    assert jax.eval_shape(model.apply, params, xs[0, 0]).shape == (4, 3)


def test_model_is_hashable_for_static_use():
  a = models.get_model("mlp", input_shape=(4, 4, 1), num_classes=2)
  b = models.get_model("mlp", input_shape=(4, 4, 1), num_classes=2)
  assert a == b and hash(a) == hash(b)
  assert a.mean == (0.5,) and a.std == (0.5,)
  c = models.get_model("mlp", input_shape=(4, 4, 3), num_classes=2, mean=0.2)
  assert c.mean == (0.2, 0.2, 0.2)
