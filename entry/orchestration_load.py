"""Many concurrent flow runs against one local stack: what the orchestration holds.

``submit_and_wait`` creates ``concurrent`` runs of the ``stack-probe/probe`` deployment at once
(each maps ``shards`` tasks and publishes an artifact) through the REST API, waits for all to end,
and reports runs completed / failed, task runs per second, submission-to-start p50/p95, the
server's peak memory (RSS of its process tree, sampled) and the database errors its log gained
("database is locked", timeouts). Used by ``benchmarks/orchestration_load.py`` and a bounded test.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import httpx
import psutil

from entry.stack import StackConfig, api_request

PROBE_DEPLOYMENT = ("stack-probe", "probe")
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
DB_ERRORS = {"database is locked": re.compile(r"database is locked", re.I),
             "timeout": re.compile(r"TimeoutError|timed out|QueuePool limit", re.I)}


@dataclass
class LoadResult:
    database: str
    concurrent: int
    shards: int
    completed: int = 0
    failed: int = 0
    unfinished: int = 0
    submit_retries: int = 0  # create_flow_run answers of 5xx / lost connections, retried
    submit_failed: int = 0  # runs never created after all retries
    task_runs_completed: int = 0
    seconds: float = 0.0
    task_runs_per_s: float = 0.0
    start_p50_s: float = 0.0
    start_p95_s: float = 0.0
    server_peak_rss_mb: float = 0.0
    db_errors: dict[str, int] = field(default_factory=dict)
    states: dict[str, int] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return asdict(self)


def _retrying(call: Callable[[], Any], attempts: int, max_sleep: float,
              on_failure: Callable[[], None] = lambda: None) -> Any:
    """``call()``; a 5xx answer or a lost connection is retried with a doubling back-off (1, 2, 4, …
    s, at most ``max_sleep``), as Prefect's own client does, and counted by ``on_failure``; the last
    failure is raised. A 4xx answer is raised at once."""
    for attempt in range(attempts):
        try:
            return call()
        except httpx.HTTPStatusError as err:
            if err.response.status_code < 500:
                raise
            failure: Exception = err
        except httpx.TransportError as err:
            failure = err
        on_failure()
        if attempt + 1 == attempts:
            raise failure
        time.sleep(min(2.0 ** attempt, max_sleep))
    raise AssertionError("unreachable")


def _read(cfg: StackConfig, path: str, body: dict) -> Any:
    """A filter / count call that waits out an overloaded server instead of ending the
    measurement: the busy server is what is measured."""
    return _retrying(lambda: api_request(cfg, "POST", path, body), attempts=8, max_sleep=30.0)


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0–100) by linear interpolation between order statistics (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class TreeMemory:
    """Peak RSS of a process and its children, sampled every ``every`` seconds in a thread."""

    def __init__(self, pid: int, every: float = 0.5) -> None:
        self.pid, self.every, self.peak = pid, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                total = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
                self.peak = max(self.peak, total)
            except psutil.Error:
                pass
            self._stop.wait(self.every)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _submit(cfg: StackConfig, deployment_id: str, parameters: dict, result: LoadResult) -> dict | None:
    """Create one flow run (6 tries); failed answers and runs never created are counted in ``result``."""

    def failed() -> None:
        result.submit_retries += 1

    try:
        return _retrying(lambda: api_request(cfg, "POST", f"/deployments/{deployment_id}/create_flow_run",
                                      {"parameters": parameters}), attempts=6, max_sleep=float("inf"),
                         on_failure=failed)
    except httpx.TransportError:
        pass
    except httpx.HTTPStatusError as err:
        if err.response.status_code < 500:
            raise
    result.submit_failed += 1
    return None


def _log_errors(text: str) -> dict[str, int]:
    return {name: len(pattern.findall(text)) for name, pattern in DB_ERRORS.items()}


def submit_and_wait(cfg: StackConfig, concurrent: int, shards: int = 50, work_ms: int = 20,
                    timeout_s: float = 900.0, label: str = "") -> LoadResult:
    """``concurrent`` probe runs submitted at once; returns when all ended or ``timeout_s`` passed."""
    database = "postgres" if cfg.postgres else ("url" if cfg.database_url else "sqlite")
    result = LoadResult(database, concurrent, shards)
    [deployment] = api_request(cfg, "POST", "/deployments/filter", {
        "flows": {"name": {"any_": [PROBE_DEPLOYMENT[0]]}}, "deployments": {"name": {"any_": [PROBE_DEPLOYMENT[1]]}}})
    log_path = cfg.folder / "server.log"
    log_offset = log_path.stat().st_size if log_path.exists() else 0
    server_pid = int((cfg.folder / "server.pid").read_text())
    with TreeMemory(server_pid) as memory:
        start = time.monotonic()
        ids = []
        for i in range(concurrent):
            run = _submit(cfg, deployment["id"], {"shards": shards, "work_ms": work_ms, "label": f"{label}{i}"},
                          result)
            if run is not None:
                ids.append(run["id"])
        while True:
            found = _read(cfg, "/flow_runs/filter", {"flow_runs": {"id": {"any_": ids}}}) if ids else []
            if all(r["state_type"] in TERMINAL for r in found) or time.monotonic() - start > timeout_s:
                break
            time.sleep(1.0)
        result.seconds = round(time.monotonic() - start, 2)
    result.server_peak_rss_mb = round(memory.peak / 2**20, 1)
    for r in found:
        result.states[r["state_type"]] = result.states.get(r["state_type"], 0) + 1
    result.completed = result.states.get("COMPLETED", 0)
    result.unfinished = sum(n for s, n in result.states.items() if s not in TERMINAL)
    result.failed = len(found) - result.completed - result.unfinished + result.submit_failed
    waits = [(_time(r["start_time"]) - _time(r["created"])).total_seconds() for r in found if r.get("start_time")]
    result.start_p50_s = round(statistics.median(waits), 2) if waits else 0.0
    result.start_p95_s = round(percentile(waits, 95), 2)
    # task-run states reach the database through the server's event pipeline: wait for it to settle
    expected, settle = result.completed * shards, time.monotonic() + 60
    while True:
        result.task_runs_completed = int(_read(cfg, "/task_runs/count", {
            "flow_runs": {"id": {"any_": ids}}, "task_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}}))
        if result.task_runs_completed >= expected or time.monotonic() > settle:
            break
        time.sleep(1.0)
    result.task_runs_per_s = round(result.task_runs_completed / max(result.seconds, 1e-9), 2)
    with open(log_path, "rb") as fh:
        fh.seek(log_offset)
        result.db_errors = _log_errors(fh.read().decode(errors="replace"))
    return result
