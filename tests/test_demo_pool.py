"""The committed demo pool: enough distinct, usable vehicles; the street-crop selection rules."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from rde.common.expert_check import load_check_yaml
from rde.common.profiles import load_profile
from rde.entry.demo_pool import PoolParams, select_street_crops, spread_per_identity
from storage import Artifact

MIN_VEHICLE_CROPS = 40  # the demo's vehicle gallery needs >= 40 images ...
MIN_VEHICLES = 10  # ... of >= 10 distinct vehicles
MIN_RELEVANT = 3  # every check-set vehicle query has at least this many relevant crops
MAX_POOL_BYTES = 3 * 1024 * 1024  # the committed pool stays small


def test_pool_has_many_distinct_vehicles_that_pass_the_size_rule(demo_pool_url: str) -> None:
    rows = Artifact(demo_pool_url).read_shard(0, ["domain", "identity", "variant", "image_bytes"]).to_pylist()
    rule = load_profile("demo").denoise.size_rule("vehicle")
    vehicles = [r for r in rows if r["domain"] == "vehicle" and r["variant"] == "crop"]
    sizes = [_jpeg_size(r["image_bytes"]) for r in vehicles]
    usable = [r for r, (w, h) in zip(vehicles, sizes, strict=True) if w >= rule.min_width and h >= rule.min_height]
    assert len(usable) >= MIN_VEHICLE_CROPS
    assert len({r["identity"] for r in usable}) >= MIN_VEHICLES
    assert sum(f.stat().st_size for f in Path(demo_pool_url).iterdir()) <= MAX_POOL_BYTES


def test_check_set_vehicle_queries_have_enough_relevant_crops(demo_pool_url: str) -> None:
    crops = Artifact(demo_pool_url).read_shard(0, ["identity", "variant"]).to_pylist()
    per_identity: dict[str, int] = {}
    for r in crops:
        if r["variant"] == "crop" and r["identity"]:
            per_identity[r["identity"]] = per_identity.get(r["identity"], 0) + 1
    queries = [q for q in load_check_yaml()["queries"] if q["domain"] == "vehicle"]
    assert queries
    for q in queries:
        relevant = sum(per_identity.get(i, 0) for i in q["relevant_identities"])
        assert relevant >= MIN_RELEVANT, (q["id"], relevant)


def _jpeg_size(data: bytes) -> tuple[int, int]:
    """Width and height of an encoded image from its header (no decode)."""
    with Image.open(io.BytesIO(data)) as img:
        return img.size


def _det(frame: int, w: float, h: float) -> dict:
    return {"frame": frame, "box": np.array([10, 10, 10 + w, 10 + h], np.float32), "score": 0.6, "label": "car"}


def test_street_selection_keeps_long_tracks_and_large_boxes() -> None:
    params = PoolParams(street_min_hits=4, street_min_box=(60, 34), street_keep_every=2)
    tracks = {
        0: [_det(f, 80, 40) for f in range(0, 12, 2)],  # 6 large boxes -> every 2nd
        1: [_det(f, 80, 40) for f in range(3)],  # too short a track
        2: [_det(f, 50, 40) for f in range(10)] + [_det(20, 61, 35)],  # only one box large enough
    }
    chosen = select_street_crops(tracks, params)
    assert [(tid, d["frame"]) for tid, d in chosen] == [(0, 0), (0, 4), (0, 8), (2, 20)]


def test_spread_per_identity_caps_and_spreads_over_the_track() -> None:
    items = [("a", np.zeros(1), {"k": k}) for k in range(10)] + [("b", np.zeros(1), {"k": 0})]
    kept = spread_per_identity(items, 3)
    assert [(i, m["k"]) for i, _, m in kept] == [("a", 0), ("a", 4), ("a", 9), ("b", 0)]
