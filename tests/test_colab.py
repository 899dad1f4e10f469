"""Executes the colab/ notebooks' code cells (tiny settings) in a fresh namespace."""

import glob
import json
import os

import matplotlib
import pytest

matplotlib.use("Agg")

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "colab",
                                          "*.ipynb")))


def test_there_are_notebooks():
  assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path):
  nb = json.load(open(path))
  namespace = {"__name__": "__main__"}
  for cell in nb["cells"]:
    if cell["cell_type"] != "code":
      continue
    lines = [l for l in "".join(cell["source"]).splitlines()
             if not l.lstrip().startswith(("!", "%"))]
    exec(compile("\n".join(lines), path, "exec"), namespace)
  res = namespace["results"]
  assert set(res) == {"fedavg", "hfedf"}
  assert all(r.final["id_acc"] > 0.2 for r in res.values())  # 10 classes: chance 0.1
