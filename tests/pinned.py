"""Pinned results: the same seeds give the same numbers across refactors.

`python tests/pinned.py` runs every registered algorithm for a few rounds on a
small synthetic federation (4 clients, a cohort of 3 so cohort sampling, per-client
state gathering and the EMA after its warm-up are all exercised) and writes
`tests/data/pinned.json`: per algorithm, digests of the evaluated parameters,
the per-round training loss and the evaluation history. `python tests/pinned.py
NAME ...` (re)computes those entries only (a new algorithm's).
`tests/test_pinned.py` reruns the same and compares.

Regenerate only for a change that is *meant* to change numbers, and say so in
the commit message: the file is what says "results reproduce" for
docs/results.md and docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "data", "pinned.json")
ROUNDS = 6


def federation():
  sys.path.insert(0, HERE)
  from conftest import synthetic_domains  # pylint: disable=g-import-not-at-top
  from fedjax_dg.data import federated, partition
  # 4 classes (chance 25 %), heavy noise, 4 source domains + 1 held-out one.
  ds = synthetic_domains(num_domains=5, per_domain=80, classes=4, size=8,
                         noise=140, seed=1)
  spec = partition.PartitionSpec(name="domain_split", num_partitions=4, d=1,
                                 seed=1)
  return federated.build(ds, spec, target_domain=0, seed=1,
                         server_fraction=0.1)


def config():
  from fedjax_dg.config import base_config
  c = base_config()
  # 6 rounds of ~6 local steps need larger steps than the papers'.
  c.client.lr = 1e-2
  for name in ("fedprox", "fedgma", "fedsr", "pfedhn", "fedccrl", "fediir",
               "elcfs", "ccst", "fedadg"):
    c[name].client.lr = 1e-2
  c.ccst.depth = 1                # AdaIN up to relu1_1 on 8x8 images
  c.ccst.client.optimizer = "adam"  # its code's plain SGD barely moves here
  c.scaffold.client.lr = 0.1      # its plain SGD: near chance at 1e-2 here
  # Adapters on a frozen random ViT: the released code's 1e-3 SGD stays at
  # chance for 6 rounds here.
  c.fedsdaf.client.optimizer = "adam"
  c.fedsdaf.client.lr = 1e-2
  c.hfedf.ema_warmup = 2          # the EMA acts from round 3
  c.hfedf.server_lr = 1e-2
  c.pfedhn.server_lr = 0.1
  for name in ("feddf", "fedbe", "fedlaw"):
    c[name].steps = 4
    c[name].batch_size = 8
  c.hfedf.autoencoder_epochs = 2
  c.hfedf.autoencoder_images = 8
  c.hfedf.autoencoder_batch_size = 4
  return c


# The ViT of FedSDAF's pinned runs: one 8x8 patch (a random frozen backbone
# keeps little of the image where its attention averages over several patches)
# and one block.
VIT = dict(patch=8, dim=64, heads=2, mlp_dim=64, depth=1)


def engine_config():
  from fedjax_dg import engine
  return engine.EngineConfig(rounds=ROUNDS, eval_every=3, epochs=1, batch_size=8,
                             cohort_size=3, client_mapping="map", seed=3,
                             progress=False, eval_batch_size=16)


def digest(tree) -> list[float]:
  """[sum, sum of squares, first value] of each leaf, in leaf order (float64)."""
  out = []
  for leaf in jax.tree.leaves(tree):
    a = np.asarray(leaf, np.float64).ravel()
    if a.size:
      out += [float(a.sum()), float(np.square(a).sum()), float(a[0])]
  return out


def run(name: str, fed, cfg, variant: dict | None = None):
  """(Algorithm, engine.RunResult) of one pinned run."""
  from conftest import model_for  # pylint: disable=g-import-not-at-top
  from fedjax_dg import algorithms, engine
  if variant:
    cfg = cfg.copy_and_resolve_references()
    for key, value in variant.items():
      section, field = key.split(".")
      cfg[section][field] = value
  model = model_for(name, fed, vit=VIT)
  alg = algorithms.build(name, model, fed.num_clients, cfg, data=fed)
  return alg, engine.run(alg, fed, model, engine_config())


def summarize(alg, res) -> dict:
  """What is pinned of one run."""
  params = jax.device_get(alg.eval_params(res.server, res.clients))
  return dict(
      eval_params=digest(params),
      loss=[float(v) for v in res.round_metrics["loss"]],
      history=[{k: v for k, v in h.items() if isinstance(v, float)}
               for h in res.history],
      final={k: res.final[k] for k in ("id_acc", "ood_acc")})


# Algorithm name -> config overrides of extra pinned variants.
VARIANTS = {
    "hfedf@tensor": ("hfedf", {"hfedf.gradalign_granularity": "tensor"}),
    "hfedf@random": ("hfedf", {"hfedf.embeddings": "random"}),
    "hfedf@autoencoder": ("hfedf", {"hfedf.embeddings": "autoencoder"}),
    "hypergenfl@aggregate_first": ("hypergenfl",
                                   {"hypergenfl.order": "aggregate_first"}),
    "hypergenfl@mse": ("hypergenfl", {"hypergenfl.server_loss": "mse"}),
    "moon@global": ("moon", {"moon.prev_init": "global"}),
    "fedbe@dirichlet": ("fedbe", {"fedbe.sampler": "dirichlet"}),
    "scaffold@option1": ("scaffold", {"scaffold.variant": "I"}),
}


def pinned_names() -> list[str]:
  from fedjax_dg import algorithms
  return list(algorithms.available()) + list(VARIANTS)


def compute(names=None) -> dict:
  fed, cfg = federation(), config()
  out = {}
  for key in names or pinned_names():
    name, variant = VARIANTS.get(key, (key, None))
    out[key] = summarize(*run(name, fed, cfg, variant))
  return out


if __name__ == "__main__":
  # `python tests/pinned.py`: every name; `python tests/pinned.py NAME ...`:
  # (re)compute those entries only, keeping the others.
  jax.config.update("jax_default_matmul_precision", "highest")
  os.makedirs(os.path.dirname(PATH), exist_ok=True)
  names = sys.argv[1:]
  results = {}
  if names and os.path.exists(PATH):
    with open(PATH) as f:
      results = json.load(f)
  results.update(compute(names or None))
  with open(PATH, "w") as f:
    json.dump(results, f, indent=1)
  print(f"wrote {PATH}: {', '.join(names) or len(results)} algorithms")
