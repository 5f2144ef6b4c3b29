"""``index-cache``: offline indexing for the cached reranker (VEDJE Alg. 1, lines 2–5): every item's
frames through the frozen backbone and the trained compressor, one Parquet row per item with its
encoded cache Z(v) (BF16 by default; ``vedje.precision`` fp8 / fp4), plus the stage-1 index.
Needs a finished ``train-vedje`` run; a cache records the backbone and compressor it was built with."""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks import vedje
from tasks.framework.context import RunContext, run_locked
from tasks.framework.runner import run_pipeline
from tasks.framework.stage import Pipeline
from tasks.framework.task_runners import default_task_runner
from tasks.vedje.index_cache import IndexCache

FLOW_NAME = "index-cache"
PIPELINE = Pipeline(FLOW_NAME, (IndexCache(),), until={"index": "index-cache"})
STAGES = PIPELINE.stop_names


@flow(name=FLOW_NAME, task_runner=default_task_runner(), log_prints=True)
def index_cache(profile: str = "demo", overrides: dict[str, Any] | None = None, output_root: str | None = None,
                until: str | None = None) -> dict[str, Any]:
    """Write the per-item caches and the stage-1 index (one task per shard of items)."""
    return run_locked(FLOW_NAME, STAGES, profile, overrides, output_root, until, _run)


def _run(ctx: RunContext, until: str | None) -> dict[str, Any]:
    return vedje.summary(ctx, run_pipeline(ctx, PIPELINE, until))


if __name__ == "__main__":
    index_cache()
