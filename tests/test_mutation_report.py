"""`tests/mutation_report.py`, the report of `make mutation`, on a mutants/
directory written here (mutmut's .meta layout)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mutation_report  # pylint: disable=g-import-not-at-top


@pytest.fixture
def mutants(tmp_path, monkeypatch):
  monkeypatch.setattr(mutation_report, "ROOT", str(tmp_path))
  monkeypatch.setattr(mutation_report, "SAMPLE_FILE",
                      str(tmp_path / "mutants" / "sample.txt"))
  codes = {
      "server/ema.py": {"fedjax_dg.server.ema.x_ema__mutmut_1": 1,
                        "fedjax_dg.server.ema.x_ema__mutmut_2": 0,
                        "fedjax_dg.server.ema.x_ema__mutmut_3": None},
      "client/sam.py": {"fedjax_dg.client.sam.x_sam__mutmut_1": 3,
                        "fedjax_dg.client.sam.x_sam__mutmut_2": 36,
                        "fedjax_dg.client.sam.x_sam__mutmut_3": 33},
  }
  for path, by_key in codes.items():
    meta = tmp_path / "mutants" / "fedjax_dg" / (path + ".meta")
    meta.parent.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps({"exit_code_by_key": by_key}))
  return tmp_path


def test_verdicts_follow_mutmuts_exit_codes(mutants):
  got = mutation_report.verdicts()
  assert got["fedjax_dg.server.ema.x_ema__mutmut_1"] == "killed"
  assert got["fedjax_dg.server.ema.x_ema__mutmut_2"] == "survived"
  assert got["fedjax_dg.server.ema.x_ema__mutmut_3"] == "not checked"
  assert got["fedjax_dg.client.sam.x_sam__mutmut_1"] == "killed"
  assert got["fedjax_dg.client.sam.x_sam__mutmut_2"] == "timeout"
  assert got["fedjax_dg.client.sam.x_sam__mutmut_3"] == "no tests"
  assert set(mutation_report.verdicts("fedjax_dg.client.*")) == {
      f"fedjax_dg.client.sam.x_sam__mutmut_{i}" for i in (1, 2, 3)}


def test_report_scores_checked_mutants_and_lists_the_rest(mutants):
  lines = mutation_report.report().splitlines()
  row = {l.split()[0]: l.split() for l in lines[1:] if l and "mutmut" not in l}
  # server: 1 killed of 2 checked (the unchecked one is not counted)
  assert row["fedjax_dg.server"][1:4] == ["1", "/", "2"]
  assert row["fedjax_dg.client"][1:4] == ["1", "/", "3"]
  assert row["all"][1:4] == ["2", "/", "5"]
  listed = [l for l in lines if "mutmut" in l]
  assert sorted(l.split()[-1] for l in listed) == [
      "fedjax_dg.client.sam.x_sam__mutmut_2",
      "fedjax_dg.client.sam.x_sam__mutmut_3",
      "fedjax_dg.server.ema.x_ema__mutmut_2"]


def test_a_sample_is_seeded_per_package_and_restricts_the_report(mutants):
  first = mutation_report.sample(2, seed=0)
  assert first == mutation_report.sample(2, seed=0)
  assert len(first) == 4
  assert sum(n.startswith("fedjax_dg.server.") for n in first) == 2
  assert set(mutation_report.verdicts()) == set(first)
  assert len(set().union(*(mutation_report.sample(2, seed=s)
                           for s in range(20)))) == 6


def test_wilson_interval():
  low, high = mutation_report.wilson(85, 100)
  # closed form at p = 0.85, n = 100, z = 1.96
  assert low == pytest.approx(76.7, abs=0.05)
  assert high == pytest.approx(90.7, abs=0.05)
  low, high = mutation_report.wilson(10, 10)
  assert high == pytest.approx(100.0) and low == pytest.approx(72.2, abs=0.05)
