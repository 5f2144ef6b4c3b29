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
        pa.field("exif_orientation", pa.int8()),  # EXIF tag 2-8 applied when decoding; null: none
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

# One schema for every rejected row of every stage (images, generated texts, templates, items):
# what was rejected, where, why, and what was measured. Rows are made by rde.common.reasons.rejected_row.
REJECTS = pa.schema(
    [
        pa.field("input_id", pa.string(), nullable=False),  # input id, image id, request id or item id
        pa.field("kind", pa.string(), nullable=False),  # image | caption | sentence | query | template | item
        pa.field("image_id", pa.string()),
        pa.field("source", pa.string()),
        pa.field("domain", pa.string()),
        pa.field("stage", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),  # a code from rde.common.reasons.Reason
        pa.field("all_reasons", pa.list_(pa.string()), nullable=False),
        pa.field("text", pa.string()),  # the rejected text (captions, queries, templates)
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

# The videos stage's account of each segment it decoded (one row per shard: a video, or part of one).
VIDEO_SEGMENTS = pa.schema(
    [
        pa.field("input_id", pa.string(), nullable=False),  # the listed video's input id
        pa.field("source", pa.string(), nullable=False),  # its path as listed
        pa.field("video", pa.string(), nullable=False),  # its name in crops (relative to the input's root)
        pa.field("segment", pa.int32(), nullable=False),
        pa.field("start_frame", pa.int64(), nullable=False),
        pa.field("stop_frame", pa.int64()),  # null: to the end
        pa.field("counts_video", pa.bool_(), nullable=False),  # the segment that accounts for the video
        pa.field("status", pa.string(), nullable=False),  # accepted | continued | rejected | skipped
        pa.field("reason", pa.string()),  # why rejected (or skipped: its video was rejected)
        pa.field("detail", pa.string()),
        pa.field("fps", pa.float64()),
        pa.field("width", pa.int32()),
        pa.field("height", pa.int32()),
        pa.field("codec", pa.string()),
        pa.field("declared_frames", pa.int64()),  # what the container says (0: nothing)
        pa.field("frames_read", pa.int64(), nullable=False),
        pa.field("last_frame", pa.int64(), nullable=False),
        pa.field("frames_sampled", pa.int64(), nullable=False),
        pa.field("detections", pa.int64(), nullable=False),
        pa.field("tracks", pa.int64(), nullable=False),
        pa.field("crops", pa.int64(), nullable=False),
        pa.field("tracks_without_crop", pa.string(), nullable=False),  # JSON: reason -> tracks
        pa.field("decode_error", pa.string()),  # decoding stopped early here: what was read before stands
    ]
)

# Captions of the caption pool (DAP input) and, later, of LargeFine-style shards.
CAPTIONS = pa.schema(
    [
        pa.field("image_id", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("q_txt", pa.float64()),  # mean token probability (GTR+ Eq. 8)
        pa.field("generator", pa.string(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),  # prompt identity name@version#sha
    ]
)

# Per-domain word frequencies by part of speech (DAP statistics).
CAPTION_STATS = pa.schema(
    [
        pa.field("domain", pa.string(), nullable=False),
        pa.field("pos", pa.string(), nullable=False),  # noun | verb | adj | adv
        pa.field("word", pa.string(), nullable=False),
        pa.field("count", pa.int64(), nullable=False),
    ]
)

QUERIES = pa.schema(
    [
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),  # generation request id
        pa.field("generator", pa.string(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),
        pa.field("keywords", pa.list_(pa.string())),  # DAP: the request's sampled keywords this query uses
    ]
)

# CGDS outcome for every accepted image: sampled into the gallery or not, with its cluster.
SAMPLING = pa.schema(
    [
        pa.field("image_id", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("cluster", pa.int32(), nullable=False),
        pa.field("sampled", pa.bool_(), nullable=False),
        pa.field("reason", pa.string()),  # null when sampled: not_sampled | wrong_category
    ]
)

GALLERY = pa.schema(
    [
        pa.field("image_id", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("identity", pa.string()),
        pa.field("cluster", pa.int32(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("width", pa.int32(), nullable=False),
        pa.field("height", pa.int32(), nullable=False),
        pa.field("image_bytes", pa.binary(), nullable=False),
    ]
)

# MECF union (Eq. 1): one row per (query, image) retrieved by at least one expert.
CANDIDATES = pa.schema(
    [
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("image_id", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("experts", pa.list_(pa.string()), nullable=False),
        pa.field("ranks", pa.list_(pa.int32()), nullable=False),  # aligned with experts, 1-based
        pa.field("scores", pa.list_(pa.float32()), nullable=False),
        pa.field("best_rank", pa.int32(), nullable=False),
    ]
)

QRELS = pa.schema(
    [
        pa.field("query_id", pa.string(), nullable=False),
        pa.field("image_id", pa.string(), nullable=False),
        pa.field("relevant", pa.bool_(), nullable=False),
        pa.field("verified", pa.bool_(), nullable=False),  # False: an unreviewed MECF candidate
        pa.field("annotator", pa.string()),
        pa.field("decided_at", pa.string()),
        pa.field("tool", pa.string()),  # where the decision was made: review-page | label-studio
    ]
)

EVALUATION = pa.schema(
    [
        pa.field("benchmark", pa.string(), nullable=False),  # the built benchmark or a check set
        pa.field("labels", pa.string(), nullable=False),  # verified | pending-review
        pa.field("expert", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),  # a domain or "all"
        pa.field("metric", pa.string(), nullable=False),  # mAP@10, R@1, ...
        pa.field("value", pa.float64(), nullable=False),
        pa.field("queries", pa.int32(), nullable=False),
    ]
)

# build-largefine: the image embedder's vector of each accepted image in largefine.domains, one shard
# per accepted shard, its rows in the accepted shard's order (the hard negatives' search reads them)
IMAGE_VECTORS = pa.schema(
    [
        pa.field("image_id", pa.string(), nullable=False),
        pa.field("vector", pa.list_(pa.float32()), nullable=False),  # the embedder's dimension
    ]
)

# The images build-largefine captions (select-images), in shards of largefine.shard_size, with where each
# one's vector is in the embed-images artifact: its shard (= its accepted shard) and its row there.
CHOSEN_IMAGES = pa.schema(
    [
        pa.field("image_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("identity", pa.string()),
        pa.field("accepted_shard", pa.int32(), nullable=False),
        pa.field("vector_row", pa.int32(), nullable=False),
    ]
)

# build-largefine: the images chosen for captioning, their neighbours and hard negative (GTR+ Eq. 1),
# the generator assigned to each, and where the image bytes live in the accepted artifact.
NEIGHBOURS = pa.schema(
    [
        pa.field("image_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("identity", pa.string()),
        pa.field("accepted_shard", pa.int32(), nullable=False),
        pa.field("neighbour_ids", pa.list_(pa.string()), nullable=False),  # top-k, best first
        pa.field("neighbour_scores", pa.list_(pa.float32()), nullable=False),
        pa.field("hard_negative_id", pa.string()),  # null when the pool has no other distinct image
        pa.field("hard_negative_shard", pa.int32()),
        pa.field("generator_index", pa.int32(), nullable=False),
        pa.field("seed", pa.int64(), nullable=False),
    ]
)

# LargeFine-Person-style captions: one row per (image, tier).
TIER_CAPTIONS = pa.schema(
    [
        pa.field("image_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("tier", pa.string(), nullable=False),  # base | inter | adv
        pa.field("text", pa.string(), nullable=False),  # cleaned: the training text
        pa.field("raw_text", pa.string()),  # the generator's output before cleaning (audit, re-gating)
        pa.field("cleaning", pa.list_(pa.string())),  # removed: negative_mentions:N, boilerplate, repeated_sentences:N
        pa.field("q_txt", pa.float64()),  # mean token probability (GTR+ Eq. 8)
        pa.field("words", pa.int32(), nullable=False),
        pa.field("generator", pa.string(), nullable=False),
        pa.field("generator_index", pa.int32(), nullable=False),
        pa.field("prompt", pa.string(), nullable=False),  # prompt identity and the steps used
        pa.field("template_id", pa.string()),  # advanced tier only
        pa.field("gallery", pa.string()),  # template gallery version (advanced tier only)
        pa.field("hard_negative_id", pa.string()),  # intermediate and advanced tiers
    ]
)

# The WebDataset export's index: one row per sample of its tars (largefine.webdataset).
WDS_INDEX = pa.schema(
    [
        pa.field("image_id", pa.string(), nullable=False),
        pa.field("tar", pa.string(), nullable=False),  # file name beside the index shards
        pa.field("key", pa.string(), nullable=False),  # the sample's key in the tar
        pa.field("members", pa.list_(pa.string()), nullable=False),
        pa.field("tiers", pa.list_(pa.string()), nullable=False),  # the tiers whose texts the json holds
        pa.field("tar_sha256", pa.string(), nullable=False),
    ]
)

# The self-asked questions and answers behind base and intermediate captions.
QA_PAIRS = pa.schema(
    [
        pa.field("image_id", pa.string(), nullable=False),
        pa.field("tier", pa.string(), nullable=False),
        pa.field("pair_index", pa.int32(), nullable=False),
        pa.field("question", pa.string(), nullable=False),
        pa.field("answer", pa.string(), nullable=False),
        pa.field("generator", pa.string(), nullable=False),
    ]
)

# The advanced tier's template gallery (a prompts artifact): accepted templates with typed slots.
TEMPLATES = pa.schema(
    [
        pa.field("template_id", pa.string(), nullable=False),
        pa.field("text", pa.string(), nullable=False),
        pa.field("slots", pa.list_(pa.string()), nullable=False),
        pa.field("origin", pa.string(), nullable=False),  # seed | extracted | expanded
        pa.field("round", pa.int32(), nullable=False),
    ]
)

SCHEMAS: dict[str, pa.Schema] = {
    "images": IMAGES,
    "measurements": MEASUREMENTS,
    "accepted_images": ACCEPTED_IMAGES,
    "rejects": REJECTS,
    "pool": POOL,
    "video_segments": VIDEO_SEGMENTS,
    "captions": CAPTIONS,
    "caption_stats": CAPTION_STATS,
    "queries": QUERIES,
    "sampling": SAMPLING,
    "gallery": GALLERY,
    "candidates": CANDIDATES,
    "qrels": QRELS,
    "evaluation": EVALUATION,
    "chosen_images": CHOSEN_IMAGES,
    "neighbours": NEIGHBOURS,
    "tier_captions": TIER_CAPTIONS,
    "qa_pairs": QA_PAIRS,
    "templates": TEMPLATES,
}

# The training pairs of a CLIP-like student, streamed shard by shard (rde.training.pair_stream): one
# caption per row with its image's encoded bytes and the teacher's vectors (SAFT: precomputed once).
TRAINING_PAIRS = pa.schema(
    [
        pa.field("split", pa.string(), nullable=False),  # train | heldout
        pa.field("pair", pa.int64(), nullable=False),  # 0, 1, ... within its split
        pa.field("image_id", pa.string(), nullable=False),
        pa.field("image_key", pa.int64(), nullable=False),  # equal for the pairs of one image
        pa.field("identity", pa.string()),
        pa.field("text", pa.string(), nullable=False),
        pa.field("q_txt", pa.float64()),
        pa.field("image", pa.binary(), nullable=False),  # as accepted: encoded, decoded by the loader
        pa.field("teacher_image", pa.list_(pa.float32()), nullable=False),
        pa.field("teacher_text", pa.list_(pa.float32()), nullable=False),
    ]
)

# The CPU model's cached features, streamed when the pairs are many (``training.stream_above``): rows
# by ``split``. train / heldout: a caption with its image's tower features in every view and its own
# text vector; gallery / query: a check set's gallery image (one view) or query (``image_id`` holds
# the check set, ``pair`` the position in it).
TRAINING_FEATURE_PAIRS = pa.schema(
    [
        pa.field("split", pa.string(), nullable=False),  # train | heldout | gallery | query
        pa.field("pair", pa.int64(), nullable=False),
        pa.field("image_id", pa.string(), nullable=False),
        pa.field("image_key", pa.int64(), nullable=False),
        pa.field("identity", pa.string()),
        pa.field("text", pa.string()),
        pa.field("q_txt", pa.float64()),
        pa.field("image_views", pa.list_(pa.list_(pa.float32()))),  # V views × the tower features
        pa.field("text_vector", pa.list_(pa.float32())),
        pa.field("teacher_image", pa.list_(pa.float32())),
        pa.field("teacher_text", pa.list_(pa.float32())),
    ]
)


# training-features, the CPU model's in-memory layout: one row per image view, pair, held-out pair,
# check-set gallery image and query (``kind``), with its tower vector and the teacher's
TRAINING_FEATURES = pa.schema([
    pa.field("kind", pa.string(), nullable=False),  # pair | heldout | image | gallery | query
    pa.field("key", pa.string(), nullable=False), pa.field("index", pa.int32(), nullable=False),
    pa.field("identity", pa.string()), pa.field("q_txt", pa.float64()), pa.field("text", pa.string()),
    pa.field("vector", pa.list_(pa.float32()), nullable=False), pa.field("teacher", pa.list_(pa.float32()))])

# a training stage's loss log: one row per step, the loss terms as JSON
TRAINING_LOG = pa.schema([pa.field("step", pa.int32(), nullable=False), pa.field("epoch", pa.int32(), nullable=False),
                          pa.field("terms", pa.string(), nullable=False)])


# the cached reranker: recall per ranking and candidate count (train-vedje, rerank), and the stage-1 index
RECALL = pa.schema([pa.field("ranking", pa.string(), nullable=False), pa.field("n_candidates", pa.int32()),
                    pa.field("metric", pa.string(), nullable=False), pa.field("value", pa.float64(), nullable=False),
                    pa.field("queries", pa.int32()), pa.field("gallery", pa.int32()),
                    pa.field("precision", pa.string())])


STAGE1_INDEX = pa.schema([pa.field("item_id", pa.string(), nullable=False), pa.field("group", pa.string()),
                          pa.field("split", pa.string()),
                          pa.field("embedding", pa.list_(pa.float32()), nullable=False)])
