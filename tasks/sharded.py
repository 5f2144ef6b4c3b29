"""The pattern every sharded stage follows: skip if complete, resume shard by shard, finalize.

A stage writes one or more artifacts with aligned shard indices under one stage key. If all of
them are complete for the key, the stage is skipped. Otherwise shards already written for the
key are kept and only missing ones are computed; manifests are written last.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from storage import Artifact, ArtifactWriter, ShardInfo
from tasks.context import RunContext


@dataclass(frozen=True)
class Output:
    """One artifact a stage writes."""

    name: str
    url: str
    kind: str
    schema: pa.Schema

    def writer(self, stage_key: str) -> ArtifactWriter:
        return ArtifactWriter(self.url, self.kind, self.schema, stage_key)


@dataclass
class StageResult:
    """What a stage did, for summaries and tables."""

    stage: str
    skipped: bool
    artifacts: dict[str, str]
    input_rows: int
    accepted: int
    rejected: dict[str, int] = field(default_factory=dict)
    shards: int = 0
    shards_resumed: int = 0
    seconds: float = 0.0


def all_complete(outputs: Sequence[Output], stage_key: str) -> bool:
    return all(Artifact(o.url).is_complete(stage_key) for o in outputs)


def begin(outputs: Sequence[Output], stage_key: str) -> None:
    for out in outputs:
        out.writer(stage_key).begin()


def existing_shards(outputs: Sequence[Output], stage_key: str, index: int) -> dict[str, ShardInfo] | None:
    """Shards a previous run of this key wrote for ``index`` (all outputs), else None."""
    found = {o.name: o.writer(stage_key).existing_shard(index) for o in outputs}
    if any(v is None for v in found.values()):
        return None
    return found  # type: ignore[return-value]


def write_shards(outputs: Sequence[Output], stage_key: str, index: int,
                 tables: dict[str, pa.Table]) -> dict[str, ShardInfo]:
    return {o.name: o.writer(stage_key).write_shard(index, tables[o.name]) for o in outputs}


def finalize(outputs: Sequence[Output], stage_key: str, shards: Sequence[dict[str, ShardInfo]], ctx: RunContext,
             *, upstream: Sequence[Artifact] = (), config: dict[str, Any] | None = None,
             models: dict[str, Any] | None = None, stats: dict[str, Any] | None = None,
             prompt_versions: dict[str, str] | None = None) -> None:
    for out in outputs:
        out.writer(stage_key).finalize(
            [s[out.name] for s in shards], code_version=ctx.code_version, config=config, models=models,
            upstream=upstream, stats=stats, prompt_versions=prompt_versions,
        )


def run_single(ctx: RunContext, stage: str, outputs: Sequence[Output], stage_key: str,
               compute: Callable[[], tuple[dict[str, pa.Table], dict[str, Any]]], *,
               upstream: Sequence[Artifact] = (), config: dict[str, Any] | None = None,
               models: dict[str, Any] | None = None, prompt_versions: dict[str, str] | None = None,
               main_output: str | None = None) -> StageResult:
    """A stage that writes its outputs as one shard each (small results: queries, candidates...).

    ``compute`` returns the tables by output name and stats with ``input_rows``, ``accepted`` and
    ``rejected`` (reason → count); skipped when every output is complete for ``stage_key``.
    """
    main = main_output or outputs[0].name
    if all_complete(outputs, stage_key):
        return skipped_result(stage, outputs, main)
    with Timer() as timer:
        begin(outputs, stage_key)
        tables, stats = compute()
        shards = write_shards(outputs, stage_key, 0, tables)
        finalize(outputs, stage_key, [shards], ctx, upstream=upstream, config=config, models=models, stats=stats,
                 prompt_versions=prompt_versions)
    return StageResult(stage, False, {o.name: o.url for o in outputs}, int(stats.get("input_rows", 0)),
                       int(stats.get("accepted", 0)), dict(stats.get("rejected", {})), 1, 0, timer.seconds)


def reason_counts(rejects: pa.Table) -> dict[str, int]:
    counts: dict[str, int] = {}
    for reason in rejects.column("reason").to_pylist():
        counts[reason] = counts.get(reason, 0) + 1
    return counts


def merge_counts(parts: Sequence[dict[str, int]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0) + value
    return total


def skipped_result(stage: str, outputs: Sequence[Output], accepted_output: str) -> StageResult:
    """A StageResult rebuilt from complete manifests (what the stage did last time)."""
    manifests = {o.name: Artifact(o.url).manifest() for o in outputs}
    stats = manifests[accepted_output].stats
    return StageResult(stage=stage, skipped=True, artifacts={o.name: o.url for o in outputs},
                       input_rows=stats.get("input_rows", 0), accepted=stats.get("accepted", 0),
                       rejected=stats.get("rejected", {}), shards=len(manifests[accepted_output].shards))


class Timer:
    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
