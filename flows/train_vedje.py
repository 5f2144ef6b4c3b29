"""``train-vedje``: the cached joint reranker (VEDJE Sec. 3; App. A.3): frozen backbone features
and stage-1 embeddings of the profile's items, then joint training of compressor + reranker with
VTM + VTC + MLM + future-delta losses, evaluated as stage 1 vs rerank on the test split."""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks import vedje
from tasks.framework.context import RunContext, run_locked
from tasks.framework.runner import run_pipeline
from tasks.framework.stage import Pipeline
from tasks.framework.task_runners import default_task_runner
from tasks.vedje.features import VedjeFeatures
from tasks.vedje.train import VedjeTrain

FLOW_NAME = "train-vedje"
PIPELINE = Pipeline(FLOW_NAME, (VedjeFeatures(), VedjeTrain()),
                    until={"features": "vedje-features", "train": "vedje-train"})
STAGES = PIPELINE.stop_names


@flow(name=FLOW_NAME, task_runner=default_task_runner(), log_prints=True)
def train_vedje(profile: str = "demo", overrides: dict[str, Any] | None = None, output_root: str | None = None,
                until: str | None = None) -> dict[str, Any]:
    """Features of the profile's ``vedje.source`` items, then training and evaluation."""
    return run_locked(FLOW_NAME, STAGES, profile, overrides, output_root, until, _run)


def _run(ctx: RunContext, until: str | None) -> dict[str, Any]:
    return vedje.summary(ctx, run_pipeline(ctx, PIPELINE, until))


if __name__ == "__main__":
    train_vedje()
