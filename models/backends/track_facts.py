"""Facts only the video knows: how the subject of a crop moves, read from its track's boxes.

A crop cut from a tracked video carries, in its ``source_meta``, the track's boxes over the
seconds around its frame (``track_window``: ``{"time", "box"}`` points), the crop's own ``box`` and
the ``frame_size``. From these, per crop:

* **velocity**: the least-squares slope over time of the box's bottom centre (the feet, or where a
  vehicle meets the road) within ``window_s`` seconds of the crop's time, in units of the track's
  median box height per second (``heights/s``). Dividing by the height makes the speed independent
  of the distance to the camera: a person walking at 1.4 m/s who is 1.7 m tall moves about
  0.8 heights/s wherever they are in the frame.
* **motion**: the state of the crop's domain (its ``motion`` list: a person is ``standing`` below
  0.06, ``walking`` from 0.15, ``running`` from 1.6; a vehicle ``parked`` below 0.03 and ``moving``
  from 0.1: ``Domain.state``). Between a ``below`` and the first ``from`` threshold nothing is
  said: a person stopping or starting within the window, or shifting on the spot while the box
  jitters, is neither.
* **direction**: the dominant axis of the velocity, when it is at least ``direction_ratio`` times
  the other: left or right in the frame, or, for the vertical axis, toward the camera (moving
  down the image) or away from it (up). Moving down the image means coming closer for a camera
  mounted above the scene, looking down, as surveillance cameras are; for a camera at ground
  level it does not hold, and a profile can switch direction off (``direction_ratio: 0``). Nothing
  is said for a subject that is not moving, or whose axes are too close to call.
* **distance**: ``near`` when the crop's box is at least ``near_height`` of the frame's height,
  ``far`` at most ``far_height``, else nothing.
* **place in the frame**: ``side`` (``left`` or ``right``: the box centre in the outer
  ``side_share`` of the frame's width) and ``height`` (``upper`` or ``lower``: the box's bottom edge,
  where the subject stands, in the top or bottom ``height_share`` of the frame). For a fixed camera
  the place in the frame is a place in the scene ("on the left side of the frame, in its upper
  part": the walkway), a context surveillance users search by.

A row without a track (a still image, a crop from a folder), or from a camera that moves
(``"camera": "moving"`` in its metadata, the video profile's ``camera``), has no motion or direction
facts; nothing is guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from models.domains import Domain, DomainSet

# phrase per measured value, and the words a caption stating it may use (a motion state's words
# are its domain's: ``MotionState.says`` and ``also``)
DIRECTION_PHRASES = {"left": "to the left", "right": "to the right", "toward": "toward the camera",
                     "away": "away from the camera"}
_HEADING = {"head", "heads", "heading"}
DIRECTION_WORDS = {"left": {"left"} | _HEADING, "right": {"right"} | _HEADING,
                   "toward": {"toward", "towards", "camera", "approach", "approaches", "approaching"} | _HEADING,
                   "away": {"away", "camera"} | _HEADING}
DISTANCE_WORDS = {"near": {"near", "close", "camera"}, "far": {"far", "distant", "camera"}}
SIDE_PHRASES = {"left": "on the left side of the frame", "right": "on the right side of the frame"}
HEIGHT_PHRASES = {"upper": "in the upper part of the frame", "lower": "in the lower part of the frame"}
PLACE_WORDS = {"side", "frame", "part", "upper", "lower"}
# every word that claims a direction, distance or place: said only when measured
PLACE_CLAIM_WORDS = set().union(*DIRECTION_WORDS.values(), *DISTANCE_WORDS.values(), PLACE_WORDS)


def track_claim_words(domains: DomainSet) -> set[str]:
    """Every word that claims a motion (any domain's states), direction, distance or place."""
    return PLACE_CLAIM_WORDS | {w for d in domains for s in d.motion for w in (*s.says, *s.also)}


@dataclass(frozen=True)
class MotionOptions:
    """Thresholds of the track facts, in box heights per second (speeds) and shares of the frame's
    height (distance); a profile sets them in its ``track_facts`` section, a domain its motion
    states' speeds. The defaults were set on the demo pool's tracks (vtest.avi at 10 fps): people's
    speeds have median 0.44 heights/s, 95th percentile 1.03; the two parked vans 0.00–0.02. The
    pedestrian domain's standing and walking thresholds were then set against 285 crops labelled by
    eye (results: "what the demo says"): below 0.06, 8 of 9 crops were standing; from 0.15, 250 of
    259 walking; the 17 crops between are left unsaid."""

    window_s: float = 1.0
    min_points: int = 4
    direction_ratio: float = 1.5
    direction_min_speed: float = 0.2
    near_height: float = 0.35
    far_height: float = 0.1
    side_share: float = 0.3
    height_share: float = 0.35


@dataclass(frozen=True)
class TrackVelocity:
    """The feet's velocity (heights/s, image axes: x to the right, y down) and the points used."""

    vx: float
    vy: float
    points: int

    @property
    def speed(self) -> float:
        return float(np.hypot(self.vx, self.vy))


def track_velocity(window: list[dict[str, Any]], time: float, window_s: float) -> TrackVelocity | None:
    """Least-squares velocity of the box's bottom centre over the points within ``window_s`` of
    ``time``, in median box heights per second; None with fewer than two points or no time span."""
    points = [p for p in window if abs(float(p["time"]) - time) <= window_s + 1e-9]
    if len(points) < 2:
        return None
    t = np.array([float(p["time"]) for p in points])
    boxes = np.array([p["box"] for p in points], np.float64)
    if np.ptp(t) <= 0:
        return None
    height = float(np.median(boxes[:, 3] - boxes[:, 1]))
    if height <= 0:
        return None
    feet_x, feet_y = (boxes[:, 0] + boxes[:, 2]) / 2, boxes[:, 3]
    tc = t - t.mean()
    denom = float((tc**2).sum())
    vx = float((tc * (feet_x - feet_x.mean())).sum() / denom) / height
    vy = float((tc * (feet_y - feet_y.mean())).sum() / denom) / height
    return TrackVelocity(vx, vy, len(points))


def direction_of(velocity: TrackVelocity, ratio: float) -> str | None:
    """``left``/``right``/``toward``/``away`` by the dominant axis, or None when the axes are within
    ``ratio`` of each other (or ``ratio`` is 0: direction off)."""
    if ratio <= 0:
        return None
    ax, ay = abs(velocity.vx), abs(velocity.vy)
    if ax >= ratio * ay:
        return "right" if velocity.vx > 0 else "left"
    if ay >= ratio * ax:
        return "toward" if velocity.vy > 0 else "away"
    return None


def motion_facts(meta: dict[str, Any] | str | None, domain: Domain | None,
                 options: MotionOptions = MotionOptions()) -> dict[str, list[str]]:
    """``motion``, ``direction``, ``distance``, ``side`` and ``height`` values of one crop of
    ``domain`` from its ``source_meta`` (a dict or its JSON); a key is present only when measured
    (no domain: no motion)."""
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except ValueError:
            return {}
    if not isinstance(meta, dict):
        return {}
    facts: dict[str, list[str]] = {}
    box, frame = meta.get("box"), meta.get("frame_size")
    if box and frame and len(frame) == 2 and frame[1]:
        share = (float(box[3]) - float(box[1])) / float(frame[1])
        if share >= options.near_height:
            facts["distance"] = ["near"]
        elif share <= options.far_height:
            facts["distance"] = ["far"]
        centre = (float(box[0]) + float(box[2])) / 2 / float(frame[0])
        feet = float(box[3]) / float(frame[1])
        if centre <= options.side_share or centre >= 1 - options.side_share:
            facts["side"] = ["left" if centre <= options.side_share else "right"]
        if feet <= options.height_share or feet >= 1 - options.height_share:
            facts["height"] = ["upper" if feet <= options.height_share else "lower"]
    window, time = meta.get("track_window"), meta.get("time")
    if meta.get("camera") == "moving":  # neither the motion nor the place in the frame is the scene's
        return {k: v for k, v in facts.items() if k == "distance"}
    if not window or time is None:
        return facts
    velocity = track_velocity(window, float(time), options.window_s)
    if velocity is None or velocity.points < options.min_points:
        return facts
    speed = velocity.speed
    state = domain.state(speed) if domain is not None else None
    if state:
        facts["motion"] = [state.name]
    if state is not None and state.at_least is not None and speed >= options.direction_min_speed:
        direction = direction_of(velocity, options.direction_ratio)
        if direction:
            facts["direction"] = [direction]
    return facts


def track_fact_words(facts: dict[str, list[str]], domain: Domain | None) -> set[str]:
    """The words a caption may use to state ``facts`` (``motion_facts``' output for ``domain``)."""
    words: set[str] = set()
    states = {s.name: {*s.says, *s.also} for s in domain.motion} if domain is not None else {}
    for value in facts.get("motion", []):
        words |= states.get(value, set())
    for value in facts.get("direction", []):
        words |= DIRECTION_WORDS.get(value, set()) | set(DIRECTION_PHRASES[value].split())
    for value in facts.get("distance", []):
        words |= DISTANCE_WORDS.get(value, set())
    for value in facts.get("side", []):
        words |= set(SIDE_PHRASES[value].split())
    for value in facts.get("height", []):
        words |= set(HEIGHT_PHRASES[value].split())
    return words


def facts_phrase(facts: dict[str, list[str]]) -> str:
    """Track facts as words: "walking, to the left, far from the camera" ("" when none)."""
    parts = list(facts.get("motion", []))
    parts += [DIRECTION_PHRASES[d] for d in facts.get("direction", []) if d in DIRECTION_PHRASES]
    parts += [f"{d} the camera" if d == "near" else "far from the camera" for d in facts.get("distance", [])]
    parts += [SIDE_PHRASES[v] for v in facts.get("side", []) if v in SIDE_PHRASES]
    parts += [HEIGHT_PHRASES[v] for v in facts.get("height", []) if v in HEIGHT_PHRASES]
    return ", ".join(parts)
