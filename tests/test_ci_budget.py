"""tests/slow_budget.py: past FEDJAX_DG_SLOW_DEADLINE, slow tests are skipped
with the reason and counted; other tests, and slow tests before it, run.

Each case runs a pytest of its own on a small test file (the plugin alone, not
this suite's conftest), as CI's `make test-slow` would.
"""

import os
import pathlib
import subprocess
import sys
import time

import slow_budget

HERE = pathlib.Path(__file__).parent

TESTS = '''
import pytest

@pytest.mark.slow
def test_slow_one():
  assert True

@pytest.mark.slow
def test_slow_two():
  assert True

def test_quick():
  assert True
'''


def pytest_run(tmp_path, deadline):
  (tmp_path / "test_some.py").write_text(TESTS)
  (tmp_path / "pytest.ini").write_text(
      "[pytest]\nmarkers =\n  slow: slow\n")
  env = dict(os.environ, PYTHONPATH=str(HERE))
  env.pop(slow_budget.ENV, None)
  if deadline is not None:
    env[slow_budget.ENV] = deadline
  return subprocess.run(
      [sys.executable, "-m", "pytest", "-p", "slow_budget", "-p",
       "no:cacheprovider", "-rs", "-v", str(tmp_path)],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_past_the_deadline_slow_tests_are_skipped_and_counted(tmp_path):
  out = pytest_run(tmp_path, str(time.time() - 60))
  assert out.returncode == 0, out.stdout + out.stderr
  assert "test_quick PASSED" in out.stdout
  assert "test_slow_one SKIPPED" in out.stdout
  assert "test_slow_two SKIPPED" in out.stdout
  assert f"{slow_budget.REASON}: started after {slow_budget.ENV}" in out.stdout
  assert "2 slow tests not run" in out.stdout


def test_before_the_deadline_or_without_one_every_test_runs(tmp_path):
  for deadline in (str(time.time() + 3600), None):
    out = pytest_run(tmp_path, deadline)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 passed" in out.stdout, (deadline, out.stdout)
    assert "slow tests not run" not in out.stdout


def test_a_deadline_that_is_not_a_number_stops_the_session(tmp_path):
  out = pytest_run(tmp_path, "in an hour")
  assert out.returncode != 0
  text = out.stdout + out.stderr
  assert f"{slow_budget.ENV}='in an hour' is not a number" in text
  assert "passed" not in out.stdout
