"""``run-shards``: one range of a fanned-out stage's shards, run by any worker of the pool.

A parent flow whose profile turns ``prefect.fanout`` on submits these runs (``tasks.framework.fanout``) for
its per-shard GPU stages (deployment ``run-shards/gpu``) and, where ``prefect.fanout.cpu_deployment``
names one, its per-shard CPU stages (``run-shards/cpu``); each loads the same profile, finds the same
stage of the same pipeline, checks that it computes the parent's stage key, loads its models once
and runs the stage's own shard tasks for its range. The parent writes the manifest.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from prefect import flow

from rde.profile import load_profile
from tasks.framework.context import RunContext
from tasks.framework.runner import run_shard_range
from tasks.framework.stage import Pipeline, Stage
from tasks.framework.task_runners import default_task_runner

FLOW_NAME = "run-shards"
# flow name -> the module that declares its PIPELINE, imported only when a run asks for that flow: a
# build-secmm or build-largefine shard range then never imports torch (the VEDJE flows' modules do)
# (a module's PIPELINE is a Pipeline, or a function of the run's profile and output root that builds
# one: ``evaluate``'s stages follow the models and benchmark its profile names)
PIPELINE_MODULES: dict[str, str] = {"build-secmm": "flows.build_secmm", "build-largefine": "flows.build_largefine",
                                    "index-cache": "flows.index_cache", "train-vedje": "flows.train_vedje",
                                    "evaluate": "flows.evaluate"}


def pipeline(flow_name: str, ctx: RunContext | None = None) -> Pipeline:
    """The pipeline of flow ``flow_name`` (built from ``ctx``'s profile where the flow's stages
    follow it); a clear error for an unknown name."""
    if flow_name not in PIPELINE_MODULES:
        raise ValueError(f"run-shards: no pipeline {flow_name!r} (known: {sorted(PIPELINE_MODULES)})")
    found = import_module(PIPELINE_MODULES[flow_name]).PIPELINE
    if not isinstance(found, Pipeline):
        if ctx is None:
            raise ValueError(f"run-shards: {flow_name}'s stages follow its profile; give the run's context")
        found = found(ctx.profile, ctx.output_root)
    if found.name != flow_name:
        raise RuntimeError(f"run-shards: {PIPELINE_MODULES[flow_name]} declares pipeline {found.name!r}, "
                           f"not {flow_name!r}")
    return found


def pipeline_stage(flow_name: str, stage: str, ctx: RunContext | None = None) -> Stage:
    """The stage ``stage`` of the pipeline of flow ``flow_name``; a clear error for unknown names."""
    stages = pipeline(flow_name, ctx).stages
    found = [s for s in stages if s.name == stage]
    if not found:
        raise ValueError(f"run-shards: {flow_name} has no stage {stage!r} (its stages: {[s.name for s in stages]})")
    if not found[0].per_shard:
        raise ValueError(f"run-shards: {flow_name}'s stage {stage!r} works over its whole input, not per shard")
    return found[0]


@flow(name=FLOW_NAME, task_runner=default_task_runner(), log_prints=True)
def run_shards(flow_name: str, stage: str, stage_key: str, indices: list[int], profile: str = "demo",
               overrides: dict[str, Any] | None = None, output_root: str | None = None,
               locations: dict[str, str] | None = None) -> dict[str, Any]:
    """Run shards ``indices`` of ``flow_name``'s stage ``stage`` for ``stage_key``; returns the
    shards it computed and those it found already written."""
    ctx = RunContext(load_profile(profile, overrides), flow_name, output_root, locations=dict(locations or {}),
                     source=profile, overrides=overrides)
    return run_shard_range(ctx, pipeline_stage(flow_name, stage, ctx), stage_key, indices)


if __name__ == "__main__":
    raise SystemExit("run-shards is started by a parent flow through its deployments (prefect.yaml: "
                     "run-shards/gpu, run-shards/cpu)")
