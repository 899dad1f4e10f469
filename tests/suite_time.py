"""The suite's own time in every log: after the summary, the session's wall
time and the ten test files that took longest (setup, call and teardown of
their tests summed; with pytest-xdist's `--dist loadfile` a file runs on one
worker, so its sum is the time it held that worker). A file that grew slow
shows in every CI log. Under pytest-xdist it also gives each worker's busy
seconds and when it finished its last test: a worker that finished long
before the other waited idle at the end (a slow file scheduled last).

Loaded by tests/conftest.py (`pytest_plugins`); tests/test_suite_time.py
runs it in a pytest of its own.
"""

import collections
import time

SHOWN = 10
_START: list[float] = []
_FILES: collections.Counter = collections.Counter()
_BUSY: collections.Counter = collections.Counter()
_DONE: dict[str, float] = {}


def pytest_sessionstart(session):  # pylint: disable=unused-argument
  _START.append(time.perf_counter())


def pytest_runtest_logreport(report):
  # On the xdist controller this sees every worker's reports as well.
  _FILES[report.nodeid.split("::", 1)[0]] += report.duration
  node = getattr(report, "node", None)  # xdist's controller sets it
  if node is not None and _START:
    worker = node.gateway.id
    _BUSY[worker] += report.duration
    _DONE[worker] = time.perf_counter() - _START[0]


def pytest_terminal_summary(terminalreporter):
  if not _START or not _FILES:
    return
  wall = time.perf_counter() - _START[0]
  terminalreporter.write_line(
      f"suite wall time {wall:.0f} s; the {min(SHOWN, len(_FILES))} slowest "
      "files (seconds of their tests):")
  for path, seconds in _FILES.most_common(SHOWN):
    terminalreporter.write_line(f"  {seconds:8.1f}  {path}")
  if _BUSY:
    each = [f"{w} {_BUSY[w]:.0f} s, {_DONE[w]:.0f} s" for w in sorted(_BUSY)]
    terminalreporter.write_line(
        "workers (busy seconds, finished at): " + "; ".join(each))
