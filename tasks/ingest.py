"""Ingest stage: inputs → ``images`` + ``ingest_rejects`` artifacts, one task per shard."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rde.ingest import (
    allowed_roots,
    describe_listing,
    ingest_shard,
    list_inputs,
    ref_from_dict,
    ref_to_dict,
    shard_refs,
)
from rde.profiles import IngestSpec
from storage import content_key
from storage.locations import project_root, resolve_location
from storage.schemas import IMAGES, REJECTS
from tasks import sharded
from tasks.context import RunContext
from tasks.reporting import Progress, log, publish_table, stage_table

STAGE = "ingest"
VERSION = "2"  # bump when the ingest logic changes what it writes


def outputs(ctx: RunContext) -> list[sharded.Output]:
    return [
        sharded.Output("images", ctx.artifact_url("images"), "images", IMAGES),
        sharded.Output("rejects", ctx.artifact_url("ingest_rejects"), "rejects", REJECTS),
    ]


@task(name="ingest-shard", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=1)
def ingest_shard_task(outs: list[sharded.Output], stage_key: str, index: int, refs: list[dict[str, Any]],
                      spec: IngestSpec, domains: list[str], pool_url: str | None,
                      roots: list[str] | None) -> dict[str, Any]:
    """Read and verify one shard of inputs; reuse the shard if this key already wrote it."""
    done = sharded.existing_shards(outs, stage_key, index)
    if done is not None:
        rejects = outs[1].writer(stage_key).read_shard(index, ["reason"])
        return {"shards": done, "rejected": sharded.reason_counts(rejects), "resumed": True}
    images, rejects = ingest_shard([ref_from_dict(r) for r in refs], spec, domains, pool_url, roots=roots)
    infos = sharded.write_shards(outs, stage_key, index, {"images": images, "rejects": rejects})
    return {"shards": infos, "rejected": sharded.reason_counts(rejects), "resumed": False}


def run_ingest(ctx: RunContext) -> sharded.StageResult:
    """List inputs, then map shard tasks; skipped when complete for the same inputs and config."""
    profile = ctx.profile
    domains = [d.name for d in profile.domains]
    refs, listing_fingerprint = list_inputs(profile.input, project_root(), domains)
    pool_url = resolve_location(profile.input.path) if profile.input.kind == "pool" else None
    roots = allowed_roots(profile.input, project_root())
    key = content_key(stage=STAGE, version=VERSION, listing=listing_fingerprint, input=profile.input.model_dump(),
                      ingest=profile.ingest.model_dump(), domains=domains)
    outs = outputs(ctx)
    if sharded.all_complete(outs, key):
        log(f"ingest: skipped, complete for the same inputs ({len(refs)} inputs)")
        return sharded.skipped_result(STAGE, outs, "images")
    log(f"ingest: {len(refs)} inputs {describe_listing(refs)} in shards of {profile.ingest.shard_size}")
    with sharded.Timer() as timer:
        sharded.begin(outs, key)
        chunks = shard_refs(refs, profile.ingest.shard_size)
        futures = [
            ingest_shard_task.submit(outs, key, i, [ref_to_dict(r) for r in chunk], profile.ingest, domains,
                                     pool_url, roots)
            for i, chunk in enumerate(chunks)
        ]
        with Progress(f"{ctx.flow_name}-{STAGE}-progress", f"{STAGE}: shards done of {len(futures)}", stage=STAGE,
                      total=len(futures), unit="shards") as progress:
            results = sharded.gather(futures, progress)
        rejected = sharded.merge_counts([r["rejected"] for r in results])
        accepted = sum(r["shards"]["images"].rows for r in results)
        stats = {"input_rows": len(refs), "accepted": accepted, "rejected": rejected}
        stats["balanced"] = sharded.check_balance(STAGE, stats)  # every listed file: one image or one reject
        upstream = []
        if pool_url:
            from storage import Artifact

            upstream = [Artifact(pool_url)]
        sharded.finalize(outs, key, [r["shards"] for r in results], ctx, upstream=upstream,
                         config={"input": profile.input.model_dump(), "ingest": profile.ingest.model_dump()},
                         stats=stats)
    result = sharded.StageResult(STAGE, False, {o.name: o.url for o in outs}, len(refs), accepted, rejected,
                                 shards=len(chunks), shards_resumed=sum(r["resumed"] for r in results),
                                 seconds=timer.seconds, balanced=True)
    log(f"ingest: {accepted}/{len(refs)} images readable, rejected {rejected}, "
        f"{result.shards_resumed}/{result.shards} shards reused, {timer.seconds:.1f}s")
    return result


def publish(result: sharded.StageResult, flow_name: str) -> None:
    publish_table(f"{flow_name}-ingest", stage_table(STAGE, result.input_rows, result.accepted, result.rejected,
                                                     result.skipped),
                  "Ingest: inputs read and verified; rejected rows by reason code")
