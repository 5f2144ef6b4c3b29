"""A motion clip set for the cached reranker: one tracked person per clip, captioned with their
appearance and the direction they move, and each clip's time-reversed twin as its hard negative.

Built from a tracked surveillance video (``vtest.avi``; the detector and tracker of
``entry.demo_clips``):

- A clip is T frames ``frame_step`` apart from one track, cut every ``window_stride`` frames where
  the track is seen in every sampled frame. Its crop is one fixed window for all T frames (the
  union of the person's boxes, padded, made square), so the person moves across the crop: a clip's
  direction is in the order of its frames, not in any one frame.
- Its direction is measured from the track's first and last box (``demo_clips.direction``); clips
  where the person stands still are left out (reason ``no_motion``).
- Its caption names the measured clothing colours (the majority over its sightings) and the
  direction: "a person in a black top and blue trousers walking to the left".
- Its **reversed twin** holds the same frames in the opposite order and the opposite direction's
  caption. The two have the same frame average, so a stage 1 that embeds a clip as the mean of its
  frames scores them the same by construction; only frame order tells them apart.
- Relevance: a query is relevant to the clips of the same track moving the same way (its group is
  ``track:direction``), so the twin of a relevant clip is a negative.
- Split by identity through time: tracks that end before ``test_from`` × the video's length less
  ``gap_frames`` are ``train``, tracks that start at or after it are ``test``, tracks in between are
  left out (``split_gap``), so no person is both trained on and evaluated (unless the tracker lost
  someone and found them again much later).

Reproducible: the same video and parameters give the same clips (no randomness).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from entry.demo_clips import ClipParams, Sighting, direction, track_people
from rde.vedje.data import ItemSet

REVERSE = {"walks to the left": "walks to the right", "walks to the right": "walks to the left",
           "walks towards the camera": "walks away from the camera",
           "walks away from the camera": "walks towards the camera"}
PHRASE = {d: d.replace("walks", "walking") for d in REVERSE}
VERSION = 1  # of how a motion set is cut from tracks (part of cache keys): bump on any change of content


@dataclass(frozen=True)
class MotionParams:
    """Everything that determines the motion set's content."""

    frames: int = 8  # T, the frames a clip caches
    frame_step: int = 3  # video frames between two cached frames (0.3 s at vtest.avi's 10 fps)
    window_stride: int = 6  # video frames between two clips' starts on one track
    min_move: float = 0.4  # a displacement over the clip below this × box height: "stands still"
    pad: float = 0.15  # the crop window's margin around the union of the boxes, × its height
    crop_size: int = 128  # crops are resized to this square
    test_from: float = 0.6
    gap_frames: int = 30


@dataclass
class MotionSet:
    """The items (originals and reversed twins) with their crops, and what was left out."""

    items: ItemSet
    crops: dict[str, np.ndarray]
    rejected: Counter


def twins_of(item_ids: Sequence[str]) -> dict[int, int]:
    """Item row → its reversed twin's row (ids ``X`` and ``X:reversed``), both ways."""
    row = {i: k for k, i in enumerate(item_ids)}
    twins = {}
    for k, item in enumerate(item_ids):
        if item.endswith(":reversed"):
            twins[k], twins[row[item.removesuffix(":reversed")]] = row[item.removesuffix(":reversed")], k
    return twins


def directions_of(groups: Sequence[str]) -> list[str]:
    """Each item's direction (its group is ``track:direction``)."""
    return [g.split(":", 1)[1] for g in groups]


def crop_window(boxes: list[np.ndarray], pad: float, width: int, height: int) -> tuple[int, int, int, int]:
    """One square window holding every box, padded by ``pad`` × its height, clipped to the frame."""
    b = np.stack(boxes)
    x1, y1, x2, y2 = b[:, 0].min(), b[:, 1].min(), b[:, 2].max(), b[:, 3].max()
    side = max(x2 - x1, y2 - y1) * (1 + 2 * pad)
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    side = int(min(side, width, height))
    left = round(float(min(max(cx - side / 2, 0), width - side)))
    top = round(float(min(max(cy - side / 2, 0), height - side)))
    return left, top, left + side, top + side


def split_of(sightings: list[Sighting], test_start: int, gap_frames: int) -> str:
    """``train`` / ``test`` / ``gap`` for a whole track (see the module docstring)."""
    if sightings[0].frame >= test_start:
        return "test"
    return "train" if sightings[-1].frame < test_start - gap_frames else "gap"


def motion_set(frames: dict[int, np.ndarray], tracks: dict[int, list[Sighting]], params: MotionParams,
               total_frames: int, name: str = "video") -> MotionSet:
    """The motion set of tracked ``frames`` (frame index → RGB) and ``tracks`` (track id → sightings)."""
    span = (params.frames - 1) * params.frame_step
    test_start = int(params.test_from * total_frames)
    ids, groups, splits, frame_keys, texts, query_items = [], [], [], [], [], []
    crops: dict[str, np.ndarray] = {}
    rejected: Counter = Counter()
    for tid in sorted(tracks):
        sightings = sorted(tracks[tid], key=lambda s: s.frame)
        by_frame = {s.frame: s for s in sightings}
        split = split_of(sightings, test_start, params.gap_frames)
        for start in range(sightings[0].frame, sightings[-1].frame - span + 1, params.window_stride):
            wanted = [start + k * params.frame_step for k in range(params.frames)]
            if not all(f in by_frame for f in wanted):
                continue  # the track is not seen in every sampled frame
            seen = [by_frame[f] for f in wanted]
            move = direction(seen[0].box, seen[-1].box, params.min_move)
            if move not in REVERSE:
                rejected["no_motion"] += 1
                continue
            if split == "gap":
                rejected["split_gap"] += 1
                continue
            height, width = frames[wanted[0]].shape[:2]
            x1, y1, x2, y2 = crop_window([s.box for s in seen], params.pad, width, height)
            keys = [f"{name}:{tid}:{f:06d}:{start:06d}" for f in wanted]  # key order = time order
            for key, f in zip(keys, wanted, strict=True):
                crops[key] = cv2.resize(frames[f][y1:y2, x1:x2], (params.crop_size, params.crop_size),
                                        interpolation=cv2.INTER_AREA)
            upper = Counter(s.upper for s in seen).most_common(1)[0][0]
            lower = Counter(s.lower for s in seen).most_common(1)[0][0]
            for order, move_of in ((keys, move), (keys[::-1], REVERSE[move])):
                row = len(ids)
                ids.append(f"{name}:track:{tid}:{start:05d}{'' if order is keys else ':reversed'}")
                groups.append(f"{tid}:{move_of}")
                splits.append(split)
                frame_keys.append(order)
                texts.append(f"a person in a {upper} top and {lower} trousers {PHRASE[move_of]}")
                query_items.append(row)
    items = ItemSet(ids, groups, splits, frame_keys, texts, query_items,
                    lambda keys: {k: crops[k] for k in keys}, dict(rejected), len(ids) // 2 + sum(rejected.values()))
    return MotionSet(items, crops, rejected)


def build_motion_set(video: str, params: MotionParams, clip_params: ClipParams | None = None) -> MotionSet:
    """Detect and track every frame of ``video`` (``demo_clips.track_people``), then ``motion_set``."""
    frames, tracks = track_people(video, clip_params or ClipParams())
    return motion_set(dict(frames), tracks, params, len(frames), Path(video).name)
