"""Retrying transient rejects (``--retry-rejects``): redo only the inputs a passing failure rejected.

A row rejected for a reason that may pass on another try (``rde.common.reasons.TRANSIENT``: a read
that failed, a refused credential, a generator that timed out) stays rejected on a plain rerun:
the stage's key has not changed, so the stage is skipped. With ``retry_rejects`` the runner looks
into a complete per-shard stage that names its inputs (``Stage.retry_by``: the column that holds
one input's id in every output) and, for each shard whose rejects hold a transient reason:

1. asks the stage to process only those inputs (``StageRun.retry_only``);
2. drops every row of those inputs from each output shard (their rejects, and any rows they had
   accepted, so nothing is written twice) and appends what the new try gave (a recovered row is at
   the end of its shard);
3. recounts the shard's stats: ``input_rows`` is unchanged, ``accepted`` and ``rejected`` lose
   the dropped rows and gain the new ones, the counts the stage derives from rows lose what the
   dropped rows contributed (``Stage.removed_stats``), and work counters (generator calls) add
   the new try's work. The shard must still balance;
4. removes the shard's old files, then writes the new ones (atomically, under the same key).

Every other shard, and every other row of a retried shard, is kept as it is. The manifests are
removed first and written last, as in any run: a run killed partway leaves the stage incomplete,
and the next run (with or without the flag) recomputes the shards whose files are missing whole.
The stages after it see a changed input (its fingerprint hashes the shards) and run again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rde.common.reasons import TRANSIENT
from storage import Artifact, ShardInfo
from tasks.framework import shards
from tasks.framework.accounting import AccountingError, check_balance, merge_counts, reason_counts, sum_stats
from tasks.framework.context import RunContext
from tasks.framework.stage import Stage, StageRun

COUNTS = ("input_rows", "accepted", "rejected")


def retryable(stage: Stage) -> bool:
    """A stage whose transient rejects can be redone input by input (and recounted: a balanced one)."""
    return stage.per_shard and stage.balance and stage.retry_by is not None and stage.rejects_write is not None


def transient_inputs(stage: Stage, outputs: list[shards.Output]) -> dict[int, set[str]]:
    """Shard index → the ids (``retry_by``) of the inputs its rejects hold for a transient reason
    (one shard's two columns read at a time)."""
    rejects = Artifact(_output(stage.rejects_write, outputs).url)
    found: dict[int, set[str]] = {}
    for index, table in rejects.iter_shards([stage.retry_by, "reason"]):
        mask = pc.is_in(table.column("reason"), pa.array(sorted(TRANSIENT)))
        ids = {i for i in table.filter(mask).column(stage.retry_by).to_pylist() if i is not None}
        if ids:
            found[index] = ids
    return found


@dataclass(frozen=True)
class RetryPlan:
    """What a retry redoes, read while the stage is still complete: its shard count, and per shard
    the inputs with a transient reject."""

    shard_count: int
    inputs: dict[int, set[str]]


def plan(ctx: RunContext, stage: Stage, outputs: list[shards.Output]) -> RetryPlan | None:
    """The retry this run makes of the (complete) stage, or None: not asked for, not possible for
    the stage, or nothing transient to retry."""
    if not (ctx.retry_rejects and retryable(stage)):
        return None
    found = transient_inputs(stage, outputs)
    if not found:
        return None
    return RetryPlan(len(Artifact(_output(stage.main_write, outputs).url).manifest().shards), found)


@dataclass
class RetriedShard:
    """One shard redone: its files, its new stats, how many inputs were retried and recovered."""

    files: dict[str, ShardInfo]
    stats: dict[str, Any]
    retried: int
    recovered: int


def redo_transient(stage: Stage, run: StageRun, outputs: list[shards.Output], key: str,
                   retry: RetryPlan) -> shards.Computed:
    """Every shard of the stage: those with transient rejects redone (module docstring), the others
    kept; the stats summed from every shard's footer, with ``retried`` and ``recovered``."""
    main = Artifact(_output(stage.main_write, outputs).url)
    files, parts, retried, recovered = [], [], 0, 0
    for index in range(retry.shard_count):
        if index in retry.inputs:
            done = _redo_shard(stage, run, outputs, key, index, retry.inputs[index])
            files.append(done.files)
            parts.append(done.stats)
            retried, recovered = retried + done.retried, recovered + done.recovered
        else:
            kept = shards.existing_shards(outputs, key, index)
            if kept is None:
                raise RuntimeError(f"stage {stage.name!r}: shard {index} is missing under the stage's key")
            files.append(kept)
            parts.append(main.shard_stats(index) or {})
    stats = {**sum_stats(parts), "retried": retried, "recovered": recovered}
    return shards.Computed(files, stats, reused=len(files) - len(retry.inputs),
                           note=f", {retried} inputs with a transient reject retried in {len(retry.inputs)} shards, "
                                f"{recovered} recovered")


def _redo_shard(stage: Stage, run: StageRun, outputs: list[shards.Output], key: str, index: int,
                ids: set[str]) -> RetriedShard:
    old_stats = Artifact(_output(stage.main_write, outputs).url).shard_stats(index) or {}
    run.retry_only = frozenset(ids)
    try:
        work = stage.process(run, index)
        [new] = list(work.shards)
    finally:
        run.retry_only = None
    wanted_ids = pa.array(sorted(ids))
    merged, removed = {}, {}
    for out in outputs:
        stray = set(new[out.name].column(stage.retry_by).to_pylist()) - ids
        if stray:  # rows of inputs it was not asked about would be written twice
            raise AccountingError(f"stage {stage.name!r}, shard {index}: asked to redo {len(ids)} inputs, it wrote "
                                  f"{out.name} rows of {len(stray)} others (its process must read run.retry_only); "
                                  "nothing was replaced")
        old = Artifact(out.url).read_shard(index)
        drop = pc.is_in(old.column(stage.retry_by), wanted_ids)
        removed[out.name] = old.filter(drop)
        merged[out.name] = pa.concat_tables([old.filter(pc.invert(drop)), new[out.name].cast(old.schema)])
    stats = _merged_stats(stage, old_stats, removed, work.stats)
    check_balance(stage.name, stats, f" (shard {index}, after retrying {len(ids)} inputs)")
    for out in outputs:  # old files out first: a kill between the two leaves a shard to compute whole
        out.writer(key).remove_shard(index)
    written = shards.write_shards(outputs, key, index, merged, stats)
    still = new[stage.rejects_write]
    failing = set(still.filter(pc.is_in(still.column("reason"), pa.array(sorted(TRANSIENT))))
                  .column(stage.retry_by).to_pylist())
    return RetriedShard(written, stats, len(ids), len(ids - failing))


def _merged_stats(stage: Stage, old: dict[str, Any], removed: dict[str, pa.Table],
                  new: dict[str, Any]) -> dict[str, Any]:
    """The shard's stats after the retry (step 3 of the module docstring)."""
    gone_rejected = reason_counts(removed[stage.rejects_write])
    gone_accepted = removed[stage.main_write].num_rows
    accepted = int(old.get("accepted", 0)) - gone_accepted + int(new.get("accepted", 0))
    rejected = merge_counts([old.get("rejected", {}), {r: -n for r, n in gone_rejected.items()},
                             new.get("rejected", {})])
    input_rows = (int(old.get("input_rows", 0)) - gone_accepted - sum(gone_rejected.values())
                  + int(new.get("input_rows", 0)))
    derived = stage.removed_stats(removed)
    out: dict[str, Any] = dict(old)
    for name, value in new.items():
        if name in COUNTS or not _number(value):
            continue
        out[name] = out.get(name, 0) + value - derived.get(name, 0)
    for name, value in derived.items():
        if name not in new:
            out[name] = out.get(name, 0) - value
    out.update(input_rows=input_rows, accepted=accepted, rejected={r: n for r, n in rejected.items() if n})
    return out


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _output(name: str | None, outputs: list[shards.Output]) -> shards.Output:
    return next(o for o in outputs if o.name == name)
