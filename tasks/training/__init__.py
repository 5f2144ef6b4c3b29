"""Training flows' stages, one module each: training-features (``features``) → train (``train``),
and the flow-level glue: the pipeline a method runs and its run summary."""

from __future__ import annotations

from typing import Any

from rde.training.pair_selection import features_layout
from rde.training.retrieval_training import (
    TrainConfig,
)
from rde.training.training_data import train_config
from storage import Artifact
from tasks.framework import accounting
from tasks.framework.context import RunContext
from tasks.framework.reporting import accounting_line, publish_markdown, split_name
from tasks.framework.runner import run_pipeline
from tasks.framework.stage import Pipeline
from tasks.training.features import TrainingFeatures, _source_root
from tasks.training.train import Train

__all__ = ["run_training", "train_config", "training_summary"]


def run_training(ctx: RunContext, until: str | None, method: str, cfg: TrainConfig) -> dict[str, Any]:
    """The body of both training flows: features, then (unless ``until='features'``) training —
    a pipeline of two stages, the second named after the method."""
    train_stage = Train(method, cfg)
    captions = Artifact(f"{_source_root(ctx)}/largefine")
    layout = features_layout(ctx.profile.training, captions.count_rows()) if captions.is_complete() else "features"
    pipeline = Pipeline(ctx.flow_name, (TrainingFeatures(layout), train_stage),
                        until={"features": "training-features", "train": train_stage.name})
    results = run_pipeline(ctx, pipeline, until)
    return training_summary(ctx, results, captions.count_rows())


def training_summary(ctx: RunContext, results: list[accounting.StageResult],
                     counted_inputs: int | None = None) -> dict[str, Any]:
    """The run summary of a training flow (stages, artifacts), also as a markdown artifact. The first
    stage's rows are reported as splits (train, held-out or test: evaluation data, not rejects) and
    rejected rows by reason; ``balanced`` compares ``counted_inputs`` (the source counted on its own;
    default the first stage's input) with splits + rejected, and every stage's input with its
    accepted + rejected rows."""
    first = results[0]
    splits = dict(first.splits)
    total_rejected = sum(first.rejected.values())
    inputs = first.input_rows if counted_inputs is None else counted_inputs
    kept = sum(splits.values()) if splits else first.accepted
    balanced = (inputs == kept + total_rejected and kept == first.accepted
                and all(r.input_rows == r.accepted + sum(r.rejected.values()) for r in results))
    summary = {"flow": ctx.flow_name, "profile": ctx.profile.name, "output_root": ctx.root,
               "stages": [r.summary_row() for r in results],
               "artifacts": {n: {"url": u} for r in results for n, u in r.artifacts.items()},
               "balanced": balanced, "inputs": inputs, "accepted": first.accepted, "splits": splits,
               "rejected": {f"{r.stage}:{k}": v for r in results for k, v in r.rejected.items()},
               "total_rejected": total_rejected}
    lines = [f"# {ctx.flow_name} ({ctx.profile.name})", "",
             f"{accounting_line(summary)}; balanced: **{balanced}**", "",
             "| stage | skipped | input | kept | seconds |", "|---|---|---|---|---|"]
    lines += [f"| {s['stage']} | {s['skipped']} | {s['input']} | {s['accepted']} | {s['seconds']} |"
              for s in summary["stages"]]
    if splits:
        lines += ["", f"| {first.stage} split | rows |", "|---|---|",
                  *[f"| {split_name(k)} | {v} |" for k, v in splits.items()]]
    if summary["rejected"]:
        lines += ["", "| rejected rows by stage:reason | count |", "|---|---|",
                  *[f"| {k} | {v} |" for k, v in sorted(summary["rejected"].items(), key=lambda kv: -kv[1])]]
    lines += ["", *[f"- `{k}`: `{v['url']}`" for k, v in summary["artifacts"].items()]]
    publish_markdown(f"{ctx.flow_name}-summary", "\n".join(lines), f"{ctx.flow_name} run summary")
    return summary
