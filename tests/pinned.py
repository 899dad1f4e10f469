"""Pinned results: the same seeds give the same numbers across refactors.

`python tests/pinned.py` runs every registered algorithm for a few rounds on a
small synthetic federation (4 clients, a cohort of 3 so cohort sampling, per-client
state gathering and the EMA after its warm-up are all exercised) and writes
`tests/data/pinned.json`: per algorithm, digests of the evaluated parameters,
the per-round training loss and the evaluation history. `python tests/pinned.py
NAME ...` (re)computes those entries only (a new algorithm's).
`tests/test_pinned.py` reruns the same and compares (`errors`, `TOLERANCE`).

Regenerate only for a change that is *meant* to change numbers, and say so in
the commit message: the file is what says "results reproduce" for
docs/results.md and docs/benchmarks.md.

The numbers must hold on any x86-64 CPU, not only the one that wrote them:
XLA:CPU's code differs between instruction sets (AVX-512, AVX2, ...), thread
counts and optimization levels, and so does the float rounding. `python
tests/pinned.py --spread [NAME ...]` measures that spread: it recomputes the
entries in one subprocess per code-generation setting (`SETTINGS`) and prints,
per entry, the largest `errors` against tests/data/pinned.json over the
settings (docs/testing.md, "Pinned numbers", has the table and the
tolerances it gave). `--dump FILE [NAME ...]` computes entries into FILE
without touching the pinned file (what `--spread` runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

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
  spec = partition.PartitionSpec(name="domain_split", num_clients=4, d=1,
                                 seed=1)
  return federated.build(ds, spec, target_domain=0, seed=1,
                         server_fraction=0.1)


def config():
  from fedjax_dg.run.config import base_config
  c = base_config()
  # 6 rounds of ~6 local steps need larger steps than the papers'.
  c.client.lr = 1e-2
  for name in ("fedprox", "fedgma", "fedsr", "pfedhn", "fedccrl", "fediir",
               "elcfs", "ccst", "fedadg"):
    c[name].client.lr = 1e-2
  c.ccst.depth = 1                # AdaIN up to relu1_1 on 8x8 images
  c.ccst.client.optimizer = "adam"  # its code's plain SGD barely moves here
  c.scaffold.client.lr = 0.1      # its plain SGD: near chance at 1e-2 here
  # Fish moves a meta_lr share of its inner steps' move: at the released
  # PACS value 0.1 its 36 steps here stay near chance (id 36 %).
  c.fish.meta_lr = 1.0
  # Adapters on a frozen random ViT: the released code's SGD (momentum 0.9),
  # at 1e-3 near chance for 6 rounds here, at 2e-2. Not Adam: its per-element
  # normalization turns the fusion MHSA's rounding-sized gradients into
  # lr-sized steps, so Adam's runs moved by 1e-2 (`errors`) between CPUs
  # where SGD's move by 1e-6 (docs/testing.md, "Pinned numbers").
  c.fedsdaf.client.lr = 2e-2
  c.hfedf.ema_warmup = 2          # the EMA acts from round 3
  c.hfedf.server_lr = 1e-2
  c.pfedhn.server_lr = 0.1
  # Fixed one-hot client embeddings (Table 6), not the all-ones ones of Alg. 1:
  # with all-ones embeddings the attention's gradients vanish in exact
  # arithmetic and AdamW rescales their rounding to lr-sized steps, so those
  # runs move by 2e-2 with the float summation order (optimizations off,
  # 2 devices: docs/faithfulness.md, "HyperGenFL"); one-hot ones by 2e-7.
  c.hypergenfl.embeddings = "onehot"
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


def leaf_sizes(tree) -> list[int]:
  """The element count of each non-empty leaf, in `digest`'s order."""
  return [int(np.size(leaf)) for leaf in jax.tree.leaves(tree) if np.size(leaf)]


def errors(got: dict, want: dict, fed) -> dict[str, float]:
  """How far `got` (a `summarize`) is from `want` (a pinned entry), per part,
  each on a scale where float rounding is small and a changed number is not:

  params      the digests' differences on each leaf's own scale: the sum's
              on n x rms, the sum of squares' on itself, the first value's on
              rms (n the leaf's size, rms from `want`'s sum of squares); a
              plain relative difference is ill-conditioned where a sum
              cancels to near 0 (0.2 on a sum of 64 numbers near 2e-4 while
              every element agreed to 1e-3)
  loss        relative, the per-round training loss
  train_loss  relative, the evaluated training loss
  flips       accuracies as examples: the largest change of an id / ood
              accuracy in units of one example of the evaluation it is a
              mean of (id: a client's id-validation split, averaged over
              clients; ood: the target split)
  """
  g = np.asarray(got["eval_params"], np.float64).reshape(-1, 3)
  w = np.asarray(want["eval_params"], np.float64).reshape(-1, 3)
  n = np.asarray(got["sizes"], np.float64)
  if g.shape != w.shape or len(n) != len(w):
    return dict(params=np.inf, loss=np.inf, train_loss=np.inf, flips=np.inf)
  sq = np.maximum(w[:, 1], 1e-30)
  scale = np.stack([np.sqrt(n * sq), sq, np.sqrt(sq / n)], axis=1)
  rel = lambda a, b: float(np.max(np.abs(np.subtract(a, b)) / np.abs(b),
                                  initial=0.0))
  hist = list(zip(got["history"], want["history"]))
  one = {"id_acc": 1.0 / (fed.num_clients * max(1, int(
             np.min(fed.packed_val.n[fed.packed_val.n > 0], initial=1)))),
         "ood_acc": 1.0 / max(1, len(fed.target_y))}
  return dict(
      params=float(np.max(np.abs(g - w) / scale, initial=0.0)),
      loss=rel(got["loss"], want["loss"]),
      train_loss=max((rel(a["train_loss"], b["train_loss"]) for a, b in hist
                      if "train_loss" in b), default=0.0),
      flips=max((abs(a[k] - b[k]) / one[k] for a, b in hist
                 for k in one if k in b), default=0.0))


# What `errors` may reach before test_pinned fails, per part. Measured
# (docs/testing.md, "Pinned numbers"): the largest over every entry and every
# emulated CPU was params 2.8e-5, loss 1.0e-5, train_loss 5.6e-6, 0 flips;
# these are 35x / 20x / 35x that (a changed key, step or default moves
# params by 1e-2 and more), and one flipped prediction, since an accuracy is
# a count and an example whose margin is at the rounding level flips.
TOLERANCE = dict(params=1e-3, loss=2e-4, train_loss=2e-4, flips=1.0)


def run(name: str, fed, cfg, variant: dict | None = None):
  """(Algorithm, engine.RunResult) of one pinned run."""
  from conftest import model_for  # pylint: disable=g-import-not-at-top
  from fedjax_dg import algorithms, engine
  from fedjax_dg.run import assemble
  if variant:
    cfg = cfg.copy_and_resolve_references()
    for key, value in variant.items():
      section, field = key.split(".")
      cfg[section][field] = value
  model = model_for(name, fed, vit=VIT)
  alg = assemble.algorithm(name, model, fed.num_clients, cfg, data=fed)
  return alg, engine.run(alg, fed, model, engine_config())


def summarize(alg, res) -> dict:
  """What is pinned of one run."""
  params = jax.device_get(alg.server.eval_params(res.server, res.clients))
  return dict(
      eval_params=digest(params),
      sizes=leaf_sizes(params),
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


# Code-generation settings that emulate other CPUs on this one (`--spread`):
# name -> (XLA_FLAGS, JAX_DISABLE_MOST_OPTIMIZATIONS, CPUs the process may use;
# None: all). `--xla_cpu_max_isa` caps the instruction set LLVM may use;
# one CPU gives XLA's thread pool one thread; two host devices shard the
# cohort where the engine's `auto` placement does.
SETTINGS = {
    "native": ("", "0", None),
    "AVX2": ("--xla_cpu_max_isa=AVX2", "0", None),
    "AVX": ("--xla_cpu_max_isa=AVX", "0", None),
    "SSE4_2": ("--xla_cpu_max_isa=SSE4_2", "0", None),
    "1 thread": ("", "0", {0}),
    # the default suite's code (tests/conftest.py)
    "no opt": ("--xla_cpu_use_fusion_emitters=false", "1", None),
    "2 devices": ("--xla_force_host_platform_device_count=2", "0", None),
}


def compute(names=None) -> dict:
  fed, cfg = federation(), config()
  out = {}
  for key in names or pinned_names():
    name, variant = VARIANTS.get(key, (key, None))
    out[key] = summarize(*run(name, fed, cfg, variant))
  return out


def spread(names=None) -> dict:
  """{setting: {entry: errors against the pinned file}}, each setting of
  `SETTINGS` computed in its own subprocess (`--dump`)."""
  with open(PATH) as f:
    want = json.load(f)
  fed = federation()
  out = {}
  with tempfile.TemporaryDirectory() as tmp:
    for setting, (flags, no_opt, cpus) in SETTINGS.items():
      dump = os.path.join(tmp, "dump.json")
      env = dict(os.environ, XLA_FLAGS=flags,
                 JAX_DISABLE_MOST_OPTIMIZATIONS=no_opt)
      subprocess.run([sys.executable, __file__, "--dump", dump,
                      *(names or [])], env=env, check=True,
                     preexec_fn=(lambda: os.sched_setaffinity(0, cpus))
                     if cpus else None)
      with open(dump) as f:
        got = json.load(f)
      out[setting] = {k: errors(got[k], want[k], fed) for k in got}
      print(f"{setting}: " + ", ".join(
          f"{part} {max(e[part] for e in out[setting].values()):.1e}"
          for part in TOLERANCE), flush=True)
  return out


def print_spread(result: dict):
  """Per entry, the largest error over the settings, and which setting."""
  keys = list(next(iter(result.values())))
  print(f"{'entry':28s}" + "".join(f"{p:>22s}" for p in TOLERANCE))
  for k in keys:
    cells = []
    for part in TOLERANCE:
      setting = max(result, key=lambda s: result[s][k][part])
      value = result[setting][k][part]
      cells.append(f"{value:9.1e} {setting[:11]:>11s} ")
    print(f"{k:28s}" + "".join(cells))


if __name__ == "__main__":
  # `python tests/pinned.py`: every name; `python tests/pinned.py NAME ...`:
  # (re)compute those entries only, keeping the others. `--dump FILE [NAME
  # ...]`, `--spread [NAME ...]`: the module docstring.
  jax.config.update("jax_default_matmul_precision", "highest")
  args = sys.argv[1:]
  if args[:1] == ["--spread"]:
    print_spread(spread(args[1:] or None))
    sys.exit(0)
  if args[:1] == ["--dump"]:
    with open(args[1], "w") as f:
      json.dump(compute(args[2:] or None), f)
    sys.exit(0)
  os.makedirs(os.path.dirname(PATH), exist_ok=True)
  names = args
  results = {}
  if names and os.path.exists(PATH):
    with open(PATH) as f:
      results = json.load(f)
  for key, entry in compute(names or None).items():
    entry.pop("sizes")  # derivable from the run: not pinned
    results[key] = entry
  with open(PATH, "w") as f:
    json.dump(results, f, indent=1)
  print(f"wrote {PATH}: {', '.join(names) or len(results)} algorithms")
