"""The load benchmark's own arithmetic and log reading (the runs themselves are in
tests/test_deployment_stack.py::test_concurrent_probe_runs_complete_on_sqlite_and_postgres)."""

from __future__ import annotations

import pytest

from entry.orchestration_load import _log_errors, percentile


def test_percentile_interpolates_between_order_statistics() -> None:
    # position (n − 1)·q/100: for [4, 1, 3, 2] and q = 95 it is 2.85 → 3 + 0.85·(4 − 3)
    assert percentile([4.0, 1.0, 3.0, 2.0], 95) == pytest.approx(3.85)
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([7.0], 95) == 7.0 and percentile([], 95) == 0.0


def test_server_log_errors_are_counted_by_kind() -> None:
    log = ("sqlite3.OperationalError: database is locked\n"
           "INFO ok\n(sqlalchemy.exc.OperationalError) Database is locked\n"
           "asyncio.TimeoutError\nQueuePool limit of size 5 overflow 10 reached\n")
    assert _log_errors(log) == {"database is locked": 2, "timeout": 2}
