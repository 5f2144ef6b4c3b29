"""``train-saft``: SAFT fine-tuning (DSMM-TBIR Sec. 3.3): ITC + α·SASS + β·ISD with the profile's
teacher precomputed once, the text tower frozen by default; baselines (ITC, ITC+SASS, CUSA,
threshold hard negatives, ITC+ISS) through ``training.saft_objective``."""

from __future__ import annotations

from typing import Any

from prefect import flow

from rde.task_runners import default_task_runner
from tasks import training
from tasks.context import RunContext, run_locked
from tasks.reporting import publish_markdown

FLOW_NAME = "train-saft"
STAGES = ("features", "train")


@flow(name=FLOW_NAME, task_runner=default_task_runner(), log_prints=True)
def train_saft(profile: str = "demo", overrides: dict[str, Any] | None = None, output_root: str | None = None,
               until: str | None = None) -> dict[str, Any]:
    """Features from the profile's build-largefine captions, then SAFT training and evaluation."""
    return run_locked(FLOW_NAME, STAGES, profile, overrides, output_root, until, _run)


def _run(ctx: RunContext, until: str | None) -> dict[str, Any]:
    features = training.features_task(ctx)
    results = [features]
    if until != "features":
        cfg = training.train_config(ctx, objective=ctx.profile.training.saft_objective)
        results.append(training.train_task(ctx, features.artifacts["features"], cfg.objective, cfg))
    return training_summary(ctx, results)


def training_summary(ctx: RunContext, results: list) -> dict[str, Any]:
    summary = {"flow": ctx.flow_name, "profile": ctx.profile.name, "output_root": ctx.root,
               "stages": [{"stage": r.stage, "skipped": r.skipped, "input": r.input_rows, "accepted": r.accepted,
                           "rejected": sum(r.rejected.values()), "shards": r.shards, "shards_reused": r.shards_resumed,
                           "seconds": round(r.seconds, 2)} for r in results],
               "artifacts": {f"{r.stage}.{n}": {"url": u} for r in results for n, u in r.artifacts.items()},
               "balanced": True, "inputs": results[0].input_rows, "accepted": results[0].accepted,
               "rejected": {f"{r.stage}:{k}": v for r in results for k, v in r.rejected.items()},
               "total_rejected": sum(sum(r.rejected.values()) for r in results[:1])}
    lines = [f"# {ctx.flow_name} ({ctx.profile.name})", "", "| stage | skipped | input | kept | seconds |",
             "|---|---|---|---|---|"]
    lines += [f"| {s['stage']} | {s['skipped']} | {s['input']} | {s['accepted']} | {s['seconds']} |"
              for s in summary["stages"]]
    lines += ["", *[f"- `{k}`: `{v['url']}`" for k, v in summary["artifacts"].items()]]
    publish_markdown(f"{ctx.flow_name}-summary", "\n".join(lines), f"{ctx.flow_name} run summary")
    return summary


if __name__ == "__main__":
    train_saft()
