"""`fedjax-dg run --estimate` (run/estimate.py): one measured round per
algorithm, extrapolated to the protocol's epochs, rounds and sweep."""

import math
import os

import pytest

from conftest import tiny_experiment
from fedjax_dg import cli
from fedjax_dg.errors import ConfigError
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
  lines = est.lines()
  assert any(line.startswith("memory per device: ") for line in lines)
  assert any(line.startswith("time per round: fedavg ") for line in lines)
  assert any(line.startswith("estimated total: ") for line in lines)
  assert said and not os.path.exists(tmp_path / "runs")  # no run directory


def test_local_steps_of_a_round():
  steps = estimate.local_steps(
      type("E", (), dict(epochs=2, batch_size=16, cohort_size=0,
                         local_steps=0))(),
      type("A", (), dict(client=type("C", (), dict(local_steps=0))()))(),
      [16, 17, 40])
  assert steps == 2 * (1 + 2 + 3)


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
