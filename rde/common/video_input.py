"""Video input: list recordings, plan their segments, and turn one segment into crops.

A video input (``input.kind: video``) is a folder of recordings or a Parquet file of their paths,
listed and confined exactly as image inputs are (``rde.common.input_listing``,
``rde.common.input_confinement``). Each video is cut into segments of ``video.segment_seconds``
(from the frame count and rate its container declares; one segment when it declares none); a
segment is one shard of the ``videos`` stage. In a segment,
frames are decoded one at a time, every n-th is sampled (n = round(fps / video.sample_fps)),
sampled frames are detected in batches of ``video.detect_batch`` and linked by ByteTrack
(``rde.common.video_tracks``), and each track ends as crops or as a count of why it gave none.

Accounting is per video: the segment that starts at frame 0 counts the video once, accepted
when its first frame decodes, else a rejected row with the reason; later segments add crops and
counts but no video. A decode that fails partway keeps what came before and says where in the
segment's row (``decode_error``). Tracks do not cross segments: a track cut by a boundary is two
tracks, two identities (each segment has its own trackers), so segments run independently.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pyarrow as pa

from models.backends.detectors import Detections, Detector
from models.domains import Domain
from models.specs import DetectorSpec
from rde.common.denoise import count_targets
from rde.common.image_decoding import DecodeError, encode_jpeg
from rde.common.ingest import reject_row
from rde.common.input_confinement import allowed_roots, confined_file
from rde.common.input_listing import InputRef, list_inputs
from rde.common.pool_config import DenoiseSpec, InputSpec, VideoSpec
from rde.common.reasons import Reason
from rde.common.video_decoding import DecodeOutcome, VideoInfo, probe, sampled_frames
from rde.common.video_tracks import Candidate, TrackBook, byte_tracker, link
from storage.schemas import POOL, REJECTS, VIDEO_SEGMENTS

NO_CROP_REASONS = tuple(str(r) for r in (Reason.TOO_SHORT, Reason.TOO_SMALL, Reason.LOW_SCORE, Reason.BLURRY,
                                         Reason.UNCONFIRMED))


@dataclass(frozen=True)
class Segment:
    """One shard of the videos stage: frames [start, stop) of one listed video (stop None: to the end)."""

    ref: InputRef
    index: int
    start: int
    stop: int | None


def _as_files(spec: InputSpec, project_root: Path) -> InputSpec:
    """A video input as the file input it is listed and confined as: a folder, or a path list."""
    return spec.model_copy(update={"kind": "folder" if _location(spec, project_root).is_dir() else "paths"})


def list_videos(spec: InputSpec, project_root: Path, domains: list[str]) -> tuple[list[InputRef], str]:
    """The listed videos (a folder's entries or a path list's rows, as ``list_inputs`` lists images)."""
    return list_inputs(_as_files(spec, project_root), project_root, domains, allow_urls=False)


def video_roots(spec: InputSpec, project_root: Path) -> list[str] | None:
    """The real folders a listed video may resolve into (``allowed_roots`` of its folder or list)."""
    return allowed_roots(_as_files(spec, project_root), project_root)


def _location(spec: InputSpec, project_root: Path) -> Path:
    path = Path(spec.path)
    return path if path.is_absolute() else project_root / path


def plan_segments(refs: list[InputRef], spec: VideoSpec, roots: list[str] | None) -> list[Segment]:
    """Each video's segments, in listing order. A video that cannot be probed here is one segment
    (which rejects it, with the reason, when it runs)."""
    segments: list[Segment] = []
    for ref in refs:
        try:
            info = probe(confined_file(ref, roots), spec.max_pixels)
        except Exception:
            segments.append(Segment(ref, 0, 0, None))
            continue
        length = max(1, round(spec.segment_seconds * info.fps))
        count = max(1, math.ceil(info.declared_frames / length)) if info.declared_frames else 1
        for k in range(count):
            segments.append(Segment(ref, k, k * length, None if k == count - 1 else (k + 1) * length))
    return segments


def plan_fingerprint(segments: list[Segment]) -> list[list[Any]]:
    """The plan as it enters the stage key (which frames each shard covers)."""
    return [[s.ref.input_id, s.index, s.start, s.stop] for s in segments]


def detector_for_video(spec: DetectorSpec, video: VideoSpec) -> DetectorSpec:
    """The profile's detector, run down to ByteTrack's low score (its second association needs the
    weak boxes), in batches of ``video.detect_batch``, remembering nothing (a frame is seen once)."""
    return spec.model_copy(update={"score_threshold": video.tracker.low_score, "batch_size": video.detect_batch,
                                   "memo_items": 0})


@dataclass
class SegmentResult:
    """What one segment gave: crop rows (POOL), its segments row, a rejected row (or none) and counts."""

    crops: list[dict[str, Any]]
    segment: dict[str, Any]
    reject: dict[str, Any] | None

    def tables(self) -> dict[str, pa.Table]:
        return {"video_crops": pa.Table.from_pylist(self.crops, schema=POOL),
                "video_segments": pa.Table.from_pylist([self.segment], schema=VIDEO_SEGMENTS),
                "video_rejects": pa.Table.from_pylist([self.reject] if self.reject else [], schema=REJECTS)}

    def stats(self) -> dict[str, Any]:
        counted = self.segment["counts_video"]
        rejected = {self.reject["reason"]: 1} if self.reject else {}
        no_crop = json.loads(self.segment["tracks_without_crop"])
        return {"input_rows": int(counted), "accepted": int(counted and not self.reject), "rejected": rejected,
                "segments": 1, "frames_read": self.segment["frames_read"],
                "frames_sampled": self.segment["frames_sampled"], "detections": self.segment["detections"],
                "tracks": self.segment["tracks"], "crops": len(self.crops),
                **{f"tracks_{reason}": no_crop.get(reason, 0) for reason in NO_CROP_REASONS},
                "partial_decodes": int(self.segment["decode_error"] is not None)}


@dataclass(frozen=True)
class Sighting:
    """One detection placed on a track, in one sampled frame."""

    domain: str
    track_id: int
    box: np.ndarray
    score: float
    label: str


@dataclass(frozen=True)
class TrackedFrame:
    """A sampled frame and the detections ByteTrack placed on tracks in it (``step``: its position
    among the segment's sampled frames, the trackers' clock)."""

    step: int
    number: int
    time: float
    rgb: np.ndarray
    sightings: list[Sighting]
    detections: int  # targets the detector found in the frame, tracked or not


def open_segment(segment: Segment, spec: VideoSpec, roots: list[str] | None) -> tuple[str, VideoInfo]:
    """The checked path and stream of a segment's video, or a DecodeError with the reason (listing,
    confinement, an empty file, the probe's reasons)."""
    ref = segment.ref
    if ref.reject_reason is not None:
        raise DecodeError(ref.reject_reason, ref.reject_detail or str(ref.reject_reason))
    path = confined_file(ref, roots)
    if os.stat(path).st_size == 0:
        raise DecodeError(Reason.EMPTY_FILE, f"{ref.source} has zero bytes")
    return path, probe(path, spec.max_pixels)


def sample_step(info: VideoInfo, spec: VideoSpec) -> int:
    """Every n-th frame is sampled: n = round(fps / sample_fps), at least 1."""
    return max(1, round(info.fps / spec.sample_fps))


def tracked_frames(path: str, info: VideoInfo, segment: Segment, spec: VideoSpec, domains: list[Domain],
                   detector: Detector, outcome: DecodeOutcome) -> Iterator[TrackedFrame]:
    """The segment's sampled frames, detected in batches of ``video.detect_batch`` and linked by
    one ByteTrack per domain (a domain's duplicate boxes under two classes merged first, as denoise
    counts them). The trackers start with the segment: its tracks are its own."""
    step = sample_step(info, spec)
    trackers = {d.name: byte_tracker(spec.tracker, lost_steps(spec, info)) for d in domains}
    frames = sampled_frames(path, info, segment.start, segment.stop, step, outcome)
    index = 0
    for batch in _batches(frames, spec.detect_batch):
        for (number, time, rgb), dets in zip(batch, detector.detect([rgb for _, _, rgb in batch]), strict=True):
            sightings, found = [], 0
            for domain in domains:
                mine = count_targets(dets, domain.target_classes)
                found += len(mine)
                sightings += [Sighting(domain.name, track_id, mine.boxes[k], float(mine.scores[k]), mine.labels[k])
                              for track_id, k in link(trackers[domain.name], mine)]
            yield TrackedFrame(index, number, time, rgb, sightings, found)
            index += 1


def lost_steps(spec: VideoSpec, info: VideoInfo) -> int:
    """ByteTrack's buffer in sampled frames: after this many unseen, a track has ended."""
    return max(1, round(spec.tracker.lost_seconds * info.fps / sample_step(info, spec)))


def process_segment(segment: Segment, spec: VideoSpec, denoise: DenoiseSpec, domains: list[Domain],
                    detector: Detector, roots: list[str] | None, source_name: str) -> SegmentResult:
    """Decode, sample, detect, track and crop one segment (see the module docstring).

    ``source_name`` is how crops name their video (the path relative to the input's root)."""
    ref = segment.ref
    row = _segment_row(segment, source_name)
    try:
        path, info = open_segment(segment, spec, roots)
    except DecodeError as err:
        return _rejected(segment, row, str(err.reason), err.detail)
    except Exception as exc:  # an OS error reading the file
        return _rejected(segment, row, str(Reason.READ_ERROR), f"{type(exc).__name__}: {exc}")
    row.update(fps=info.fps, width=info.width, height=info.height, codec=info.codec,
               declared_frames=info.declared_frames)
    outcome = DecodeOutcome()
    crops: list[dict[str, Any]] = []
    no_crop: dict[str, int] = {}
    counts = {"frames_sampled": 0, "detections": 0, "tracks": 0}
    book = TrackBook(spec, denoise, lost_steps=lost_steps(spec, info))
    meta = {"video": source_name, "video_id": ref.input_id, "segment": segment.index, "fps": round(info.fps, 3),
            "frame_size": [info.width, info.height]}
    if info.rotation:  # written only when the recording is stored turned: upright ones keep their metadata
        meta["rotation"] = info.rotation

    def confirmed(candidate: Candidate, domain: str) -> bool:
        """Exactly one target of the domain scoring ≥ confirm_score on the stored crop (denoise's count)."""
        found = detector.detect([_stored(candidate.crop, spec.jpeg_quality)])[0]  # as denoise will see it
        keep = found.scores >= spec.confirm_score
        strong = Detections(found.boxes[keep], [lab for lab, k in zip(found.labels, keep, strict=True) if k],
                            found.scores[keep])
        return len(count_targets(strong, classes[domain])) == 1

    classes = {d.name: d.target_classes for d in domains}

    def finish(tracks: list) -> None:
        for track in tracks:
            counts["tracks"] += 1
            chosen, why = book.choose(track, confirmed if spec.confirm_crops else None)
            if why is not None:
                no_crop[why] = no_crop.get(why, 0) + 1
            for candidate in chosen:
                crops.append(_crop_row(candidate, track, meta, spec, source_name, segment.index))

    for frame in tracked_frames(path, info, segment, spec, domains, detector, outcome):
        counts["frames_sampled"] += 1
        counts["detections"] += frame.detections
        for s in frame.sightings:
            book.observe(frame.step, frame.number, frame.time, frame.rgb, s.domain, s.track_id, s.box, s.score,
                         s.label)
        finish(book.ended(frame.step))
    finish(book.close())
    if segment.index == 0 and outcome.frames_read == 0:
        detail = outcome.error or f"{ref.source}: the {info.codec} stream gives no frame"
        return _rejected(segment, row, str(Reason.NO_FRAMES), detail)
    row.update(frames_read=outcome.frames_read, last_frame=outcome.last_frame, decode_error=outcome.error,
               crops=len(crops), tracks_without_crop=json.dumps(no_crop, sort_keys=True), **counts,
               status="accepted" if segment.index == 0 else "continued")
    crops.sort(key=lambda r: r["pool_id"])
    return SegmentResult(crops, row, None)


Frame = tuple[int, float, np.ndarray]  # (frame number, time in seconds, RGB)


def _batches(frames: Iterator[Frame], size: int) -> Iterator[list[Frame]]:
    """Sampled frames in batches of ``size`` (the detector's batch: all that is held at once)."""
    batch: list[Frame] = []
    for item in frames:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _segment_row(segment: Segment, source_name: str) -> dict[str, Any]:
    return {"input_id": segment.ref.input_id, "source": segment.ref.source, "video": source_name,
            "segment": segment.index, "start_frame": segment.start, "stop_frame": segment.stop,
            "counts_video": segment.index == 0, "status": "", "reason": None, "detail": None,
            "fps": None, "width": None, "height": None, "codec": None, "declared_frames": None,
            "frames_read": 0, "last_frame": -1, "frames_sampled": 0, "detections": 0, "tracks": 0, "crops": 0,
            "tracks_without_crop": "{}", "decode_error": None}


def _rejected(segment: Segment, row: dict[str, Any], reason: str, detail: str) -> SegmentResult:
    """The video is rejected (segment 0 writes the row; a later segment of it records only why it gave nothing)."""
    row.update(status="rejected" if segment.index == 0 else "skipped", reason=reason, detail=detail)
    reject = reject_row(segment.ref, "videos", [reason], detail, kind="video") if segment.index == 0 else None
    return SegmentResult([], row, reject)


def _stored(rgb: np.ndarray, quality: int) -> np.ndarray:
    """A crop as it will be stored and read back (JPEG at ``quality``, decoded)."""
    return cv2.cvtColor(cv2.imdecode(np.frombuffer(encode_jpeg(rgb, quality), np.uint8), cv2.IMREAD_COLOR),
                        cv2.COLOR_BGR2RGB)


def _crop_row(candidate: Any, track: Any, meta: dict[str, Any], spec: VideoSpec, source_name: str,
              segment: int) -> dict[str, Any]:
    identity = f"{source_name}#{track.domain}-s{segment:03d}-{track.track_id:04d}"
    source_meta = {**meta, "frame": candidate.frame, "time": round(candidate.time, 3), "box": candidate.box,
                   "score": candidate.score, "label": candidate.label, "track": track.track_id,
                   "track_window": track.window(candidate.time, spec.window_seconds)}
    if spec.camera == "moving":  # written only when it moves: a fixed camera's crops keep their metadata
        source_meta["camera"] = "moving"
    return {"pool_id": f"{identity}:f{candidate.frame:07d}", "domain": track.domain, "identity": identity,
            "variant": "crop", "source_meta": json.dumps(source_meta, sort_keys=True),
            "image_bytes": encode_jpeg(candidate.crop, spec.jpeg_quality)}


def source_name(ref: InputRef, spec: InputSpec, project_root: Path) -> str:
    """A video's name in crops: its path relative to the input folder (the list file's folder for a
    path list), else the path as listed."""
    base = _location(spec, project_root)
    base = base if base.is_dir() else base.parent
    try:
        return str(Path(ref.source).relative_to(base))
    except ValueError:
        return ref.source

