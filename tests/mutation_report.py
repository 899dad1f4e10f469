"""Mutation-testing helper of `make mutation` (docs/testing.md); not a test.

`python tests/mutation_report.py --preflight` collects the default suite in this
process and fails if that started a JAX backend: mutmut's fork server collects
the tests once and forks a worker per mutant from that process, and XLA's thread
pools do not survive fork() (a worker would hang on its first computation).

`python tests/mutation_report.py --sample N [--seed S]` generates the mutants
(mutmut's own generation step, nothing runs) and prints a seeded random sample of
N mutant names per package (server, client, algorithms) to
mutants/sample.txt: a full run is ~9,900 mutants, days on 2 cores; a sample of
N per package estimates each package's score (docs/testing.md).

`python tests/mutation_report.py [GLOB]` reads mutmut's results (mutants/**.meta)
and prints, per package, killed / checked mutants with a 95 % interval, then every
mutant that was not killed (survived, timeout, no tests, ...), only those whose
name matches GLOB (e.g. 'fedjax_dg.server.*') if given, only the sample's if
mutants/sample.txt exists.
"""

from __future__ import annotations

import collections
import fnmatch
import glob
import json
import math
import os
import random
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# mutmut's exit code -> verdict (mutmut/stats.py `status_by_exit_code`).
VERDICT = {1: "killed", 3: "killed", 0: "survived", 5: "no tests",
           33: "no tests", 34: "skipped", 36: "timeout", 37: "type check",
           -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout",
           -11: "segfault", -9: "segfault", None: "not checked"}


def preflight() -> int:
  import pytest  # pylint: disable=g-import-not-at-top
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  code = pytest.main(["--collect-only", "-qqq", "-p", "no:cacheprovider"])
  if code != 0:
    return int(code)
  if xla_bridge._backends:  # pylint: disable=protected-access
    print("collecting the tests started a JAX backend "
          f"({sorted(xla_bridge._backends)}): some test module computes at "  # pylint: disable=protected-access
          "import time; move that into a fixture, or mutmut's fork-server "
          "workers hang (docs/testing.md)")
    return 1
  return 0


SAMPLE_FILE = os.path.join(ROOT, "mutants", "sample.txt")


def generate() -> None:
  """mutmut's generation step alone (the first block of `mutmut run`): copies
  the sources into mutants/ and writes each mutated file and its .meta (every
  mutant's name, unchecked). Files whose mutants are newer are left as they are."""
  from mutmut import __main__ as mm  # pylint: disable=g-import-not-at-top
  os.chdir(ROOT)
  os.makedirs("mutants", exist_ok=True)
  mm.set_mutant_under_test("mutant_generation")
  mm.copy_src_dir()
  mm.copy_also_copy_files()
  mm.setup_source_paths()
  mm.create_mutants(os.cpu_count() or 2)


def sample(per_package: int, seed: int = 0) -> list[str]:
  """A seeded uniform sample of `per_package` mutants of each package."""
  by_package = collections.defaultdict(list)
  for name in verdicts(use_sample=False):
    by_package[package_of(name)].append(name)
  rng = random.Random(seed)
  picked = []
  for package in sorted(by_package):
    names = sorted(by_package[package])
    picked += sorted(rng.sample(names, min(per_package, len(names))))
  with open(SAMPLE_FILE, "w") as f:
    f.write("\n".join(picked) + "\n")
  return picked


def package_of(name: str) -> str:
  return ".".join(name.split(".")[:2])


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
  """95 % Wilson score interval of a proportion k / n, in percent."""
  if n == 0:
    return float("nan"), float("nan")
  p = k / n
  centre = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
  return 100 * (centre - half), 100 * (centre + half)


def verdicts(pattern: str = "*", use_sample: bool = True) -> dict[str, str]:
  """Mutant name -> verdict, from mutmut's per-file .meta files (only the
  sample's mutants when mutants/sample.txt exists and use_sample)."""
  keep = None
  if use_sample and os.path.exists(SAMPLE_FILE):
    with open(SAMPLE_FILE) as f:
      keep = set(f.read().split())
  out = {}
  for path in sorted(glob.glob(os.path.join(ROOT, "mutants", "fedjax_dg", "**",
                                            "*.py.meta"), recursive=True)):
    with open(path) as f:
      for name, code in json.load(f)["exit_code_by_key"].items():
        if fnmatch.fnmatch(name, pattern) and (keep is None or name in keep):
          out[name] = VERDICT.get(code, "suspicious")
  return out


def report(pattern: str = "*") -> str:
  found = verdicts(pattern)
  if not found:
    return "no mutmut results under mutants/ (run `make mutation` first)"
  by_package = collections.defaultdict(collections.Counter)
  for name, verdict in found.items():
    by_package[package_of(name)][verdict] += 1
  by_package["all"] = sum(by_package.values(), collections.Counter())
  lines = ["package                  killed / checked  score   95 % interval  "
           "(not checked)"]
  for package, counts in sorted(by_package.items()):
    checked = sum(counts.values()) - counts["not checked"]
    score = 100.0 * counts["killed"] / checked if checked else float("nan")
    low, high = wilson(counts["killed"], checked)
    lines.append(f"{package:24s} {counts['killed']:6d} / {checked:<7d} "
                 f"{score:5.1f} %  {low:4.1f}-{high:5.1f} %  "
                 f"({counts['not checked']})")
  lines.append("")
  lines += [f"{verdict:12s} {name}" for name, verdict in sorted(found.items())
            if verdict not in ("killed", "not checked")]
  return "\n".join(lines)


if __name__ == "__main__":
  args = sys.argv[1:]
  if args == ["--preflight"]:
    sys.exit(preflight())
  if args[:1] == ["--sample"]:
    generate()
    seed = int(args[args.index("--seed") + 1]) if "--seed" in args else 0
    picked = sample(int(args[1]), seed)
    print(f"{len(picked)} mutants sampled (seed {seed}): {SAMPLE_FILE}")
  else:
    print(report(*args[:1]))
