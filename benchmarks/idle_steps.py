"""Idle local steps (not a test): a round on a skewed partition with the idle
steps skipped, computed-and-masked, and an oracle that runs each client's own
number of steps.

Every client scans E * ceil(N_max / B) steps; client i needs E * ceil(n_i / B).
On the HyperGenFL scenarios' Dirichlet label skew (beta 0.1 "extreme", 0.25
"advanced", 100 clients, a cohort of 20) most steps are idle. Variants, timed
round-robin in one process on the same cohort (FedAvg, the CIFAR CNN, SGD):

  masked   `train.skip_idle_steps=False`: every step computed, idle ones
           discarded (`jnp.where`)
  skipped  the default: clients mapped one at a time by `lax.map`, an idle
           step a `lax.cond` branch that computes nothing
  oracle   a Python loop over the cohort, each client's jitted update on its
           own rows padded to a multiple of B (its own step count; compiled
           per size before timing)

and the share of the steps computed that are real. Both engine variants give
the same parameters (checked here too).

    .venv/bin/python benchmarks/idle_steps.py --scenario extreme
    .venv/bin/python benchmarks/idle_steps.py --scenario advanced --images 12000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from _data import random_dataset
from _worker import round_robin


def federation(scenario: str, images: int, seed: int):
  """Label-skewed Fashion-MNIST-like data: random 32x32x3 images whose labels
  follow the real class counts (the partition is what matters here)."""
  from fedjax_dg import presets
  from fedjax_dg.data import federated, partition
  s = presets.SCENARIOS[scenario]
  ds = random_dataset(images, (32, 32, 3), seed)
  spec = partition.PartitionSpec(name="dirichlet",
                                 num_partitions=s["num_clients"],
                                 alpha=s["beta"], min_partition_size=2,
                                 seed=seed)
  return federated.build(ds, spec, target_domain=None, val_fraction=0.0,
                         seed=seed), s["cohort_size"]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--scenario", default="extreme",
                 choices=("standard", "advanced", "extreme"))
  p.add_argument("--images", type=int, default=12000)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--epochs", type=int, default=1)
  p.add_argument("--reps", type=int, default=3)
  args = p.parse_args(argv)

  from fedjax_dg import engine, models
  from fedjax_dg.algorithms.fedavg import fedavg
  from fedjax_dg.client import objectives
  from fedjax_dg.client.update import local_update
  from fedjax_dg.optim import make_optimizer
  fed, cohort = federation(args.scenario, args.images, 0)
  model = models.get_model("cifar_cnn", input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean,
                           std=fed.std)
  loss = objectives.cross_entropy(model)
  opt = make_optimizer("sgd", 1e-2)
  alg = fedavg(model, opt, loss)
  key = jax.random.key(0)
  base = engine.EngineConfig(rounds=10, epochs=args.epochs,
                             batch_size=args.batch, cohort_size=cohort,
                             client_mapping="map", progress=False)
  runners, finals = {}, {}
  for name, skip in (("masked", False), ("skipped", True)):
    cfg = dataclasses.replace(base, skip_idle_steps=skip)
    progs = engine.programs(alg, model, cfg, fed.num_clients)
    train = progs.layout.put_clients(fed.train)
    carry0 = progs.init(key)

    def one_round(progs=progs, train=train, carry0=carry0, name=name):
      carry, metrics = progs.chunk(jax.tree.map(jnp.copy, carry0),
                                   jnp.int32(0), train, key, None, 1)
      jax.block_until_ready(carry)
      finals[name] = (carry, np.asarray(metrics["cohort"])[0])

    runners[name] = one_round

  # The oracle: the cohort round 0 draws, each client alone at its own size.
  runners["masked"]()
  ids = finals["masked"][1]
  n = np.asarray(fed.train.n)
  update = jax.jit(lambda p, x, y, c, k: local_update(
      loss, opt, p, x, y, c, k, None, batch_size=args.batch,
      epochs=args.epochs), donate_argnums=())
  params = model.init(key)

  def oracle():
    out = []
    for i in ids:
      rows = -(-int(n[i]) // args.batch) * args.batch
      x = fed.train.x[i, :rows]
      y = fed.train.y[i, :rows]
      out.append(update(params, x, y, jnp.int32(n[i]),
                        jax.random.fold_in(key, int(i))))
    jax.block_until_ready(out)

  runners["oracle"] = oracle
  for name, fn in runners.items():
    t0 = time.perf_counter()
    fn()
    print(f"{name}: first round (with compiling) "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
  same = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(finals["masked"][0]),
      jax.tree.leaves(finals["skipped"][0])))
  times = round_robin(runners, args.reps)
  steps_max = args.epochs * -(-int(n.max()) // args.batch)
  real = sum(args.epochs * -(-int(n[i]) // args.batch) for i in ids)
  print(f"\n{args.scenario}: {fed.num_clients} clients, cohort {cohort}, "
        f"{args.images} images, cifar_cnn 32x32x3, batch {args.batch}, "
        f"{args.epochs} epoch(s); real steps {real} of {steps_max * len(ids)} "
        f"computed when masked ({real / (steps_max * len(ids)):.0%}); "
        f"masked vs skipped parameters differ by {same:.1e}; medians of "
        f"{args.reps}, {platform.processor() or platform.machine()}, "
        f"jax {jax.__version__}")
  med = {k: statistics.median(v) for k, v in times.items()}
  for name in order:
    print(f"{name:8s} {med[name]:8.3f} s   masked / this {med['masked'] / med[name]:5.2f}"
          f"   this / oracle {med[name] / med['oracle']:5.2f}")
  print("@@json " + json.dumps(dict(args=vars(args), times=times,
                                    real_share=real / (steps_max * len(ids)),
                                    max_param_diff=same)))


if __name__ == "__main__":
  main()
