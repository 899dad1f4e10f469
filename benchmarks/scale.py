"""Large federations (not a test): round time and device memory against the
number of clients N at a fixed cohort, per placement (`train.placement`).

Every client holds the same number of examples (28x28x1 uint8, random: the
cost is the point), so a round does the same work at every N: a cohort of m
clients, E epochs each, FedAvg and Local-only (a model per client: the
largest per-client state). Each (algorithm, N, placement) is a real
`engine.run` with no id-validation and no target split (evaluation is then
empty and the run is training, the host's gathers and the state's trips).

  round time   seconds between successive chunk boundaries (`on_eval`)
               divided by the rounds per chunk; the first chunk (compiling)
               is left out; median over the chunks of every repetition,
               the repetitions interleaved over N. Wall time, and the
               process's CPU time (every thread: XLA's and the host's
               gathers), which other jobs on a shared machine disturb less
  device peak  live + temp:
               live = bytes of every live jax.Array (`jax.live_arrays()`)
               at each chunk boundary, less those alive before the run:
               the server and client state or the chunk's table, the
               chunk's cohorts and the next chunk's (host), the padded
               federation (device); the largest over the run
               temp = `memory_analysis().temp_size_in_bytes` of the
               compiled chunk program (XLA's buffers for the round's
               activations, gathers and scan copies)
               On CPU the "device" is host memory, so the process RSS
               cannot tell them apart; these two are what an accelerator
               would hold.

    .venv/bin/python benchmarks/scale.py                   # N = 100, 1000, 10000
    .venv/bin/python benchmarks/scale.py --clients 100 1000 --reps 2
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from _data import random_dataset


def federation(num_clients: int, per_client: int, seed: int = 0):
  """`num_clients` clients of `per_client` random 28x28x1 examples each."""
  from fedjax_dg.data import federated, partition
  ds = random_dataset(num_clients * per_client, (28, 28, 1), seed)
  spec = partition.PartitionSpec(name="iid", num_partitions=num_clients,
                                 seed=seed)
  return federated.build(ds, spec, target_domain=None, val_fraction=0.0,
                         seed=seed)


def _live_bytes() -> int:
  return sum(a.nbytes for a in jax.live_arrays())


def chunk_temp_bytes(alg, model, cfg, fed, placement: str) -> int:
  """temp_size_in_bytes of the compiled chunk program of this run."""
  from fedjax_dg import engine
  from fedjax_dg.data.federated import ClientArrays
  n = fed.num_clients
  progs = engine.programs(alg, model, cfg, n)
  key = jax.random.key(0)
  m = cfg.cohort_size or n
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)
  packed = fed.packed_train
  image = packed.x.shape[1:]
  if placement == "device":
    carry = jax.eval_shape(alg.init, key)
    train = ClientArrays(sds((n, packed.width) + image, jnp.uint8),
                         sds((n, packed.width), jnp.int32), sds((n,), jnp.int32))
  else:
    table = min(n, cfg.eval_every * m)
    carry = (jax.eval_shape(lambda k: alg.init(k)[0], key),
             jax.eval_shape(alg.init_rows, key, jnp.arange(table)))
    lm = (cfg.eval_every, m)
    train = engine.Cohort(sds(lm, jnp.int32), sds(lm, jnp.int32), ClientArrays(
        sds(lm + (packed.width,) + image, jnp.uint8),
        sds(lm + (packed.width,), jnp.int32), sds(lm, jnp.int32)))
  compiled = progs.chunk.lower(carry, jnp.int32(0), train, key, None,
                               cfg.eval_every).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)


def measure(alg, model, fed, cfg) -> dict:
  """One run: per-round seconds of its chunks after the first, peak live
  device bytes at the chunk boundaries."""
  from fedjax_dg import engine
  gc.collect()
  before = _live_bytes()
  stamps, cpu, live = [], [], []

  def on_eval(entry):
    del entry
    stamps.append(time.perf_counter())
    cpu.append(time.process_time())
    live.append(_live_bytes() - before)

  engine.run(alg, fed, model, cfg, on_eval=on_eval)
  return dict(round_s=(np.diff(stamps) / cfg.eval_every).tolist(),
              cpu_s=(np.diff(cpu) / cfg.eval_every).tolist(), live=max(live))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10000])
  p.add_argument("--cohort", type=int, default=100)
  p.add_argument("--per-client", type=int, default=64)
  p.add_argument("--hidden", type=int, default=16)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--epochs", type=int, default=2)
  p.add_argument("--rounds", type=int, default=10)
  p.add_argument("--eval-every", type=int, default=1)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--placements", nargs="+", default=["host", "device"],
                 choices=("host", "device"))
  p.add_argument("--algorithms", nargs="+", default=["fedavg", "local_only"],
                 choices=("fedavg", "local_only"))
  args = p.parse_args(argv)

  from fedjax_dg import engine, models
  from fedjax_dg.algorithms.fedavg import fedavg
  from fedjax_dg.algorithms.local_only import local_only
  from fedjax_dg.client import objectives
  from fedjax_dg.optim import make_optimizer
  feds = {n: federation(n, args.per_client) for n in args.clients}
  any_fed = feds[args.clients[0]]
  model = models.get_model("mlp", input_shape=any_fed.image_shape,
                           num_classes=10, mean=any_fed.mean, std=any_fed.std,
                           hidden=args.hidden)
  loss, opt = objectives.cross_entropy(model), make_optimizer("sgd", 1e-2)
  build = dict(fedavg=lambda n: fedavg(model, opt, loss),
               local_only=lambda n: local_only(model, opt, loss, num_clients=n))
  base = engine.EngineConfig(rounds=args.rounds, eval_every=args.eval_every,
                             epochs=args.epochs, batch_size=args.batch,
                             cohort_size=args.cohort, client_mapping="map",
                             progress=False)
  cases = {(a, n, pl): (build[a](n), dataclasses.replace(base, placement=pl))
           for a in args.algorithms for n in args.clients
           for pl in args.placements}
  rows = {key: dict(round_s=[], cpu_s=[], live=0) for key in cases}
  for key, (alg, cfg) in cases.items():  # compile every program first
    rows[key]["temp"] = chunk_temp_bytes(alg, model, cfg, feds[key[1]], key[2])
    measure(alg, model, feds[key[1]], dataclasses.replace(cfg, rounds=2))
  order = list(cases)
  for rep in range(args.reps):  # rotated, so noise hits every case alike
    for key in order[rep % len(order):] + order[:rep % len(order)]:
      alg, cfg = cases[key]
      got = measure(alg, model, feds[key[1]], cfg)
      rows[key]["round_s"] += got["round_s"]
      rows[key]["cpu_s"] += got["cpu_s"]
      rows[key]["live"] = max(rows[key]["live"], got["live"])
      print(".", end="", flush=True)
  print(f"\ncohort {args.cohort}, {args.per_client} examples per client "
        f"(28x28x1), MLP hidden {args.hidden}, batch {args.batch}, "
        f"{args.epochs} epoch(s), "
        f"{args.eval_every} round(s) per chunk, {args.rounds} rounds x "
        f"{args.reps} reps (median of the chunks after the first); "
        f"{platform.processor() or platform.machine()}, "
        f"{jax.device_count()} {jax.default_backend()} device(s), "
        f"jax {jax.__version__}")
  mib = lambda b: b / 2**20
  print(f"{'algorithm':10s} {'placement':9s} {'N':>6s} {'round ms':>9s} "
        f"{'vs N0':>6s} {'cpu ms':>7s} {'vs N0':>6s} {'live MiB':>9s} "
        f"{'temp MiB':>9s} {'peak MiB':>9s} {'vs N0':>6s}")
  for a in args.algorithms:
    for pl in args.placements:
      first = rows[(a, args.clients[0], pl)]
      t0, c0 = (statistics.median(first[k]) for k in ("round_s", "cpu_s"))
      peak0 = first["live"] + first["temp"]
      for n in args.clients:
        r = rows[(a, n, pl)]
        t, c = (statistics.median(r[k]) for k in ("round_s", "cpu_s"))
        peak = r["live"] + r["temp"]
        print(f"{a:10s} {pl:9s} {n:6d} {1e3 * t:9.1f} {t / t0:6.2f} "
              f"{1e3 * c:7.1f} {c / c0:6.2f} {mib(r['live']):9.1f} "
              f"{mib(r['temp']):9.1f} {mib(peak):9.1f} {peak / peak0:6.2f}")
  print("@@json " + json.dumps(dict(
      args=vars(args), rows={"/".join(map(str, k)): v for k, v in rows.items()})))


if __name__ == "__main__":
  main()
