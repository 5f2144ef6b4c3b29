"""Shards: where a stage's rows are written, reused after a crash, and computed as Prefect tasks.

A stage writes one or more artifacts with aligned shard indices under one stage key. Shards
already written for the key are kept and only missing ones are computed; manifests are written
last. Each shard's stats travel in its Parquet footer, so a shard reused after a crash brings its
own counts back; a shard written without them is computed again, never recounted from its rows
(its input would then be accepted + rejected by construction, and its balance could not fail).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectNotFound
from prefect.futures import as_completed
from prefect.runtime import flow_run

from storage import Artifact, ArtifactWriter, ShardInfo
from tasks.framework.accounting import AccountingError, StageResult, check_balance, check_reasons
from tasks.framework.context import RunContext
from tasks.framework.reporting import Progress, warn


@dataclass(frozen=True)
class Output:
    """One artifact a stage writes."""

    name: str
    url: str
    kind: str
    schema: pa.Schema

    def writer(self, stage_key: str) -> ArtifactWriter:
        return ArtifactWriter(self.url, self.kind, self.schema, stage_key)


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
                 tables: dict[str, pa.Table], stats: dict[str, Any] | None = None) -> dict[str, ShardInfo]:
    """Write shard ``index`` of every output; ``stats`` (the shard's own counts) go in each footer."""
    return {o.name: o.writer(stage_key).write_shard(index, tables[o.name], stats) for o in outputs}


def finalize(outputs: Sequence[Output], stage_key: str, shards: Sequence[dict[str, ShardInfo]], ctx: RunContext,
             *, upstream: Sequence[Artifact] = (), config: dict[str, Any] | None = None,
             models: dict[str, Any] | None = None, stats: dict[str, Any] | None = None,
             prompt_versions: dict[str, str] | None = None) -> None:
    for out in outputs:
        out.writer(stage_key).finalize(
            [s[out.name] for s in shards], code_version=ctx.code_version, config=config, models=models,
            upstream=upstream, stats=stats, prompt_versions=prompt_versions,
        )


def skipped_result(stage: str, outputs: Sequence[Output], accepted_output: str) -> StageResult:
    """A StageResult rebuilt from complete manifests (what the stage did last time)."""
    manifests = {o.name: Artifact(o.url).manifest() for o in outputs}
    stats = manifests[accepted_output].stats
    return StageResult(stage=stage, skipped=True, artifacts={o.name: o.url for o in outputs},
                       input_rows=stats.get("input_rows", 0), accepted=stats.get("accepted", 0),
                       rejected=stats.get("rejected", {}), shards=len(manifests[accepted_output].shards),
                       splits=stats.get("splits", {}), balanced=stats.get("balanced"), stats=dict(stats))


def gather(futures: Sequence[Any], progress: Progress) -> list[Any]:
    """The results of shard task ``futures`` in submission order, advancing ``progress`` by one as each
    finishes, and by the input rows a computed shard held (called from the flow's thread: one display
    per stage, not per shard)."""
    for future in as_completed(list(futures)):
        done = future.result()
        progress.advance(items=0 if done.get("resumed") else done.get("stats", {}).get("input_rows", 0))
    return [f.result() for f in futures]


class Timer:
    """Wall seconds and this process's CPU seconds (every thread of it, no child process) of a block."""

    def __enter__(self) -> Timer:
        self.start, self.cpu_start = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
        self.cpu_seconds = time.process_time() - self.cpu_start


ShardCompute = Callable[[int], tuple[dict[str, pa.Table], dict[str, Any]]]


@dataclass
class Computed:
    """What one way of computing a stage (whole input, per shard, fanned out) hands back to the
    lifecycle: every shard's files by output name, the stage's stats (summed over its shards), how
    many shards it found written, and what its log line adds."""

    shards: list[dict[str, ShardInfo]]
    stats: dict[str, Any]
    reused: int = 0
    note: str = ""


def footer_stats(outputs: Sequence[Output], index: int) -> dict[str, Any] | None:
    """The counts the stage recorded in shard ``index``'s footer when it wrote it; None when the
    shard holds none (written before footers held counts, or by other code)."""
    return Artifact(outputs[0].url).shard_stats(index)


def reusable_shard(stage: str, outputs: Sequence[Output], stage_key: str, index: int
                   ) -> tuple[dict[str, ShardInfo], dict[str, Any]] | None:
    """Shard ``index`` as a previous run of this key wrote it, with the counts from its footer; None
    when it must be computed: not written, or written without counts (its input cannot be told from
    its rows: accepted + rejected would balance by construction)."""
    found = existing_shards(outputs, stage_key, index)
    if found is None:
        return None
    stats = footer_stats(outputs, index)
    if stats is None:
        warn(f"{stage} shard {index}: written without its counts in the Parquet footer; computed again "
             "(its input cannot be told from its rows)")
        return None
    return found, stats


def discard_uncounted_shards(stage: str, outputs: Sequence[Output], stage_key: str, indices: Sequence[int]
                             ) -> list[int]:
    """Remove every output's file of each shard of ``indices`` written for this key without counts in
    its footer, so that it is computed again (a fanned-out stage's parent does this before it decides
    which shards its ranges ask for); returns those indices."""
    uncounted = [i for i in indices
                 if existing_shards(outputs, stage_key, i) is not None and footer_stats(outputs, i) is None]
    for index in uncounted:
        for out in outputs:
            out.writer(stage_key).remove_shard(index)
    if uncounted:
        warn(f"{stage}: shards {uncounted} were written without their counts in the Parquet footer; computed "
             "again (their input cannot be told from their rows)")
    return uncounted


_LIMITS_SEEN: dict[tuple[str, str], bool] = {}  # (flow run id, limit name) → the limit exists


def _limit_exists(name: str) -> bool:
    """Whether the Prefect server has a global concurrency limit ``name`` (an unreachable server
    counts as yes: acquiring a slot then reports the real error)."""
    try:
        with get_client(sync_client=True) as client:
            client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        return False
    except Exception:
        return True
    return True


def resolve_concurrency_limit(name: str | None) -> str | None:
    """``name`` if that global concurrency limit exists, else None with one warning per flow run:
    Prefect would skip a missing limit anyway, but warn once per shard (34 times in a demo build)."""
    if not name:
        return None
    key = (str(flow_run.get_id() or ""), name)
    if key not in _LIMITS_SEEN:
        _LIMITS_SEEN[key] = _limit_exists(name)
        if not _LIMITS_SEEN[key]:
            warn(f"concurrency limit {name!r} does not exist on this Prefect server: its stages run without "
                 "a slot limit (`rde stack up` creates it)")
    return name if _LIMITS_SEEN[key] else None


def _retry_unless_accounting(task: Any, task_run: Any, state: Any) -> bool:
    """A lost row is a bug, not a flaky device: retrying the shard would only lose it again."""
    return not isinstance(getattr(state, "data", None), AccountingError)


@task(name="shard", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2,
      retry_condition_fn=_retry_unless_accounting)
def shard_task(outputs: list[Output], stage_key: str, index: int, compute: ShardCompute,
               concurrency_limit: str | None = None, stage: str = "",
               balance: bool = False, announce: bool = False) -> dict[str, Any]:
    """One shard of a sharded stage: reuse what a previous run of the same key wrote (with the
    stats in its footer; one written without them is computed again), else compute and write it
    atomically, its stats in the footer. A retry (or a rerun after a crash) redoes only this shard.
    With ``balance`` a shard whose rows do not account for its input is not written. With
    ``concurrency_limit`` the computation holds one slot of that Prefect global concurrency limit
    (e.g. ``gpu``; created by ``rde stack up``; ``map_shards`` passes None where it does not exist)."""
    reused = reusable_shard(stage, outputs, stage_key, index)
    if reused is not None:
        return {"index": index, "shards": reused[0], "resumed": True, "stats": reused[1]}
    if concurrency_limit:
        with concurrency(concurrency_limit, occupy=1, strict=False):
            tables, stats = compute(index)
    else:
        tables, stats = compute(index)
    check_reasons(stage, stats, f" shard {index}")
    if balance:
        check_balance(stage, stats, f" shard {index}")
    written = write_shards(outputs, stage_key, index, tables, stats)
    if announce:
        announce_shard(stage, stage_key, index, written)
    return {"index": index, "shards": written, "resumed": False, "stats": stats}


def announce_shard(stage: str, stage_key: str, index: int, written: dict[str, ShardInfo]) -> None:
    """A Prefect event for each shard a fanned-out stage writes (``rde.shard.written``, resource
    ``rde.shard.<stage>.<index>``): the event log then shows which run wrote which shard, and a
    shard written twice shows as two events."""
    from prefect.events import emit_event

    first = next(iter(written.values()))
    emit_event("rde.shard.written", resource={"prefect.resource.id": f"rde.shard.{stage}.{index}",
                                               "rde.stage": stage, "rde.stage-key": stage_key[:16],
                                               "rde.index": str(index)},
               payload={"rows": first.rows, "sha256": {name: info.sha256 for name, info in written.items()}})


def map_shards(flow_name: str, stage: str, outputs: Sequence[Output], stage_key: str, indices: Sequence[int],
               compute: ShardCompute, *, total: int, tags: Sequence[str] = (),
               concurrency_limit: str | None = None, balance: bool = False,
               announce: bool = False, progress_key: str = "", one_at_a_time: bool = False,
               row_unit: str = "rows") -> list[dict[str, Any]]:
    """Shard ``indices`` as Prefect tasks (tagged; holding a slot of ``concurrency_limit`` while
    computing), with a progress artifact of ``total`` shards (key ``<flow>-<stage>-progress``
    unless given) advanced as each finishes. ``one_at_a_time``: each task is submitted when the one
    before it has finished (a shard-range run uses its worker's one GPU for one shard at a time).
    ``row_unit``: what the shards' input rows are (images), for the progress line's rate."""
    task_fn = shard_task.with_options(name=stage, tags=list(tags), task_run_name=f"{stage}-{{index}}")
    concurrency_limit = resolve_concurrency_limit(concurrency_limit)
    with Progress(progress_key or f"{flow_name}-{stage}-progress", f"{stage}: shards done of {total}", stage=stage,
                  total=total, unit="shards", item_unit=row_unit) as progress:
        progress.update(total - len(indices))

        def submit(index: int) -> Any:
            return task_fn.submit(list(outputs), stage_key, index, compute, concurrency_limit, stage, balance,
                                  announce)

        if one_at_a_time:
            return [gather([submit(index)], progress)[0] for index in indices]
        return gather([submit(index) for index in indices], progress)


