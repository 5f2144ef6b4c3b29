"""The committed demo pool: what the videos stage produces (a slice rebuilt and compared), enough
distinct, usable vehicles, check-set queries with enough relevant crops."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from conftest import DEMO_VIDEOS, needs_demo_videos
from PIL import Image

from entry.demo_pool import PERSONS, POOL_VIDEO, VEHICLES, stage_crops
from rde.common.expert_check import load_check_yaml
from rde.profile import load_profile
from storage import Artifact

MIN_VEHICLE_CROPS = 40  # the demo's vehicle gallery needs >= 40 images ...
MIN_VEHICLES = 10  # ... of >= 10 distinct vehicles
MIN_RELEVANT = 2  # every check-set vehicle query is multi-match: at least two relevant crops
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


VTEST = DEMO_VIDEOS / "vtest.avi"


@needs_demo_videos
def test_the_committed_pool_is_what_the_videos_stage_gives(demo_pool_url: str) -> None:
    """vtest.avi's last segment (frames 600-794) rebuilt by the stage: the same crops, tracks and
    frames as committed; boxes within 1 px and crop sizes within 2 px (the detector's floats may
    round otherwise on another CPU; on the machine that built the pool the bytes are equal)."""
    rebuilt = stage_crops(str(VTEST), POOL_VIDEO, PERSONS + VEHICLES, segments=[1])
    committed = [r for r in Artifact(demo_pool_url).read_shard(0).to_pylist()
                 if r["variant"] == "crop" and r["pool_id"].startswith("vtest.avi#") and "-s001-" in r["identity"]]
    assert len(rebuilt) > 20
    assert [r["pool_id"] for r in rebuilt] == [r["pool_id"] for r in committed]
    for new, old in zip(rebuilt, committed, strict=True):
        a, b = json.loads(new["source_meta"]), json.loads(old["source_meta"])
        assert np.allclose(a["box"], b["box"], atol=1.0) and a["frame"] == b["frame"] and a["track"] == b["track"]
        assert np.allclose(_jpeg_size(new["image_bytes"]), _jpeg_size(old["image_bytes"]), atol=2)
        assert (new["domain"], new["identity"]) == (old["domain"], old["identity"])
