"""Idle local steps (not a test): a round on a skewed partition, its idle
steps computed-and-masked against each client costing its own steps, and an
oracle that runs each client's own number of steps.

Every client of the masked scan runs E * ceil(N_max / B) steps; client i
needs E * ceil(n_i / B). On the HyperGenFL scenarios' Dirichlet label skew
(beta 0.1 "extreme", 0.25 "advanced", 100 clients, a cohort of 20) most
steps are idle. Variants, timed round-robin in one process on the same
cohort (FedAvg, SGD, the CIFAR CNN or `--model`):

  map_masked   `lax.map`, `train.skip_idle_steps=False`: every step computed,
               idle ones discarded (`jnp.where`)
  map          the CPU default: one loop of its own steps per client
  vmap_masked  `vmap` (the accelerator path), skip_idle_steps=False
  vmap_lanes   `vmap` with the cohort packed into `train.vmap_lanes` lanes
               (`--lanes`, 0: what `engine.layout.resolve_lanes` picks)
  oracle       a Python loop over the cohort, each client's jitted update on
               its own rows padded to a multiple of B (its own step count;
               compiled per size before timing)

with wall-clock and process CPU seconds (the machine is shared), the share
of the computed steps that are real, and the largest parameter difference
to the first variant (the same numbers). `--plan` prints, without training,
the client-steps and loop iterations of size buckets against lanes.

    .venv/bin/python benchmarks/idle_steps.py --scenario extreme
    .venv/bin/python benchmarks/idle_steps.py --scenario advanced --images 60000
    .venv/bin/python benchmarks/idle_steps.py --model mlp --variants vmap_masked,vmap_lanes
    .venv/bin/python benchmarks/idle_steps.py --plan --scenario advanced
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
  from fedjax_dg.run import presets
  from fedjax_dg.data import federated, partition
  s = presets.SCENARIOS[scenario]
  ds = random_dataset(images, (32, 32, 3), seed)
  spec = partition.PartitionSpec(name="dirichlet",
                                 num_clients=s["num_clients"],
                                 alpha=s["beta"], min_partition_size=2,
                                 seed=seed)
  return federated.build(ds, spec, target_domain=None, val_fraction=0.0,
                         seed=seed), s["cohort_size"]


def plan(args, rounds: int = 20):
  """Computed / real client-steps of one round, medians over the cohorts of
  `rounds` rounds: masked (every client the federation's largest count),
  K equal size buckets of the cohort sorted by steps (each runs its largest
  count), W lanes packed longest first (`client.lanes.schedule`)."""
  from fedjax_dg.client.lanes import schedule
  from fedjax_dg.client.update import local_steps
  fed, m = federation(args.scenario, args.images, 0)
  n = np.asarray(fed.train.n)
  work = np.asarray(local_steps(n, args.batch, args.epochs))
  ratios = {}
  for r in range(rounds):  # the engine's cohorts (round key's first split)
    cohort_key = jax.random.split(jax.random.fold_in(jax.random.key(0), r),
                                  3)[0]
    ids = np.asarray(jax.random.choice(cohort_key, len(n), (m,),
                                       replace=False))
    w = np.sort(work[ids])
    real, top = w.sum(), w[-1]
    add = lambda name, width, loop: ratios.setdefault(name, []).append(
        (width * loop / real, loop / top))
    add("masked", m, work.max())
    for k in (1, 2, 4, 5, 10):
      b = m // k
      maxima = [w[(i + 1) * b - 1] for i in range(k)]
      ratios.setdefault(f"K={k} buckets", []).append(
          (b * sum(maxima) / real, sum(maxima) / top))
    for lanes in (2, 4, 5, 10, m):
      add(f"W={lanes} lanes", lanes,
          int(np.max(schedule(jnp.asarray(w), lanes)[2])))
  print(f"{args.scenario}, {args.images} images, cohort {m}, batch "
        f"{args.batch}, {args.epochs} epoch(s); medians over {rounds} "
        "cohorts of: client-steps computed per real one, loop iterations "
        "per step of the cohort's largest client")
  for k, v in ratios.items():
    print(f"  {k:14s} {statistics.median([a for a, _ in v]):5.2f} "
          f"{statistics.median([b for _, b in v]):5.2f}")


ENGINE = {  # name: (client_mapping, skip_idle_steps)
    "map_masked": ("map", False),
    "map": ("map", True),
    "vmap_masked": ("vmap", False),
    "vmap_lanes": ("vmap", True),
}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--scenario", default="extreme",
                 choices=("standard", "advanced", "extreme"))
  p.add_argument("--images", type=int, default=12000)
  p.add_argument("--model", default="cifar_cnn",
                 choices=("cifar_cnn", "small_cnn", "mlp"))
  p.add_argument("--variants", default=",".join(ENGINE),
                 help="engine variants to time beside the oracle, of "
                 + ", ".join(ENGINE))
  p.add_argument("--lanes", type=int, default=0,
                 help="train.vmap_lanes (0: auto, engine.layout.resolve_lanes)")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--epochs", type=int, default=1)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--plan", action="store_true",
                 help="no training: the client-steps each design computes "
                 "per real one (size buckets vs lanes) over 20 cohorts")
  args = p.parse_args(argv)
  if args.plan:
    return plan(args)
  variants = args.variants.split(",")
  unknown = set(variants) - set(ENGINE)
  if unknown:
    p.error(f"unknown variants {sorted(unknown)}: allowed {list(ENGINE)}")

  from fedjax_dg import engine, models
  from fedjax_dg.algorithms.fedavg import fedavg
  from fedjax_dg.client import objectives
  from fedjax_dg.client.lanes import schedule
  from fedjax_dg.client.update import local_steps, local_update
  from fedjax_dg.engine.layout import resolve_lanes
  from fedjax_dg.engine.programs import programs
  from fedjax_dg.optim import make_optimizer
  t_setup = time.perf_counter()
  fed, cohort = federation(args.scenario, args.images, 0)
  model = models.get_model(args.model, input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean,
                           std=fed.std)
  loss = objectives.cross_entropy(model)
  opt = make_optimizer("sgd", 1e-2)
  alg = fedavg(model, opt, loss)
  key = jax.random.key(0)
  base = engine.EngineConfig(rounds=10, epochs=args.epochs,
                             batch_size=args.batch, cohort_size=cohort,
                             vmap_lanes=args.lanes, progress=False)
  base = resolve_lanes(  # the lanes "vmap" resolves to
      dataclasses.replace(base, client_mapping="vmap"), alg, fed.train.n)
  runners, finals = {}, {}
  for name in variants:
    mapping, skip = ENGINE[name]
    cfg = dataclasses.replace(base, client_mapping=mapping,
                              skip_idle_steps=skip)
    progs = programs(alg, model, cfg, fed.num_clients)
    train = progs.layout.put_clients(fed.train)
    carry0 = progs.init(key)

    def one_round(progs=progs, train=train, carry0=carry0, name=name):
      carry, metrics = progs.chunk(jax.tree.map(jnp.copy, carry0),
                                   jnp.int32(0), train, key, None, 1,
                                   jnp.int32(cfg.rounds))
      jax.block_until_ready(carry)
      finals[name] = (carry, np.asarray(metrics["cohort"])[0])

    runners[name] = one_round

  # The oracle: the cohort round 0 draws, each client alone at its own size.
  first = variants[0]
  runners[first]()
  ids = finals[first][1]
  n = np.asarray(fed.train.n)
  update = jax.jit(lambda p, x, y, c, k: local_update(
      loss, opt, p, x, y, c, k, None, batch_size=args.batch,
      epochs=args.epochs))
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
  work = np.asarray(local_steps(n[ids], args.batch, args.epochs))
  real = int(work.sum())
  lanes = base.vmap_lanes
  lane_steps = int(np.max(schedule(jnp.asarray(work), lanes)[2]))
  if any(v.startswith("vmap") for v in variants):
    # The accelerator path's oracle: the cohort's real client-steps as
    # `lanes` equal clients vmapped in lockstep (no idle step), each
    # ceil(real / lanes) steps on rows of a cohort client.
    rows = -(-real // lanes) * args.batch // args.epochs
    pick = np.resize(ids, lanes)
    xs, ys = fed.train.x[pick, :rows], fed.train.y[pick, :rows]
    if xs.shape[1] < rows:  # fewer padded rows than that: repeat them
      xs, ys = (np.resize(a.swapaxes(0, 1), (rows,) + a.swapaxes(0, 1).shape[1:]
                          ).swapaxes(0, 1) for a in (xs, ys))
    lockstep = jax.jit(jax.vmap(lambda x, y, k: local_update(
        loss, opt, params, x, y, jnp.int32(rows), k, None,
        batch_size=args.batch, epochs=args.epochs)))
    lane_keys = jax.random.split(key, lanes)
    runners["vmap_oracle"] = lambda: jax.block_until_ready(
        lockstep(xs, ys, lane_keys))
  for name, fn in runners.items():
    t0 = time.perf_counter()
    fn()
    print(f"{name}: first round (with compiling) "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
  setup_s = time.perf_counter() - t_setup
  diff = {name: max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
      jax.tree.leaves(finals[first][0]), jax.tree.leaves(finals[name][0])))
          for name in variants}
  cpu = {name: [] for name in runners}  # process CPU seconds (all threads)

  def cpu_timed(name, fn):
    def run():
      t0 = time.process_time()
      fn()
      cpu[name].append(time.process_time() - t0)
    return run

  times = round_robin({k: cpu_timed(k, f) for k, f in runners.items()},
                      args.reps)
  steps_max = args.epochs * -(-int(n.max()) // args.batch)
  print(f"\n{args.scenario}: {fed.num_clients} clients, cohort {cohort}, "
        f"{args.images} images, {args.model} 32x32x3, batch {args.batch}, "
        f"{args.epochs} epoch(s); client-steps: real {real}, masked "
        f"{steps_max * len(ids)} ({real / (steps_max * len(ids)):.0%} real), "
        f"cohort's largest {int(work.max())} steps, vmap_lanes {lanes}: "
        f"{lanes} x {lane_steps} = {lanes * lane_steps} "
        f"({real / (lanes * lane_steps):.0%} real); parameters against "
        f"{first}: " + ", ".join(f"{k} {v:.1e}" for k, v in diff.items())
        + f"; medians of {args.reps}, {platform.processor() or platform.machine()}"
        f", {jax.devices()[0].device_kind}, jax {jax.__version__}; setup and "
        f"first rounds {setup_s:.0f} s")
  for clock, data in (("wall", times), ("cpu", cpu)):
    med = {k: statistics.median(v) for k, v in data.items()}
    print(f"{clock} clock: median s (min-max); its masked / this; this / "
          "oracle; this / vmap_oracle")
    for name in runners:
      masked = med.get(f"{name.split('_')[0]}_masked")
      vs = f"{masked / med[name]:5.2f}" if masked else "    -"
      vo = (f"{med[name] / med['vmap_oracle']:5.2f}" if "vmap_oracle" in med
            else "    -")
      print(f"  {name:12s} {med[name]:8.3f} ({min(data[name]):.3f}-"
            f"{max(data[name]):.3f})   {vs}   {med[name] / med['oracle']:5.2f}"
            f"   {vo}")
  print("@@json " + json.dumps(dict(
      args=vars(args), times=times, cpu=cpu, real=real,
      masked=steps_max * len(ids),
      lanes=lanes, lane_steps=lane_steps, max_param_diff=diff)))


if __name__ == "__main__":
  main()
