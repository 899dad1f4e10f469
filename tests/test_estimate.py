"""`fedjax-dg run --estimate` (run/estimate.py): one measured round per
algorithm, extrapolated to the protocol's epochs, rounds and sweep."""

import math
import os
import types

import jax
import numpy as np
import pytest

from conftest import TINY_VIT, synthetic_federation, tiny_experiment
from fedjax_dg import algorithms, cli, engine, models
from fedjax_dg.errors import ConfigError
from fedjax_dg.optim import make_optimizer
from fedjax_dg.run import config as config_lib
from fedjax_dg.run import estimate


def _config(tmp_path, *sets):
  path = tiny_experiment(tmp_path / "tiny.py", tmp_path / "runs",
                         algorithms=("fedavg",), targets="0")
  return path, config_lib.apply_overrides(config_lib.load(path), list(sets))


def test_estimate_extrapolates_one_measured_round(tmp_path):
  path, cfg = _config(tmp_path, "train.epochs=3", "train.rounds=40",
                      "train.eval_every=10")
  said = []
  est = estimate.estimate(cfg, config_path=path, echo=said.append)
  (cost,) = est.costs
  assert cost.name == "fedavg" and cost.epoch_scale == 3
  # 40 of every domain's images loaded (max_per_domain): the round and the
  # data scaled to the whole dataset's.
  assert cost.image_scale == pytest.approx(
      estimate.full_images(cfg, 0) / (6 * 40))
  assert cost.image_scale > 100
  for value in (cost.round_s, cost.eval_s, cost.compile_s, cost.device_bytes,
                cost.program_bytes, cost.data_bytes, cost.carry_bytes):
    assert math.isfinite(value) and value > 0, cost
  # The round is measured at one epoch: the protocol's is three of them.
  assert cost.protocol_round_s == pytest.approx(
      3 * cost.image_scale * cost.round_s)
  assert est.evals == 40 // 10 + 1 and est.rounds == 40 and est.targets == 1
  assert est.run_s == pytest.approx(40 * cost.protocol_round_s
                                    + 5 * cost.protocol_eval_s)
  assert est.run_s >= 40 * cost.protocol_round_s
  assert est.cells == 1 and est.sweep_s == est.run_s
  # The data the device holds, scaled to the whole dataset like the round:
  # at least its pixels (the 5 source domains' 200 loaded images, 16x16x1
  # bytes each).
  assert cost.data_bytes >= cost.image_scale * 200 * 16 * 16
  lines = est.lines()
  assert any(line.startswith("memory per device: ") for line in lines)
  assert any(line.startswith("time per round: fedavg ") for line in lines)
  assert any(line.startswith("estimated total: ") for line in lines)
  assert said and not os.path.exists(tmp_path / "runs")  # no run directory


def test_local_steps_of_a_round():
  ecfg = lambda cohort: types.SimpleNamespace(
      epochs=2, batch_size=16, cohort_size=cohort, local_steps=0)
  alg = types.SimpleNamespace(client=types.SimpleNamespace(local_steps=0))
  assert estimate.local_steps(ecfg(0), alg, [16, 17, 40]) == 2 * (1 + 2 + 3)
  # A cohort of 1 of the 3: a third of the steps (the cohort's share).
  assert estimate.local_steps(ecfg(1), alg, [16, 17, 40]) == 4


def _cost(name, **kw):
  fields = dict(name=name, compile_s=1.0, round_s=2.0, steps=5, eval_s=3.0,
                epoch_scale=4.0, image_scale=10.0, data_bytes=100,
                carry_bytes=20, frozen_bytes=7, program_bytes=3,
                placement="device")
  return estimate.AlgorithmCost(**{**fields, **kw})


def test_the_totals_add_every_part_algorithm_target_and_cell():
  """The arithmetic of the three numbers, on made-up measurements: memory
  is data + carry + frozen + round program, the largest algorithm's; the
  protocol's round and evaluation scale with the epochs and images; a run
  is rounds and evaluations, summed over the algorithms and the targets,
  and the sweep is the cells' runs."""
  a, b = _cost("a"), _cost("b", frozen_bytes=1000, round_s=1.0)
  assert a.device_bytes == 100 + 20 + 7 + 3
  assert a.protocol_round_s == 2.0 * 4 * 10 and a.protocol_eval_s == 3.0 * 10
  assert a.run_s(rounds=6, evals=2) == 6 * 80 + 2 * 30
  est = estimate.Estimate(name="x", device="cpu", rounds=6, evals=2,
                          targets=3, cells=5, measured="", costs=(a, b))
  assert est.device_bytes == b.device_bytes == 100 + 20 + 1000 + 3
  assert est.run_s == 3 * (a.run_s(6, 2) + b.run_s(6, 2))
  assert est.sweep_s == 5 * est.run_s
  assert est.lines()[-1].endswith("for the sweep's 5 cells")


def test_the_round_programs_own_buffers_are_outputs_not_donated_plus_temporaries():
  stats = lambda out, alias, temp: types.SimpleNamespace(memory_analysis=(
      lambda: types.SimpleNamespace(output_size_in_bytes=out,
                                    alias_size_in_bytes=alias,
                                    temp_size_in_bytes=temp)))
  assert estimate._program_bytes(stats(100, 30, 50)) == 70 + 50
  assert estimate._program_bytes(stats(10, 30, 50)) == 50
  assert estimate._program_bytes(types.SimpleNamespace(
      memory_analysis=lambda: None)) == 0


@pytest.mark.slow
def test_measure_counts_a_frozen_backbone_and_the_padded_data():
  """FedSDAF on a tiny ViT: the frozen backbone's bytes are the frozen
  pytree's, the data the padded training and validation arrays'. (Slow:
  ~5-10 s of ViT compiles for one line; the default suite's estimate test
  has no frozen parameters.)"""
  fed = synthetic_federation(num_clients=3, per_domain=20)
  vit = models.get_model("vit_tiny", input_shape=fed.image_shape,
                         num_classes=fed.num_classes, mean=(0.5,), std=(0.25,),
                         **dict(TINY_VIT, depth=1))
  with pytest.warns(UserWarning, match="no model.weights"):
    alg = algorithms.create("fedsdaf", vit, optimizer=make_optimizer("sgd", 0.1),
                            num_clients=3, hparams={})
  ecfg = engine.EngineConfig(rounds=2, epochs=1, batch_size=8,
                             client_mapping="map", progress=False)
  m = estimate.measure(alg, fed, vit, ecfg, echo=lambda *a: None)
  frozen = alg.frozen(jax.random.key(0))
  want = sum(np.asarray(a).nbytes for a in jax.tree.leaves(frozen))
  assert m["frozen_bytes"] == want > 0
  assert m["data_bytes"] == (fed.packed_train.nbytes(padded=True)
                             + fed.packed_val.nbytes(padded=True))
  assert m["round_s"] > 0 and m["steps"] == 3 * 3  # ceil(18 / 8) each


def test_cli_prints_the_three_numbers_and_refuses_a_bad_config(
    tmp_path, capsys):
  path, _ = _config(tmp_path)
  assert cli.main(["run", "--config", path, "--estimate",
                   "--set", "train.rounds=4"]) == 0
  out = capsys.readouterr().out
  for head in ("memory per device: ", "time per round: ", "estimated total: "):
    assert head in out, out
  assert "for one run (4 rounds" in out
  assert cli.main(["run", "--config", path, "--estimate",
                   "--set", "train.roundz=4"]) == 2
  assert "train.rounds" in capsys.readouterr().err  # the closest valid key
  assert cli.main(["run", "--config", path, "--estimate",
                   "--set", "data.name=no_such_data"]) == 2
  assert "no_such_data" in capsys.readouterr().err
  assert cli.main(["run", "--estimate", "--resume", str(tmp_path)]) == 2
  assert "--estimate needs --config" in capsys.readouterr().err
  with pytest.raises(ConfigError):
    estimate.estimate(config_lib.apply_overrides(
        config_lib.load(path), ["algorithms=no_such_algorithm"]))
