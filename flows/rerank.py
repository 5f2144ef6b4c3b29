"""``rerank``: online reranking (VEDJE Alg. 1, lines 6–13): stage-1 text encoding and search, cache
fetch for the top-N_c, joint scoring with the stage-1 prior. Without ``queries`` it reranks the
test split's captions and reports R@K of stage 1 vs rerank; caches must match the trained model."""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks import vedje
from tasks.framework.context import run_locked
from tasks.framework.runner import run_pipeline
from tasks.framework.stage import Pipeline
from tasks.framework.task_runners import default_task_runner
from tasks.vedje.rerank import Rerank

FLOW_NAME = "rerank"
STAGES = ("rerank",)


@flow(name=FLOW_NAME, task_runner=default_task_runner(), log_prints=True)
def rerank(profile: str = "demo", overrides: dict[str, Any] | None = None, output_root: str | None = None,
           until: str | None = None, queries: list[str] | None = None) -> dict[str, Any]:
    """Rerank ``queries`` (or the labelled test captions) over the cached items."""
    return run_locked(FLOW_NAME, STAGES, profile, overrides, output_root, until,
                      lambda ctx, _until: vedje.summary(ctx, run_pipeline(ctx, _pipeline(queries), None)))


def _pipeline(queries: list[str] | None) -> Pipeline:
    """One stage; the queries to rerank are the stage's input (in its key)."""
    return Pipeline(FLOW_NAME, (Rerank(queries),))


if __name__ == "__main__":
    rerank()
