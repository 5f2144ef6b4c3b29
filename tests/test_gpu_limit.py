"""Model stages hold a slot of the ``gpu`` global concurrency limit while they compute: with a limit
of 1, two shards that would run at once on the flow's two task threads take turns."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest

pytestmark = pytest.mark.slow


def test_two_captioning_shards_under_a_limit_of_one_do_not_overlap(tmp_path: Path) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    from rde.common.profiles import load_profile
    from tasks.framework.accounting import StageResult
    from tasks.framework.context import RunContext
    from tasks.framework.runner import run_stage
    from tasks.framework.stage import Resources, Stage, StageRun, Work, Write

    limit = f"gpu-test-{tmp_path.name[-12:]}"
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=limit, limit=1))
    schema = pa.schema([pa.field("id", pa.string(), nullable=False)])
    spans: dict[int, tuple[float, float]] = {}
    threads: set[int] = set()

    class Captioning(Stage):
        """Stands in for a captioning stage: each of its two shards holds the device for a while."""

        name = "qa-tiers"
        version = "1"
        writes = (Write("captions", "captions", schema),)
        resources = Resources(device="gpu")

        def shard_count(self, run: StageRun) -> int:
            return 2

        def process(self, run: StageRun, index: int) -> Work:
            began = time.monotonic()
            threads.add(threading.get_ident())
            time.sleep(1.5)
            spans[index] = (began, time.monotonic())
            return Work.one({"captions": pa.table({"id": [f"{index}"]}, schema=schema)},
                            {"input_rows": 1, "accepted": 1, "rejected": {}})

    class OnTheCpu(Captioning):
        resources = Resources(device="cpu")

    @flow(name="gpu-limit-check")
    def two_shards() -> StageResult:
        ctx = RunContext(load_profile("demo", {"prefect": {"gpu_concurrency_limit": limit}}), "gpu-limit-check",
                         str(tmp_path / "out"))
        return run_stage(ctx, Captioning())

    result = two_shards()
    assert result.accepted == 2 and len(spans) == 2
    assert len(threads) == 2, "the two shards did not run on two threads, so the limit was not exercised"
    (_, a_end), (b_start, _) = sorted(spans.values())
    assert b_start >= a_end, f"shards overlapped under a limit of 1: {spans}"

    # without the limit (a stage that does not declare a GPU) the same two shards do run at once (the
    # check above can fail)
    spans.clear()

    @flow(name="gpu-limit-check-unlimited")
    def two_shards_unlimited() -> StageResult:
        ctx = RunContext(load_profile("demo", {"prefect": {"gpu_concurrency_limit": limit}}), "gpu-limit-check",
                         str(tmp_path / "out2"))
        return run_stage(ctx, OnTheCpu())

    two_shards_unlimited()
    (_, a_end), (b_start, _) = sorted(spans.values())
    assert b_start < a_end
