"""One measurement in its own process, for the benchmarks that compare variants.

A variant's peak RSS (`resource.getrusage`) is only its own when it runs alone in
a fresh process: the parent re-runs its script with `--worker JSON`, the worker
prints one line `@@<json result>`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time


def emit(result: dict) -> None:
  """Worker side: hand the result to the parent."""
  print("@@" + json.dumps(result), flush=True)


def run_worker(script: str, spec: dict,
               env: dict | None = None) -> tuple[dict | None, str]:
  """Parent side: (the worker's result, "") or (None, why it failed); `env`:
  the worker's environment (default: this process's)."""
  proc = subprocess.run([sys.executable, script, "--worker", json.dumps(spec)],
                        capture_output=True, text=True, env=env)
  line = [l for l in proc.stdout.splitlines() if l.startswith("@@")]
  if proc.returncode == 0 and line:
    return json.loads(line[-1][2:]), ""
  if proc.returncode < 0:  # SIGKILL from the kernel's OOM killer leaves no stderr
    why = f"killed by signal {-proc.returncode} (out of memory?)"
  else:
    why = (proc.stderr.strip().splitlines() or ["no error output"])[-1][:120]
  return None, f"failed (rc {proc.returncode}): {why}"


def round_robin(runners: dict, reps: int) -> dict:
  """{name: [seconds per call]}: every runner called `reps` times, the order
  rotated each repetition so machine noise hits every variant alike."""
  times = {name: [] for name in runners}
  order = list(runners)
  for rep in range(reps):
    for name in order[rep % len(order):] + order[:rep % len(order)]:
      t0 = time.perf_counter()
      runners[name]()
      times[name].append(time.perf_counter() - t0)
  return times
