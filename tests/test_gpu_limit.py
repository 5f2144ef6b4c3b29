"""Model stages hold a slot of the ``gpu`` global concurrency limit while they compute: with a limit
of 1, two shards that would run at once on the flow's two task threads take turns."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

pytestmark = pytest.mark.slow
HOLD_S = 2.0  # how long a shard under the limit gives the other the chance to compute at the same time
DEADLINE_S = 120.0  # for what must happen (the other shard asking, starting), however loaded the machine


def test_two_captioning_shards_under_a_limit_of_one_do_not_overlap(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """No sleep stands in for "the other shard started": a shard holds the device until the other
    has asked for the slot (``concurrency`` entered; or computes already) and then until the other
    is computing too, or HOLD_S passed. Under the limit the other cannot compute meanwhile, so the hold ends at HOLD_S
    (a loaded machine only makes it end later, never makes the check fail); without a limit, both
    compute at once at the first chance, however late it comes."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    from rde.profile import load_profile
    from tasks.framework import shards
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
    lock = threading.Lock()
    asked, computing = [0], [0]
    both_computing = threading.Event()
    other_seen = threading.Event()  # both shards asked for the slot, or (without a slot) compute at once
    slot = shards.concurrency

    @contextlib.contextmanager
    def counted_slot(*args: object, **kwargs: object) -> Iterator[None]:
        with lock:
            asked[0] += 1
            if asked[0] == 2:
                other_seen.set()
        with slot(*args, **kwargs):
            yield

    monkeypatch.setattr(shards, "concurrency", counted_slot)

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
            with lock:
                threads.add(threading.get_ident())
                computing[0] += 1
                if computing[0] == 2:
                    both_computing.set()
                    other_seen.set()
            if self.resources.device == "gpu":
                assert other_seen.wait(DEADLINE_S), "the other shard never asked for the gpu slot"
                both_computing.wait(HOLD_S)  # under the limit: times out (the other waits for the slot)
            else:
                assert both_computing.wait(DEADLINE_S), "the two shards never computed at once"
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
    computing[0] = 0
    both_computing.clear()

    @flow(name="gpu-limit-check-unlimited")
    def two_shards_unlimited() -> StageResult:
        ctx = RunContext(load_profile("demo", {"prefect": {"gpu_concurrency_limit": limit}}), "gpu-limit-check",
                         str(tmp_path / "out2"))
        return run_stage(ctx, OnTheCpu())

    two_shards_unlimited()
    (_, a_end), (b_start, _) = sorted(spans.values())
    assert b_start < a_end
