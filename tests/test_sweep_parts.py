"""A sweep split over processes (`sweep --part I/N`): the parts share one
folder, each trains its block of cells, and together they make the sweep
one process makes."""

import json
import os
import subprocess
import sys

import pytest

from conftest import tiny_experiment
from fedjax_dg.run import sweep
from fedjax_dg.errors import ConfigError
from test_sweep_resume import _env, _finals, assert_same_runs


def _start(path, out, *args):
  return subprocess.Popen([sys.executable, "-m", "fedjax_dg.cli", "sweep",
                           "--config", path, "--out", str(out), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=_env())


@pytest.mark.slow  # three sweep processes, ~1 min on a 2-core CPU
def test_two_processes_share_a_sweep_and_make_the_whole_one(tmp_path):
  """Parts 1/2 and 2/2 started together on one --out: both end well, every
  cell is done in the one sweep.json, the last part wrote the report, and
  every run equals the unpartitioned sweep's; a second process of a part
  that runs, or a whole sweep's resume beside the parts, is refused."""
  path = tiny_experiment(tmp_path / "tiny.py", tmp_path / "runs",
                         algorithms=("fedavg",), targets="0,75")
  whole = tmp_path / "whole"
  one = _start(path, whole, "--seeds", "0,1,2,3")
  out = tmp_path / "parts"
  parts = [_start(path, out, "--seeds", "0,1,2,3", "--part", f"{i}/2")
           for i in (1, 2)]
  # While they run: the same part again, and a whole sweep, are refused.
  import time
  while not os.path.isfile(out / "sweep.json"):
    time.sleep(0.05)
  again = subprocess.run([sys.executable, "-m", "fedjax_dg.cli", "sweep",
                          "--resume", str(out), "--part", "1/2"],
                         capture_output=True, text=True, env=_env())
  whole_resume = subprocess.run([sys.executable, "-m", "fedjax_dg.cli",
                                 "sweep", "--resume", str(out)],
                                capture_output=True, text=True, env=_env())
  outs = [p.communicate(timeout=900) for p in parts]
  assert [p.returncode for p in parts] == [0, 0], [e[-2000:] for _, e in outs]
  assert one.wait(timeout=900) == 0
  if parts[0].returncode == 0 and again.returncode == 2:
    assert "in use by another sweep" in again.stderr
  assert whole_resume.returncode == 2 or "0 runs to do" in whole_resume.stdout
  manifest = json.load(open(out / "sweep.json"))
  assert manifest["parts"] == 2
  assert [c["status"] for c in manifest["cells"]] == ["done"] * 4
  said = "".join(o for o, _ in outs)
  assert "part 1/2: cells 1-2 of 4" in said and "part 2/2: cells 3-4 of 4" in said
  assert os.path.isfile(out / "report" / "report.md")
  assert_same_runs(_finals(out), _finals(whole))


def test_parts_are_checked():
  assert sweep.parse_part("2/4") == (2, 4)
  assert [list(sweep.part_cells(5, (i, 2))) for i in (1, 2)] == [[0, 1],
                                                                  [2, 3, 4]]
  assert list(sweep.part_cells(3, None)) == [0, 1, 2]
  for bad in ("3/2", "0/2", "1", "a/b"):
    with pytest.raises(ConfigError, match="--part"):
      sweep.parse_part(bad)
