"""Large federations (not a test): round time, device and host memory
against the number of clients N at a fixed cohort, per placement
(`train.placement`); and (`--flower`) the same FedAvg workload as a Flower
simulation.

Three federations (`--data`) of 28x28x1 uint8 images, a cohort of m clients
per round, FedAvg and Local-only (a model per client: the largest per-client
state):

  random     every client holds `--per-client` random examples, `--epochs`
             epochs: a round does the same work at every N; with `--total T`
             each of the N clients holds T / N of them instead, so that
             (with `--cohort 0`, every client every round) a round trains
             the same examples at every N, in more or fewer clients
  fmnist     Dir(`--fmnist-alpha`) label skew of the 60,000 Fashion-MNIST
             training images (`fedjax-dg prepare fashion_mnist`), at least
             one example per client (alpha 0.5 cannot give 10,000 non-empty
             clients: 6 images each on average); as many local steps as a
             random client
  synthetic  `--synthetic-total` (1 M) random examples over N clients, log-normal
             sizes (`_data.synthetic_federation`: one packed array shared by
             every N, per-client offsets); every client takes as many local
             steps as a random one (same compute per round), but the cohort
             holds 1 M / N examples each; host placement only ("device"
             would hold the padded [N, N_max] view)

`--host-gather clients rows` runs every host case both ways
(`train.host_gather`: each cohort member's whole client, padded to the
largest, or only the rows its local steps read; fmnist and synthetic take
fixed local steps, so "auto" picks the rows where they are fewer) and adds
the ratio of each to the first. `--shuffle sort feistel` runs every case
with each `train.shuffle` (each pass's order by sorted uniform draws over
the largest client, or a Feistel permutation evaluated at the positions
the steps read) and adds the ratio of each to the first ("vs s0").

Each (data, algorithm, N, placement, gather) is a real `engine.run` with no
id-validation and no target split (evaluation is then empty and the run is
training, the host's gathers and the state's trips).

  round time   seconds between successive chunk boundaries (`on_eval`)
               divided by the rounds per chunk; the first chunk (compiling)
               is left out; median over the chunks of every repetition,
               the repetitions interleaved over the cases. Wall time, and the
               process's CPU time (every thread: XLA's and the host's
               gathers), which other processes on the machine disturb less
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
  host         held + run peak: held = the packed examples (and, "device",
               the padded view it places); run peak = the most bytes numpy
               and Python allocated during a 2-round run (`tracemalloc`, in
               an untimed run): the gathered cohorts, the state rows kept on
               the host (Local-only). XLA's own buffers are not in it.

    .venv/bin/python benchmarks/scale.py                   # N = 100, 1000, 10000
    .venv/bin/python benchmarks/scale.py --quick           # smoke run, < 1 min
    .venv/bin/python benchmarks/scale.py --data synthetic --reps 3 --rounds 6
    .venv/bin/python benchmarks/scale.py --data synthetic --algorithms fedavg \
        --host-gather clients rows --reps 3 --rounds 4
    .venv/bin/python benchmarks/scale.py --flower --clients 1000 --rounds 4 \
        --reps 2                                           # after `make bench`
    .venv/bin/python benchmarks/scale.py --data random --total 24000 \
        --clients 20 200 --cohort 0 --placements device --algorithms fedavg \
        --batch 32 --epochs 1 --hidden 64 --reps 5 --rounds 4
                                        # the same 24,000 examples, 20 or 200
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import itertools
import json
import os
import platform
import statistics
import time
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np

from _data import random_dataset, synthetic_federation
from _worker import run_worker

SIDES = ("engine", "flower")


def federation(num_clients: int, per_client: int, seed: int = 0):
  """`num_clients` clients of `per_client` random 28x28x1 examples each."""
  from fedjax_dg.data import federated, partition
  ds = random_dataset(num_clients * per_client, (28, 28, 1), seed)
  spec = partition.PartitionSpec(name="iid", num_clients=num_clients,
                                 seed=seed)
  return federated.build(ds, spec, target_domain=None, val_fraction=0.0,
                         seed=seed)


@functools.lru_cache(maxsize=1)
def fmnist_train():
  """The 60,000 Fashion-MNIST training images as one domain (`fedjax-dg
  prepare fashion_mnist`'s data)."""
  from fedjax_dg.data import sources
  ds = sources.load("fashion_mnist")
  keep = ds.domains == ds.domain_names.index("train")
  return dataclasses.replace(
      ds, images=ds.images[keep], labels=ds.labels[keep],
      domains=np.zeros(int(keep.sum()), np.int32), domain_names=("train",))


def fmnist_federation(num_clients: int, alpha: float, seed: int = 0):
  """Dir(`alpha`) label skew of the Fashion-MNIST training images over
  `num_clients` clients, each with at least one example."""
  from fedjax_dg.data import federated, partition
  spec = partition.PartitionSpec(name="dirichlet", num_clients=num_clients,
                                 alpha=alpha, min_partition_size=1, seed=seed)
  return federated.build(fmnist_train(), spec, target_domain=None,
                         val_fraction=0.0, seed=seed)


def _live_bytes() -> int:
  return sum(a.nbytes for a in jax.live_arrays())


def chunk_temp_bytes(alg, model, cfg, fed, placement: str) -> int:
  """temp_size_in_bytes of the compiled chunk program of this run."""
  from fedjax_dg.data.federated import ClientArrays
  from fedjax_dg.engine.placement import resolve_gather
  from fedjax_dg.engine.programs import programs
  from fedjax_dg.engine.round import Cohort
  n = fed.num_clients
  cfg = resolve_gather(cfg, alg, placement, fed.packed_train.width)
  progs = programs(alg, model, cfg, n)
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
             jax.eval_shape(alg.initial_rows, key, jnp.arange(table)))
    lm = (cfg.eval_every, m)
    width = (cfg.local_steps * cfg.batch_size if cfg.host_gather == "rows"
             else packed.width)
    train = Cohort(sds(lm, jnp.int32), sds(lm, jnp.int32), ClientArrays(
        sds(lm + (width,) + image, jnp.uint8),
        sds(lm + (width,), jnp.int32), sds(lm, jnp.int32)))
  compiled = progs.chunk.lower(carry, jnp.int32(0), train, key, None,
                               cfg.eval_every, jnp.int32(cfg.rounds)).compile()
  return int(compiled.memory_analysis().temp_size_in_bytes)


def measure(alg, model, fed, cfg, trace_host: bool = False) -> dict:
  """One run: per-round seconds of its chunks after the first, peak live
  device bytes at the chunk boundaries; with `trace_host`, the peak bytes
  the run allocated on the host (numpy and Python, `tracemalloc`: slow, so
  not in a timed run)."""
  from fedjax_dg import engine
  gc.collect()
  before = _live_bytes()
  if trace_host:
    tracemalloc.start()
  stamps, cpu, live = [], [], []

  def on_eval(entry):
    del entry
    stamps.append(time.perf_counter())
    cpu.append(time.process_time())
    live.append(_live_bytes() - before)

  engine.run(alg, fed, model, cfg, on_eval=on_eval)
  host = tracemalloc.get_traced_memory()[1] if trace_host else 0
  tracemalloc.stop()
  return dict(round_s=(np.diff(stamps) / cfg.eval_every).tolist(),
              cpu_s=(np.diff(cpu) / cfg.eval_every).tolist(), live=max(live),
              host=host)


def quick(args) -> None:
  """--quick: a smoke run (< 1 min): N = 10, 100; a 20,000-example synthetic
  federation; one repetition of 3 rounds."""
  args.clients, args.rounds, args.reps = [10, 100], 3, 1
  args.cohort, args.synthetic_total = 10, 20_000


def placements(args, data: str) -> list[tuple[str, str]]:
  """(placement, host_gather) pairs: every --host-gather on the host, "auto"
  (nothing gathered) on the device. The synthetic federation runs on the
  host only: "device" would hold its padded [N, N_max] view (1.2-2.4 GiB at
  1 M examples) on the host and the device."""
  return [(pl, g) for pl in args.placements
          if data != "synthetic" or pl == "host"
          for g in (args.host_gather if pl == "host" else ["auto"])]


def per_client(args, n: int) -> int:
  """A random client's examples at N = n: `--per-client`, or `--total` / n."""
  if not args.total:
    return args.per_client
  if args.total % n:
    raise SystemExit(f"--total {args.total} is not a multiple of N = {n}")
  return args.total // n


def feds_for(args) -> dict:
  """{(data, N): FederatedData} and the local steps of each data kind."""
  feds = {}
  for n in args.clients:
    if "random" in args.data:
      feds[("random", n)] = federation(n, per_client(args, n))
    if "fmnist" in args.data:
      feds[("fmnist", n)] = fmnist_federation(n, args.fmnist_alpha)
    if "synthetic" in args.data:
      feds[("synthetic", n)] = synthetic_federation(
          n, args.synthetic_total, skew=args.synthetic_skew)
  return feds


def flower_env(flwr_dir: str) -> dict:
  """The Flower worker's environment: Flower's folder first on PYTHONPATH,
  then benchmarks/ (Ray's actors import `_flower`) and the repository."""
  here = os.path.dirname(os.path.abspath(__file__))
  path = [os.path.abspath(flwr_dir), here, os.path.dirname(here)]
  old = os.environ.get("PYTHONPATH")
  return dict(os.environ, PYTHONPATH=os.pathsep.join(path + ([old] if old
                                                             else [])))


def compare_flower(args) -> None:
  """FedAvg on the same federation, the engine against a Flower simulation:
  each side in its own process, alternating, `reps` times; round 1 (compiling,
  Ray's start) left out of the medians."""
  if not os.path.isdir(os.path.join(args.flwr_dir, "flwr")):
    raise SystemExit(f"no Flower in {args.flwr_dir!r}: run `make bench` (it "
                     "installs flwr[simulation]==1.42.0 there), or pass "
                     "--flwr-dir")
  n = args.clients[-1]
  spec = dict(clients=n, cohort=args.cohort, per_client=args.per_client,
              epochs=args.epochs, batch=args.batch, rounds=args.rounds,
              seed=0, cores=len(os.sched_getaffinity(0)))
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        "_flower.py")
  env = flower_env(args.flwr_dir)
  got = {side: dict(round_s=[], total_s=[], rss=0) for side in SIDES}
  for rep in range(args.reps):
    for side in SIDES if rep % 2 == 0 else SIDES[::-1]:
      row, why = run_worker(script, dict(spec, side=side), env)
      if row is None:
        raise SystemExit(f"{side} worker {why}")
      got[side]["round_s"] += row["round_s"][1:]
      got[side]["total_s"].append(row["total_s"])
      got[side]["rss"] = max(got[side]["rss"], row["rss"])
      print(".", end="", flush=True)
  print(f"\nFedAvg, N = {n:,} clients of {args.per_client} random 28x28x1 "
        f"images, cohort {args.cohort}, small_cnn, {args.epochs} epoch(s) of "
        f"batch {args.batch}, SGD; {args.rounds} rounds x {args.reps} reps "
        f"per side (round 1 left out); {spec['cores']} cores")
  eng = statistics.median(got["engine"]["round_s"])
  print(f"{'side':7s} {'round s (median)':>17s} {'min':>6s} {'max':>6s} "
        f"{'run s (median)':>15s} {'driver RSS MiB':>15s} {'x engine':>9s}")
  for side in SIDES:
    g = got[side]
    med = statistics.median(g["round_s"])
    print(f"{side:7s} {med:17.2f} {min(g['round_s']):6.2f} "
          f"{max(g['round_s']):6.2f} {statistics.median(g['total_s']):15.1f} "
          f"{g['rss'] / 2**20:15.0f} {med / eng:9.2f}")
  print("@@json " + json.dumps(dict(args=vars(args), sides=got)))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10000])
  p.add_argument("--cohort", type=int, default=100)
  p.add_argument("--data", nargs="+", default=["random", "synthetic"],
                 choices=("random", "fmnist", "synthetic"),
                 help="random: --per-client examples per client; fmnist: "
                 "Dir(--fmnist-alpha) label skew of the 60,000 Fashion-MNIST "
                 "training images; synthetic: --synthetic-total examples over "
                 "N clients (log-normal sizes); fmnist and synthetic clients "
                 "take as many local steps as a random client")
  p.add_argument("--fmnist-alpha", type=float, default=0.5)
  p.add_argument("--per-client", type=int, default=64)
  p.add_argument("--total", type=int, default=0,
                 help="random data: this many examples over the N clients "
                 "(N divides it) instead of --per-client each")
  p.add_argument("--synthetic-total", type=int, default=1_000_000)
  p.add_argument("--synthetic-skew", type=float, default=0.3)
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
  p.add_argument("--host-gather", nargs="+", default=["auto"],
                 choices=("auto", "clients", "rows"),
                 help="train.host_gather of the host cases; several: each "
                 "case run with each, side by side")
  p.add_argument("--shuffle", nargs="+", default=["sort"],
                 choices=("sort", "feistel"),
                 help="train.shuffle; several: each case run with each, side "
                 "by side")
  p.add_argument("--quick", action="store_true", help=quick.__doc__)
  p.add_argument("--flower", action="store_true",
                 help="instead: FedAvg with the small CNN, the engine against "
                 "a Flower simulation, at the last --clients")
  p.add_argument("--flwr-dir", default=".venv/flwr",
                 help="where `make bench` installed Flower")
  args = p.parse_args(argv)
  if args.flower:
    return compare_flower(args)
  if args.quick:
    quick(args)

  from fedjax_dg import engine, models
  from fedjax_dg.algorithms.fedavg import fedavg
  from fedjax_dg.algorithms import local_only
  from fedjax_dg.client import objectives
  from fedjax_dg.optim import make_optimizer
  feds = feds_for(args)
  any_fed = next(iter(feds.values()))
  model = models.get_model("mlp", input_shape=any_fed.image_shape,
                           num_classes=10, mean=any_fed.mean, std=any_fed.std,
                           hidden=args.hidden)
  loss, opt = objectives.cross_entropy(model), make_optimizer("sgd", 1e-2)
  build = dict(fedavg=lambda n: fedavg(model, opt, loss),
               local_only=lambda n: local_only.build(model, opt, loss, num_clients=n))
  base = engine.EngineConfig(rounds=args.rounds, eval_every=args.eval_every,
                             epochs=args.epochs, batch_size=args.batch,
                             cohort_size=args.cohort, client_mapping="map",
                             progress=False)
  fixed = args.epochs * -(-args.per_client // args.batch)
  steps = dict(random=0, fmnist=fixed, synthetic=fixed)
  cases = {(d, a, n, pl, g, sh): (build[a](n), dataclasses.replace(
      base, placement=pl, host_gather=g, local_steps=steps[d], shuffle=sh))
           for d in args.data for a in args.algorithms for n in args.clients
           for pl, g in placements(args, d) for sh in args.shuffle}
  rows = {key: dict(round_s=[], cpu_s=[], live=0) for key in cases}
  for key, (alg, cfg) in cases.items():  # compile every program first
    fed = feds[(key[0], key[2])]
    rows[key]["temp"] = chunk_temp_bytes(alg, model, cfg, fed, key[3])
    # The host holds the packed examples; "device" also the padded view it
    # places (`FederatedData.train`, built once, kept with the federation).
    rows[key]["fed"] = fed.packed_train.nbytes(padded=False) + (
        fed.packed_train.nbytes(padded=True) if key[3] == "device" else 0)
    rows[key]["largest"] = int(fed.packed_train.width)
    measure(alg, model, fed, dataclasses.replace(cfg, rounds=2))
    rows[key]["host"] = measure(alg, model, fed, dataclasses.replace(
        cfg, rounds=2), trace_host=True)["host"]
  order = list(cases)
  for rep in range(args.reps):  # rotated, so noise hits every case alike
    for key in order[rep % len(order):] + order[:rep % len(order)]:
      alg, cfg = cases[key]
      got = measure(alg, model, feds[(key[0], key[2])], cfg)
      rows[key]["round_s"] += got["round_s"]
      rows[key]["cpu_s"] += got["cpu_s"]
      rows[key]["live"] = max(rows[key]["live"], got["live"])
      print(".", end="", flush=True)
  random = (f"{args.total:,} examples over the N clients" if args.total
            else f"{args.per_client} examples per client")
  print(f"\ncohort {args.cohort or 'all'}; random: {random}, "
        f"{args.epochs} epoch(s) of batch {args.batch}; fmnist: "
        f"Dir({args.fmnist_alpha}) over 60,000 images; synthetic: "
        f"{args.synthetic_total:,} examples over N clients (log-normal sizes, "
        f"sigma {args.synthetic_skew}), {fixed} local steps (fmnist, "
        f"synthetic) of batch {args.batch}; 28x28x1 uint8; MLP hidden {args.hidden}; "
        f"{args.eval_every} round(s) per chunk, {args.rounds} rounds x "
        f"{args.reps} reps (median of the chunks after the first); "
        f"{platform.processor() or platform.machine()}, "
        f"{jax.device_count()} {jax.default_backend()} device(s), "
        f"jax {jax.__version__}")
  print_table(args, rows)
  print("@@json " + json.dumps(dict(
      args=vars(args), rows={"/".join(map(str, k)): v for k, v in rows.items()})))


def print_table(args, rows: dict) -> None:
  """One line per case; every "vs N0" is the ratio to the first N's line of
  the same gather and shuffle, "vs g0" (round time, CPU, device peak) to the
  first --host-gather's line of the same N and shuffle (several gathers
  only), "vs s0" (round time, CPU) to the first --shuffle's line of the
  same N and gather (several shuffles only)."""
  mib = lambda b: b / 2**20
  several = len(args.host_gather) > 1
  shuffles = len(args.shuffle) > 1
  t_med = lambda r: statistics.median(r["round_s"])
  c_med = lambda r: statistics.median(r["cpu_s"])
  peak_of = lambda r: r["live"] + r["temp"]
  print(f"{'data':9s} {'algorithm':10s} {'placement':9s} {'gather':7s} "
        f"{'shuffle':7s} "
        f"{'N':>6s} {'largest':>7s} {'round ms':>9s} {'vs N0':>6s} "
        f"{'cpu ms':>7s} {'vs N0':>6s} {'live MiB':>9s} {'temp MiB':>9s} "
        f"{'peak MiB':>9s} {'vs N0':>6s} {'held MiB':>8s} {'host MiB':>9s} "
        f"{'vs N0':>6s}" + (f" {'round':>6s} {'cpu':>6s} {'peak':>6s} "
                            "(vs g0)" if several else "")
        + (f" {'round':>6s} {'cpu':>6s} (vs s0)" if shuffles else ""))
  for d in args.data:
    for a in args.algorithms:
      for (pl, g), sh in itertools.product(placements(args, d),
                                           args.shuffle):
        first = rows[(d, a, args.clients[0], pl, g, sh)]
        t0, c0, peak0 = t_med(first), c_med(first), peak_of(first)
        host0 = first["fed"] + first["host"]
        for n in args.clients:
          r = rows[(d, a, n, pl, g, sh)]
          t, c, peak = t_med(r), c_med(r), peak_of(r)
          host = r["fed"] + r["host"]
          g0 = rows[(d, a, n, pl, args.host_gather[0] if pl == "host"
                     else g, sh)]
          s0 = rows[(d, a, n, pl, g, args.shuffle[0])]
          vs_g0 = (f" {t / t_med(g0):6.2f} {c / c_med(g0):6.2f} "
                   f"{peak / peak_of(g0):6.2f}" if several else "")
          vs_s0 = (f" {t / t_med(s0):6.2f} {c / c_med(s0):6.2f}" if shuffles
                   else "")
          print(f"{d:9s} {a:10s} {pl:9s} {g:7s} {sh:7s} {n:6d} "
                f"{r['largest']:7d} "
                f"{1e3 * t:9.1f} {t / t0:6.2f} {1e3 * c:7.1f} {c / c0:6.2f} "
                f"{mib(r['live']):9.1f} {mib(r['temp']):9.1f} {mib(peak):9.1f} "
                f"{peak / peak0:6.2f} {mib(r['fed']):8.1f} {mib(host):9.1f} "
                f"{host / host0:6.2f}{vs_g0}{vs_s0}")


if __name__ == "__main__":
  main()
