"""Denoise (GTR+ Sec. 3.3): measure every image, then decide with thresholds.

Measuring (Laplacian variance, target-object detections) is the expensive part and does not
depend on thresholds; deciding is a cheap streaming pass. Changing a threshold therefore
re-runs only the decision (Data-Juicer's ``compute_stats`` / ``process`` split).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from models.backends.detectors import Detections, Detector, box_iou
from models.domains import Domain
from rde.common.image_decoding import DecodeError, decode_rgb
from rde.common.pool_config import DenoiseSpec
from rde.common.reasons import Reason, rejected_row
from storage.schemas import ACCEPTED_IMAGES, MEASUREMENTS, REJECTS


def laplacian_variance(rgb: np.ndarray) -> float:
    """Variance of the 3×3 Laplacian (kernel [[0,1,0],[1,-4,1],[0,1,0]], reflect-101 borders)
    of the 8-bit grayscale image (ITU-R 601 luma), the sharpness measure of GTR+."""
    gray = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY) if rgb.ndim == 3 else rgb
    return float(cv2.Laplacian(gray, cv2.CV_64F).var())


def count_targets(dets: Detections, target_classes: Iterable[str], merge_iou: float = 0.5) -> Detections:
    """Detections of the target classes with class-agnostic duplicates merged.

    One object can be reported under two classes (a van as 'truck' and 'bus'); boxes of target
    classes overlapping by IoU > ``merge_iou`` count as one object (highest score kept).
    """
    mine = dets.of_classes(set(target_classes))
    keep: list[int] = []
    for i in np.argsort(-mine.scores):
        if keep and (box_iou(mine.boxes[i], mine.boxes[keep]) > merge_iou).any():
            continue
        keep.append(int(i))
    keep.sort()
    return Detections(mine.boxes[keep], [mine.labels[k] for k in keep], mine.scores[keep])


def measure_table(images: pa.Table, detector: Detector, domains: dict[str, Domain],
                  batch_size: int, max_pixels: int) -> pa.Table:
    """Measurements for one shard of images: Laplacian variance and target detections.

    A failure on one image (decode or detector) becomes that row's ``error``, never the shard's.
    """
    rows: list[dict[str, Any]] = []
    pending: list[tuple[dict[str, Any], np.ndarray, str]] = []

    def flush() -> None:
        if not pending:
            return
        try:
            results: list[Detections | None] = list(detector.detect([img for _, img, _ in pending]))
        except Exception:
            results = [_detect_one(detector, img, row) for row, img, _ in pending]
        for (row, _, domain), dets in zip(pending, results, strict=True):
            if dets is None:
                continue
            targets = count_targets(dets, domains[domain].target_classes)
            row["target_count"] = len(targets)
            row["target_scores"] = [float(s) for s in targets.scores]
            row["target_boxes"] = [[float(v) for v in b] for b in targets.boxes]
        pending.clear()

    for rec in images.select(["input_id", "image_id", "domain", "image_bytes"]).to_pylist():
        row = {"input_id": rec["input_id"], "image_id": rec["image_id"], "laplacian_variance": None,
               "target_count": None, "target_scores": None, "target_boxes": None, "error": None}
        rows.append(row)
        try:
            rgb = decode_rgb(rec["image_bytes"], max_pixels)
        except DecodeError as err:
            row["error"] = f"decode failed: {err.detail}"
            continue
        row["laplacian_variance"] = laplacian_variance(rgb)
        pending.append((row, rgb, rec["domain"]))
        if len(pending) >= batch_size:
            flush()
    flush()
    return pa.Table.from_pylist(rows, schema=MEASUREMENTS)


def _detect_one(detector: Detector, image: np.ndarray, row: dict[str, Any]) -> Detections | None:
    try:
        return detector.detect([image])[0]
    except Exception as exc:
        row["error"] = f"detector failed: {type(exc).__name__}: {exc}"
        return None


def decide(width: int, height: int, laplacian_var: float | None, target_count: int | None,
           error: str | None, spec: DenoiseSpec, domain: str | None = None) -> list[str]:
    """All reasons an image fails the thresholds, in a fixed order (empty list = accepted).

    The size rule is the one for the image's ``domain`` (``DenoiseSpec.size_rule``).
    """
    reasons: list[str] = []
    if error is not None:
        reasons.append(Reason.MEASURE_ERROR)
    size = spec.size_rule(domain)
    if width < size.min_width or height < size.min_height:
        reasons.append(Reason.TOO_SMALL)
    if laplacian_var is not None and laplacian_var < spec.min_laplacian_variance:
        reasons.append(Reason.BLURRY)
    if spec.required_target_count is not None and target_count is not None \
            and target_count != spec.required_target_count:
        reasons.append(Reason.NO_TARGET if target_count < spec.required_target_count else Reason.MULTIPLE_TARGETS)
    return [str(r) for r in reasons]


@dataclass
class DenoiseCounts:
    """Accounting of one decision pass."""

    input: int = 0
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)

    def add_reject(self, reason: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1


def decide_shards(pairs: Iterator[tuple[pa.Table, pa.Table]], spec: DenoiseSpec,
                  counts: DenoiseCounts, seen: dict[str, str] | None = None) -> Iterator[tuple[pa.Table, pa.Table]]:
    """Stream (images, measurements) shard pairs → (accepted, rejected) shard pairs.

    Exact duplicates (same content hash) are rejected after their first occurrence in input
    order; the set of seen hashes (image id → the input id of its first occurrence) is the only
    state kept across shards. ``seen``: the first occurrences before these shards (a shard decided
    on its own: :func:`first_occurrences` of its ids in the shards before it).
    """
    seen = dict(seen or {})
    for images, measures in pairs:
        by_input = {m["input_id"]: m for m in measures.to_pylist()}
        accepted, rejected = [], []
        for rec in images.to_pylist():
            counts.input += 1
            m = by_input.get(rec["input_id"])
            if m is None:
                m = {"laplacian_variance": None, "target_count": None, "target_scores": None,
                     "target_boxes": None, "error": "no measurement for this image"}
            reasons = decide(rec["width"], rec["height"], m["laplacian_variance"], m["target_count"], m["error"], spec,
                             rec["domain"])
            detail = m["error"]
            if spec.deduplicate:
                first = seen.get(rec["image_id"])
                if first is not None:
                    reasons.insert(0, str(Reason.DUPLICATE))
                    detail = f"same bytes as input {first}"
                else:
                    seen[rec["image_id"]] = rec["input_id"]
            if reasons:
                counts.add_reject(reasons[0])
                rejected.append(rejected_row(
                    rec["input_id"], "denoise", reasons[0], kind="image", domain=rec["domain"], source=rec["source"],
                    image_id=rec["image_id"], all_reasons=reasons, detail=detail or _detail(reasons[0], rec, m, spec),
                    width=rec["width"], height=rec["height"], laplacian_variance=m["laplacian_variance"],
                    target_count=m["target_count"]))
            else:
                counts.accepted += 1
                accepted.append({**rec, **{k: m[k] for k in
                                           ("laplacian_variance", "target_count", "target_scores", "target_boxes")}})
        yield pa.Table.from_pylist(accepted, schema=ACCEPTED_IMAGES), pa.Table.from_pylist(rejected, schema=REJECTS)


def first_occurrences(image_ids: set[str], earlier: Iterable[pa.Table]) -> dict[str, str]:
    """Image id → input id of its first row among the ``earlier`` tables (columns ``image_id``,
    ``input_id``, in input order), for the ids in ``image_ids`` only: what :func:`decide_shards`
    would have seen of them before a shard, held for that shard's ids alone."""
    wanted = pa.array(sorted(image_ids), pa.string())
    found: dict[str, str] = {}
    for table in earlier:
        hits = table.filter(pc.is_in(table.column("image_id"), value_set=wanted))
        for image_id, input_id in zip(hits.column("image_id").to_pylist(), hits.column("input_id").to_pylist(),
                                      strict=True):
            found.setdefault(image_id, input_id)
    return found


def _detail(reason: str, rec: dict[str, Any], m: dict[str, Any], spec: DenoiseSpec) -> str:
    if reason == Reason.TOO_SMALL:
        size = spec.size_rule(rec["domain"])
        return f"{rec['width']}x{rec['height']} below {size.min_width}x{size.min_height} ({rec['domain']})"
    if reason == Reason.BLURRY:
        return f"Laplacian variance {m['laplacian_variance']:.1f} < {spec.min_laplacian_variance}"
    if reason in (Reason.NO_TARGET, Reason.MULTIPLE_TARGETS):
        return f"{m['target_count']} target objects detected, {spec.required_target_count} required"
    return reason
