"""Reporting for the HyperGenFL protocol: best-over-rounds next to final accuracy,
"test" naming for official-split targets, and the Table 1 scenario presets."""

import os

import pytest

from fedjax_dg.run import config, presets
from fedjax_dg.report import run_summary, tables
from fedjax_dg.report.records import eval_label, records_from_cell


def _results(targets=("test",), algorithms=("fedavg", "hypergenfl")):
  """A constructed results.json dict: best round != final round."""
  curves = {"fedavg": [0.40, 0.55, 0.50], "hypergenfl": [0.45, 0.52, 0.60]}
  runs = []
  for alg in algorithms:
    for i, t in enumerate(targets):
      acc = [a + 0.01 * i for a in curves[alg]]
      history = [dict(round=r + 1, id_acc=0.7 + 0.01 * r, ood_acc=a,
                      train_loss=1.0 / (r + 1)) for r, a in enumerate(acc)]
      runs.append(dict(algorithm=alg, target=t, seconds=1.0, history=history,
                       final=dict(round=3, id_acc=0.72, ood_acc=acc[-1]),
                       round_metrics={}))
  return dict(name="hg", run_dir="", dataset="cifar10",
              domains=["train", "test"], targets=list(targets),
              algorithms=list(algorithms), runs=runs)


def test_report_shows_best_and_final_side_by_side():
  header, rows = run_summary.table_rows(_results())
  assert header == ["algorithm", "id test", "id μ", "best id test", "best id μ",
                    "test test", "test μ", "best test test", "best test μ"]
  cols = dict(zip(header, zip(*rows)))
  # FedAvg peaks at round 2 (55.0) and ends at 50.0; HyperGenFL ends at its best.
  assert cols["test test"] == ("50.0", "60.0")
  assert cols["best test test"] == ("55.0", "60.0")
  assert cols["best id μ"] == ("72.0", "72.0")
  assert run_summary.best_over_rounds(_results()["runs"][0], "ood_acc") == (0.55, 2)
  lines = run_summary.best_rounds(_results())
  assert lines[0] == "fedavg / test: best test 55.0 at round 2 of 3 (final 50.0)"


def test_report_names_ood_for_domain_targets_and_writes_table(tmp_path):
  res = _results(targets=("photo", "sketch"))
  header, rows = run_summary.table_rows(res)
  assert "ood μ" in header and "best ood μ" in header and "test μ" not in header
  cols = dict(zip(header, zip(*rows)))
  assert cols["best ood μ"][0] == "55.5 ± 0.5"  # mean (std) of 55.0 and 56.0
  assert run_summary.eval_label(["test"]) == "test"
  assert run_summary.eval_label(["val"]) == "test"  # Tiny-ImageNet's labeled split
  assert run_summary.eval_label(["test", "photo"]) == "ood"
  assert run_summary.eval_label([]) == "ood"
  res = _results()
  paths = run_summary.write_all(res, str(tmp_path))
  text = open(os.path.join(tmp_path, "table.md")).read()
  assert "best test μ" in text and "held-out official test split" in text
  assert "best test 55.0 at round 2" in text
  assert any(p.endswith(".png") for p in paths)


def test_tables_best_and_final_with_test_naming():
  res = _results(targets=("test",))
  cfg = {"seed": 0, "data": {"d": 1}}
  records = records_from_cell("c0", {}, cfg, res)
  fedavg = [r for r in records if r["algorithm"] == "fedavg"][0]
  assert fedavg["ood_acc"] == 0.50 and fedavg["best_ood_acc"] == 0.55
  assert fedavg["best_ood_round"] == 2
  assert eval_label(records) == "test"
  final, best = tables.table2(records, "final"), tables.table2(records, "best")
  assert final.header == ["algorithm", "d=1 μ_id", "d=1 μ_test"]
  assert final.rows[0][2].startswith("50.0") and best.rows[0][2].startswith("55.0")
  # CSV columns keep the engine's field names.
  assert "d1_ood" in final.csv_header
  summary = tables.summary(records)
  assert "best μ_test" in summary.header
  row = dict(zip(summary.header, summary.rows[0]))
  assert (row["μ_test"], row["best μ_test"]) == ("50.0", "55.0")
  per = tables.per_domain(records, 1, "best")
  assert per.header[-2:] == ["test test", "test μ"]
  dg = records_from_cell("c0", {}, cfg, _results(targets=("photo",)))
  assert eval_label(dg) == "ood"


@pytest.mark.parametrize("name,clients,active,beta", [
    ("standard", 10, 5, 0.5), ("advanced", 100, 20, 0.25),
    ("extreme", 100, 20, 0.1)])
def test_scenarios_follow_table1(name, clients, active, beta):
  from fedjax_dg.run import assemble  # pylint: disable=g-import-not-at-top
  cfg = config.base_config()
  applied = presets.apply_scenario(cfg, name)
  assert cfg.data.partition == "dirichlet" and cfg.data.targets == "test"
  assert cfg.scenario == name and f"scenario={name!r}" in applied
  cfg = assemble.resolve(cfg)
  assert (cfg.data.num_clients, cfg.train.cohort_size, cfg.data.alpha) == (
      clients, active, beta)
  assert (cfg.train.rounds, cfg.train.batch_size, cfg.train.epochs) == (100, 32, 10)
  assert cfg.train.eval_every == 1 and cfg.train.ood_eval_max == 0
  assert (cfg.client.optimizer, cfg.client.lr, cfg.client.weight_decay) == (
      "adamw", 0.01, 1e-5)
  assert cfg.data.min_partition_size == 10
  assert cfg.fedprox.mu == 0.01


@pytest.mark.parametrize("dataset,model,size,epochs,target", [
    ("fashion_mnist", "resnet50", 28, 10, "test"),
    ("cifar10", "cifar_cnn", 32, 10, "test"),
    ("cifar100", "resnet50", 32, 10, "test"),
    ("tiny_imagenet", "resnet50", 64, 1, "val")])
def test_scenario_with_dataset_sets_backbone_and_epochs(dataset, model, size,
                                                        epochs, target):
  from fedjax_dg import models  # pylint: disable=g-import-not-at-top
  from fedjax_dg.run import checks
  from fedjax_dg.data import splits  # pylint: disable=g-import-not-at-top
  cfg = config.base_config()
  presets.apply_scenario(cfg, "extreme", dataset=dataset)
  assert (cfg.data.name, cfg.model.name, cfg.data.image_size) == (dataset, model,
                                                                   size)
  assert cfg.train.epochs == epochs and cfg.data.targets == target
  assert target == splits.eval_split(dataset)
  assert model in models.available()
  checks.validate(cfg)


def test_scenario_errors_and_optional_sections():
  cfg = config.base_config()
  with pytest.raises(ValueError, match="standard"):
    presets.apply_scenario(cfg, "hard")
  with pytest.raises(ValueError, match="cifar10"):
    presets.apply_scenario(cfg, "standard", dataset="pacs")
  # A config without an optional baseline section: skipped, or an error if strict.
  cfg = config.base_config()
  with cfg.unlocked():
    del cfg["moon"]
  applied = presets.apply_scenario(cfg, "std")
  assert not any(a.startswith("moon.") for a in applied)
  with pytest.raises(ValueError, match="moon"):
    presets.apply_scenario(cfg, "standard", strict=True)
  values = presets.scenario_values("extreme", "cifar100")
  assert values["moon.temperature"] == 0.5 and values["scenario"] == "extreme"


def test_targets_all_on_split_datasets_is_the_evaluation_split_only():
  """data.targets='all' never holds out 'train' (clients would train on test)."""
  from fedjax_dg.run import assemble
  from fedjax_dg.run.config import base_config
  c = base_config()
  c.data.name = "fashion_mnist"
  assert assemble.target_domains(c, ("train", "test")) == ["test"]
  c.data.name = "tiny_imagenet"
  assert assemble.target_domains(c, ("train", "val")) == ["val"]
  c.data.name = "rotated_fashion_mnist"
  assert assemble.target_domains(c, ("0", "15")) == ["0", "15"]


def test_scenario_field_sets_table1_values_and_rejects_conflicts():
  from fedjax_dg.run import assemble, checks  # pylint: disable=g-import-not-at-top
  cfg = config.apply_overrides(config.base_config(), ["scenario=extreme"])
  resolved = assemble.resolve(cfg)
  assert (resolved.data.num_clients, resolved.train.cohort_size,
          resolved.data.alpha) == (100, 20, 0.1)
  assert cfg.data.num_clients == 0           # resolve works on a copy
  again = assemble.resolve(resolved)       # idempotent
  assert again.data.alpha == 0.1
  # The scenario's own value given twice is fine; another value is an error.
  ok = config.apply_overrides(config.base_config(),
                              ["scenario=advanced", "data.num_clients=100"])
  assert assemble.resolve(ok).data.alpha == 0.25
  bad = config.apply_overrides(config.base_config(),
                               ["scenario=extreme", "data.alpha=0.3"])
  with pytest.raises(ValueError, match=r"data\.alpha=0\.1.*data\.alpha=0\.3"):
    assemble.resolve(bad)
  # An explicit value equal to the base default is not silently replaced.
  given = ["scenario=extreme", "data.alpha=0.5"]
  with pytest.raises(ValueError, match=r"sets data\.alpha=0\.1.*data\.alpha=0\.5"):
    assemble.resolve(config.apply_overrides(config.base_config(), given))
  same = ["data.alpha=0.1", "train.cohort_size=20", "scenario=extreme"]
  assemble.resolve(config.apply_overrides(config.base_config(), same))
  with pytest.raises(ValueError, match="scenario='hard'.*standard"):
    checks.validate(config.apply_overrides(config.base_config(),
                                               ["scenario=hard"]))
  assert assemble.resolve(config.base_config()).data.num_clients == 0


def _scenario_records():
  """FedAvg and HG-FL in two scenarios, two seeds each; best != final."""
  records = []
  for scenario, shift in (("extreme", -0.2), ("standard", 0.0)):
    for seed in (0, 1):
      res = _results()
      for run in res["runs"]:
        for h in run["history"]:
          h["ood_acc"] += shift + 0.02 * seed
        run["final"]["ood_acc"] = run["history"][-1]["ood_acc"]
      cfg = {"seed": seed, "data": {"d": 1}, "scenario": scenario}
      records += records_from_cell(
          f"scenario={scenario}__seed={seed}",
          {"scenario": scenario, "seed": str(seed)}, cfg, res)
  return records


def test_scenario_table_rows_are_methods_columns_are_scenarios():
  records = _scenario_records()
  t = tables.scenario_table(records)
  # Table 1's order, not first-seen order; best (the paper's number) then final.
  assert t.header == ["algorithm", "standard best", "standard final",
                      "extreme best", "extreme final"]
  rows = {r[0]: r[1:] for r in t.rows}
  assert set(rows) == {"FedAvg", "HG-FL"}
  # FedAvg: best 55 / final 50 (+1 for seed 1 on average), std over 2 seeds.
  assert rows["FedAvg"][0] == "56.0 ± 1.4" and rows["FedAvg"][1] == "51.0 ± 1.4"
  assert rows["FedAvg"][2] == "36.0 ± 1.4"
  assert rows["HG-FL"][1] == "**61.0 ± 1.4**"   # the best final in that column
  csv_row = dict(zip(t.csv_header, t.csv_rows[0]))
  assert csv_row["standard_best_seeds"] == 2
  assert abs(csv_row["extreme_final"] - 31.0) < 1e-9
  # The d-shaped tables keep one row per scenario (never averaged over them).
  t2 = tables.table2(records)
  assert len(t2.rows) == 4
  assert tables.scenario_table(records_from_cell(
      "c0", {}, {"seed": 0, "data": {"d": 1}}, _results())) is None
