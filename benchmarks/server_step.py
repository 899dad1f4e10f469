"""Cost of the hFedF server step as the cohort grows (not a test).

One jitted hFedF `server_update` (GradAlign over per-client hypernetwork gradients,
Adam step, EMA) for the Table 9 Inception CNN (32x32x3, 7 classes; ~0.93M client
parameters, ~47M hypernetwork parameters) at C = 16, 64, 256 clients:

  engine  `server.hypernetwork_grads`: g_avg is one VJP, <g_avg, g_i> one JVP,
          |g_i| in closed form from the linear heads
          (`models.hypernetwork.client_grad_sq_norms`), the weighted gradient one
          more VJP; no [C, P_hypernetwork] stack is ever built.
  engine_vjp  the same without the closed form: |g_i| from a `lax.map` of
          per-client VJPs (the generic path for any generator; one
          hypernetwork-sized gradient at a time).
  naive   the textbook computation: per-client gradients g_i = VJP_i(delta_i)
          materialized as a [C, P_hypernetwork] stack (`vmap` of the VJP), cosines
          to their mean, softmax, weighted sum. Skipped where the stack alone would
          exceed --naive-limit-gib.

Each (variant, C) runs in its own process; the table gives the median server-step
time over --reps timed calls after one warm-up, the process's peak RSS, and that
peak divided by the size of C hypernetwork gradients (C x P_hypernetwork x 4 bytes):
the engine's ratio must fall as C grows (memory does not scale with C x P_hyper).

    .venv/bin/python benchmarks/server_step.py
    .venv/bin/python benchmarks/server_step.py --clients 16 64 --reps 2
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


def worker(variant: str, c: int, reps: int) -> dict:
  import jax
  import jax.numpy as jnp

  from fedjax_dg import algorithms, models, tree
  from fedjax_dg.algorithms.base import ClientResult
  from fedjax_dg.run.config import base_config
  from fedjax_dg.run import assemble

  model = models.get_model("inception_cnn", input_shape=(32, 32, 3), num_classes=7)
  cfg = base_config()
  if variant == "engine_vjp":  # the generic per-client VJP norms
    from fedjax_dg.server import hypernetwork as server_hypernetwork
    server_hypernetwork.client_grad_sq_norms = lambda module: None
  alg = assemble.algorithm("hfedf", model, c, cfg)
  server, _ = jax.jit(alg.init)(jax.random.key(0))
  ids = jnp.arange(c)
  start = jax.jit(alg.client.start)(server, None, ids)
  noise = jax.jit(lambda s: jax.tree.map(
      lambda x: x + 1e-3 * jax.random.normal(jax.random.key(1), x.shape), s))
  trained = noise(start)
  # Round 10: after the EMA's warm-up (its counter lives in the server state).
  server = server._replace(ema=server.ema._replace(count=jnp.int32(10)))
  result = ClientResult(ids, jnp.int32(10), start, trained, jnp.ones(c),
                        jnp.ones(c))
  p_hyper = tree.num_params(server.hp.theta)

  if variant in ("engine", "engine_vjp"):
    step = jax.jit(lambda s, r: alg.server.update(s, r, None))
    call = lambda: step(server, result)
  else:
    hp = server.hp
    module = models.hypernetwork.hypernetwork_module(model)
    h = lambda th, v: module.apply({"params": th}, v)

    @jax.jit
    def naive(theta, emb, deltas):
      def g_i(e, d):
        return jax.vjp(lambda th: h(th, e), theta)[1](d)[0]
      g = jax.vmap(g_i)(emb, deltas)                       # [C, P_hyper] stack
      flat = jnp.concatenate([x.reshape(c, -1) for x in jax.tree.leaves(g)], 1)
      mean = flat.mean(0)
      cos = flat @ mean / (jnp.linalg.norm(flat, axis=1) * jnp.linalg.norm(mean))
      w = jax.nn.softmax(cos)
      return tree.weighted_sum(g, w), w

    deltas = jax.tree.map(jnp.subtract, start, trained)
    emb = hp.embeddings
    call = lambda: naive(hp.theta, emb, deltas)

  t = time.perf_counter()
  jax.block_until_ready(call())
  first = time.perf_counter() - t
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - t)
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
  return dict(variant=variant, clients=c, ms=1000 * statistics.median(times),
              first_s=first, peak_gib=peak, p_hyper=p_hyper)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--clients", type=int, nargs="+", default=[16, 64, 256])
  ap.add_argument("--variants", nargs="+", default=["engine", "engine_vjp", "naive"])
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--naive-limit-gib", type=float, default=16.0)
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    spec = json.loads(args.worker)
    emit(worker(spec["variant"], spec["clients"], spec["reps"]))
    return 0

  p_hyper = None
  rows = []
  for c in args.clients:
    for variant in args.variants:
      if variant == "naive" and p_hyper is not None:
        need = c * p_hyper * 4 / 2**30
        if need > args.naive_limit_gib:
          rows.append(dict(variant=variant, clients=c, skipped=
                           f"the [C, P_hyper] stack alone needs {need:.0f} GiB"))
          print(f"[{variant} C={c}] skipped: needs {need:.0f} GiB", flush=True)
          continue
      row, why = run_worker(__file__, dict(variant=variant, clients=c,
                                           reps=args.reps))
      if row is None:
        rows.append(dict(variant=variant, clients=c, skipped=why))
        print(f"[{variant} C={c}] {why}", flush=True)
        continue
      p_hyper = row["p_hyper"]
      rows.append(row)
      print(f"[{variant} C={c}] {row['ms']:.0f} ms, peak {row['peak_gib']:.2f} GiB",
            flush=True)

  import jax
  size = (f"hypernetwork {p_hyper:,} parameters ({p_hyper * 4 / 2**20:.0f} MiB per "
          "gradient)" if p_hyper else "no variant finished")
  print(f"\nMachine: {platform.processor() or platform.machine()}, "
        f"jax {jax.__version__}; {size}\n")
  print("| variant | C | server step ms (median) | peak RSS GiB | "
        "peak / (C x hypernetwork gradient) |")
  print("|---|---|---|---|---|")
  for r in rows:
    if "skipped" in r:
      print(f"| {r['variant']} | {r['clients']} | — | — | {r['skipped']} |")
      continue
    ratio = r["peak_gib"] * 2**30 / (r["clients"] * r["p_hyper"] * 4)
    print(f"| {r['variant']} | {r['clients']} | {r['ms']:,.0f} | "
          f"{r['peak_gib']:.2f} | {ratio:.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
