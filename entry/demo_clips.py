"""Build the demo video-clip set for the cached reranker: short clips of ``vtest.avi`` with captions
grounded in what the engine measures (tracked persons, their clothing colours, where they walk).

- Every frame is detected (bundled SSD-MobileNet) and persons are linked into tracks by the videos
  stage's own loop (``rde.common.video_input.tracked_frames``: ByteTrack, ``CLIP_VIDEO``), so each
  clip knows which people it shows and how they move.
- A clip is T frames ``frame_step`` apart (default 8 frames, 0.5 s apart = a 4 s window), starting
  every ``clip_stride`` frames. Frames are stored once (clips overlap) as JPEGs.
- Captions per clip: one per tracked person visible in at least half of its frames (largest first,
  at most ``max_person_captions``): upper/lower clothing colour (the attributes backend's colour
  measurement on that person's middle box), walking direction from the track's displacement, and
  the side of the frame; plus one caption counting the people and their directions.
- Split by time: clips that end before ``test_from`` × duration minus ``gap_frames`` are ``train``,
  clips that start at or after ``test_from`` × duration are ``test``; the clips in between are kept
  with split ``gap`` (never trained or tested on), so no test frame is ever seen in training.

Reproducible: the same video and parameters give the same clips (no randomness, no wall clock).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa

from models.backends.attributes import COLOURS, _region, colour_distribution
from models.backends.detectors import load_detector
from models.domains import load_domain
from rde.common.image_decoding import encode_jpeg
from rde.common.input_listing import InputRef
from rde.common.pool_config import VideoSpec
from rde.common.video_decoding import DecodeOutcome, probe
from rde.common.video_input import Segment, detector_for_video, open_segment, tracked_frames
from rde.profile import load_profile
from storage import ArtifactWriter, content_key

CLIP_FRAMES = pa.schema([pa.field("frame_index", pa.int32(), nullable=False),
                         pa.field("image_bytes", pa.binary(), nullable=False)])
CLIPS = pa.schema([pa.field("clip_id", pa.string(), nullable=False), pa.field("split", pa.string(), nullable=False),
                   pa.field("start_frame", pa.int32(), nullable=False),
                   pa.field("frame_indices", pa.list_(pa.int32()), nullable=False),
                   pa.field("captions", pa.list_(pa.string()), nullable=False),
                   pa.field("persons", pa.int32(), nullable=False)])
NUMBERS = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight"]
# every frame of the 10 fps recording is tracked (clips sample frames 0.5 s apart from the tracks)
CLIP_VIDEO = VideoSpec(sample_fps=10.0, segment_seconds=3600.0)
PERSONS = [load_domain("pedestrian")]


@dataclass
class ClipParams:
    """Everything that determines the clip set's content."""

    frames: int = 8
    frame_step: int = 5
    clip_stride: int = 5
    test_from: float = 0.7
    gap_frames: int = 40
    min_move: float = 0.6  # displacement below this × box height = "stands"
    max_person_captions: int = 3
    frame_width: int = 320
    jpeg_quality: int = 80


@dataclass
class Sighting:
    frame: int
    box: np.ndarray
    upper: str
    lower: str


def _colour(rgb: np.ndarray, box: np.ndarray, top: float, bottom: float) -> str:
    dist = colour_distribution(_region(rgb, box, top, bottom))
    return "unknown" if dist is None else COLOURS[int(np.argmax(dist))]


def track_people(video: str, params: ClipParams) -> tuple[list[tuple[int, np.ndarray]], dict[int, list[Sighting]]]:
    """All frames, and per track id the sightings (frame, box, measured upper/lower colour), tracked
    by the videos stage's loop with ``CLIP_VIDEO`` (the demo profile's detector)."""
    detector = load_detector(detector_for_video(load_profile("demo").models.detector, CLIP_VIDEO))
    segment = Segment(InputRef(f"demo:{Path(video).name}", video, "pedestrian"), 0, 0, None)
    path, info = open_segment(segment, CLIP_VIDEO, None)
    frames: list[tuple[int, np.ndarray]] = []
    tracks: dict[int, list[Sighting]] = {}
    for frame in tracked_frames(path, info, segment, CLIP_VIDEO, PERSONS, detector, DecodeOutcome()):
        frames.append((frame.number, frame.rgb))
        for seen in frame.sightings:
            box = np.asarray(seen.box, np.float32).copy()
            tracks.setdefault(seen.track_id, []).append(Sighting(frame.number, box, _colour(frame.rgb, box, 0.15, 0.5),
                                                                 _colour(frame.rgb, box, 0.5, 0.85)))
    return frames, tracks


def direction(first: np.ndarray, last: np.ndarray, min_move: float) -> str:
    """Walking direction from two boxes: the larger of the horizontal and the (foreshortened,
    ×2) vertical displacement; 'stands' when it is below ``min_move`` box heights."""
    c0, c1 = (first[:2] + first[2:]) / 2, (last[:2] + last[2:]) / 2
    dx, dy = c1 - c0
    height = max(float(first[3] - first[1]), 1.0)
    if max(abs(dx), 2 * abs(dy)) < min_move * height:
        return "stands still"
    if abs(dx) >= 2 * abs(dy):
        return "walks to the left" if dx < 0 else "walks to the right"
    return "walks towards the camera" if dy > 0 else "walks away from the camera"


def side(box: np.ndarray, width: int) -> str:
    x = (box[0] + box[2]) / 2 / width
    return "on the left" if x < 1 / 3 else "on the right" if x > 2 / 3 else "in the middle"


def clip_captions(frame_ids: list[int], tracks: dict[int, list[Sighting]], width: int, params: ClipParams
                  ) -> tuple[list[str], int]:
    """Captions of one clip (person captions, largest first, then the count caption) and its person count."""
    lo, hi = frame_ids[0], frame_ids[-1]
    people = []
    for sightings in tracks.values():
        inside = [s for s in sightings if lo <= s.frame <= hi]
        sampled = {s.frame for s in inside} & set(frame_ids)
        if len(sampled) * 2 < len(frame_ids):
            continue
        middle = inside[len(inside) // 2]
        area = float(np.prod(middle.box[2:] - middle.box[:2]))
        people.append((area, middle, direction(inside[0].box, inside[-1].box, params.min_move)))
    people.sort(key=lambda p: -p[0])
    captions = [f"a person in a {m.upper} top and {m.lower} trousers {d} {side(m.box, width)} of the path"
                for _, m, d in people[: params.max_person_captions]]
    moves = Counter(d for _, _, d in people)
    if people:
        parts = [f"{NUMBERS[min(n, 8)]} {'person' if n == 1 else 'people'} {d.replace('walks', 'walk') if n > 1 else d}"
                 for d, n in sorted(moves.items(), key=lambda kv: (-kv[1], kv[0]))]
        count = NUMBERS[min(len(people), 8)]
        captions.append(f"{count} {'pedestrian' if len(people) == 1 else 'pedestrians'} on the campus path: "
                        + ", ".join(parts).replace("people stands still", "people stand still"))
    else:
        captions.append("an empty campus path with parked cars and a van, nobody walking")
    return captions, len(people)


def build_clip_rows(video: str, params: ClipParams) -> tuple[list[dict], list[dict]]:
    """(frame rows, clip rows) matching ``CLIP_FRAMES`` and ``CLIPS``."""
    frames, tracks = track_people(video, params)
    total = len(frames)
    width = frames[0][1].shape[1]
    span = (params.frames - 1) * params.frame_step
    test_start = int(params.test_from * total)
    clips, used = [], set()
    for start in range(0, total - span, params.clip_stride):
        ids = [start + k * params.frame_step for k in range(params.frames)]
        split = "test" if start >= test_start else "train" if ids[-1] < test_start - params.gap_frames else "gap"
        captions, persons = clip_captions(ids, tracks, width, params)
        clips.append({"clip_id": f"{Path(video).name}:clip:{start:05d}", "split": split, "start_frame": start,
                      "frame_indices": ids, "captions": captions, "persons": persons})
        used.update(ids)

    rows = []
    for index, rgb in frames:
        if index in used:
            h, w = rgb.shape[:2]
            small = cv2.resize(rgb, (params.frame_width, round(h * params.frame_width / w)),
                               interpolation=cv2.INTER_AREA)
            rows.append({"frame_index": index, "image_bytes": encode_jpeg(small, params.jpeg_quality)})
    return rows, clips


def video_fps(video: str) -> float | None:
    """The video's frame rate as its container states it (None when unknown): clip times in seconds."""
    try:
        return probe(video, CLIP_VIDEO.max_pixels).fps
    except Exception:
        return None


def write_clip_set(frame_rows: list[dict], clip_rows: list[dict], out_dir: str, params: ClipParams, video: str,
                   fps: float | None = None) -> None:
    """Two one-shard artifacts: ``<out>/frames`` and ``<out>/clips`` (the engine's reader and lineage apply);
    ``fps`` (the video's frame rate) is recorded in the config so clip spans can be told in seconds."""
    key = content_key(kind="clips", video=Path(video).name, params=asdict(params),
                      tracking=CLIP_VIDEO.model_dump(mode="json"))
    splits = Counter(c["split"] for c in clip_rows)
    for name, kind, schema, rows in (("frames", "clip_frames", CLIP_FRAMES, frame_rows),
                                     ("clips", "clips", CLIPS, clip_rows)):
        writer = ArtifactWriter(f"{out_dir}/{name}", kind, schema, key)
        writer.begin()
        shard = writer.write_shard(0, pa.Table.from_pylist(rows, schema=schema))
        writer.finalize([shard], code_version="demo-clips-builder-2 (videos stage tracking)",
                        config={"params": asdict(params), "video": Path(video).name, "fps": fps,
                                "tracking": CLIP_VIDEO.model_dump(mode="json")},
                        models={"detector": "ssd_mobilenet_v2_coco_2018_03_29", "tracker": "ultralytics ByteTrack"},
                        stats={"splits": dict(splits), "captions": sum(len(c["captions"]) for c in clip_rows)})
