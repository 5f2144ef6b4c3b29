"""Detections kept on disk across processes (``RDE_DETECTION_CACHE``): read back exactly, keyed by
the detector's settings, a torn file computed again, and nothing kept where memoisation is off."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import require_module

from models.backends import content_memo
from models.backends.detectors import DETECTION_ARRAYS, ChunkedDetector, Detections, SsdMobileNetDetector
from models.backends.disk_memo import DETECTION_CACHE_ENV, DiskMemo
from models.specs import DetectorSpec


class CountingDetector(ChunkedDetector):
    """One box per image whose place and score follow its mean pixel; counts the images it is run on."""

    model_id = "counting"

    def __init__(self, spec: DetectorSpec) -> None:
        self.spec = spec
        self.seen = 0

    def _detect_chunk(self, images: list[np.ndarray]) -> list[Detections]:
        self.seen += len(images)
        out = []
        for image in images:
            m = float(image.mean())
            out.append(Detections(np.array([[m, 1.5, m + 10.25, 20.0]], np.float32), ["person"],
                                  np.array([m / 255], np.float32)) if m < 128 else Detections())
        return out


def _images(n: int, offset: int = 0) -> list[np.ndarray]:
    return [np.full((8, 6, 3), 10 * k + offset, np.uint8) for k in range(n)]


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "detections"
    monkeypatch.setenv(DETECTION_CACHE_ENV, str(folder))
    content_memo.clear_all()  # a fresh process, as far as the in-memory memo goes
    yield folder
    content_memo.clear_all()


def _same(a: list[Detections], b: list[Detections]) -> bool:
    return all(x.labels == y.labels and np.array_equal(x.boxes, y.boxes) and np.array_equal(x.scores, y.scores)
               and x.boxes.shape == y.boxes.shape for x, y in zip(a, b, strict=True))


def test_a_second_process_reads_the_detections_the_first_kept(store: Path) -> None:
    first = CountingDetector(DetectorSpec())
    images = _images(15)  # 13 with a person, 2 empty (mean >= 128)
    found = first.detect(images)
    assert first.seen == 15 and len(list(store.rglob("*.npz"))) == 15
    content_memo.clear_all()
    second = CountingDetector(DetectorSpec())
    again = second.detect([*images[:5], *_images(2, offset=3)])  # 5 kept, 2 new
    assert second.seen == 2 and _same(again[:5], found[:5])
    assert second._disk_memo.hits == 5 and second._disk_memo.misses == 2
    assert again[4].boxes.shape == (1, 4) and found[14].boxes.shape == (0, 4) and found[14].labels == []


def test_other_settings_are_another_key(store: Path) -> None:
    CountingDetector(DetectorSpec()).detect(_images(3))
    content_memo.clear_all()
    stricter = CountingDetector(DetectorSpec(score_threshold=0.7))
    stricter.detect(_images(3))
    assert stricter.seen == 3 and len([p for p in store.iterdir() if p.is_dir()]) == 2


def test_a_torn_file_is_detected_again_and_replaced(store: Path) -> None:
    images = _images(2)
    CountingDetector(DetectorSpec()).detect(images)
    torn = DiskMemo(store, CountingDetector(DetectorSpec()).identity(), DETECTION_ARRAYS).path(images[0])
    torn.write_bytes(b"PK\x03\x04 cut short")
    content_memo.clear_all()
    again = CountingDetector(DetectorSpec())
    result = again.detect(images)
    assert again.seen == 1 and result[0].labels == ["person"]
    assert np.load(torn)["boxes"].shape == (1, 4)  # replaced by a whole file


def test_nothing_is_kept_without_the_folder_or_with_memoisation_off(store: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    off = CountingDetector(DetectorSpec(memo_items=0))
    off.detect(_images(3))
    assert not store.exists()
    monkeypatch.delenv(DETECTION_CACHE_ENV)
    CountingDetector(DetectorSpec()).detect(_images(3))
    assert not store.exists()


def test_ssd_detections_read_back_bit_for_bit(store: Path, person_crop: np.ndarray) -> None:
    images = [person_crop, np.ascontiguousarray(person_crop[:, ::-1]), np.zeros((40, 30, 3), np.uint8)]
    first = SsdMobileNetDetector(DetectorSpec()).detect(images)
    content_memo.clear_all()
    second = SsdMobileNetDetector(DetectorSpec())
    second._detect_chunk = lambda chunk: pytest.fail("detected again")
    assert _same(second.detect(images), first) and len(first[0].of_classes({"person"})) == 1


def test_yolo_weights_are_keyed_by_their_bytes_and_random_weights_not_kept(tmp_path: Path) -> None:
    """A YOLO .pt file is keyed by a hash of its bytes (the same file name with other weights is
    another key); an architecture file (.yaml: random weights, another model each build) has no key."""
    require_module("ultralytics")
    from models.backends.detectors import YoloDetector

    def identity(weights: str) -> dict | None:
        detector = YoloDetector.__new__(YoloDetector)  # the key only: no model is loaded
        detector.spec, detector.model_id = DetectorSpec(backend="yolo", weights=weights), Path(weights).name
        return detector.identity()

    weights = tmp_path / "yolov8x.pt"
    weights.write_bytes(b"weights, first training")
    first = identity(str(weights))
    weights.write_bytes(b"weights, fine-tuned")
    assert first is not None and identity(str(weights))["weights"] != first["weights"]
    assert identity("yolov8n.yaml") is None
