"""The colab/ notebooks: one install cell for all, an "Open in Colab" badge
naming each notebook's own file, and every notebook executed (tiny settings,
code cells in a fresh namespace, from a temporary folder) with checks of what
it computed.

Executing a notebook takes 15-80 s of CPU (colab/README.md): quickstart and
the tutorials are marked `notebooks`, excluded from the default suite, and run
by `make test-notebooks` (which CI runs after `make test`).
"""

import csv
import glob
import json
import math
import os
import re

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

ROOT = os.path.join(os.path.dirname(__file__), "..")
COLAB = os.path.join(ROOT, "colab")
NOTEBOOKS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(COLAB,
                                                                      "*.ipynb")))
TUTORIALS = [n for n in NOTEBOOKS if n != "quickstart.ipynb"]
BADGE = "https://colab.research.google.com/assets/colab-badge.svg"


def cells(name: str, kind: str = "code") -> list[str]:
  nb = json.load(open(os.path.join(COLAB, name)))
  return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind]


def badge_base() -> str:
  """The one place that names the repository: colab/README.md's badge base."""
  (base,) = re.findall(r"^Badge base: `(\S+)`", open(os.path.join(
      COLAB, "README.md")).read(), re.M)
  return base


def run_notebook(name: str, tmp_path, monkeypatch) -> dict:
  """Executes the code cells (shell `!` / magic `%` lines dropped) in one
  namespace from `tmp_path`; returns the namespace."""
  import matplotlib.pyplot as plt
  monkeypatch.chdir(tmp_path)
  namespace = {"__name__": "__main__"}
  path = os.path.join(COLAB, name)
  try:
    for code in cells(name):
      lines = [l for l in code.splitlines()
               if not l.lstrip().startswith(("!", "%"))]
      exec(compile("\n".join(lines), path, "exec"), namespace)
  finally:
    plt.close("all")
  return namespace


# ------------------------------------------------------------ every notebook


def test_there_are_the_tutorials():
  assert NOTEBOOKS == sorted(["quickstart.ipynb", "hfedf_walkthrough.ipynb",
                              "hypergenfl_label_skew.ipynb",
                              "fedccrl_fedsdaf.ipynb", "your_own_algorithm.ipynb",
                              "your_own_data.ipynb", "scale.ipynb"])
  assert set(TUTORIALS) == set(CHECKS)


@pytest.mark.parametrize("name", TUTORIALS)
def test_every_notebook_opens_with_quickstarts_install_cell(name):
  """One install cell (tested in test_install.py), the same in every notebook."""
  assert cells(name)[0] == cells("quickstart.ipynb")[0]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_notebook_has_a_colab_badge_naming_its_own_file(name):
  base = badge_base()
  assert "PLACEHOLDER" in base   # no public repository URL yet
  links = re.findall(rf"\[!\[Open In Colab\]\({re.escape(BADGE)}\)\]\((\S+?)\)",
                     cells(name, "markdown")[0])
  assert links == [f"{base}colab/{name}"]


def test_readmes_link_every_tutorial_and_its_badge():
  readme = open(os.path.join(ROOT, "README.md")).read()
  listing = open(os.path.join(COLAB, "README.md")).read()
  for name in NOTEBOOKS:
    assert f"(colab/{name})" in readme, name
    assert f"({badge_base()}colab/{name})" in listing, name


# -------------------------------------------------- what each one computed


def check_quickstart(ns):
  res = ns["results"]
  assert set(res) == {"fedavg", "hfedf"}
  assert all(r.final["id_acc"] > 0.2 for r in res.values())  # chance: 0.1


def check_hfedf_walkthrough(ns):
  # The hypernetwork generates a different model per client from round 0.
  gap = ns["gap"]
  assert np.all(np.diag(gap) == 0) and np.all(gap[~np.eye(len(gap), dtype=bool)] > 0)
  np.testing.assert_allclose(ns["smoothed"], ns["expected"], rtol=1e-5)
  res = ns["results"]
  assert {(r["algorithm"], r["target"]) for r in res["runs"]} == {
      (a, t) for a in ("hfedf", "fedavg", "local_only") for t in ("0", "75")}
  for w in ns["theta_weights"].values():
    assert w.shape == (ns["ROUNDS"], 5)
    np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-5)
    assert w.std() > 1e-3      # GradAlign is not plain averaging
  figures = {os.path.basename(p) for p in ns["paths"]}
  assert {"curves.png", "gradalign.png", "weight_divergence.png",
          "embeddings.png", "confidence.png"} <= figures
  assert all(os.path.getsize(p) > 0 for p in ns["paths"])
  assert all(e.shape == (5, 2) for e in ns["embeddings"].values())  # 1 + 5 // 4
  for r in res["runs"]:
    assert r["final"]["id_acc"] > 0.2, r["algorithm"]


def check_hypergenfl_label_skew(ns):
  feds = ns["feds"]
  assert [feds[s].num_clients for s in ("standard", "advanced", "extreme")] == [
      10, 100, 100]
  # Lower beta, fewer classes per client (Table 1).
  classes = {title.split(":")[0]: np.median((table > 0).sum(1))
             for title, _, table in ns["panels"]}
  assert classes["standard"] > classes["advanced"] > classes["extreme"]
  # The comparison table holds each scenario's final test accuracy.
  with open(os.path.join(os.path.dirname(ns["paths"][0]),
                         "comparison_ood.csv")) as f:
    rows = {r["algorithm"]: r for r in csv.DictReader(f)}
  for s, res in ns["results"].items():
    for r in res["runs"]:
      assert r["target"] == "test"
      assert float(rows[r["algorithm"]][f"{s}:test_mean"]) == pytest.approx(
          100 * r["final"]["ood_acc"])
      assert r["final"]["ood_acc"] > 0.2, (s, r["algorithm"])   # chance 0.1
  # Every layer's weights sum to one over the last cohort; random embeddings
  # weigh the clients unequally.
  w = ns["w"]
  assert w.shape == (20, len(ns["layer_names"])) == (20, 2)
  np.testing.assert_allclose(w.sum(0), 1.0, rtol=1e-5)
  assert w.max() > 1 / 20 + 0.01
  for res in ns["results"].values():
    ones, _ = ns["last_cohort_weights"](res)
    np.testing.assert_allclose(ones.sum(0), 1.0, rtol=1e-5)


def check_fedccrl_fedsdaf(ns):
  ds = ns["ds"]
  assert ds.images.shape[1:] == (28, 28, 3) and ds.num_domains == 5
  views, gray = ns["views"], np.asarray(ns["views"]["gray"])
  assert len(views) == 1 + 4 + 3
  # lam = 1: a re-styled image takes the other image's channel means (up to
  # clipping to [0, 1]), far closer than gray's own.
  for name in ds.domain_names[1:]:
    other = ds.images[ns["pick"][name]].astype(np.float64).mean((0, 1)) / 255
    got = np.asarray(views[f"gray in {name}'s style"]).mean((0, 1))
    assert np.abs(got - other).max() < np.abs(gray.mean((0, 1)) - other).max() / 3
  augmix = [np.asarray(views[f"AugMix view {k}"]) for k in (1, 2, 3)]
  assert all(0 <= a.min() and a.max() <= 1 for a in augmix)
  assert max(np.abs(a - gray).max() for a in augmix) > 0.1
  runs = {(r["algorithm"], r["target"]): r for r in ns["ccrl"]["runs"]}
  assert set(runs) == {("fedccrl", "texture"), ("fedavg", "texture")}
  # Every source client uploads ceil(r n_i) statistics (r = 0.1), n_i its
  # training examples after its 10 % id-validation split.
  n = ns["MAX_PER_DOMAIN"] - max(1, round(0.1 * ns["MAX_PER_DOMAIN"]))
  assert runs[("fedccrl", "texture")]["round_metrics"]["ccdt_pool_size"] == [
      4 * math.ceil(0.1 * n)] * ns["ROUNDS"]
  assert os.path.getsize("vit_gray.npz") > 0
  runs = {r["algorithm"]: r for r in ns["sdaf"]["runs"]}
  assert set(runs) == {"fedsdaf", "fedavg_adapter"}
  sdaf = runs["fedsdaf"]
  per_client = sdaf["final"]["ood_acc_per_client"]
  assert len(per_client) == 4
  assert sdaf["final"]["ood_acc"] == pytest.approx(np.mean(per_client))
  ga = np.asarray(sdaf["round_metrics"]["ga_weights"])
  assert ga.shape == (ns["ROUNDS"], 4)
  np.testing.assert_allclose(ga.sum(1), 1.0, rtol=1e-5)


def check_your_own_algorithm(ns):
  doc = open(os.path.join(ROOT, "docs", "extending.md")).read()
  (module,) = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S)
               if b.startswith("# fedjax_dg/algorithms/fedfit.py")]
  assert module.rstrip("\n") in cells("your_own_algorithm.ipynb")
  res = ns["results"]
  assert set(res) == {"fedfit", "fedavg"}
  assert all(r.final["id_acc"] > 0.15 for r in res.values())   # chance 0.1
  loss = np.asarray(res["fedfit"].round_metrics["fit_loss"], np.float64)
  weight = np.asarray(res["fedfit"].round_metrics["fit_weight"])
  n = np.asarray(ns["fed"].train.n, np.float64)
  want = n * np.exp(loss / ns["TEMPERATURE"])
  np.testing.assert_allclose(weight, want / want.sum(1, keepdims=True), rtol=1e-5)
  assert np.std(weight) > 0


def check_your_own_data(ns):
  ds = ns["ds"]
  assert ds.domain_names == tuple(sorted(ns["DOMAINS"]))
  assert ds.class_names == tuple(sorted(ns["CLASSES"]))
  assert len(ds.images) == len(ns["DOMAINS"]) * len(ns["CLASSES"]) * ns["PER_CLASS"]
  counts = ns["federation_view"].counts
  for name, fed in ns["feds"].items():
    names, table = counts(fed, ds, "domains")
    assert ns["TARGET"] not in names
    np.testing.assert_array_equal(table.sum(1), fed.train.n)
    held = (table > 0).sum(1)
    if name == "domain_split d=1":
      assert set(held) == {1}
    elif name == "domain_split d=2":
      assert set(held) == {2}
    elif name == "k_per_domain k=3":
      assert set(held) == {1} and fed.num_clients == 3 * len(names)
  assert ns["result"].final["id_acc"] > 0.35    # 4 classes: chance 0.25


def check_scale(ns):
  rows, feds, clients = ns["rows"], ns["feds"], ns["CLIENTS"]
  assert len(clients) >= 2 and min(clients) >= 1000
  assert [f.num_clients for f in feds.values()] == list(clients)
  for name in ns["ALGORITHMS"]:
    mine = [r for r in rows if r["algorithm"] == name]
    assert [r["clients"] for r in mine] == list(clients)
    # The host placement holds no more at the largest N than at the smallest
    # (the "device" placement holds every client's examples: it would grow).
    assert 0 < mine[-1]["held"] <= mine[0]["held"]
    assert all(r["acc"] > 0.15 for r in mine), name          # chance 0.1
    assert all(r["round_ms"] > 0 for r in mine)
  # What the device placement would hold: the padded examples of every client
  # and, for SCAFFOLD, N control variates the size of the model.
  params = sum(np.size(x) * np.dtype(x.dtype).itemsize for x in
               ns["jax"].tree.leaves(ns["model"].init(ns["jax"].random.key(0))))
  for r in rows:
    n = feds[r["clients"]].packed_train.n   # no id-val split: val holds none
    padded = len(n) * n.max() * (28 * 28 + 4)   # uint8 image + int32 label
    # FedAvg: the server's model; SCAFFOLD: the server's model and control
    # variate, and one control variate per client.
    models = r["clients"] + 2 if r["algorithm"] == "scaffold" else 1
    assert r["device_need"] == padded + models * params, r
  # "auto": this machine's choices by the stated rule.
  cap = ns["placement"].device_capacity()
  for r in rows:
    assert ns["auto"][r["algorithm"], r["clients"]] == (
        "device" if r["device_need"] <= cap / 4 else "host")
  assert ns["mapping"] == ("shard" if ns["jax"].device_count() > 1 else "map")
  # vmap lanes: one per client with equal local steps; with 1 epoch
  # ceil(g * mean / max) of the clients' ceil(n_i / B) steps.
  n = feds[clients[-1]].packed_train.n
  steps = np.ceil(n / ns["by_epochs"].batch_size)
  assert ns["lanes"] == {"local_steps": ns["COHORT"], "epochs": math.ceil(
      ns["COHORT"] * steps.mean() / steps.max())}
  assert ns["lanes"]["epochs"] < ns["COHORT"]


CHECKS = {"hfedf_walkthrough.ipynb": check_hfedf_walkthrough,
          "hypergenfl_label_skew.ipynb": check_hypergenfl_label_skew,
          "fedccrl_fedsdaf.ipynb": check_fedccrl_fedsdaf,
          "your_own_algorithm.ipynb": check_your_own_algorithm,
          "your_own_data.ipynb": check_your_own_data,
          "scale.ipynb": check_scale}


@pytest.mark.notebooks
def test_quickstart_runs(tmp_path, monkeypatch):
  check_quickstart(run_notebook("quickstart.ipynb", tmp_path, monkeypatch))


@pytest.mark.notebooks
@pytest.mark.parametrize("name", TUTORIALS)
def test_tutorial_runs(name, tmp_path, monkeypatch):
  CHECKS[name](run_notebook(name, tmp_path, monkeypatch))


def test_plots_keep_a_notebooks_backend_and_show_saved_figures(tmp_path,
                                                               monkeypatch):
  """Inside a Jupyter kernel (ipykernel loaded) writing a figure must not
  switch the inline backend to Agg; elsewhere it does."""
  import sys
  from fedjax_dg.report import plots
  plt = plots.pyplot()
  before = matplotlib.get_backend()
  monkeypatch.setitem(sys.modules, "ipykernel", object())
  matplotlib.use("svg")
  plots.pyplot()
  assert matplotlib.get_backend() == "svg"
  monkeypatch.delitem(sys.modules, "ipykernel")
  plots.pyplot()
  assert matplotlib.get_backend().lower() == "agg"
  path = str(tmp_path / "x.png")
  fig, ax = plt.subplots(figsize=(2, 1))
  fig.savefig(path)
  plt.close(fig)
  shown = []
  monkeypatch.setattr(plt, "show", lambda: shown.append(plt.gcf().get_size_inches()))
  plots.show(path, None, width=4)
  assert len(shown) == 1 and shown[0][0] == pytest.approx(4)
  assert shown[0][1] == pytest.approx(2)   # the image's aspect (2 x 1 inches)
  matplotlib.use(before)
