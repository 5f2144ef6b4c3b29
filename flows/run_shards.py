"""``run-shards``: one range of a fanned-out stage's shards, run by any worker of the pool.

A parent flow whose profile turns ``prefect.fanout`` on submits these runs (``tasks.fanout``) for
its per-shard GPU stages; each loads the same profile, finds the same stage of the same pipeline,
checks that it computes the parent's stage key, loads its models once and runs the stage's own
shard tasks for its range. The parent writes the manifest.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows import build_largefine, build_secmm, index_cache, train_vedje
from rde.common.profiles import load_profile
from rde.common.task_runners import default_task_runner
from tasks.context import RunContext
from tasks.runner import run_shard_range
from tasks.stage import Pipeline, Stage

FLOW_NAME = "run-shards"
PIPELINES: dict[str, Pipeline] = {p.name: p for p in (build_secmm.PIPELINE, build_largefine.PIPELINE,
                                                      index_cache.PIPELINE, train_vedje.PIPELINE)}


def pipeline_stage(flow_name: str, stage: str) -> Stage:
    """The stage ``stage`` of the pipeline of flow ``flow_name``; a clear error for unknown names."""
    if flow_name not in PIPELINES:
        raise ValueError(f"run-shards: no pipeline {flow_name!r} (known: {sorted(PIPELINES)})")
    found = [s for s in PIPELINES[flow_name].stages if s.name == stage]
    if not found:
        raise ValueError(f"run-shards: {flow_name} has no stage {stage!r} "
                         f"(its stages: {[s.name for s in PIPELINES[flow_name].stages]})")
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
    return run_shard_range(ctx, pipeline_stage(flow_name, stage), stage_key, indices)


if __name__ == "__main__":
    raise SystemExit("run-shards is started by a parent flow through its deployment (prefect.yaml: run-shards/gpu)")
