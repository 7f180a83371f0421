"""A pytest plugin for scripts/gpu_tests.sh: each failure's traceback is written as it happens, not in the summary at
the end, so a target stopped by its time limit (`timeout` kills pytest before its summary) still shows why the
tests before it failed. Loaded with `-p instafail` (gpu_tests.sh puts scripts/ on PYTHONPATH)."""

from __future__ import annotations

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        print(f"\n== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n", flush=True)
