"""Times conv implementations inside the federated loop structure (not a test).

One jitted program per implementation: `lax.map` over C clients x `lax.scan` over S
local SGD steps of a model (default: InceptionCNN, batch 64, 32x32x3, dropout on).
Timed runs are interleaved across implementations (round-robin) after a warm-up, and
the median is reported as ms per client-step, with ratios to the fastest.

    .venv/bin/python benchmarks/conv_in_loop.py            # all three impls
    .venv/bin/python benchmarks/conv_in_loop.py --impls im2col custom_vjp --reps 5
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_dg import models


def make_round(model: models.Model, lr: float):
  """(stacked params, x [C,S,B,H,W,ch] uint8, y [C,S,B], key) -> stacked params."""

  def loss_fn(params, x, y, rng):
    logits = model.apply(params, x, train=True, rng=rng)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def client(args):
    params, xs, ys, key = args

    def step(p, batch):
      x, y, k = batch
      g = jax.grad(loss_fn)(p, x, y, k)
      return jax.tree.map(lambda a, b: a - lr * b, p, g), None

    keys = jax.random.split(key, xs.shape[0])
    params, _ = jax.lax.scan(step, params, (xs, ys, keys))
    return params

  @jax.jit
  def run(stacked, xs, ys, key):
    keys = jax.random.split(key, xs.shape[0])
    return jax.lax.map(client, (stacked, xs, ys, keys))

  return run


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="inception_cnn")
  ap.add_argument("--impls", nargs="+",
                  default=["auto", "im2col", "custom_vjp", "xla"])
  ap.add_argument("--clients", type=int, default=4)
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--classes", type=int, default=7)
  ap.add_argument("--reps", type=int, default=5, help="timed runs per impl")
  ap.add_argument("--budget-s", type=float, default=120.0,
                  help="cap on timed seconds per impl (slow impls get fewer reps, "
                  "at least 1)")
  args = ap.parse_args(argv)

  c, s, b = args.clients, args.steps, args.batch
  rng = np.random.default_rng(0)
  xs = jnp.asarray(rng.integers(0, 256, (c, s, b, 32, 32, 3), dtype=np.uint8))
  ys = jnp.asarray(rng.integers(0, args.classes, (c, s, b), dtype=np.int32))
  key = jax.random.key(0)

  runs, params, compile_s, warm_s, reps, times = {}, {}, {}, {}, {}, {}
  outs = {}
  for impl in args.impls:
    model = models.get_model(args.model, input_shape=(32, 32, 3),
                             num_classes=args.classes, conv_impl=impl)
    p = model.init(jax.random.key(1))
    params[impl] = jax.tree.map(lambda a: jnp.broadcast_to(a, (c,) + a.shape), p)
    run = make_round(model, 0.01)
    t0 = time.perf_counter()
    runs[impl] = run.lower(params[impl], xs, ys, key).compile()
    compile_s[impl] = time.perf_counter() - t0
    t0 = time.perf_counter()
    jax.block_until_ready(runs[impl](params[impl], xs, ys, key))  # warm-up
    warm_s[impl] = time.perf_counter() - t0
    reps[impl] = max(1, min(args.reps, int(args.budget_s // warm_s[impl])))
    times[impl] = []
    print(f"{impl}: compile {compile_s[impl]:.1f} s, warm-up run "
          f"{warm_s[impl]:.2f} s -> {reps[impl]} timed runs", flush=True)

  # Round-robin so that machine-load drift hits every impl alike.
  for r in range(max(reps.values())):
    for impl in args.impls:
      if r < reps[impl]:
        t0 = time.perf_counter()
        outs[impl] = jax.block_until_ready(
            runs[impl](params[impl], xs, ys, key))
        times[impl].append(time.perf_counter() - t0)

  # Every impl computes the same round (same data, keys and initial params).
  ref = outs[args.impls[0]]
  max_diff = {i: max(float(jnp.abs(a - r).max()) for a, r in zip(
      jax.tree.leaves(outs[i]), jax.tree.leaves(ref))) for i in args.impls}

  ms = {i: 1e3 * statistics.median(times[i]) / (c * s) for i in args.impls}
  best = min(ms.values())
  print(f"\n{args.model}, lax.map over {c} clients x lax.scan over {s} SGD steps, "
        f"batch {b}, 32x32x3; jax {jax.__version__}, backend "
        f"{jax.default_backend()}, {platform.processor() or platform.machine()}")
  print("| conv_impl | ms / client-step (median) | x fastest | timed runs | "
        "compile s | max abs diff of params vs first impl |")
  print("|---|---|---|---|---|---|")
  for i in args.impls:
    spread = (f"{1e3 * min(times[i]) / (c * s):.1f}-"
              f"{1e3 * max(times[i]) / (c * s):.1f}")
    print(f"| {i} | {ms[i]:.1f} (range {spread}) | {ms[i] / best:.2f} | "
          f"{reps[i]} | {compile_s[i]:.1f} | {max_diff[i]:.1e} |")


if __name__ == "__main__":
  main()
