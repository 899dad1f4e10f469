"""docs/extending.md's example, built from the page's own code and run.

The file shown on the page is written into a temporary folder on the algorithm
package's path: the registry must find it (its name, config section and display
name), and a short run must do what the page says: clients train on jittered
images, send the start model's loss on a probe of their data, and the server
weighs them by n_i * softmax(loss / T).
"""

import importlib
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import synthetic_federation
from fedjax_dg import algorithms, engine, models
from fedjax_dg.run import assemble, checks, config
from fedjax_dg.report.records import display_name
from fedjax_dg.client.update import Batch
from fedjax_dg.engine.round import END_STREAM

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "extending.md")


def doc_module_source() -> str:
  blocks = re.findall(r"```python\n(.*?)```", open(DOC).read(), re.S)
  files = [b for b in blocks if b.startswith("# fedjax_dg/algorithms/fedfit.py")]
  assert len(files) == 1, "docs/extending.md must show the whole fedfit.py once"
  return files[0]


@pytest.fixture
def fedfit(tmp_path, monkeypatch):
  (tmp_path / "fedfit.py").write_text(doc_module_source())
  monkeypatch.setattr(algorithms, "__path__",
                      list(algorithms.__path__) + [str(tmp_path)])
  algorithms.modules.cache_clear()
  algorithms._specs.cache_clear()
  yield importlib.import_module("fedjax_dg.algorithms.fedfit")
  sys.modules.pop("fedjax_dg.algorithms.fedfit", None)
  algorithms.modules.cache_clear()
  algorithms._specs.cache_clear()


def test_one_new_file_is_a_registered_configured_algorithm(fedfit):
  assert "fedfit" in algorithms.available()
  c = config.base_config()
  assert (c.fedfit.jitter, c.fedfit.temperature, c.fedfit.probe) == (0.1, 1.0, 32)
  assert set(c.fedfit.client) == set(algorithms.CLIENT_KEYS)
  assert display_name("fedfit") == "FedFit"
  c.algorithms = ("fedfit", "fedavg")
  c.model.name = "mlp"
  checks.validate(c)
  with pytest.raises(config.ConfigError, match="did you mean 'fedfit.temperature'"):
    config.apply_overrides(c, ["fedfit.temprature=0.5"])
  # A bad value is the user's to fix: a ConfigError, as every module raises.
  with pytest.raises(config.ConfigError, match="fedfit.temperature must be > 0"):
    fedfit.build(None, None, None, temperature=0.0)


def test_the_augmentation_is_a_bounded_brightness_shift(fedfit):
  x = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 4, 4, 1)),
                  jnp.uint8)
  batch = Batch(x, jnp.zeros((8,), jnp.int32), jnp.ones((8,)))
  out = jax.jit(fedfit.brightness_jitter(0.1))(batch, jax.random.key(0), None)
  assert out.x.dtype == jnp.uint8 and out.x.shape == x.shape
  diff = out.x.astype(np.int32) - x.astype(np.int32)
  assert np.abs(diff).max() <= 26 and np.abs(diff).max() > 0
  # One shift per image (clipping aside).
  inside = (x > 30) & (x < 225)
  for i in range(8):
    assert len(np.unique(np.asarray(diff[i])[np.asarray(inside[i])])) <= 2


def test_the_server_weighs_clients_by_the_statistic_they_send(fedfit):
  fed = synthetic_federation(num_clients=3)
  model = models.get_model("mlp", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean,
                           std=fed.std)
  c = config.base_config()
  c.fedfit.temperature = 0.5
  c.fedfit.probe = 16
  alg = assemble.algorithm("fedfit", model, fed.num_clients, c)
  cfg = engine.EngineConfig(rounds=2, eval_every=2, epochs=1, batch_size=8,
                            client_mapping="map", progress=False,
                            eval_batch_size=16, seed=4)
  res = engine.run(alg, fed, model, cfg)
  stat = np.asarray(res.round_metrics["fit_loss"])      # [rounds, m]
  weight = np.asarray(res.round_metrics["fit_weight"])
  n = np.asarray(fed.train.n, np.float64)
  want = n * np.exp(stat / 0.5)
  np.testing.assert_allclose(weight, want / want.sum(1, keepdims=True),
                             rtol=1e-5)
  assert np.std(weight[0]) > 0
  # Round 0's statistic by hand: the initial model's loss on the probe drawn
  # with the engine's client key (fold_in(split(fold_in(root, 0))[1], id)).
  root = jax.random.key(cfg.seed)
  start = alg.init(jax.random.fold_in(root, 2**31 - 1))[0].params
  _, client_key, _ = jax.random.split(jax.random.fold_in(root, 0), 3)
  for i in range(fed.num_clients):
    key = jax.random.fold_in(jax.random.fold_in(client_key, i), END_STREAM)
    idx = np.asarray(jax.random.randint(key, (16,), 0, int(fed.train.n[i])))
    logits = np.asarray(model.apply(start, fed.train.x[i][idx]), np.float64)
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    ce = -logp[np.arange(16), fed.train.y[i][idx]].mean()
    np.testing.assert_allclose(stat[0, i], ce, rtol=1e-5)
  assert res.final["id_acc"] > 1.0 / fed.num_classes
