"""``build-secmm``: the DSMM-TBIR engine flow, as a list of stages.

ingest → measure → denoise → near-duplicates → caption pool → statistics → DAP queries → CGDS gallery → MECF
candidates (Eq. 1) → benchmark export (unverified until reviewed) → evaluation.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks.framework.context import RunContext, run_locked
from tasks.framework.runner import run_pipeline
from tasks.framework.stage import Pipeline
from tasks.framework.summary import publish_summary
from tasks.framework.task_runners import default_task_runner
from tasks.pool import CLEAN_POOL
from tasks.pool.summary import run_summary
from tasks.secmm import SECMM_STAGES

FLOW_NAME = "build-secmm"
PIPELINE = Pipeline(FLOW_NAME, CLEAN_POOL + SECMM_STAGES,
                    until={"denoise": "denoise", "queries": "dap", "gallery": "cgds", "candidates": "mecf",
                           "benchmark": "export", "evaluate": "evaluate"})
STAGES = PIPELINE.stop_names


@flow(name=FLOW_NAME, task_runner=default_task_runner(), log_prints=True)
def build_secmm(profile: str = "demo", overrides: dict[str, Any] | None = None,
                output_root: str | None = None, until: str | None = None,
                retry_rejects: bool = False) -> dict[str, Any]:
    """Build the SecMM-style benchmark from the profile's inputs; returns the run summary.

    ``until`` stops after a stage (a stop name such as ``denoise`` or ``queries``, or any stage's
    name), e.g. ``denoise`` for only the cleaned pool.

    ``retry_rejects`` redoes, in stages already complete, the inputs rejected for a transient
    reason (a failed read, a generator timeout) and keeps every other row.
    """
    return run_locked(FLOW_NAME, STAGES, profile, overrides, output_root, until, _run, retry_rejects)


def _run(ctx: RunContext, until: str | None) -> dict[str, Any]:
    summary = run_summary(ctx, run_pipeline(ctx, PIPELINE, until))
    publish_summary(FLOW_NAME, summary)
    return summary


if __name__ == "__main__":
    build_secmm()
