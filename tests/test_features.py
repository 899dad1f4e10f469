"""Target-domain features kept after a run (`train.features_max`) and their
t-SNE plot (FedCCRL Fig. 5)."""

import dataclasses
import os

import jax
import numpy as np
import pytest

from fedjax_dg import algorithms, engine, models
from fedjax_dg.run import assemble, directory
from fedjax_dg.report import plots
from fedjax_dg.run.config import base_config
from fedjax_dg.errors import ConfigError

CFG = engine.EngineConfig(rounds=1, eval_every=1, epochs=1, batch_size=16,
                          progress=False, features_max=13, eval_batch_size=8)


@pytest.fixture(scope="module")
def setup(fed3):
  model = models.get_model("mlp", input_shape=fed3.image_shape,
                           num_classes=fed3.num_classes, mean=fed3.mean,
                           std=fed3.std, hidden=16)
  return fed3, model


def test_features_are_the_final_models_features_of_target_examples(setup):
  fed, model = setup
  alg = assemble.algorithm("fedavg", model, fed.num_clients, base_config())
  res = engine.run(alg, fed, model, CFG)
  f, y = res.features["features"], res.features["labels"]
  assert f.shape == (13, 16) and y.shape == (13,)
  every = np.asarray(model.features(res.server.params, fed.target_x))
  # Each kept row is the feature vector of a distinct target example with
  # that label (a seeded pick, no padding rows).
  rows = [int(np.argmin(np.abs(every - row).max(1))) for row in f]
  assert len(set(rows)) == 13
  np.testing.assert_allclose(f, every[rows], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(y, np.asarray(fed.target_y)[rows])
  off = engine.run(alg, fed, model, dataclasses.replace(CFG, features_max=0))
  assert off.features is None


def test_personalized_algorithms_keep_no_features(setup):
  fed, model = setup
  alg = assemble.algorithm("local_only", model, fed.num_clients, base_config())
  assert engine.run(alg, fed, model, CFG).features is None


def test_negative_features_max_names_the_field():
  with pytest.raises(ConfigError, match="train.features_max"):
    dataclasses.replace(CFG, features_max=-1).validate(3)


def test_tsne_plot_draws_one_panel_per_algorithm_with_features(tmp_path):
  rng = np.random.default_rng(0)
  results = dict(run_dir=str(tmp_path), targets=["t0"],
                 algorithms=["fedavg", "fedccrl", "fedprox"], runs=[])
  assert plots.tsne(results, str(tmp_path / "tsne.png")) is None
  for name in ("fedavg", "fedccrl"):
    directory.save_features(str(tmp_path), name, "t0", dict(
        features=rng.normal(size=(40, 5)).astype(np.float32),
        labels=rng.integers(0, 3, 40)))
  out = plots.tsne(results, str(tmp_path / "tsne.png"))
  assert out and os.path.getsize(out) > 0
  import matplotlib.image
  assert matplotlib.image.imread(out).shape[1] > 600  # two panels wide
