"""Per-item cache rows in Parquet (VEDJE Sec. "Cache"): one row per item with its encoded Z(v),
plus the lineage that says which backbone and compressor wrote it.

The manifest's ``config.cache_lineage`` holds the backbone spec, the compressor fingerprint and
the cache shape; a reader compares it with what a reranker checkpoint was trained with and
refuses a mismatch with a message that names the fix (re-run ``index-cache``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from models.reranker.cache_codec import Precision, decode, encode, payload_bytes
from storage import Artifact

CACHE = pa.schema([pa.field("item_id", pa.string(), nullable=False),
                   pa.field("frames", pa.int32(), nullable=False),
                   pa.field("tokens_per_frame", pa.int32(), nullable=False),
                   pa.field("dim", pa.int32(), nullable=False),
                   pa.field("precision", pa.string(), nullable=False),
                   pa.field("payload_bytes", pa.int64(), nullable=False),  # without the fp8/fp4 scale
                   pa.field("cache", pa.binary(), nullable=False)])


class CacheLineageError(ValueError):
    """The cache was written by another backbone or compressor than the reranker expects."""


def cache_rows(item_ids: Sequence[str], caches: np.ndarray, frames: int, tokens_per_frame: int,
               precision: Precision) -> pa.Table:
    """Encode B×(T·M)×d caches as rows of ``CACHE``."""
    shape = tuple(caches.shape[1:])
    rows = [{"item_id": i, "frames": frames, "tokens_per_frame": tokens_per_frame, "dim": int(shape[1]),
             "precision": precision, "payload_bytes": payload_bytes(shape, precision),
             "cache": encode(z, precision)} for i, z in zip(item_ids, caches, strict=True)]
    return pa.Table.from_pylist(rows, schema=CACHE)


def check_lineage(found: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    """Raise ``CacheLineageError`` naming the first differing field (backbone, compressor, shape)."""
    for key in ("backbone", "compressor", "frames", "tokens_per_frame", "dim"):
        if found.get(key) != expected.get(key):
            what = {"backbone": "visual backbone", "compressor": "compressor weights"}.get(key, key)
            raise CacheLineageError(
                f"the caches at {where} were written with a different {what} ({key}: cache has "
                f"{str(found.get(key))[:80]!r}, the reranker expects {str(expected.get(key))[:80]!r}); "
                "a new backbone or compressor invalidates the cache: run `rde index-cache` again with this "
                "reranker (updating only the joint encoder keeps caches valid)")


@dataclass
class FetchStats:
    items: int = 0
    bytes: int = 0
    seconds: float = 0.0


class CacheIndex:
    """All caches of an ``index-cache`` artifact held in memory as encoded bytes (the host-RAM
    residency of the paper's latency table); ``fetch`` decodes the requested items to FP32."""

    def __init__(self, url: str, expected_lineage: dict[str, Any] | None = None) -> None:
        art = Artifact(url)
        if not art.is_complete():
            raise FileNotFoundError(f"no finished cache at {url}: run `rde index-cache` first")
        manifest = art.manifest()
        self.fingerprint = manifest.fingerprint
        self.lineage: dict[str, Any] = manifest.config.get("cache_lineage", {})
        if expected_lineage is not None:
            check_lineage(self.lineage, expected_lineage, url)
        self.blobs: dict[str, bytes] = {}
        self.shape: tuple[int, int] | None = None
        self.precision: Precision = "bf16"
        for _, table in art.iter_shards():
            for r in table.to_pylist():
                self.blobs[r["item_id"]] = r["cache"]
                self.shape = (r["frames"] * r["tokens_per_frame"], r["dim"])
                self.precision = r["precision"]
        self.stats = FetchStats()

    def __len__(self) -> int:
        return len(self.blobs)

    def fetch(self, item_ids: Sequence[str]) -> torch.Tensor:
        """N×(T·M)×d float32 caches of these items (a missing item is a KeyError naming it)."""
        start = time.perf_counter()
        missing = [i for i in item_ids if i not in self.blobs]
        if missing:
            raise KeyError(f"{len(missing)} candidate(s) have no cache, e.g. {missing[0]!r}: index them first")
        assert self.shape is not None
        out = np.stack([decode(self.blobs[i], self.shape, self.precision) for i in item_ids])
        self.stats.items += len(item_ids)
        self.stats.bytes += sum(len(self.blobs[i]) for i in item_ids)
        self.stats.seconds += time.perf_counter() - start
        return torch.from_numpy(out)
