"""Explicit pyarrow schemas, one per artifact kind.

Measured values travel with every row ("measure, then decide"), so a rejected row explains
itself and thresholds can change without recomputation.
"""

from __future__ import annotations

import pyarrow as pa

# Source images as ingested: original bytes, content hash, decoded size and provenance.
IMAGES = pa.schema(
    [
        pa.field("input_id", pa.string(), nullable=False),  # hash of the source reference
        pa.field("image_id", pa.string(), nullable=False),  # SHA-256 of the image bytes
        pa.field("source", pa.string(), nullable=False),  # path, URL or pool reference
        pa.field("domain", pa.string(), nullable=False),  # pedestrian | vehicle | ...
        pa.field("identity", pa.string()),  # identity label when known (track id), else null
        pa.field("width", pa.int32(), nullable=False),
        pa.field("height", pa.int32(), nullable=False),
        pa.field("source_mode", pa.string(), nullable=False),  # PIL mode before RGB normalisation
        pa.field("image_format", pa.string(), nullable=False),  # JPEG, PNG, ...
        pa.field("source_meta", pa.string()),  # JSON: frame, box, score... (pool provenance)
        pa.field("image_bytes", pa.binary(), nullable=False),
    ]
)

# Per-image measurements made by the denoise stage (thresholds are applied afterwards).
MEASUREMENTS = pa.schema(
    [
        pa.field("input_id", pa.string(), nullable=False),
        pa.field("image_id", pa.string(), nullable=False),
        pa.field("laplacian_variance", pa.float64()),
        pa.field("target_count", pa.int32()),  # detections of the domain's target classes
        pa.field("target_scores", pa.list_(pa.float32())),
        pa.field("target_boxes", pa.list_(pa.list_(pa.float32(), 4))),  # x1, y1, x2, y2 in pixels
        pa.field("error", pa.string()),  # measurement failure (becomes a rejection reason)
    ]
)

_MEASURED_COLUMNS = [
    pa.field("laplacian_variance", pa.float64()),
    pa.field("target_count", pa.int32()),
    pa.field("target_scores", pa.list_(pa.float32())),
    pa.field("target_boxes", pa.list_(pa.list_(pa.float32(), 4))),
]

# Images that passed every filter, with their measurements.
ACCEPTED_IMAGES = pa.schema(list(IMAGES) + _MEASURED_COLUMNS)

# One schema for every rejected row of every stage: who, where, why, and what was measured.
REJECTS = pa.schema(
    [
        pa.field("input_id", pa.string(), nullable=False),
        pa.field("image_id", pa.string()),
        pa.field("source", pa.string(), nullable=False),
        pa.field("domain", pa.string()),
        pa.field("stage", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),  # a code from rde.reasons.Reason
        pa.field("all_reasons", pa.list_(pa.string()), nullable=False),
        pa.field("detail", pa.string()),
        pa.field("width", pa.int32()),
        pa.field("height", pa.int32()),
        pa.field("laplacian_variance", pa.float64()),
        pa.field("target_count", pa.int32()),
    ]
)

# The demo pool: real crops cut from a surveillance video, with track identities.
POOL = pa.schema(
    [
        pa.field("pool_id", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("identity", pa.string()),
        pa.field("variant", pa.string(), nullable=False),  # crop | tiny | blurred | group | background
        pa.field("source_meta", pa.string(), nullable=False),
        pa.field("image_bytes", pa.binary(), nullable=False),
    ]
)

SCHEMAS: dict[str, pa.Schema] = {
    "images": IMAGES,
    "measurements": MEASUREMENTS,
    "accepted_images": ACCEPTED_IMAGES,
    "rejects": REJECTS,
    "pool": POOL,
}
