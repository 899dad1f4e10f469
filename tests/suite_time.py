"""The suite's own time in every log: after the summary, the session's wall
time and the ten test files that took longest (setup, call and teardown of
their tests summed; with pytest-xdist's `--dist loadfile` a file runs on one
worker, so its sum is the time it held that worker). A file that grew slow
shows in every CI log.

Loaded by tests/conftest.py (`pytest_plugins`); tests/test_suite_time.py
runs it in a pytest of its own.
"""

import collections
import time

SHOWN = 10
_START: list[float] = []
_FILES: collections.Counter = collections.Counter()


def pytest_sessionstart(session):  # pylint: disable=unused-argument
  _START.append(time.perf_counter())


def pytest_runtest_logreport(report):
  # On the xdist controller this sees every worker's reports as well.
  _FILES[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
  if not _START or not _FILES:
    return
  wall = time.perf_counter() - _START[0]
  terminalreporter.write_line(
      f"suite wall time {wall:.0f} s; the {min(SHOWN, len(_FILES))} slowest "
      "files (seconds of their tests):")
  for path, seconds in _FILES.most_common(SHOWN):
    terminalreporter.write_line(f"  {seconds:8.1f}  {path}")
