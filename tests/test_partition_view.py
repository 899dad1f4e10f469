"""`fedjax-dg partition`: the counts it prints are the federation's, and the
plot is written."""

import re

import numpy as np
import pytest

from fedjax_dg import cli, federation_view
from fedjax_dg.run import assemble, config as config_lib
from fedjax_dg.errors import ConfigError

from conftest import synthetic_domains, synthetic_federation

CONFIG = '''
from fedjax_dg.run.config import base_config

def get_config():
  c = base_config()
  c.algorithms = ("fedavg",)
  c.data.max_per_domain = 40
  c.data.image_size = 16
  c.data.targets = "0,75"
  c.model.name = "mlp"
  return c
'''


def parse(printed):
  """{target: (column names, int [clients, columns], n, val)} of the tables."""
  out, lines = {}, printed.splitlines()
  for i, line in enumerate(lines):
    if line.startswith("target "):
      target = line.split(":")[0].split()[1]
      heads = re.split(r"\s{2,}", lines[i + 1].strip())  # names may hold spaces
      assert heads[0] == "client" and heads[-2:] == ["n", "val"]
      rows = []
      for row in lines[i + 2:]:
        if row.split()[0] == "total":
          break
        rows.append([int(v) for v in row.split()[1:]])
      rows = np.array(rows)
      out[target] = (heads[1:-2], rows[:, :-2], rows[:, -2], rows[:, -1])
  return out


def federations(path, sets):
  cfg = assemble.resolve(config_lib.apply_overrides(config_lib.load(path),
                                                      sets))
  ds = assemble.load_dataset(cfg)
  return ds, {t: assemble.federate(cfg, ds, t) for t in ("0", "75")}


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
  path = tmp_path_factory.mktemp("partition") / "cfg.py"
  path.write_text(CONFIG)
  return str(path)


def test_class_counts_are_the_federations_and_the_plot_is_written(
    config_path, tmp_path, capsys):
  sets = ["data.partition=dirichlet", "data.num_clients=4", "data.alpha=0.3"]
  out = tmp_path / "classes.png"
  args = ["partition", "--config", config_path, "--by", "classes",
          "--plot", str(out)]
  assert cli.main(args + sum((["--set", s] for s in sets), [])) == 0
  tables = parse(capsys.readouterr().out)
  ds, feds = federations(config_path, sets)
  assert set(tables) == set(feds)
  for target, fed in feds.items():
    names, counts, n, val = tables[target]
    y, want_n = np.asarray(fed.train.y), np.asarray(fed.train.n)
    want = np.stack([np.bincount(y[c, :want_n[c]], minlength=fed.num_classes)
                     for c in range(fed.num_clients)])
    assert names == list(fed.class_names)
    np.testing.assert_array_equal(counts, want)
    np.testing.assert_array_equal(n, want_n)
    np.testing.assert_array_equal(val, np.asarray(fed.val.n))
  import matplotlib.image
  assert matplotlib.image.imread(str(out)).ndim == 3


@pytest.mark.parametrize("d", [1, 2])
def test_domain_counts_are_the_federations(config_path, tmp_path, capsys, d):
  out = tmp_path / "domains.png"
  assert cli.main(["partition", "--config", config_path, "--set", f"data.d={d}",
                   "--plot", str(out), "--plot-kind", "heatmap"]) == 0
  tables = parse(capsys.readouterr().out)
  ds, feds = federations(config_path, [f"data.d={d}"])
  for target, fed in feds.items():
    names, counts, n, _ = tables[target]
    assert names == list(fed.source_domains)
    np.testing.assert_array_equal(n, np.asarray(fed.train.n))
    np.testing.assert_array_equal(counts.sum(1), np.asarray(fed.train.n))
    for c, held in enumerate(fed.client_domains):
      assert {names[k] for k in np.flatnonzero(counts[c])} == set(held)
  assert out.stat().st_size > 0


@pytest.mark.parametrize("lam", [0.0, 1.0])
def test_the_benchmarks_partition_from_the_config(config_path, tmp_path,
                                                  capsys, lam):
  """data.partition=heterogeneous with 7 clients over 4 source domains: at
  lam = 0 each client trains on one domain, at 1 every client on all five,
  each client's share of a domain within a few examples of the others'
  (its id-validation share is carved out afterwards); the plot is written."""
  sets = ["data.partition=heterogeneous", "data.num_clients=7",
          f"data.lam={lam}"]
  out = tmp_path / "lam.png"
  assert cli.main(["partition", "--config", config_path, "--plot", str(out)]
                  + sum((["--set", s] for s in sets), [])) == 0
  tables = parse(capsys.readouterr().out)
  _, feds = federations(config_path, sets)
  for target, fed in feds.items():
    _, counts, n, _ = tables[target]
    assert counts.shape == (7, 5)
    np.testing.assert_array_equal(n, np.asarray(fed.train.n))
    held = (counts > 0).sum(axis=1)
    assert (held == 1).all() if lam == 0 else (held == 5).all(), counts
    if lam == 1:
      assert np.ptp(counts, axis=0).max() <= 3, counts
  assert out.stat().st_size > 0


def test_counts_on_a_synthetic_federation_and_errors(tmp_path):
  fed = synthetic_federation(num_clients=3, d=1)
  ds = synthetic_domains()
  names, table = federation_view.counts(fed, ds, "domains")
  assert names == list(fed.source_domains)
  np.testing.assert_array_equal(table.sum(1), np.asarray(fed.train.n))
  assert (np.count_nonzero(table, axis=1) == 1).all()
  text = federation_view.text_table(names, table, np.asarray(fed.val.n))
  assert text.splitlines()[-1].split()[-2] == str(int(table.sum()))
  with pytest.raises(ConfigError, match="--by"):
    federation_view.counts(fed, ds, "labels")
  with pytest.raises(ConfigError, match="--plot-kind"):
    federation_view.plot([("t", names, table)], "domains",
                         str(tmp_path / "x.png"), kind="pie")


def test_plot_path_must_be_png_and_bad_settings_are_config_errors(
    config_path, capsys):
  assert cli.main(["partition", "--config", config_path, "--plot",
                   "out.pdf"]) == 2
  assert "--plot 'out.pdf'" in capsys.readouterr().err
  assert cli.main(["partition", "--config", config_path, "--set",
                   "data.d=6"]) == 2
  assert "PartitionSpec.d" in capsys.readouterr().err
