"""The one runner: takes any stage of the stage contract (``stage.py``) from skip to finalize.

``run_stage`` is the stage's whole life, in one place (``lifecycle``): build the content key
(stage name and version, the fingerprints of what it reads, its declared config, its lineage:
models, prompt versions, other inputs); skip the stage when every output is complete for that
key; else begin its outputs, compute, check every reason code and, for a balanced stage,
``input = accepted + rejected``; write the manifests; log one line; publish the stage's table
and report. Computing is one of three ways, each handing back the same ``Computed``:

- ``whole``: the stage's ``run`` over its whole input, as one Prefect task (its shards streamed);
- ``per_shard``: ``process`` per shard, one Prefect task each, with resume (``shards.map_shards``);
- ``fanout.fanned_out``: the shards as shard-range flow runs on the work pool.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rde.common.progress import StageProgress
from rde.common.run_lock import output_lock
from storage import Artifact, ShardInfo, content_key
from tasks.framework import fanout, retry, shards
from tasks.framework.accounting import StageResult, check_balance, check_reasons, sum_stats
from tasks.framework.context import RunContext
from tasks.framework.reporting import log, publish_markdown, publish_table, stage_table
from tasks.framework.shards import Computed
from tasks.framework.stage import Lineage, Pipeline, Stage, StageRun, Work


class MissingInput(RuntimeError):
    """A stage's read is not a complete artifact: an earlier stage did not run (or failed)."""


def outputs(stage: Stage, ctx: RunContext, key: str) -> list[shards.Output]:
    """Where the stage's writes go for this key: the flow's folder, or a shared output's content-
    addressed folder (recorded in ``ctx.locations`` so later stages of the run read it there)."""
    for w in stage.writes:
        if w.shared:
            ctx.locations[w.name] = ctx.shared_url(w.name, key)
    return [shards.Output(w.name, ctx.artifact_url(w.name), w.kind, w.schema) for w in stage.writes]


def stage_key(stage: Stage, reads: dict[str, Artifact], optional: dict[str, Artifact | None],
              config: dict[str, Any], lineage: Lineage) -> str:
    """The content key: what the stage's outputs depend on, and nothing else (an optional read
    that is not there keys as None)."""
    return content_key(stage=stage.name, version=stage.version,
                       reads={name: a.manifest().fingerprint for name, a in reads.items()},
                       optional={name: a.manifest().fingerprint if a else None for name, a in optional.items()},
                       config=config, models=lineage.models, prompts=lineage.prompts, extra=lineage.extra)


def run_pipeline(ctx: RunContext, pipeline: Pipeline, until: str | None) -> list[StageResult]:
    """Run the pipeline's stages that apply to the profile, in order, up to ``until`` (inclusive)."""
    return [run_stage(ctx, stage) for stage in pipeline.upto(until) if stage.applies(ctx.profile)]


@dataclass
class PreparedStage:
    """A stage ready to run: its run, key, outputs and what each manifest records beside the rows."""

    stage: Stage
    run: StageRun
    key: str
    outputs: list[shards.Output]
    upstream: list[Artifact]
    config: dict[str, Any]  # the manifest's config: declared fields, lineage extras, resources
    models: dict[str, Any]
    prompt_versions: dict[str, str]


def prepare_stage(ctx: RunContext, stage: Stage) -> PreparedStage:
    """Check the stage's reads, compute its lineage and content key, and where its writes go (the
    parent run and a fanned-out stage's shard-range runs compute it the same way)."""
    run = StageRun(stage, ctx)
    reads = {name: run.input(name) for name in stage.reads}
    missing = [name for name, artifact in reads.items() if not artifact.is_complete()]
    if missing:
        raise MissingInput(f"stage {stage.name!r} needs {missing} under {ctx.root}, which are not complete: run "
                           "the stages before it first")
    optional = {name: run.input(name) for name in stage.optional_reads}
    present = {name: artifact for name, artifact in optional.items() if artifact.is_complete()}
    lineage = stage.lineage(run)
    run.check_prepared()
    config = run.config_dump()
    key = stage_key(stage, reads, {name: present.get(name) for name in optional}, config, lineage)
    run.key = key
    return PreparedStage(stage, run, key, outputs(stage, ctx, key),
                         upstream=[*reads.values(), *present.values(), *lineage.upstream],
                         config={**config, **lineage.extra, "resources": resources(stage, ctx)},
                         models=lineage.models, prompt_versions=lineage.prompts)


Computation = Callable[[RunContext, PreparedStage], Computed]


def run_stage(ctx: RunContext, stage: Stage) -> StageResult:
    """Run (or skip) one stage, publish its table and report; returns what it did."""
    prepared = prepare_stage(ctx, stage)
    with _shared_outputs_held(stage, ctx):
        result = lifecycle(ctx, prepared, computation(stage, ctx, prepared.run))
    if stage.rejects_from_upstream:
        result = replace(result, rejects_from_upstream=True)
    _publish(ctx, stage, prepared.run, result)
    return result


def computation(stage: Stage, ctx: RunContext, run: StageRun) -> Computation:
    """How the stage computes: fanned out over the pool, per shard in this run, or whole."""
    if fans_out(stage, ctx, run):
        return _fanned_out
    return per_shard if stage.per_shard else whole


def lifecycle(ctx: RunContext, prepared: PreparedStage, compute: Computation) -> StageResult:
    """One stage from skip to finalize (module docstring): the same steps, checks and log line
    whichever way it computes."""
    stage, outs, key = prepared.stage, prepared.outputs, prepared.key
    complete = shards.all_complete(outs, key)
    redo = retry.plan(ctx, stage, outs) if complete else None
    if complete and redo is None:
        result = shards.skipped_result(stage.name, outs, stage.main_write)
        log(f"{stage.name}: skipped, complete for the same inputs ({result.accepted}/{result.input_rows} accepted)")
        return result
    with shards.Timer() as timer:
        shards.begin(outs, key)
        computed = retry.redo_transient(stage, prepared.run, outs, key, redo) if redo else compute(ctx, prepared)
        stats = computed.stats
        check_reasons(stage.name, stats)
        balanced = check_balance(stage.name, stats) if stage.balance else None
        shards.finalize(outs, key, computed.shards, ctx, upstream=prepared.upstream, config=prepared.config,
                        models=prepared.models, stats={**stats, "balanced": balanced},
                        prompt_versions=prepared.prompt_versions)
    result = StageResult(stage.name, False, {o.name: o.url for o in outs}, int(stats.get("input_rows", 0)),
                         int(stats.get("accepted", 0)), dict(stats.get("rejected", {})), len(computed.shards),
                         computed.reused, timer.seconds, timer.cpu_seconds, splits=dict(stats.get("splits", {})),
                         balanced=balanced, stats={**stats, "balanced": balanced})
    log(f"{stage.name}: {result.accepted}/{result.input_rows} accepted, rejected {result.rejected}, "
        f"{result.shards} shards ({result.shards_resumed} reused){computed.note}, {timer.seconds:.1f}s")
    return result


def whole(ctx: RunContext, prepared: PreparedStage) -> Computed:
    """The stage's ``run`` over its whole input as one Prefect task, its shards written as they come."""
    with StageProgress(prepared.stage.name):
        done = _whole_task.with_options(name=prepared.stage.name)(prepared.stage, prepared.run, prepared.outputs,
                                                                  prepared.key)
    return Computed(done["shards"], done["stats"])


def per_shard(ctx: RunContext, prepared: PreparedStage) -> Computed:
    """``process`` per shard as Prefect tasks of this run (tagged; a GPU stage's computation holds a
    slot of the profile's GPU limit), a progress artifact updated per finished shard. A shard
    reused from an interrupted run brings its stats back from its footer."""
    stage = prepared.stage
    n_shards = stage.shard_count(prepared.run)
    done = shards.map_shards(ctx.flow_name, stage.name, prepared.outputs, prepared.key, range(n_shards),
                             _ShardWork(stage, prepared.run), total=n_shards, **shard_options(stage, ctx),
                             balance=stage.balance)
    return Computed([d["shards"] for d in done], sum_stats([d["stats"] for d in done]),
                    reused=sum(d["resumed"] for d in done))


def _fanned_out(ctx: RunContext, prepared: PreparedStage) -> Computed:
    stage = prepared.stage
    return fanout.fanned_out(ctx, stage.name, prepared.outputs, prepared.key, stage.shard_count(prepared.run),
                             balance=stage.balance, device=stage.resources.device)


def shard_options(stage: Stage, ctx: RunContext) -> dict[str, Any]:
    """A per-shard stage's task tags, the concurrency limit its computation holds (GPU stages) and
    what its rows are (the progress line's rate)."""
    limit = ctx.profile.prefect.gpu_concurrency_limit if stage.resources.device == "gpu" else None
    return {"tags": [limit] if limit else [], "concurrency_limit": limit if stage.resources.hold_slot else None,
            "row_unit": stage.row_unit}


def fans_out(stage: Stage, ctx: RunContext, run: StageRun | None = None) -> bool:
    """Whether the stage's shards run as shard-range flow runs on a pool (``prefect.fanout``): per-shard
    stages (those listed in ``fanout.stages``, or all) whose device has a deployment (GPU stages
    ``fanout.deployment``, CPU stages ``fanout.cpu_deployment``), when the profile turns it on and
    the stage's ``fans_out`` agrees for this ``run``."""
    spec = ctx.profile.prefect.fanout
    return (spec.enabled and stage.per_shard and spec.deployment_for(stage.resources.device) is not None
            and (not spec.stages or stage.name in spec.stages) and (run is None or stage.fans_out(run)))


def run_shard_range(ctx: RunContext, stage: Stage, key: str, indices: Sequence[int]) -> dict[str, Any]:
    """A fanned-out stage's shards ``indices`` in this (shard-range) flow run: the same key the
    parent computed, else an error (the worker's checkout or inputs differ from the parent's); then
    the stage's own shard tasks, one at a time (a GPU range's run has its worker's one GPU, and the
    `gpu` limit bounds the runs across the pool; a CPU range's run is one of its worker's
    processes): skip what exists, write atomically, hold the GPU slot,
    announce each written shard as an event. Returns which shards it computed and which it reused."""
    prepared = prepare_stage(ctx, stage)
    if prepared.key != key:
        raise fanout.FanoutError(f"stage {stage.name!r}: this shard-range run computes stage key "
                                 f"{prepared.key[:16]}, its parent {key[:16]}; the worker's code, profile or "
                                 "inputs differ from the parent's")
    n_shards = stage.shard_count(prepared.run)
    wrong = [i for i in indices if not 0 <= i < n_shards]
    if wrong:
        raise fanout.FanoutError(f"stage {stage.name!r} has {n_shards} shards; asked for {wrong}")
    done = shards.map_shards(ctx.flow_name, stage.name, prepared.outputs, key, list(indices),
                             _ShardWork(stage, prepared.run), total=len(indices),
                             **shard_options(stage, ctx), balance=stage.balance, announce=True,
                             progress_key=artifact_key(ctx.flow_name, f"{stage.name}-range-{indices[0]}-progress"),
                             one_at_a_time=True)
    rows = [{"shard": d["index"], "computed": not d["resumed"], "input": d["stats"].get("input_rows", 0),
             "accepted": d["stats"].get("accepted", 0)} for d in done]
    publish_table(artifact_key(ctx.flow_name, f"{stage.name}-range"), rows,
                  f"{stage.name}: the shards of this range, computed here or found written")
    log(f"{stage.name}: shards {list(indices)}: {sum(r['computed'] for r in rows)} computed, "
        f"{sum(not r['computed'] for r in rows)} found written")
    return {"computed": [r["shard"] for r in rows if r["computed"]],
            "reused": [r["shard"] for r in rows if not r["computed"]]}


@contextmanager
def _shared_outputs_held(stage: Stage, ctx: RunContext) -> Iterator[None]:
    """Hold the run lock of each shared output's folder: a second flow computing the same shared
    output waits for the first, then finds it complete and skips."""
    with ExitStack() as held:
        for w in stage.writes:
            if w.shared:
                held.enter_context(output_lock(ctx.artifact_url(w.name), ctx.flow_name, wait=True))
        yield


def resources(stage: Stage, ctx: RunContext) -> dict[str, Any]:
    """What the stage declared it needs, with its batch size read from the profile field it names
    (recorded in each output's manifest; not part of the key: a batch size does not change rows)."""
    declared = stage.resources
    size: Any = None
    if declared.batch_size:
        size = ctx.profile
        for part in declared.batch_size.split("."):
            size = getattr(size, part, None)
    return {"device": declared.device, "holds_gpu_slot": declared.device == "gpu" and declared.hold_slot,
            "batch_size_field": declared.batch_size, "batch_size": size}


class _ShardWork:
    """``process`` of one stage bound to its run, as the shard task's compute (picklable for Dask)."""

    def __init__(self, stage: Stage, run: StageRun) -> None:
        self.stage, self.run = stage, run

    def __call__(self, index: int) -> tuple[dict[str, Any], dict[str, Any]]:
        work = self.stage.process(self.run, index)
        found = list(work.shards)
        if len(found) != 1:
            raise ValueError(f"stage {self.stage.name!r}: process() must return one shard, got {len(found)}")
        return found[0], work.stats


@task(name="stage", cache_policy=NO_CACHE)
def _whole_task(stage: Stage, run: StageRun, outs: list[shards.Output], key: str) -> dict[str, Any]:
    """A whole-input stage's work, writing its shards as they come (a streamed stage holds one)."""
    work: Work = stage.run(run)
    names = {o.name for o in outs}
    written: list[dict[str, ShardInfo]] = []
    for index, tables in enumerate(work.shards):
        if set(tables) != names:
            raise ValueError(f"stage {stage.name!r} returned tables {sorted(tables)}, it declares {sorted(names)}")
        written.append(shards.write_shards(outs, key, index, tables))
    return {"shards": written, "stats": dict(work.stats)}


def artifact_key(flow_name: str, suffix: str) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes): ``train-saft-train-saft``."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{flow_name}-{suffix}".lower())


def _publish(ctx: RunContext, stage: Stage, run: StageRun, result: StageResult) -> None:
    """The stage table (rows in, kept, rejected by reason) under ``<flow>-<stage>``, then its report."""
    publish_table(artifact_key(ctx.flow_name, stage.name),
                  stage_table(stage.name, result.input_rows, result.accepted, result.rejected, result.skipped),
                  stage.title or f"{stage.name}: rows in, kept, rejected by reason")
    report = stage.report(run, result)
    for suffix, rows, description in report.tables:
        publish_table(artifact_key(ctx.flow_name, suffix), rows, description)
    for suffix, text, description in report.markdown:
        publish_markdown(artifact_key(ctx.flow_name, suffix), text, description)
    if report.log:
        log(report.log)
