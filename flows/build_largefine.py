"""``build-largefine``: the GTR+ generation stage into LargeFine-Person-style shards, as a list of stages.

ingest → measure → denoise → embed the domains' images (per shard, GPU) → select + hard-negative
neighbours → base + intermediate tiers (per
shard, holding a GPU slot) → template gallery (extract and expand) → advanced tier (per shard) →
export + dataset card.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from rde.largefine.card import throughput_rows
from tasks import largefine
from tasks.framework.context import RunContext, run_locked
from tasks.framework.reporting import publish_table
from tasks.framework.runner import run_pipeline
from tasks.framework.stage import Pipeline
from tasks.framework.summary import publish_summary
from tasks.framework.task_runners import default_task_runner
from tasks.pool import CLEAN_POOL
from tasks.pool.summary import run_summary

FLOW_NAME = "build-largefine"
PIPELINE = Pipeline(FLOW_NAME, CLEAN_POOL + largefine.LARGEFINE_STAGES,
                    until={"denoise": "denoise", "neighbours": "hard-negatives", "tiers": "qa-tiers",
                           "gallery": "template-gallery", "advanced": "adv-tier", "export": "export-webdataset"})
STAGES = PIPELINE.stop_names


@flow(name=FLOW_NAME, task_runner=default_task_runner(), log_prints=True)
def build_largefine(profile: str = "demo", overrides: dict[str, Any] | None = None,
                    output_root: str | None = None, until: str | None = None,
                    retry_rejects: bool = False) -> dict[str, Any]:
    """Caption the profile's person images in three tiers; returns the run summary (with the
    caption accounting: captions + rejected texts = 3 × captioned images).

    ``retry_rejects`` redoes, in stages already complete, the inputs rejected for a transient
    reason (a failed read, a generator timeout) and keeps every other row.
    """
    return run_locked(FLOW_NAME, STAGES, profile, overrides, output_root, until, _run, retry_rejects)


def _run(ctx: RunContext, until: str | None) -> dict[str, Any]:
    results = run_pipeline(ctx, PIPELINE, until)
    summary = run_summary(ctx, results)
    captioning = [r for r in results if r.stage in largefine.CAPTIONING]
    if captioning:
        rows = throughput_rows(captioning)
        summary["captioning"] = rows
        publish_table(f"{FLOW_NAME}-throughput", rows,
                      "Captioning stages: retention, generator calls, tokens, images/s and tokens/s")
    publish_summary(FLOW_NAME, summary)
    return summary


if __name__ == "__main__":
    build_largefine()
