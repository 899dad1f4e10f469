"""benchmarks/_worker.py: results come back, failures say why (incl. the OOM killer)."""

import os
import sys
import textwrap

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from _worker import run_worker  # noqa: E402


def _script(tmp_path, body: str) -> str:
  path = tmp_path / "w.py"
  path.write_text(textwrap.dedent(f"""
      import json, os, signal, sys
      sys.path.insert(0, {os.path.join(os.path.dirname(__file__), "..", "benchmarks")!r})
      from _worker import emit
      spec = json.loads(sys.argv[2])
      {body}
  """))
  return str(path)


def test_result_round_trips(tmp_path):
  row, why = run_worker(_script(tmp_path, 'print("noise"); emit(dict(c=spec["c"] * 2))'),
                        dict(c=21))
  assert (row, why) == (dict(c=42), "")


def test_error_reports_last_stderr_line(tmp_path):
  row, why = run_worker(_script(tmp_path, 'raise ValueError("bad C=" + str(spec["c"]))'),
                        dict(c=3))
  assert row is None and "rc 1" in why and "ValueError: bad C=3" in why


def test_kill_signal_is_named(tmp_path):
  row, why = run_worker(_script(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)"), {})
  assert row is None and "signal 9" in why and "out of memory" in why


def test_exit_zero_without_result_is_a_failure(tmp_path):
  row, why = run_worker(_script(tmp_path, "pass"), {})
  assert row is None and "rc 0" in why and "no error output" in why
