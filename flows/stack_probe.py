"""``stack-probe``: the orchestration alone, no models and no data: one flow run maps ``shards``
tasks that each do ``work_ms`` of work, then publishes a table artifact of what ran. It is what
``benchmarks/orchestration_load.py`` submits many times at once to see how many concurrent runs a
server (SQLite or PostgreSQL) holds, and a quick check that a stack's worker runs flows at all."""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from tasks.framework.reporting import publish_table
from tasks.framework.task_runners import default_task_runner

FLOW_NAME = "stack-probe"


@task(name="probe-shard", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def probe_shard(index: int, work_ms: int) -> dict[str, Any]:
    """One shard's stand-in: sleep ``work_ms`` (a task's own work, without using the CPU)."""
    start = time.perf_counter()
    time.sleep(work_ms / 1000.0)
    return {"shard": index, "seconds": round(time.perf_counter() - start, 4)}


@flow(name=FLOW_NAME, task_runner=default_task_runner(), log_prints=True)
def stack_probe(shards: int = 50, work_ms: int = 20, label: str = "") -> dict[str, Any]:
    """Map ``shards`` probe tasks, wait for all, publish one table artifact; returns the counts."""
    results = probe_shard.map(list(range(shards)), work_ms).result()
    rows = [{"label": label, "shards": shards, "completed": len(results),
             "task_seconds": round(sum(r["seconds"] for r in results), 3)}]
    publish_table("stack-probe", rows, f"stack-probe {label}: {len(results)}/{shards} shard tasks")
    return rows[0]


if __name__ == "__main__":
    stack_probe()
