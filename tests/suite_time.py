"""The suite's own time in every log: after the summary, the session's wall
time and the ten test files that took longest (setup, call and teardown of
their tests summed; with pytest-xdist's `--dist loadfile` a file runs on one
worker, so its sum is the time it held that worker). A file that grew slow
shows in every CI log. Under pytest-xdist it also gives each worker's busy
seconds and when it finished its last test: a worker that finished long
before the other waited idle at the end (a slow file scheduled last).
Where the tests ran JAX, it also sums what JAX reported spending, in the
tests' own processes (not in the subprocesses they start), on tracing,
lowering to MLIR and XLA's compiling: what is left of the tests' seconds
is running, Python and subprocesses.

Loaded by tests/conftest.py (`pytest_plugins`); tests/test_suite_time.py
runs it in a pytest of its own.
"""

import collections
import sys
import time

import pytest

SHOWN = 10
_START: list[float] = []
_FILES: collections.Counter = collections.Counter()
_BUSY: collections.Counter = collections.Counter()
_DONE: dict[str, float] = {}
# JAX's monitoring events (jax._src.dispatch) and their names here.
JAX_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "tracing",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering",
              "/jax/core/compile/backend_compile_duration": "compiling"}
_JAX: collections.Counter = collections.Counter()    # since the last report
_SPENT: collections.Counter = collections.Counter()  # summed from reports
_LISTENING: list[bool] = []


def _listen(event, seconds, **kwargs):  # pylint: disable=unused-argument
  name = JAX_EVENTS.get(event)
  if name:
    _JAX[name] += seconds


def pytest_runtest_setup(item):  # pylint: disable=unused-argument
  # Listens once JAX is imported (the plugin itself never imports it).
  if not _LISTENING and "jax" in sys.modules:
    sys.modules["jax"].monitoring.register_event_duration_secs_listener(
        _listen)
    _LISTENING.append(True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # pylint: disable=unused-argument
  # The seconds travel with the report (xdist sends it to the controller).
  outcome = yield
  if _JAX:
    outcome.get_result().user_properties.append(("jax_seconds", dict(_JAX)))
    _JAX.clear()


def pytest_sessionstart(session):  # pylint: disable=unused-argument
  _START.append(time.perf_counter())


def pytest_runtest_logreport(report):
  # On the xdist controller this sees every worker's reports as well.
  _FILES[report.nodeid.split("::", 1)[0]] += report.duration
  for key, value in report.user_properties:
    if key == "jax_seconds":
      _SPENT.update(value)
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
  if _SPENT:
    terminalreporter.write_line(
        f"of the tests' {sum(_FILES.values()):.0f} s, JAX in their own "
        "processes: " + ", ".join(f"{name} {_SPENT[name]:.2f} s"
                                  for name in JAX_EVENTS.values()))
  if _BUSY:
    each = [f"{w} {_BUSY[w]:.0f} s, {_DONE[w]:.0f} s" for w in sorted(_BUSY)]
    terminalreporter.write_line(
        "workers (busy seconds, finished at): " + "; ".join(each))
