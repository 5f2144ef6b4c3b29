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

from models.reranker.cache_codec import Precision, decode_rows, encode, payload_bytes
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
    residency of the paper's latency table), one contiguous uint8 row per item; ``fetch`` gathers the
    requested rows and decodes them to FP32 in one vectorised call."""

    def __init__(self, url: str, expected_lineage: dict[str, Any] | None = None) -> None:
        art = Artifact(url)
        if not art.is_complete():
            raise FileNotFoundError(f"no finished cache at {url}: run `rde index-cache` first")
        manifest = art.manifest()
        self.fingerprint = manifest.fingerprint
        self.lineage: dict[str, Any] = manifest.config.get("cache_lineage", {})
        if expected_lineage is not None:
            check_lineage(self.lineage, expected_lineage, url)
        self.rows: dict[str, int] = {}
        self.shape: tuple[int, int] | None = None
        self.precision: Precision = "bf16"
        blobs: list[bytes] = []
        for _, table in art.iter_shards():
            for r in table.to_pylist():
                shape = (r["frames"] * r["tokens_per_frame"], r["dim"])
                if (self.shape, self.precision) != (shape, r["precision"]) and blobs:
                    raise ValueError(f"the caches at {url} mix shapes or precisions ({self.shape} {self.precision} "
                                     f"vs {shape} {r['precision']} for {r['item_id']!r}): run `rde index-cache` again")
                self.shape, self.precision = shape, r["precision"]
                if r["item_id"] in self.rows:
                    blobs[self.rows[r["item_id"]]] = r["cache"]
                else:
                    self.rows[r["item_id"]] = len(blobs)
                    blobs.append(r["cache"])
        width = len(blobs[0]) if blobs else 0
        if any(len(b) != width for b in blobs):
            raise ValueError(f"the caches at {url} have rows of different byte lengths: run `rde index-cache` again")
        self.codes = np.frombuffer(b"".join(blobs), np.uint8).reshape(len(blobs), width)  # items × encoded bytes
        self.stats = FetchStats()

    def __len__(self) -> int:
        return len(self.rows)

    def encoded(self, item_id: str) -> bytes:
        """The stored bytes of one item's cache (what ``cache_codec.decode`` reads)."""
        return self.codes[self.rows[item_id]].tobytes()

    def fetch(self, item_ids: Sequence[str]) -> torch.Tensor:
        """N×(T·M)×d float32 caches of these items (a missing item is a KeyError naming it)."""
        start = time.perf_counter()
        missing = [i for i in item_ids if i not in self.rows]
        if missing:
            raise KeyError(f"{len(missing)} candidate(s) have no cache, e.g. {missing[0]!r}: index them first")
        assert self.shape is not None or not item_ids
        picked = self.codes[[self.rows[i] for i in item_ids]]
        out = (decode_rows(picked, self.shape, self.precision) if self.shape is not None
               else np.zeros((0, 0, 0), np.float32))
        self.stats.items += len(item_ids)
        self.stats.bytes += picked.size
        self.stats.seconds += time.perf_counter() - start
        return torch.from_numpy(out)
