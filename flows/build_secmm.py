"""``build-secmm``: the DSMM-TBIR engine flow.

ingest → denoise (measure, decide) → caption pool → statistics + DAP queries → CGDS gallery →
MECF candidates (Eq. 1) → benchmark export (unverified until reviewed) → evaluation.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from rde.task_runners import default_task_runner
from tasks import denoise, secmm
from tasks.context import RunContext, run_locked
from tasks.sharded import StageResult
from tasks.summary import publish_summary, run_summary

FLOW_NAME = "build-secmm"
STAGES = ("denoise", "queries", "gallery", "candidates", "benchmark", "evaluate")


@flow(name=FLOW_NAME, task_runner=default_task_runner(), log_prints=True)
def build_secmm(profile: str = "demo", overrides: dict[str, Any] | None = None,
                output_root: str | None = None, until: str | None = None) -> dict[str, Any]:
    """Build the SecMM-style benchmark from the profile's inputs; returns the run summary.

    ``until`` stops after a stage (one of STAGES), e.g. ``denoise`` for only the cleaned pool.
    """
    return run_locked(FLOW_NAME, STAGES, profile, overrides, output_root, until, _run)


def _run(ctx: RunContext, until: str | None) -> dict[str, Any]:
    results: list[StageResult] = []

    def finish() -> dict[str, Any]:
        for result in results[3:]:  # ingest and denoise published their own tables
            secmm.publish(result, FLOW_NAME)
        summary = run_summary(ctx, results)
        publish_summary(FLOW_NAME, summary)
        return summary

    results += denoise.run_clean_pool(ctx)
    if until == "denoise":
        return finish()
    accepted = results[-1].artifacts["accepted"]
    captions = secmm.caption_pool_task(ctx, accepted)
    stats, queries = secmm.dap_task(ctx, captions.artifacts["captions"])
    results += [captions, stats, queries]
    if until == "queries":
        return finish()
    gallery = secmm.cgds_task(ctx, accepted)
    results.append(gallery)
    if until == "gallery":
        return finish()
    candidates = secmm.mecf_task(ctx, queries.artifacts["queries"], gallery.artifacts["gallery"])
    results.append(candidates)
    if until == "candidates":
        return finish()
    results.append(secmm.export_task(ctx, queries.artifacts["queries"], gallery.artifacts["gallery"],
                                     candidates.artifacts["candidates"]))
    if until == "benchmark":
        return finish()
    results.append(secmm.evaluate_task(ctx, ctx.artifact_url("benchmark")))
    return finish()


if __name__ == "__main__":
    build_secmm()
