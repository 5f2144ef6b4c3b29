"""The detector speed benchmark (benchmarks/detector_speed.py): its exact-equality check, its head
share, and a tiny run on real demo crops."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from detector_speed import close_detections, head_share, main, same_detections

from models.backends.detectors import Detections


def _dets(score: float) -> Detections:
    return Detections(np.array([[1.0, 2.0, 3.0, 4.0]], np.float32), ["person"], np.array([score], np.float32))


def test_same_detections_is_exact() -> None:
    assert same_detections([_dets(0.75), Detections()], [_dets(0.75), Detections()])
    assert not same_detections([_dets(0.75)], [_dets(np.nextafter(np.float32(0.75), np.float32(1.0)))])
    assert not same_detections([_dets(0.75)], [Detections()])
    assert not same_detections([_dets(0.75)], [_dets(0.75), _dets(0.75)])


def test_close_detections_allow_last_bits_not_other_findings() -> None:
    """Within half a pixel and 1e-4 of score the runs agree; another label, a missing box or a
    score 1e-3 off does not."""
    moved = Detections(np.array([[1.3, 2.0, 3.0, 4.4]], np.float32), ["person"], np.array([0.75005], np.float32))
    assert close_detections([_dets(0.75), Detections()], [moved, Detections()])
    assert not close_detections([_dets(0.75)], [_dets(0.751)])
    assert not close_detections([_dets(0.75)], [Detections(moved.boxes, ["car"], moved.scores)])
    assert not close_detections([_dets(0.75)], [Detections()])
    far = Detections(np.array([[1.0, 2.0, 3.0, 5.0]], np.float32), ["person"], np.array([0.75], np.float32))
    assert not close_detections([_dets(0.75)], [far])


def test_head_share_by_hand() -> None:
    layers = {"BoxPredictor_1/ClassPredictor/Conv2D": 30.0, "ClassPredictor/concat/sigmoid": 10.0,
              "BoxPredictor_1/BoxEncodingPredictor/Conv2D": 20.0, "FeatureExtractor/Conv": 40.0}
    assert head_share(layers) == 0.4
    assert head_share({}) == 0.0


def test_tiny_run_on_demo_crops(capsys) -> None:
    results = main(["--images", "4", "--repeats", "1", "--batches", "1", "8"])
    # batch 1 against batch 8: the same findings on any CPU; the same bits only where the
    # convolutions round alike for both shapes (they do on this machine: reported, not required)
    assert results["batch 1"]["close"] is True and isinstance(results["batch 1"]["same"], bool)
    assert results["batch 8"]["same"] is True and results["batch 8"]["close"] is True  # batch 8 is the reference
    assert 0.0 < results["profile"]["head_share"] < 1.0
    out = capsys.readouterr().out
    assert "same detections as batch 8" in out
    # each arm's ratio is its own median time over batch 8's, and the table prints those figures:
    # read back from the printed rows (ms/image to 0.1, ratio to 0.01), the ratio is the printed times'
    # quotient within what the rounding of the three figures allows
    rows = {line[:28].strip(): line[28:].split() for line in out.splitlines() if line.startswith("batch ")}
    assert rows.keys() == {"batch 1", "batch 8"}
    base = results["batch 8"]["ms_per_image"]
    for name, (ms, ratio, *_) in rows.items():
        assert results[name]["ratio"] == pytest.approx(results[name]["ms_per_image"] / base, rel=1e-12), name
        assert (ms, ratio) == (f"{results[name]['ms_per_image']:.1f}", f"{results[name]['ratio']:.2f}×"), name
        m, b, r = float(ms), float(rows["batch 8"][0]), float(ratio.rstrip("×"))
        slack = 0.005 + 0.05 * (1 / b + m / b ** 2) * 1.01  # ratio's rounding + the two times' rounding
        assert abs(r - m / b) <= slack, (name, m, b, r)
    assert results["batch 8"]["ratio"] == 1.0 and rows["batch 8"][1] == "1.00×"
