"""Denoise filters against hand-made images with known size, blur and person count."""

from __future__ import annotations

import cv2
import numpy as np
import pyarrow as pa
import pytest
from conftest import PERSON_A, PERSON_B

from models.backends.detectors import Detections, load_detector
from models.domains import load_domain
from models.specs import DetectorSpec
from rde.common.denoise import (
    DenoiseCounts,
    count_targets,
    decide,
    decide_shards,
    first_occurrences,
    laplacian_variance,
    measure_table,
)
from rde.common.image_decoding import decode_rgb
from rde.common.pool_config import DenoiseSpec
from rde.profile import load_profile
from storage.schemas import IMAGES, MEASUREMENTS

SPEC = DenoiseSpec()


def test_laplacian_variance_hand_computed() -> None:
    flat = np.full((64, 32, 3), 200, np.uint8)
    assert laplacian_variance(flat) == 0.0
    # checkerboard of 0/255: every pixel's Laplacian is 4*(neighbour - self) = ±1020 (reflect-101
    # borders keep the pattern), mean 0, so the variance is 1020**2.
    board = ((np.indices((64, 32)).sum(axis=0) % 2) * 255).astype(np.uint8)
    assert laplacian_variance(np.repeat(board[:, :, None], 3, axis=2)) == pytest.approx(1020.0**2)
    # a single bright pixel (value 255) in a 5x5 black image: Laplacian -1020 at the pixel, +255 at
    # its 4 neighbours, 0 elsewhere: mean 0, variance (1020**2 + 4*255**2) / 25
    impulse = np.zeros((5, 5), np.uint8)
    impulse[2, 2] = 255
    assert laplacian_variance(impulse) == pytest.approx((1020**2 + 4 * 255**2) / 25)


def test_blur_lowers_laplacian_variance_below_threshold() -> None:
    rng = np.random.default_rng(0)
    sharp = rng.integers(0, 256, (128, 64, 3), dtype=np.uint8)
    blurred = cv2.GaussianBlur(sharp, (0, 0), 4.0)
    assert laplacian_variance(sharp) > 80 > laplacian_variance(blurred)
    assert decide(64, 128, laplacian_variance(blurred), 1, None, SPEC) == ["blurry"]
    assert decide(64, 128, laplacian_variance(sharp), 1, None, SPEC) == []


@pytest.mark.parametrize(("w", "h", "expected"), [(32, 64, []), (31, 64, ["too_small"]), (32, 63, ["too_small"]),
                                                  (1, 1, ["too_small"]), (500, 900, [])])
def test_size_thresholds_are_inclusive_minimums(w: int, h: int, expected: list[str]) -> None:
    assert decide(w, h, 500.0, 1, None, SPEC) == expected


def test_decide_lists_every_failing_reason_in_order() -> None:
    assert decide(10, 10, 5.0, 0, None, SPEC) == ["too_small", "blurry", "no_target"]
    assert decide(64, 128, 500.0, 3, None, SPEC) == ["multiple_targets"]
    assert decide(64, 128, None, None, "decode failed", SPEC) == ["measure_error"]
    assert decide(64, 128, 500.0, 3, None, DenoiseSpec(required_target_count=None)) == []


def test_count_targets_merges_one_object_reported_under_two_classes() -> None:
    dets = Detections(np.array([[0, 0, 100, 60], [2, 1, 101, 62], [200, 0, 260, 50], [0, 0, 10, 30]], np.float32),
                      ["truck", "bus", "car", "person"], np.array([0.7, 0.5, 0.6, 0.9], np.float32))
    vehicles = count_targets(dets, ["car", "bus", "truck"])
    assert len(vehicles) == 2 and sorted(vehicles.labels) == ["car", "truck"]
    assert len(count_targets(dets, ["person"])) == 1


def _canvas(*people: np.ndarray) -> np.ndarray:
    h = max(p.shape[0] for p in people) + 20
    w = sum(p.shape[1] for p in people) + 10 * (len(people) + 1)
    canvas = np.full((h, w, 3), 128, np.uint8)
    x = 10
    for p in people:
        canvas[10 : 10 + p.shape[0], x : x + p.shape[1]] = p
        x += p.shape[1] + 10
    return canvas


def test_person_count_on_hand_made_images(pool_rows: dict[str, dict]) -> None:
    """Known counts: an empty grey image (0), one real person crop (1), two crops side by side (2)."""
    detector = load_detector(DetectorSpec())
    a = decode_rgb(pool_rows[PERSON_A]["image_bytes"])
    b = decode_rgb(pool_rows[PERSON_B]["image_bytes"])
    images = [np.full((160, 80, 3), 128, np.uint8), a, _canvas(a, b)]
    counts = [len(count_targets(d, ["person"])) for d in detector.detect(images)]
    assert counts == [0, 1, 2]


class _BrokenDetector:
    model_id = "broken"

    def detect(self, images):
        if any(im.shape[0] == 77 for im in images):
            raise RuntimeError("boom")
        return [Detections() for _ in images]


def _images_table(arrays: list[np.ndarray], domains: list[str] | None = None) -> pa.Table:
    rows = []
    for i, arr in enumerate(arrays):
        ok, buf = cv2.imencode(".png", arr)
        assert ok
        domain = domains[i] if domains else "pedestrian"
        rows.append({"input_id": f"in{i}", "image_id": f"img{i}", "source": f"s{i}", "domain": domain,
                     "identity": None, "width": arr.shape[1], "height": arr.shape[0], "source_mode": "RGB",
                     "image_format": "PNG", "source_meta": None, "image_bytes": buf.tobytes()})
    return pa.Table.from_pylist(rows, schema=IMAGES)


def test_detector_failure_on_one_image_does_not_lose_the_shard() -> None:
    images = _images_table([np.zeros((77, 40, 3), np.uint8), np.zeros((90, 40, 3), np.uint8)])
    table = measure_table(images, _BrokenDetector(), {"pedestrian": load_domain("pedestrian")},
                          batch_size=8, max_pixels=10**7)
    rows = table.to_pylist()
    assert rows[0]["error"].startswith("detector failed: RuntimeError: boom") and rows[0]["target_count"] is None
    assert rows[1]["error"] is None and rows[1]["target_count"] == 0


def test_decide_shards_deduplicates_and_accounts_for_every_row() -> None:
    rng = np.random.default_rng(1)
    sharp = rng.integers(0, 256, (128, 64, 3), dtype=np.uint8)
    images = _images_table([sharp, sharp, np.zeros((10, 10, 3), np.uint8)])
    images = images.set_column(1, "image_id", pa.array(["same", "same", "other"]))
    measures = pa.Table.from_pylist(
        [{"input_id": f"in{i}", "image_id": "x", "laplacian_variance": v, "target_count": c, "target_scores": [],
          "target_boxes": [], "error": None} for i, (v, c) in enumerate([(900.0, 1), (900.0, 1), (0.0, 0)])],
        schema=MEASUREMENTS)
    counts = DenoiseCounts()
    [(accepted, rejected)] = list(decide_shards(iter([(images, measures)]), SPEC, counts))
    assert accepted.column("input_id").to_pylist() == ["in0"]
    assert rejected.column("reason").to_pylist() == ["duplicate", "too_small"]
    assert rejected.column("detail").to_pylist()[0] == "same bytes as input in0"
    assert rejected.column("all_reasons").to_pylist()[1] == ["too_small", "blurry", "no_target"]
    assert counts.input == 3 and counts.accepted == 1 and counts.rejected == {"duplicate": 1, "too_small": 1}


def test_a_shard_decided_alone_rejects_the_duplicates_of_earlier_shards_as_the_stream_does() -> None:
    """Three shards where image "a" is first in shard 0 (input in1), again in shards 1 and 2, and
    "b" first in shard 1 (in3), again in shard 2: each shard decided on its own with the first
    occurrences of its ids in the shards before it (what the per-shard stage does) gives the rows,
    reasons and details of one pass over all three. Fails when a shard is decided without them
    (its copies of "a" would be accepted) or with a later occurrence as the first."""
    rng = np.random.default_rng(3)
    sharp = rng.integers(0, 256, (128, 64, 3), dtype=np.uint8)
    ids = [["x", "a"], ["a", "b", "y"], ["b", "a"]]
    shards, at = [], 0
    for shard_ids in ids:
        table = _images_table([sharp] * len(shard_ids))
        table = table.set_column(0, "input_id", pa.array([f"in{at + i}" for i in range(len(shard_ids))]))
        shards.append(table.set_column(1, "image_id", pa.array(shard_ids)))
        at += len(shard_ids)
    measures = [pa.Table.from_pylist(
        [{"input_id": i, "image_id": "-", "laplacian_variance": 900.0, "target_count": 1, "target_scores": [],
          "target_boxes": [], "error": None} for i in t.column("input_id").to_pylist()], schema=MEASUREMENTS)
        for t in shards]
    stream = list(decide_shards(iter(zip(shards, measures, strict=True)), SPEC, DenoiseCounts()))
    alone = []
    for index, (table, m) in enumerate(zip(shards, measures, strict=True)):
        seen = first_occurrences(set(table.column("image_id").to_pylist()), shards[:index])
        alone += list(decide_shards(iter([(table, m)]), SPEC, DenoiseCounts(), seen))
    assert first_occurrences({"a", "b", "zz"}, shards[:2]) == {"a": "in1", "b": "in3"}
    assert [(a.to_pylist(), r.to_pylist()) for a, r in alone] == [(a.to_pylist(), r.to_pylist()) for a, r in stream]
    rejected = [(r["input_id"], r["detail"]) for _, t in alone for r in t.to_pylist()]
    assert rejected == [("in2", "same bytes as input in1"), ("in5", "same bytes as input in3"),
                        ("in6", "same bytes as input in1")]


def test_size_rule_is_per_domain() -> None:
    """The demo profile's rules: a wide, low 120x60 crop passes as a vehicle and fails as a person
    (GTR+ needs height >= 64 for upright people); the rejected row names the rule it failed."""
    spec = load_profile("demo").denoise
    assert decide(120, 60, 500.0, 1, None, spec, "vehicle") == []
    assert decide(120, 60, 500.0, 1, None, spec, "pedestrian") == ["too_small"]
    assert decide(60, 120, 500.0, 1, None, spec, "vehicle") == ["too_small"]
    rng = np.random.default_rng(2)
    wide = rng.integers(0, 256, (60, 120, 3), dtype=np.uint8)
    images = _images_table([wide, wide[:, ::-1]], ["vehicle", "pedestrian"])
    measures = pa.Table.from_pylist(
        [{"input_id": f"in{i}", "image_id": f"img{i}", "laplacian_variance": 900.0, "target_count": 1,
          "target_scores": [0.9], "target_boxes": [], "error": None} for i in range(2)], schema=MEASUREMENTS)
    counts = DenoiseCounts()
    [(accepted, rejected)] = list(decide_shards(iter([(images, measures)]), spec, counts))
    assert accepted.column("domain").to_pylist() == ["vehicle"]
    [row] = rejected.to_pylist()
    assert (row["domain"], row["reason"], row["width"], row["height"]) == ("pedestrian", "too_small", 120, 60)
    assert row["detail"] == "120x60 below 32x64 (pedestrian)"
