"""Cost of the HyperGenFL server step vs FedAvg's weighted mean (not a test).

One jitted `server_update` of each algorithm, as the engine calls it, on the same
stacked client models: the paper's CIFAR-10 simple CNN (`cifar_cnn`, 32x32x3, 10
classes; `small_cnn` where this checkout has no `cifar_cnn`) at m = 20 and 100
active clients (Table 1's advanced / extreme cohorts, and all of 100 clients):

  fedavg            `server.weighted_mean`: sum_c n_c theta_c / sum_c n_c.
  hypergenfl        attention hypernetwork over the cohort's embeddings (d = 128),
                    layer-wise aggregation (one weight per module), one VJP of the
                    aggregation for (phi, sigma), AdamW step, the aggregate with the
                    updated hypernetwork (Alg. 1) and the round metrics.
  hypergenfl_tensor the same with one weight per parameter tensor.

N = max(100, m) clients hold embeddings. Each (variant, m) runs in its own
process; the table gives the median over --reps timed calls after one warm-up,
the process's peak RSS (`resource.getrusage`, which includes the Python / jax
runtime, the stacked models and their copies), and the time ratio to FedAvg at
the same m.

    .venv/bin/python benchmarks/hypergenfl_server.py
    .venv/bin/python benchmarks/hypergenfl_server.py --clients 20 --reps 5 \
        --model small_cnn
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import sys
import time

from _worker import emit, run_worker

VARIANTS = ("fedavg", "hypergenfl", "hypergenfl_tensor")


def default_model() -> str:
  from fedjax_dg import models
  return "cifar_cnn" if "cifar_cnn" in models.available() else "small_cnn"


def worker(variant: str, m: int, model_name: str, reps: int) -> dict:
  import jax
  import jax.numpy as jnp

  from fedjax_dg import algorithms, models, tree
  from fedjax_dg.algorithms.base import ClientResult
  from fedjax_dg.run.config import base_config
  from fedjax_dg.run import assemble

  model = models.get_model(model_name, input_shape=(32, 32, 3), num_classes=10)
  cfg = base_config()
  n = max(100, m)
  if variant == "hypergenfl_tensor":
    cfg.hypergenfl.granularity = "tensor"
  alg = assemble.algorithm("fedavg" if variant == "fedavg" else "hypergenfl",
                           model, n, cfg)
  server, _ = jax.jit(alg.init)(jax.random.key(0))
  ids = jax.random.choice(jax.random.key(1), n, (m,), replace=False)
  start = jax.jit(alg.client.start)(server, None, ids)
  trained = jax.jit(lambda s: jax.tree.map(
      lambda x: x + 1e-2 * jax.random.normal(jax.random.key(2), x.shape), s))(
          start)
  result = ClientResult(ids, jnp.int32(3), start, trained, jnp.full((m,), 500),
                        jnp.ones(m))
  step = jax.jit(lambda s, r: alg.server.update(s, r, None))
  call = lambda: step(server, result)

  t = time.perf_counter()
  jax.block_until_ready(call())
  first = time.perf_counter() - t
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - t)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # MiB
  p = tree.num_params(server.params)
  return dict(variant=variant, clients=m, ms=1000 * statistics.median(times),
              first_s=first, peak_mib=peak, params=p,
              stack_mib=m * p * 4 / 2**20)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--clients", type=int, nargs="+", default=[20, 100])
  ap.add_argument("--variants", nargs="+", default=list(VARIANTS),
                  choices=VARIANTS)
  ap.add_argument("--model", default="")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    spec = json.loads(args.worker)
    emit(worker(spec["variant"], spec["clients"], spec["model"], spec["reps"]))
    return 0

  model_name = args.model or default_model()
  rows = []
  for m in args.clients:
    for variant in args.variants:
      row, why = run_worker(__file__, dict(variant=variant, clients=m,
                                           model=model_name, reps=args.reps))
      if row is None:
        rows.append(dict(variant=variant, clients=m, skipped=why))
        print(f"[{variant} m={m}] {why}", flush=True)
        continue
      rows.append(row)
      print(f"[{variant} m={m}] {row['ms']:.2f} ms, peak {row['peak_mib']:.0f} MiB",
            flush=True)

  import jax
  params = next((r["params"] for r in rows if "params" in r), 0)
  print(f"\nMachine: {platform.processor() or platform.machine()}, "
        f"{jax.default_backend()}, jax {jax.__version__}; model {model_name} "
        f"(32x32x3, 10 classes): {params:,} parameters\n")
  fedavg = {r["clients"]: r["ms"] for r in rows
            if r["variant"] == "fedavg" and "ms" in r}
  print("| variant | m | server step ms (median) | peak RSS MiB | "
        "stacked models MiB | time / FedAvg |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    if "skipped" in r:
      print(f"| {r['variant']} | {r['clients']} | — | — | — | {r['skipped']} |")
      continue
    ratio = (f"{r['ms'] / fedavg[r['clients']]:.1f}x" if r["clients"] in fedavg
             else "—")
    print(f"| {r['variant']} | {r['clients']} | {r['ms']:.2f} | "
          f"{r['peak_mib']:.0f} | {r['stack_mib']:.1f} | {ratio} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
