"""A time budget for the slow tests: CI runs them only while they can finish.

CI (`.ci/run`) has 90 minutes on a 2-core machine whose CPU varies: the same
suites take ~2.5x longer on its AMD EPYC than on its Intel Xeon (docs/testing.md,
"The suites"). It sets FEDJAX_DG_SLOW_DEADLINE (Unix seconds): a test marked
`slow` that would start after it is skipped, with the reason, and the summary
counts them, so a slow CPU runs fewer slow tests instead of being stopped
mid-test with nothing reported. Unset (`make test-slow` by hand), every slow
test runs. Tests not marked `slow` are never skipped by it.

Loaded by tests/conftest.py (`pytest_plugins`); tests/test_ci_budget.py runs it
in a pytest of its own.
"""

import os
import time

import pytest

ENV = "FEDJAX_DG_SLOW_DEADLINE"
REASON = "CI time budget"


def deadline() -> float | None:
  """FEDJAX_DG_SLOW_DEADLINE as Unix seconds, None when unset or empty."""
  value = os.environ.get(ENV, "").strip()
  if not value:
    return None
  try:
    return float(value)
  except ValueError:
    raise pytest.UsageError(
        f"{ENV}={value!r} is not a number: it is the Unix time (seconds, as "
        f"`date +%s` prints) after which no slow test starts; unset it to run "
        f"every slow test") from None


def pytest_configure(config):  # pylint: disable=unused-argument
  deadline()  # a bad value stops the session before any test runs


def pytest_runtest_setup(item):
  end = deadline()
  if end is not None and item.get_closest_marker("slow") and time.time() > end:
    pytest.skip(f"{REASON}: started after {ENV} "
                f"({time.strftime('%H:%M:%S', time.localtime(end))}); "
                f"run it with `make test-slow`")


def pytest_terminal_summary(terminalreporter):
  skipped = [r for r in terminalreporter.stats.get("skipped", [])
             if REASON in str(getattr(r, "longrepr", ""))]
  if skipped:
    terminalreporter.write_line(
        f"{len(skipped)} slow tests not run: past {ENV} ({REASON}, "
        f"tests/slow_budget.py); `make test-slow` runs them all", yellow=True)
