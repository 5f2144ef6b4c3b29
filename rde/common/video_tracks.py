"""Detections linked into tracks, and the crops each track gives.

The tracker is ultralytics' ``BYTETracker`` (ByteTrack, Zhang et al. 2022), a kept library rather
than our own linker: ultralytics is already the engine's YOLO backend, its ByteTrack is
appearance-free (no re-identification model to download, so it runs offline on any detector's
boxes) and it associates low-score boxes in a second pass, which keeps a person's track through
the partial occlusions that a greedy IoU linker breaks. One tracker per domain: a person's box
never continues a car's track.

A track's life is cut into bins of ``video.crop_bin_seconds``; each bin keeps its best crop,
quality q = score · √(w·h) · min(1, L / (2·L_min)), L the crop's Laplacian variance and L_min
denoise's blur threshold: large, confident, sharp. When the track ends, ``crops_per_track`` of
its bins are taken evenly over its life. Crops must pass the domain's size rule and the blur
threshold (denoise's, so no crop is cut that denoise would reject for either); a track with no
such crop says why: ``too_short`` (fewer than ``video.min_track_detections`` detections),
``too_small`` (no box large enough), ``low_score`` (every large enough box scored below
``video.crop_min_score``: ByteTrack continues tracks through weak boxes, whose crops the detector
would not confirm), ``blurry``, or with ``video.confirm_crops`` ``unconfirmed`` (the detector
finds no single target on any chosen crop; up to five candidates per bin are tried, best first).
Memory per live track is one crop per bin (five with confirmation).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TypeVar

import numpy as np

from models.backends.detectors import Detections
from rde.common.denoise import laplacian_variance
from rde.common.pool_config import DenoiseSpec, TrackerSpec, VideoSpec
from rde.common.reasons import Reason

T = TypeVar("T")
CONFIRM_CANDIDATES = 5  # with video.confirm_crops: the best candidates of a bin tried, in order


class TrackedBoxes:
    """Detections in the form ByteTrack reads (``conf``, ``cls``, ``xywh``, boolean indexing)."""

    def __init__(self, xyxy: np.ndarray, conf: np.ndarray, cls: np.ndarray) -> None:
        self.xyxy = np.asarray(xyxy, np.float32).reshape(-1, 4)
        self.conf = np.asarray(conf, np.float32).reshape(-1)
        self.cls = np.asarray(cls, np.float32).reshape(-1)

    @property
    def xywh(self) -> np.ndarray:
        centre = (self.xyxy[:, :2] + self.xyxy[:, 2:]) / 2
        return np.concatenate([centre, self.xyxy[:, 2:] - self.xyxy[:, :2]], axis=1)

    def __len__(self) -> int:
        return len(self.conf)

    def __getitem__(self, index: Any) -> TrackedBoxes:
        return TrackedBoxes(self.xyxy[index], self.conf[index], self.cls[index])


def byte_tracker(spec: TrackerSpec, lost_updates: int) -> Any:
    """A fresh ultralytics ByteTrack whose buffer is ``lost_updates`` updates (sampled frames).
    Imported offline, and quiet when nothing imported ultralytics before (its first import otherwise
    prints a settings-file banner in the middle of a run's progress)."""
    if "ultralytics" not in sys.modules:
        os.environ.setdefault("YOLO_OFFLINE", "1")
        os.environ.setdefault("YOLO_VERBOSE", "False")
    from ultralytics.trackers.byte_tracker import BYTETracker

    args = SimpleNamespace(track_high_thresh=spec.high_score, track_low_thresh=spec.low_score,
                           new_track_thresh=spec.new_track_score, match_thresh=spec.match_threshold,
                           track_buffer=lost_updates, fuse_score=True)
    return BYTETracker(args)


def link(tracker: Any, dets: Detections) -> list[tuple[int, int]]:
    """(track id, detection index) for the detections the tracker placed on a confirmed track."""
    boxes = TrackedBoxes(dets.boxes, dets.scores, np.zeros(len(dets)))
    rows = tracker.update(boxes)
    return [(int(row[4]), int(row[7])) for row in rows]


def expand_box(box: np.ndarray, margin: tuple[float, float], width: int, height: int) -> tuple[int, int, int, int]:
    """Grow a box by a fraction of its size on each side, clipped to the frame (integer pixels)."""
    x1, y1, x2, y2 = (float(v) for v in box)
    mx, my = (x2 - x1) * margin[0], (y2 - y1) * margin[1]
    return (max(0, int(x1 - mx)), max(0, int(y1 - my)), min(width, int(np.ceil(x2 + mx))),
            min(height, int(np.ceil(y2 + my))))


@dataclass
class Candidate:
    """A crop a track may give: the best of its bin so far."""

    quality: float
    frame: int
    time: float
    box: list[float]
    score: float
    label: str
    crop: np.ndarray


@dataclass
class Track:
    """One track of one domain: every detection on it (frame, time, box), the best crop per bin."""

    track_id: int
    domain: str
    first_time: float
    last_step: int
    detections: list[tuple[int, float, list[float]]] = field(default_factory=list)
    bins: dict[int, list[Candidate]] = field(default_factory=dict)  # best first
    large_enough: int = 0  # detections whose crop passes the size rule
    weak: int = 0  # of those, detections scoring below video.crop_min_score

    def window(self, time: float, seconds: float) -> list[dict[str, Any]]:
        """The track's boxes within ``seconds`` of ``time`` (the motion window of a crop)."""
        return [{"frame": f, "time": round(t, 3), "box": b} for f, t, b in self.detections if abs(t - time) <= seconds]


class TrackBook:
    """The live tracks of one segment, and the crops of those that ended."""

    def __init__(self, spec: VideoSpec, denoise: DenoiseSpec, lost_steps: int) -> None:
        self.spec, self.denoise, self.lost_steps = spec, denoise, lost_steps
        self.live: dict[tuple[str, int], Track] = {}

    def observe(self, step: int, frame: int, time: float, rgb: np.ndarray, domain: str, track_id: int,
                box: np.ndarray, score: float, label: str) -> None:
        """Add one detection of a track, and its crop when it is the best of its bin so far."""
        track = self.live.get((domain, track_id))
        if track is None:
            track = self.live[domain, track_id] = Track(track_id, domain, time, step)
        rounded = [round(float(v), 1) for v in box]
        track.detections.append((frame, time, rounded))
        track.last_step = step
        x1, y1, x2, y2 = expand_box(box, self.spec.crop_margin, rgb.shape[1], rgb.shape[0])
        rule = self.denoise.size_rule(domain)
        if x2 - x1 < rule.min_width or y2 - y1 < rule.min_height:
            return
        track.large_enough += 1
        if score < self.spec.crop_min_score:  # a weak box continues the track; its crop is not kept
            track.weak += 1
            return
        crop = rgb[y1:y2, x1:x2]
        sharpness = laplacian_variance(crop)
        if sharpness < self.denoise.min_laplacian_variance:
            return
        quality = crop_quality(score, x2 - x1, y2 - y1, sharpness, self.denoise.min_laplacian_variance)
        held = track.bins.setdefault(int((time - track.first_time) // self.spec.crop_bin_seconds), [])
        keep = CONFIRM_CANDIDATES if self.spec.confirm_crops else 1  # candidates to confirm, best first
        if len(held) < keep or quality > held[-1].quality:
            held.append(Candidate(quality, frame, time, rounded, round(float(score), 3), label, crop.copy()))
            held.sort(key=lambda c: -c.quality)
            del held[keep:]

    def ended(self, step: int) -> list[Track]:
        """Tracks unseen for more than the tracker's buffer: removed from the live set."""
        done = [key for key, t in self.live.items() if step - t.last_step > self.lost_steps]
        return [self.live.pop(key) for key in sorted(done)]

    def close(self) -> list[Track]:
        """Every live track (the segment ended)."""
        done = [self.live.pop(key) for key in sorted(self.live)]
        return done

    def choose(self, track: Track, confirm: Callable[[Candidate, str], bool] | None = None
               ) -> tuple[list[Candidate], str | None]:
        """The crops a finished track gives, spread over its life, or none and why. With
        ``confirm`` (``video.confirm_crops``), each chosen bin gives its best candidate that
        ``confirm(candidate, domain)`` accepts, or nothing."""
        if len(track.detections) < self.spec.min_track_detections:
            return [], str(Reason.TOO_SHORT)
        if not track.bins:
            if track.large_enough == 0:
                return [], str(Reason.TOO_SMALL)
            return [], str(Reason.LOW_SCORE if track.weak == track.large_enough else Reason.BLURRY)
        chosen = []
        for candidates in spread(track.bins, self.spec.crops_per_track):
            passing = candidates if confirm is None else [c for c in candidates if confirm(c, track.domain)][:1]
            chosen.extend(passing[:1])
        return chosen, None if chosen else str(Reason.UNCONFIRMED)


def crop_quality(score: float, width: int, height: int, sharpness: float, blur_threshold: float) -> float:
    """q = score · √(w·h) · min(1, L / (2·L_min)) (see the module docstring)."""
    factor = 1.0 if blur_threshold <= 0 else min(1.0, sharpness / (2 * blur_threshold))
    return float(score) * float(np.sqrt(width * height)) * factor


def spread(bins: dict[int, T], count: int) -> list[T]:
    """``count`` bins taken evenly from first to last (all when there are fewer), in time order."""
    order = sorted(bins)
    picks = sorted({int(i) for i in np.linspace(0, len(order) - 1, min(count, len(order))).round()})
    return [bins[order[i]] for i in picks]
