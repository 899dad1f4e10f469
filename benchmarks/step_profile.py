"""Where one client step's time goes, per kind of op (not a test).

One SGD step (forward + backward, batch 64) of the Inception CNN at 32x32x3
in --dtype, jitted on one XLA:CPU device, run --reps times under
`jax.profiler.trace`; each op the trace names is mapped to the compiled HLO
and classed by what it (or the fusion it calls) computes: convolutions,
dots (matmuls, XLA:CPU's library fusions), converts, slices / pads /
concatenations (im2col's patches and their backward sums, the pools'
windows), transposes / copies, reductions, the rest. Op times are summed
over both threads, so they add up to more than the step's wall time.

    .venv/bin/python benchmarks/step_profile.py --dtype float32
    .venv/bin/python benchmarks/step_profile.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile

import jax
import jax.numpy as jnp

from matmul_peak import client_step, cpu_name

KINDS = ("convolution", "dot", "convert", "slice / pad / concatenate",
         "transpose / copy", "reduce", "other")


def _computations(hlo: str) -> dict[str, list[str]]:
  comps, cur = {}, None
  for ln in hlo.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", ln)
    if head and "=" not in ln.split("{")[0]:
      cur = comps.setdefault(head.group(1), [])
    elif cur is not None:
      cur.append(ln)
  return comps


def op_kinds(hlo: str) -> dict[str, str]:
  """{instruction name: kind} of every instruction of `hlo` (a compiled
  module's text), a fusion classed by the computations it calls."""
  comps = _computations(hlo)

  def body(name, depth=0):
    out = list(comps.get(name, []))
    for ln in comps.get(name, []) if depth < 3 else ():
      for sub in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", ln):
        out += body(sub, depth + 1)
    return out

  kinds = {}
  for ln in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = \S+ ([a-z][\w\-]*)\(", ln)
    if not m:
      continue
    name, op = m.groups()
    sub = re.findall(r"calls=%?([\w.\-]+)", ln)
    ops = set(re.findall(r"= \S+ ([a-z][\w\-]*)\(",
                         "\n".join(body(sub[0])) if sub else ln)) | {op}
    if "convolution" in ops:
      kinds[name] = "convolution"
    elif "dot" in ops:
      kinds[name] = "dot"
    elif "convert" in ops:
      kinds[name] = "convert"
    elif ops & {"transpose", "copy"} and not ops & {"slice", "pad"}:
      kinds[name] = "transpose / copy"
    elif ops & {"slice", "pad", "concatenate", "dynamic-slice",
                "dynamic-update-slice"}:
      kinds[name] = "slice / pad / concatenate"
    elif ops & {"reduce", "reduce-window", "select-and-scatter"}:
      kinds[name] = "reduce"
    else:
      kinds[name] = "other"
  return kinds


def profile(dtype: str, reps: int) -> tuple[float, dict[str, float]]:
  """(the step's wall ms, {kind: op ms}) per step."""
  step, model = client_step(dtype)
  params = model.init(jax.random.key(0))
  x = jax.random.randint(jax.random.key(1), (64, 32, 32, 3), 0, 255
                         ).astype(jnp.uint8)
  y = jnp.arange(64) % 7
  compiled = jax.jit(step).lower(params, x, y).compile()
  kinds = op_kinds(compiled.as_text())
  jax.block_until_ready(compiled(params, x, y))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(reps):
        jax.block_until_ready(compiled(params, x, y))
    path = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]
    with gzip.open(path) as f:
      trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  wall, per = 0.0, collections.Counter()
  for e in events:
    if e.get("ph") != "X":
      continue
    if e["name"] == "ThunkExecutor::Execute (wait for completion)":
      wall += e["dur"]
    elif e["name"] in kinds:
      per[kinds[e["name"]]] += e["dur"]
  return wall / reps / 1e3, {k: per[k] / reps / 1e3 for k in KINDS}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                  choices=["float32", "bfloat16"])
  ap.add_argument("--reps", type=int, default=10)
  args = ap.parse_args()
  rows = {d: profile(d, args.reps) for d in args.dtype}
  print(f"# {cpu_name()}; jax {jax.__version__}; "
        "Inception CNN client step, batch 64, one device; ms per step")
  print("| kind | " + " | ".join(args.dtype) + " |")
  print("|---|" + "---:|" * len(args.dtype))
  print("| step (wall) | " + " | ".join(f"{rows[d][0]:.1f}" for d in args.dtype)
        + " |")
  for k in KINDS:
    print(f"| {k} | " + " | ".join(f"{rows[d][1][k]:.1f}" for d in args.dtype)
          + " |")


if __name__ == "__main__":
  main()
