"""``build-largefine``: the GTR+ generation stage into LargeFine-Person-style shards.

ingest → denoise → select + hard-negative neighbours → base + intermediate tiers (per shard, ``gpu``
tag) → template gallery (extract and expand) → advanced tier (per shard) → export + dataset card.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from rde.task_runners import default_task_runner
from tasks import denoise, largefine
from tasks.context import RunContext, run_locked
from tasks.reporting import publish_table
from tasks.sharded import StageResult
from tasks.summary import publish_summary, run_summary

FLOW_NAME = "build-largefine"
STAGES = ("denoise", "neighbours", "tiers", "gallery", "advanced", "export")


@flow(name=FLOW_NAME, task_runner=default_task_runner(), log_prints=True)
def build_largefine(profile: str = "demo", overrides: dict[str, Any] | None = None,
                    output_root: str | None = None, until: str | None = None) -> dict[str, Any]:
    """Caption the profile's person images in three tiers; returns the run summary (with the
    caption accounting: captions + rejected texts = 3 × captioned images)."""
    return run_locked(FLOW_NAME, STAGES, profile, overrides, output_root, until, _run)


def _run(ctx: RunContext, until: str | None) -> dict[str, Any]:
    results: list[StageResult] = []

    def finish(captioning: list[StageResult]) -> dict[str, Any]:
        for result in results[3:]:
            largefine.publish(result, FLOW_NAME)
        summary = run_summary(ctx, results)
        if captioning:
            rows = largefine.throughput_rows(captioning, ctx)
            summary["captioning"] = rows
            publish_table(f"{FLOW_NAME}-throughput", rows,
                          "Captioning stages: retention, generator calls, tokens, images/s and tokens/s")
        publish_summary(FLOW_NAME, summary)
        return summary

    results += denoise.run_clean_pool(ctx)
    if until == "denoise":
        return finish([])
    accepted = results[-1].artifacts["accepted"]
    neighbours = largefine.neighbours_task(ctx, accepted)
    results.append(neighbours)
    if until == "neighbours":
        return finish([])
    tiers = largefine.run_qa_tiers(ctx, accepted, neighbours.artifacts["neighbours"])
    results.append(tiers)
    if until == "tiers":
        return finish([tiers])
    gallery = largefine.gallery_task(ctx, tiers.artifacts["captions"])
    results.append(gallery)
    if until == "gallery":
        return finish([tiers])
    advanced = largefine.run_advanced_tier(ctx, accepted, neighbours.artifacts["neighbours"],
                                           tiers.artifacts["captions"], gallery.artifacts["templates"])
    results.append(advanced)
    if until == "advanced":
        return finish([tiers, advanced])
    results.append(largefine.export_task(ctx, neighbours.artifacts["neighbours"], tiers.artifacts["captions"],
                                         tiers.artifacts["rejects"],
                                         advanced.artifacts["captions"], advanced.artifacts["rejects"]))
    return finish([tiers, advanced])


if __name__ == "__main__":
    build_largefine()
