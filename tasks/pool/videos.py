"""The videos stage: recordings → person and vehicle crops with track identities, before ingest.

Runs only for ``input.kind: video``. One shard per video segment (``rde.common.video_input``), a
per-shard GPU stage like ``measure``: it fans out over the pool and resumes at the first segment
not written. Its crops artifact has the demo pool's schema; ingest reads it as it reads a pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from models.backends.detectors import load_detector
from models.backends.registry import detector_lineage
from rde.common.video_input import (
    detector_for_video,
    list_videos,
    plan_fingerprint,
    plan_segments,
    process_segment,
    source_name,
    video_roots,
)
from rde.profile import Profile
from storage.locations import project_root, state_dir
from storage.schemas import POOL, REJECTS, VIDEO_SEGMENTS
from tasks.framework.reporting import log
from tasks.framework.stage import Lineage, Report, Resources, Stage, StageRun, Work, Write


@dataclass(frozen=True)
class VideoPlan:
    """What ``lineage`` planned: the segments (one shard each), the roots videos may be read under,
    and each video's source name."""

    segments: list[Any]
    roots: Any
    names: dict[str, str]


class Videos(Stage):
    """Decode, sample, detect (batched), track (ByteTrack) and crop every listed video; each video
    is accepted or rejected with a reason, each segment's counts are a row of ``video_segments``."""

    name = "videos"
    version = "2"  # 2: detections counts every target found, tracked or not
    writes = (Write("video_segments", "video_segments", VIDEO_SEGMENTS), Write("video_crops", "pool", POOL),
              Write("video_rejects", "rejects", REJECTS, rejects=True))
    config = ("input", "video", "domains", "denoise")
    resources = Resources(device="gpu", batch_size="video.detect_batch")
    prepares = VideoPlan
    balance = True
    title = "Videos: decoded, sampled, detected, tracked (ByteTrack) and cropped; rejected videos by reason"
    row_unit = "videos"

    def applies(self, profile: Profile) -> bool:
        return profile.input.kind == "video"

    def lineage(self, run: StageRun) -> Lineage:
        """The listing (paths, sizes, modification times), its segment plan and the detector."""
        spec = run.section("input")
        root = project_root()
        domains = [d.name for d in run.section("domains")]
        refs, fingerprint = list_videos(spec, root, domains)
        roots = video_roots(spec, root)
        segments = plan_segments(refs, run.section("video"), roots)
        run.prepared = VideoPlan(segments, roots, {r.input_id: source_name(r, spec, root) for r in refs})
        log(f"videos: {len(refs)} videos in {len(segments)} segments of at most "
            f"{run.section('video').segment_seconds:g} s")
        detector = detector_for_video(run.models.detector, run.section("video"))
        return Lineage(models={"detector": detector_lineage(detector)},
                       extra={"listing": fingerprint, "segments": plan_fingerprint(segments)})

    def shard_count(self, run: StageRun) -> int:
        return len(run.prepared.segments)

    def process(self, run: StageRun, index: int) -> Work:
        plan: VideoPlan = run.prepared
        segment = plan.segments[index]
        video = run.section("video")
        detector = load_detector(detector_for_video(run.models.detector, video), str(state_dir()))
        result = process_segment(segment, video, run.section("denoise"), run.section("domains"), detector,
                                 plan.roots, plan.names[segment.ref.input_id])
        return Work.one(result.tables(), result.stats())

    def report(self, run: StageRun, result: Any) -> Report:
        """Per segment: frames read and sampled, detections, tracks, crops, tracks without a crop and why."""
        columns = ["video", "segment", "status", "reason", "frames_read", "frames_sampled", "detections", "tracks",
                   "crops", "tracks_without_crop", "decode_error"]
        rows = run.output_artifact("video_segments").rows(columns)
        crops = sum(r["crops"] for r in rows)
        partial = sum(r["decode_error"] is not None for r in rows)
        return Report(tables=[("videos-segments", rows, "videos: per segment, what was read, found and cropped")],
                      log=f"videos: {crops} crops from {result.accepted} videos"
                          + (f"; {partial} segments stopped decoding early (see decode_error)" if partial else ""))
