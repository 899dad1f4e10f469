"""What a FedCCRL round costs over a FedAvg round on the same clients, and
what the other Table 1 methods cost (not a test).

FedCCRL's local step trains on three views of each batch (the original, and
two CCDT + AugMix views, Eq. 15) and adds SupCon and JS terms; its clients
also compute style statistics for the pool (their end of round). The paper calls the
module's overhead negligible. This measures, side by side in one process, one
round of each variant on the same federation (same model, clients, batch,
epochs and optimizer: Adam lr 1e-3 with the cosine over the run), timed
round-robin so machine noise hits every variant alike:

  fedavg             plain cross-entropy, one view
  fedccrl            the full method (CCDT, per-image AugMix, L_RA, L_JS)
  fedccrl-views      ccdt=difp=False, lambda1=lambda2=0: CE on the batch
                     three times (the cost of the three passes alone)
  fedccrl-noaug      ccdt=difp=False: the three passes plus SupCon and JS
  fedccrl-noaugmix   difp=False: CCDT only (no AugMix)
  fedccrl-noccdt     ccdt=False: AugMix only
  fedccrl-nojs-ra    lambda1=lambda2=0: both augmentations, plain CE on 3 views
  fedccrl-batchmix   augmix_per_batch=True: one AugMix chain per batch (the
                     released code's reading)

and prints the median round time of each and its ratio to FedAvg's, then the
differences that isolate each part (views - fedavg: the passes; noaug -
views: the losses; noaugmix - noaug: CCDT; fedccrl - noaugmix: AugMix).
`--variants` also takes the other methods of the Table 1 run
(experiments/styled_fmnist_table1.py): fedprox, fedsr, fedadg, fediir,
feddg_ga, ccst (AdaIN to relu1_1 as in that run, random weights: the cost
of the trained ones; ccst-d2 to relu2_1) and elcfs.

    .venv/bin/python benchmarks/fedccrl_overhead.py                 # small CNN, 32 px
    .venv/bin/python benchmarks/fedccrl_overhead.py --size 28 --classes 10 \
        --per-client 1800 --batch 64 --epochs 1 --reps 3 --variants fedavg fedprox \
        fedsr fedadg fediir feddg_ga ccst elcfs fedccrl   # the Table 1 run's clients
    .venv/bin/python benchmarks/fedccrl_overhead.py --model mobilenet_v3_large \
        --size 64 --per-client 64 --reps 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from _worker import round_robin

NO_LOSSES = dict(lambda1=0.0, lambda2=0.0)
VARIANTS = {
    "fedavg": ("fedavg", {}),
    "fedccrl": ("fedccrl", {}),
    "fedccrl-views": ("fedccrl", dict(ccdt=False, difp=False, **NO_LOSSES)),
    "fedccrl-noaug": ("fedccrl", dict(ccdt=False, difp=False)),
    "fedccrl-noaugmix": ("fedccrl", dict(difp=False)),
    "fedccrl-noccdt": ("fedccrl", dict(ccdt=False)),
    "fedccrl-nojs-ra": ("fedccrl", NO_LOSSES),
    "fedccrl-batchmix": ("fedccrl", dict(augmix_per_batch=True)),
    # The other methods of FedCCRL's Table 1 (and ELCFS), their defaults.
    **{name: (name, {}) for name in ("fedprox", "fedsr", "fedadg", "fediir",
                                     "feddg_ga", "elcfs")},
    "ccst": ("ccst", dict(depth=1)),
    "ccst-d2": ("ccst", dict(depth=2)),
}
DEFAULT = ("fedavg", "fedccrl", "fedccrl-views", "fedccrl-noaug",
           "fedccrl-noaugmix", "fedccrl-noccdt", "fedccrl-nojs-ra",
           "fedccrl-batchmix")
# (part, variant with it, variant without it): the differences printed.
PARTS = (("3 passes (CE x3)", "fedccrl-views", "fedavg"),
         ("SupCon + JS", "fedccrl-noaug", "fedccrl-views"),
         ("CCDT", "fedccrl-noaugmix", "fedccrl-noaug"),
         ("AugMix (per image)", "fedccrl", "fedccrl-noaugmix"),
         ("AugMix, no CCDT", "fedccrl-noccdt", "fedccrl-noaug"),
         ("per-image vs per-batch AugMix", "fedccrl", "fedccrl-batchmix"))


def federation(clients: int, per_client: int, size: int, classes: int):
  """Random RGB images, one domain per client plus a held-out one."""
  from fedjax_dg.data import federated, partition
  from fedjax_dg.data.dataset import DomainDataset
  rng = np.random.default_rng(0)
  n = (clients + 1) * per_client
  ds = DomainDataset(
      name="bench", images=rng.integers(0, 256, (n, size, size, 3), np.uint8),
      labels=rng.integers(0, classes, n).astype(np.int32),
      domains=np.repeat(np.arange(clients + 1), per_client).astype(np.int32),
      domain_names=tuple(f"d{i}" for i in range(clients + 1)),
      class_names=tuple(f"c{i}" for i in range(classes)))
  spec = partition.PartitionSpec(name="domain_split", num_clients=clients,
                                 d=1, seed=0)
  return federated.build(ds, spec, target_domain=0, val_fraction=0.0)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default="small_cnn")
  p.add_argument("--size", type=int, default=32)
  p.add_argument("--clients", type=int, default=4)
  p.add_argument("--per-client", type=int, default=256)
  p.add_argument("--classes", type=int, default=7)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--epochs", type=int, default=1)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--variants", nargs="+", default=list(DEFAULT),
                 choices=list(VARIANTS))
  args = p.parse_args(argv)

  import warnings
  from fedjax_dg import algorithms, engine, models
  from fedjax_dg.engine.programs import programs
  from fedjax_dg.optim import make_optimizer, with_schedule
  warnings.filterwarnings("ignore", message="ccst: no AdaIN weights")
  fed = federation(args.clients, args.per_client, args.size, args.classes)
  model = models.get_model(args.model, input_shape=fed.image_shape,
                           num_classes=fed.num_classes, mean=fed.mean,
                           std=fed.std)
  rounds = 1000  # the cosine's horizon; only a few rounds run
  cfg = engine.EngineConfig(rounds=rounds, eval_every=1, epochs=args.epochs,
                            batch_size=args.batch, client_mapping="map",
                            progress=False)
  root = jax.random.key(0)
  runners = {}
  for name in args.variants:
    alg_name, hp = VARIANTS[name]
    opt = with_schedule(make_optimizer("adam", 1e-3), "cosine")
    alg = algorithms.create(alg_name, model, optimizer=opt,
                            hparams=hp, num_clients=fed.num_clients, data=fed)
    progs = programs(alg, model, cfg, fed.num_clients)
    train = progs.layout.put_clients(fed.train)
    carry = progs.init(jax.random.fold_in(root, 2**31 - 1))
    frozen = progs.frozen(root)  # CCST's AdaIN network (None for the others)
    state = {"carry": carry, "r": 0}

    def one_round(progs=progs, train=train, state=state, frozen=frozen):
      carry, metrics = progs.chunk(state["carry"], jnp.int32(state["r"]), train,
                                   root, frozen, 1, jnp.int32(cfg.rounds))
      jax.block_until_ready((carry, metrics))
      state["carry"], state["r"] = carry, state["r"] + 1

    t0 = time.perf_counter()
    one_round()  # compile + first round
    print(f"{name}: compiled and ran one round in {time.perf_counter() - t0:.1f} s",
          flush=True)
    runners[name] = one_round

  times = round_robin(runners, args.reps)

  base = statistics.median(times["fedavg"]) if "fedavg" in times else None
  steps = args.per_client // args.batch + bool(args.per_client % args.batch)
  print(f"\n{args.model} {args.size}x{args.size}x3, {args.clients} clients x "
        f"{args.per_client} examples, batch {args.batch}, {args.epochs} "
        f"epoch(s) ({steps * args.epochs} steps per client), medians of "
        f"{args.reps} rounds, "
        f"{platform.processor() or platform.machine()}, jax {jax.__version__}")
  print(f"{'variant':18s} {'median s':>9s} {'x fedavg':>9s}")
  out = {}
  for name, ts in times.items():
    med = statistics.median(ts)
    ratio = med / base if base else float("nan")
    out[name] = dict(median_s=med, ratio=ratio, times=ts)
    print(f"{name:18s} {med:9.3f} {ratio:9.2f}")
  meds = {name: out[name]["median_s"] for name in out}
  parts = [(part, a, b) for part, a, b in PARTS if a in meds and b in meds]
  if parts and base:
    print(f"\n{'part':30s} {'s/round':>8s} {'x fedavg':>9s}")
    for part, a, b in parts:
      d = meds[a] - meds[b]
      print(f"{part:30s} {d:8.3f} {d / base:9.2f}   ({a} - {b})")
  print("@@json " + json.dumps(dict(args=vars(args), results=out)))


if __name__ == "__main__":
  main()
