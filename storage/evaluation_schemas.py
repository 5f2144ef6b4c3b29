"""The Arrow schemas of ``rde evaluate``'s artifacts (beside ``storage.schemas``, the building and
training flows' own)."""

from __future__ import annotations

import pyarrow as pa

# rde evaluate: one retriever's gallery vectors (per gallery shard), its metrics with intervals, its
# per-query outcomes, its run (top items per query), and the comparison of every retriever
GALLERY_VECTORS = pa.schema([pa.field("item_id", pa.string(), nullable=False),
                             pa.field("domain", pa.string(), nullable=False),
                             pa.field("vector", pa.list_(pa.float32()), nullable=False)])
MODEL_METRICS = pa.schema([
    pa.field("benchmark", pa.string(), nullable=False), pa.field("labels", pa.string(), nullable=False),
    pa.field("model", pa.string(), nullable=False), pa.field("domain", pa.string(), nullable=False),
    pa.field("metric", pa.string(), nullable=False), pa.field("mean", pa.float64(), nullable=False),
    pa.field("low", pa.float64(), nullable=False), pa.field("high", pa.float64(), nullable=False),
    pa.field("queries", pa.int32(), nullable=False)])
QUERY_OUTCOMES = pa.schema([
    pa.field("query_id", pa.string(), nullable=False), pa.field("domain", pa.string(), nullable=False),
    pa.field("text", pa.string(), nullable=False), pa.field("first_hit", pa.int32()),
    pa.field("n_relevant", pa.int32(), nullable=False), pa.field("top", pa.list_(pa.string()), nullable=False),
    pa.field("relevant", pa.list_(pa.string()), nullable=False),
    pa.field("metrics", pa.list_(pa.struct([pa.field("name", pa.string()), pa.field("value", pa.float64())])),
             nullable=False)])
RUN_ROWS = pa.schema([
    pa.field("query_id", pa.string(), nullable=False), pa.field("item_id", pa.string(), nullable=False),
    pa.field("rank", pa.int32(), nullable=False), pa.field("score", pa.float64(), nullable=False)])
COMPARISON = pa.schema([*MODEL_METRICS, pa.field("reference", pa.string()), pa.field("diff_mean", pa.float64()),
                        pa.field("diff_low", pa.float64()), pa.field("diff_high", pa.float64())])
