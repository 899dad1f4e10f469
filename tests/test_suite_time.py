"""tests/suite_time.py: the session's wall time and its slowest files, the
slowest first, after the summary. A pytest of its own on two small files
(the plugin alone), serially and on two xdist workers as `make test` runs."""

import os
import pathlib
import re
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def _run(tmp_path, *args, jit=False):
  (tmp_path / "test_quick.py").write_text("def test_a():\n  assert True\n")
  (tmp_path / "test_sleepy.py").write_text(
      "import time\n\ndef test_b():\n  time.sleep(0.6)\n\n"
      "def test_c():\n  time.sleep(0.6)\n")
  (tmp_path / "pytest.ini").write_text("[pytest]\n")
  if jit:  # compiles a program of its own in its test
    (tmp_path / "test_jitted.py").write_text(
        "import jax\nimport jax.numpy as jnp\n\ndef f(x):\n"
        "  for _ in range(40):  # long enough to trace for ~0.01 s\n"
        "    x = jnp.sin(x) @ x.T + 7.25\n  return x\n\ndef test_d():\n"
        "  assert jax.jit(f)(jnp.ones((3, 3))).shape == (3, 3)\n")
  env = dict(os.environ, PYTHONPATH=str(HERE))
  return subprocess.run(
      [sys.executable, "-m", "pytest", "-p", "suite_time", "-p",
       "no:cacheprovider", *args, str(tmp_path)],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_the_summary_names_the_wall_time_and_the_slowest_files_first(
    tmp_path):
  """Serially, on files that never import JAX (no JAX line); on two xdist
  workers with a third file that jits: JAX's tracing, lowering and
  compiling seconds, each above 0 and together within the tests' seconds
  (they travel to the controller with the reports)."""
  for args in ((), ("-n", "2", "--dist", "loadfile")):
    out = _run(tmp_path, *args, jit=bool(args))
    assert out.returncode == 0, out.stdout + out.stderr
    files = 3 if args else 2
    wall = re.search(rf"suite wall time (\d+) s; the {files} slowest files",
                     out.stdout)
    assert wall, out.stdout
    rows = re.findall(r"^\s+([\d.]+)\s+(test_\w+\.py)$", out.stdout, re.M)
    seconds = {name: float(s) for s, name in rows}
    assert sorted(seconds) == sorted(
        ["test_sleepy.py", "test_quick.py"] + ["test_jitted.py"] * bool(args))
    assert [float(s) for s, _ in rows] == sorted(seconds.values(),
                                                 reverse=True), rows
    assert seconds["test_sleepy.py"] >= 1.2  # both sleeps, summed
    assert seconds["test_quick.py"] < 0.6, rows
    workers = re.findall(r"(gw\d) (\d+) s, (\d+) s", out.stdout)
    jax_line = re.search(r"of the tests' (\d+) s, JAX in their own "
                         r"processes: tracing ([\d.]+) s, lowering ([\d.]+) "
                         r"s, compiling ([\d.]+) s", out.stdout)
    if args:  # both files' 1.2 s of sleeps on one worker or the other
      assert sorted(w for w, _, _ in workers) == ["gw0", "gw1"], out.stdout
      assert sum(int(b) for _, b, _ in workers) in (1, 2), out.stdout
      assert all(int(b) <= int(d) for _, b, d in workers), out.stdout
      assert jax_line, out.stdout
      tests, *spent = (float(v) for v in jax_line.groups())
      assert all(v > 0 for v in spent), jax_line[0]
      assert sum(spent) <= tests + 0.5, jax_line[0]
    else:
      assert "workers" not in out.stdout
      assert "JAX in their own processes" not in out.stdout
