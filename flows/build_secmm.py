"""``build-secmm``: the DSMM-TBIR engine flow (ingest → denoise; later stages join here)."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from rde.profiles import load_profile
from tasks import denoise, ingest
from tasks.context import RunContext
from tasks.summary import publish_summary, run_summary

FLOW_NAME = "build-secmm"


@flow(name=FLOW_NAME, task_runner=ThreadPoolTaskRunner(max_workers=2), log_prints=True)
def build_secmm(profile: str = "demo", overrides: dict[str, Any] | None = None,
                output_root: str | None = None) -> dict[str, Any]:
    """Build the SecMM-style benchmark from the profile's inputs; returns the run summary."""
    ctx = RunContext(load_profile(profile, overrides), FLOW_NAME, output_root)
    ingested = ingest.run_ingest(ctx)
    ingest.publish(ingested, FLOW_NAME)
    measured = denoise.run_measure(ctx, ingested.artifacts["images"])
    denoised = denoise.decide_task(ctx, ingested.artifacts["images"], measured.artifacts["measurements"])
    denoise.publish(denoised, FLOW_NAME)
    summary = run_summary(ctx, [ingested, measured, denoised])
    publish_summary(FLOW_NAME, summary)
    return summary


if __name__ == "__main__":
    build_secmm()
