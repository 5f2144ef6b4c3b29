"""Detector backends through their real code paths (bundled SSD weights; YOLO and OWL-ViT built from
config)."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import build_tiny_owl

from models.backends.detectors import OwlDetector, SsdMobileNetDetector, YoloDetector, known_classes, load_detector
from models.backends.model_errors import ModelLoadError
from models.specs import DetectorSpec
from rde.profile import load_profile


@pytest.fixture(scope="module")
def tiny_owl_folder(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_owl(tmp_path_factory.mktemp("tiny-owl"))


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
    __import__("conftest").require_module("ultralytics")  # skipped where missing; CI: fails
    import torch

    torch.manual_seed(0)  # fixed random weights
    detector = YoloDetector(DetectorSpec(backend="yolo", weights="yolov8n.yaml", score_threshold=0.0,
                                         input_size=128, memo_items=0))
    images = [np.random.default_rng(0).integers(0, 255, (96, 64, 3), dtype=np.uint8),
              np.zeros((64, 64, 3), np.uint8)]
    results = detector.detect(images)
    assert len(results) == 2
    # threshold 0: every anchor's class score is a sigmoid (> 0), and NMS always keeps the best box,
    # so each image has at least one detection (dozens with these random weights)
    for image, dets in zip(images, results, strict=True):
        assert len(dets) >= 1 and dets.boxes.shape == (len(dets), 4) and len(dets.scores) == len(dets)
        assert all(isinstance(label, str) for label in dets.labels) and (dets.scores > 0).all()
        h, w = image.shape[:2]
        assert (dets.boxes[:, :2] >= 0).all() and (dets.boxes[:, 2] <= w).all() and (dets.boxes[:, 3] <= h).all()
    # known counts on the first image: above its best score nothing is left; just under it (midway to
    # the next distinct score) the best box is a candidate, so NMS keeps at least it and nothing scored
    # under the cut. (Not "exactly the threshold-0 boxes above the cut": random weights tie many
    # scores, and NMS breaks ties between overlapping boxes either way.)
    best = np.unique(results[0].scores)[-2:]
    assert len(best) == 2, results[0].scores
    for cut, at_least, at_most in ((float(best[1]) * 1.01, 0, 0), (float(best.mean()), 1, len(results[0]))):
        detector.spec = detector.spec.model_copy(update={"score_threshold": cut})
        [dets] = detector.detect(images[:1])
        assert at_least <= len(dets) <= at_most and (dets.scores > cut).all(), (cut, dets)


def test_owl_open_vocabulary_backend_finds_the_classes_a_domain_names(tmp_path, tiny_owl_folder) -> None:
    """A random-weight OWL-ViT built from config, through the profile: a domain naming a class outside
    COCO ("forklift") makes the owl detector look for it by text; every box is labelled with one of
    the classes it was told and lies inside its (non-square) image."""
    domain = tmp_path / "forklift.yaml"
    domain.write_text("name: forklift\nsubject: {classes: [forklift], open_vocabulary: [a forklift truck], "
                      "noun: forklift, said_as: the forklift, nouns: [forklift]}\n"
                      "queries: {prompt: dap_generic}\ncaptions: {request: Describe the forklift.}\n")
    profile = load_profile("demo", overrides={"domains": ["pedestrian", "vehicle", str(domain)], "models": {
        "detector": {"backend": "owl", "model_id": str(tiny_owl_folder), "score_threshold": 0.0}}})
    spec = profile.models.detector
    assert "forklift" in spec.classes and spec.prompts[spec.classes.index("forklift")] == "a forklift truck"
    assert known_classes(spec) == set(spec.classes)
    detector = load_detector(spec)
    assert isinstance(detector, OwlDetector) and detector.identity()["model_type"] == "owlvit"
    images = [np.random.default_rng(0).integers(0, 255, (96, 64, 3), dtype=np.uint8),
              np.random.default_rng(1).integers(0, 255, (40, 120, 3), dtype=np.uint8)]
    results = detector.detect(images)
    assert len(results) == 2 and sum(len(d.labels) for d in results) > 0  # threshold 0: every box is kept
    for image, dets in zip(images, results, strict=True):
        h, w = image.shape[:2]
        assert set(dets.labels) <= set(spec.classes)
        assert (dets.boxes[:, 0] >= 0).all() and (dets.boxes[:, 2] <= w).all() and (dets.boxes[:, 3] <= h).all()
        assert (dets.boxes[:, 0] <= dets.boxes[:, 2]).all() and (dets.boxes[:, 1] <= dets.boxes[:, 3]).all()
    # the best box is the model's own best prediction (centre, size as shares of the image) in pixels
    import torch

    image = images[1]
    h, w = image.shape[:2]
    with torch.no_grad():
        out = detector.model(**detector.text, pixel_values=detector.image_processor(images=[image],
                                                                                    return_tensors="pt")["pixel_values"])
    best = int(out.logits[0].max(-1).values.argmax())
    cx, cy, bw, bh = out.pred_boxes[0, best].numpy()
    expected = np.clip([(cx - bw / 2) * w, (cy - bh / 2) * h, (cx + bw / 2) * w, (cy + bh / 2) * h], 0, [w, h, w, h])
    top = results[1].boxes[int(np.argmax(results[1].scores))]
    np.testing.assert_allclose(top, expected, atol=1e-3)  # pixels


def test_owl_without_a_model_or_classes_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"needs detector\.model_id"):
        DetectorSpec(backend="owl")
    with pytest.raises(ModelLoadError, match="needs its classes"):
        OwlDetector(DetectorSpec(backend="owl", model_id="nowhere"))


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
