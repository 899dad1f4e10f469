"""tests/suite_time.py: the session's wall time and its slowest files, the
slowest first, after the summary. A pytest of its own on two small files
(the plugin alone), serially and on two xdist workers as `make test` runs."""

import os
import pathlib
import re
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def _run(tmp_path, *args):
  (tmp_path / "test_quick.py").write_text("def test_a():\n  assert True\n")
  (tmp_path / "test_sleepy.py").write_text(
      "import time\n\ndef test_b():\n  time.sleep(0.6)\n\n"
      "def test_c():\n  time.sleep(0.6)\n")
  (tmp_path / "pytest.ini").write_text("[pytest]\n")
  env = dict(os.environ, PYTHONPATH=str(HERE))
  return subprocess.run(
      [sys.executable, "-m", "pytest", "-p", "suite_time", "-p",
       "no:cacheprovider", *args, str(tmp_path)],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_the_summary_names_the_wall_time_and_the_slowest_files_first(
    tmp_path):
  for args in ((), ("-n", "2", "--dist", "loadfile")):
    out = _run(tmp_path, *args)
    assert out.returncode == 0, out.stdout + out.stderr
    wall = re.search(r"suite wall time (\d+) s; the 2 slowest files",
                     out.stdout)
    assert wall, out.stdout
    rows = re.findall(r"^\s+([\d.]+)\s+(test_\w+\.py)$", out.stdout, re.M)
    assert [name for _, name in rows] == ["test_sleepy.py", "test_quick.py"]
    assert float(rows[0][0]) >= 1.2  # both sleeps, summed over its tests
    assert float(rows[1][0]) < 0.6
    workers = re.findall(r"(gw\d) (\d+) s, (\d+) s", out.stdout)
    if args:  # both files' 1.2 s of sleeps on one worker or the other
      assert sorted(w for w, _, _ in workers) == ["gw0", "gw1"], out.stdout
      assert sum(int(b) for _, b, _ in workers) in (1, 2), out.stdout
      assert all(int(b) <= int(d) for _, b, d in workers), out.stdout
    else:
      assert "workers" not in out.stdout
