"""Denoise stage: measure (per shard, model work) then decide (one streaming pass)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from models.backends.detectors import load_detector
from models.backends.registry import detector_lineage
from rde.denoise import DenoiseCounts, decide_shards, measure_table
from rde.profiles import Profile
from storage import Artifact, content_key
from storage.locations import state_dir
from storage.schemas import ACCEPTED_IMAGES, MEASUREMENTS, REJECTS
from tasks import ingest, sharded
from tasks.context import RunContext
from tasks.reporting import Progress, log, publish_table, stage_table

MEASURE_VERSION = "1"
DECIDE_VERSION = "2"  # 2: per-domain size rule (denoise.size_by_domain)


@task(name="measure-shard", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=1)
def measure_shard_task(outs: list[sharded.Output], stage_key: str, images_url: str, index: int,
                       profile: Profile) -> dict[str, Any]:
    """Laplacian variance and target detections for one images shard (detector loaded once per process)."""
    done = sharded.existing_shards(outs, stage_key, index)
    if done is not None:
        stats = sharded.reused_shard_stats(outs, index, sharded.count_accepted_rejected("measurements"))
        return {"shards": done, "resumed": True, "stats": stats}
    images = Artifact(images_url).read_shard(index, ["input_id", "image_id", "domain", "image_bytes"])
    detector = load_detector(profile.models.detector, str(state_dir()))
    domains = {d.name: d for d in profile.domains}
    table = measure_table(images, detector, domains, profile.models.detector.batch_size, profile.ingest.max_pixels)
    stats = {"input_rows": images.num_rows, "accepted": table.num_rows, "rejected": {}}  # one row per image read
    sharded.check_balance("measure", stats, f" shard {index}")
    return {"shards": sharded.write_shards(outs, stage_key, index, {"measurements": table}, stats), "resumed": False,
            "stats": stats}


def run_measure(ctx: RunContext, images_url: str) -> sharded.StageResult:
    profile = ctx.profile
    images = Artifact(images_url)
    manifest = images.manifest()
    spec = profile.models.detector
    key = content_key(stage="measure", version=MEASURE_VERSION, images=manifest.fingerprint,
                      detector=detector_lineage(spec), domains=[d.model_dump() for d in profile.domains],
                      max_pixels=profile.ingest.max_pixels)
    outs = [sharded.Output("measurements", ctx.artifact_url("measurements"), "measurements", MEASUREMENTS)]
    if sharded.all_complete(outs, key):
        log(f"measure: skipped, complete for the same images ({manifest.total_rows} rows)")
        result = sharded.skipped_result("measure", outs, "measurements")
        return result
    with sharded.Timer() as timer:
        sharded.begin(outs, key)
        task_fn = measure_shard_task.with_options(tags=[profile.prefect.gpu_concurrency_limit])
        futures = [task_fn.submit(outs, key, images_url, s.index, profile) for s in manifest.shards]
        with Progress(f"{ctx.flow_name}-measure-progress", f"measure: shards done of {len(futures)}", stage="measure",
                      total=len(futures), unit="shards") as progress:
            results = sharded.gather(futures, progress)
        stats = sharded.sum_stats([r["stats"] for r in results])
        stats["balanced"] = sharded.check_balance("measure", stats)
        sharded.finalize(outs, key, [r["shards"] for r in results], ctx, upstream=[images],
                         config={"detector": detector_lineage(spec)}, models={"detector": spec.weights or spec.backend},
                         stats=stats)
    resumed = sum(r["resumed"] for r in results)
    log(f"measure: {stats['accepted']} images measured with {spec.backend}, "
        f"{resumed}/{len(results)} shards reused, {timer.seconds:.1f}s")
    return sharded.StageResult("measure", False, {"measurements": outs[0].url}, stats["input_rows"],
                               stats["accepted"], {}, len(results), resumed, timer.seconds, balanced=True)


@task(name="denoise-decide", cache_policy=NO_CACHE)
def decide_task(ctx: RunContext, images_url: str, measurements_url: str) -> sharded.StageResult:
    """Apply thresholds and exact-duplicate removal → ``accepted`` + ``denoise_rejects``."""
    profile = ctx.profile
    images, measurements = Artifact(images_url), Artifact(measurements_url)
    key = content_key(stage="denoise", version=DECIDE_VERSION, images=images.manifest().fingerprint,
                      measurements=measurements.manifest().fingerprint, denoise=profile.denoise.model_dump())
    outs = [sharded.Output("accepted", ctx.artifact_url("accepted"), "accepted_images", ACCEPTED_IMAGES),
            sharded.Output("rejects", ctx.artifact_url("denoise_rejects"), "rejects", REJECTS)]
    if sharded.all_complete(outs, key):
        log("denoise: skipped, complete for the same measurements and thresholds")
        return sharded.skipped_result("denoise", outs, "accepted")
    with sharded.Timer() as timer:
        sharded.begin(outs, key)
        counts = DenoiseCounts()
        pairs = ((images.read_shard(i), measurements.read_shard(i)) for i, _ in
                 enumerate(images.manifest().shards))
        shards = [sharded.write_shards(outs, key, i, {"accepted": acc, "rejects": rej})
                  for i, (acc, rej) in enumerate(decide_shards(pairs, profile.denoise, counts))]
        stats = {"input_rows": counts.input, "accepted": counts.accepted, "rejected": counts.rejected}
        stats["balanced"] = sharded.check_balance("denoise", stats)
        sharded.finalize(outs, key, shards, ctx, upstream=[images, measurements],
                         config={"denoise": profile.denoise.model_dump()}, stats=stats)
    log(f"denoise: accepted {counts.accepted}/{counts.input}, rejected {counts.rejected}, {timer.seconds:.1f}s")
    return sharded.StageResult("denoise", False, {o.name: o.url for o in outs}, counts.input, counts.accepted,
                               counts.rejected, len(shards), 0, timer.seconds, balanced=True)


def publish(result: sharded.StageResult, flow_name: str) -> None:
    publish_table(f"{flow_name}-denoise", stage_table("denoise", result.input_rows, result.accepted,
                                                      result.rejected, result.skipped),
                  "Denoise (GTR+): size, Laplacian blur, target count, exact duplicates; rejected rows by reason")


def run_clean_pool(ctx: RunContext) -> list[sharded.StageResult]:
    """The stages every building flow starts with: ingest → measure → decide, each publishing its
    table under the flow's name. Returns [ingest, measure, denoise]; the last holds ``accepted``."""
    ingested = ingest.run_ingest(ctx)
    ingest.publish(ingested, ctx.flow_name)
    measured = run_measure(ctx, ingested.artifacts["images"])
    denoised = decide_task(ctx, ingested.artifacts["images"], measured.artifacts["measurements"])
    publish(denoised, ctx.flow_name)
    return [ingested, measured, denoised]
