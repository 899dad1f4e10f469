"""The yardstick for a round's arithmetic rate (not a test): XLA:CPU's own
matmul rate in float32 and bfloat16 (bf16 x bf16 -> f32, the form its matrix
units run) at the Inception CNN's im2col shapes and at a large one, and the
FLOPs of one client step (forward + backward, batch 64, 32x32x3) of the
Inception CNN as XLA counts them, so that a round's ms (round_time.py) reads
as GFLOP/s against these peaks.

    python benchmarks/matmul_peak.py [--reps 10]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import optax

from fedjax_dg import models

# (m, k, n): the im2col matmuls of the Inception CNN at batch 64 (conv3; the
# inceptions' 3x3 convs at 64 and 176 input channels), and a large square-ish
# one for the machine's peak.
SHAPES = ((16384, 288, 64), (4096, 576, 64), (4096, 1584, 64),
          (4096, 2304, 256), (8192, 4096, 1024))


def median_s(fn, *args, reps: int) -> float:
  """Median seconds of `reps` calls of jitted `fn(*args)`, after a warm-up."""
  fn = jax.jit(fn)
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def matmul_rates(reps: int) -> list[tuple[tuple[int, int, int], float, float]]:
  """[((m, k, n), float32 GFLOP/s, bfloat16 -> float32 GFLOP/s)]."""
  out = []
  key = jax.random.key(0)
  for m, k, n in SHAPES:
    a = jax.random.normal(key, (m, k))
    b = jax.random.normal(key, (k, n))
    flops = 2 * m * k * n / 1e9
    f32 = median_s(jnp.dot, a, b, reps=reps)
    b16 = median_s(
        lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32),
        a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), reps=reps)
    out.append(((m, k, n), flops / f32, flops / b16))
  return out


def client_step(dtype: str):
  """(one SGD step `step(params, x, y) -> params` of the Inception CNN in
  `dtype`, at 32x32x3 with 7 classes, and its model); a batch is 64."""
  model = models.get_model("inception_cnn", input_shape=(32, 32, 3),
                           num_classes=7, dtype=dtype)

  def step(p, x, y):
    loss = lambda q: optax.softmax_cross_entropy_with_integer_labels(
        model.apply(q, x), y).mean()
    return jax.tree.map(lambda a, g: a - 0.01 * g, p, jax.grad(loss)(p))

  return step, model


def client_step_gflop(dtype: str) -> float:
  """XLA's FLOP count of one SGD step of the Inception CNN (batch 64)."""
  step, model = client_step(dtype)
  params = jax.eval_shape(model.init, jax.random.key(0))
  x = jax.ShapeDtypeStruct((64, 32, 32, 3), jnp.uint8)
  y = jax.ShapeDtypeStruct((64,), jnp.int32)
  cost = jax.jit(step).lower(params, x, y).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["flops"]) / 1e9


def cpu_name() -> str:
  """The CPU's model name and whether it has AMX-BF16 (/proc/cpuinfo)."""
  try:
    with open("/proc/cpuinfo") as f:
      info = f.read()
  except OSError:
    return platform.machine()
  name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines()
               if ln.startswith("model name")), platform.machine())
  return name + (", AMX-BF16" if "amx_bf16" in info else ", no AMX")


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--reps", type=int, default=10)
  args = ap.parse_args()
  print(f"# {cpu_name()}; {jax.device_count()} device(s), jax {jax.__version__}")
  print("| m x k x n | float32 GFLOP/s | bfloat16 -> float32 GFLOP/s |")
  print("|---|---:|---:|")
  for (m, k, n), f32, b16 in matmul_rates(args.reps):
    print(f"| {m} x {k} x {n} | {f32:,.0f} | {b16:,.0f} |")
  for dtype in ("float32", "bfloat16"):
    print(f"Inception CNN client step ({dtype}): "
          f"{client_step_gflop(dtype):.2f} GFLOP (XLA's count)")


if __name__ == "__main__":
  main()
