"""Whether XLA:CPU runs a bfloat16 convolution faster than a float32 one (not a test).

One 3x3 `lax.conv_general_dilated` layer (NHWC / HWIO, "SAME"), forward and
both backward convolutions (`jax.grad` of a tanh-summed output with respect
to input and kernel), float32 operands against bfloat16 operands accumulated
in float32 (`preferred_element_type`), at the Inception CNN's convolution
shapes. Each XLA flag setting runs in its own process (XLA reads XLA_FLAGS
once), float32 and bfloat16 side by side in it, medians of --reps calls; the
table gives GFLOP/s (3 convolutions' multiply-adds) and bfloat16's speed-up.

The engine's CPU policy keeps convolutions float32 because XLA:CPU upcasts a
bfloat16 convolution (docs/models.md, "Mixed precision"); a flag setting
whose speed-up is well above 1 here is what would let bfloat16 pay on a CPU.

    .venv/bin/python benchmarks/conv_dtype.py                 # default flag sets
    .venv/bin/python benchmarks/conv_dtype.py --flags "" "--xla_cpu_use_onednn=true"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax import lax

from matmul_peak import cpu_name, median_s

# (batch, height = width, input channels, output channels): conv3 of the
# Inception CNN at batch 64 (16x16, 64 -> 64) and an inception's 3x3 branch
# (8x8, 176 -> 128).
SHAPES = ((64, 16, 64, 64), (64, 8, 176, 128))
FLAG_SETS = (
    "",
    "--xla_cpu_use_onednn=true",
    "--xla_cpu_experimental_onednn_custom_call=true",
    "--xla_cpu_experimental_onednn_fusion_type=individual_convolution",
    "--xla_cpu_experimental_xnn_fusion_type=individual_convolution",
    "--xla_cpu_experimental_ynn_fusion_type=individual_convolution",
)


def measure(shape: tuple[int, int, int, int], reps: int) -> dict[str, float]:
  """{dtype: median seconds} of the layer's forward + backward, this process."""
  n, h, cin, cout = shape
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (n, h, h, cin))
  w = jax.random.normal(kw, (3, 3, cin, cout)) * 0.05
  out = {}
  for name, dt in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
    def loss(x, w, dt=dt):
      y = lax.conv_general_dilated(
          x.astype(dt), w.astype(dt), (1, 1), "SAME",
          dimension_numbers=("NHWC", "HWIO", "NHWC"),
          preferred_element_type=jnp.float32)
      return jnp.sum(jnp.tanh(y))
    out[name] = median_s(jax.grad(loss, (0, 1)), x, w, reps=reps)
  return out


def _flops(shape) -> float:
  n, h, cin, cout = shape
  return 3 * 2 * n * h * h * 9 * cin * cout


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--flags", nargs="+", default=list(FLAG_SETS),
                  help="XLA_FLAGS settings, one process each ('' = default)")
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker:  # one flag setting: print its JSON line
    shapes = json.loads(args.worker)
    print(json.dumps([measure(tuple(s), args.reps) for s in shapes]))
    return
  print(f"# {cpu_name()}; {os.cpu_count()} cores, jax {jax.__version__}")
  print("| XLA_FLAGS | n x h x w x cin -> cout | float32 GFLOP/s "
        "| bfloat16 GFLOP/s | bfloat16 speed-up |")
  print("|---|---|---:|---:|---:|")
  for flags in args.flags:
    env = dict(os.environ, XLA_FLAGS=flags)
    proc = subprocess.run(
        [sys.executable, __file__, "--reps", str(args.reps), "--worker",
         json.dumps(SHAPES)], env=env, capture_output=True, text=True)
    if proc.returncode:
      print(f"| `{flags}` | failed: {proc.stderr.strip().splitlines()[-1]} "
            "| | | |")
      continue
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for shape, got in zip(SHAPES, results):
      n, h, cin, cout = shape
      f32, bf16 = (_flops(shape) / got[d] / 1e9
                   for d in ("float32", "bfloat16"))
      print(f"| `{flags or '(default)'}` | {n} x {h} x {h} x {cin} -> {cout} "
            f"| {f32:.0f} | {bf16:.0f} | {bf16 / f32:.2f} |")


if __name__ == "__main__":
  main()
