"""Detector backends through their real code paths (bundled SSD weights; YOLO built from config)."""

from __future__ import annotations

import numpy as np
import pytest

from models.backends.detectors import SsdMobileNetDetector, YoloDetector, load_detector
from models.backends.model_errors import ModelLoadError
from models.specs import DetectorSpec


def test_ssd_finds_the_persons_of_a_real_frame_crop(person_crop: np.ndarray) -> None:
    image = person_crop
    detector = load_detector(DetectorSpec())
    assert isinstance(detector, SsdMobileNetDetector) and load_detector(DetectorSpec()) is detector  # cached
    [dets] = detector.detect([image])
    persons = dets.of_classes({"person"})
    assert len(persons) == 1 and persons.scores[0] > 0.9
    x1, y1, x2, y2 = persons.boxes[0]
    assert 0 <= x1 < x2 <= image.shape[1] and 0 <= y1 < y2 <= image.shape[0]
    assert detector.detect([]) == []


def test_yolo_backend_runs_from_an_architecture_file() -> None:
    """Random-weight YOLOv8n built offline from its YAML: the real ultralytics predict path."""
    pytest.importorskip("ultralytics")
    detector = YoloDetector(DetectorSpec(backend="yolo", weights="yolov8n.yaml", score_threshold=0.0,
                                         input_size=128))
    images = [np.random.default_rng(0).integers(0, 255, (96, 64, 3), dtype=np.uint8),
              np.zeros((64, 64, 3), np.uint8)]
    results = detector.detect(images)
    assert len(results) == 2
    for dets in results:
        assert dets.boxes.shape[1] == 4 and len(dets.labels) == len(dets.scores)
        assert all(isinstance(label, str) for label in dets.labels)


def test_yolo_missing_weights_is_a_clear_error() -> None:
    with pytest.raises(ModelLoadError, match=r"set models\.detector\.weights to the local path"):
        YoloDetector(DetectorSpec(backend="yolo", weights="/nonexistent/yolov8x.pt"))


def test_detector_chunks_large_inputs_by_batch_size(person_crop: np.ndarray) -> None:
    """A caller may pass a whole gallery: the detector must process it batch_size images at a time."""
    detector = SsdMobileNetDetector(DetectorSpec(batch_size=4, memo_items=0))
    seen: list[int] = []
    original = detector._detect_chunk
    detector._detect_chunk = lambda chunk: (seen.append(len(chunk)), original(chunk))[1]
    gallery = [np.clip(person_crop.astype(np.int16) + k, 0, 255).astype(np.uint8) for k in range(10)]  # 10 distinct
    results = detector.detect(gallery)
    assert seen == [4, 4, 2] and len(results) == 10
    assert all(len(r.of_classes({"person"})) == 1 for r in results)
