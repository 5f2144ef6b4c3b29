"""Image embeddings cached as an artifact, so a rerun (or another stage, or another flow) never re-embeds.

One cache artifact per embedder identity: (model id, revision, preprocessing, dimension), under
``<output root>/cache/embeddings/``, shared by every flow writing to that output (CGDS and the hard
negatives embed the same pool once). Rows are keyed by the image's content hash (``image_id``).
New embeddings are appended as a new shard and the manifest replaced atomically, holding the
cache folder's lock (a ``flock``, so writers in other processes on the same machine wait; an
object-store root has no lock: see ``rde.common.run_lock``). A reader never sees the cache
incomplete: the old manifest stays until the new one replaces it, and the shards it lists are
never rewritten. Two processes missing the same image both embed it and both append it: a
duplicate row, harmless to lookups.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from models.backends.interfaces import ImageEmbedder, TextImageExpert
from rde.common.image_decoding import decode_rgb
from rde.common.run_lock import output_lock
from storage import Artifact, ArtifactWriter
from storage.filesystem import join
from storage.hashing import sha256_json

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def embedder_identity(embedder: ImageEmbedder) -> dict[str, object]:
    spec = getattr(embedder, "spec", None)
    identity: dict[str, object] = {"model_id": embedder.model_id, "revision": getattr(spec, "revision", None),
                                   "preprocessing": embedder.preprocessing, "dim": int(embedder.dim)}
    lineage = getattr(embedder, "lineage", None)
    if lineage is not None:
        identity["lineage"] = lineage
    return identity


class ExpertImages:
    """A retrieval expert's image side as an ``ImageEmbedder``, so its gallery vectors are cached
    like any embedding: MECF and the evaluation encode the same gallery, and an evaluation rerun
    (after a label import) or a check set met before costs a lookup, not a detector pass.
    ``lineage``: the expert's spec with the parts it is built from (``ModelRegistry.lineage``);
    it enters the cache key, so another detector threshold is another cache."""

    def __init__(self, expert: TextImageExpert, lineage: dict[str, object]) -> None:
        self.expert = expert
        self.model_id = f"expert:{expert.model_id}"
        self.dim = int(expert.dim)
        self.preprocessing = expert.preprocessing
        self.lineage = lineage

    def embed(self, images: list[np.ndarray]) -> np.ndarray:
        return self.expert.encode_image(images)


class EmbeddingCache:
    """Cached ``embedder.embed`` keyed by image content hash."""

    def __init__(self, root_url: str, embedder: ImageEmbedder) -> None:
        self.embedder = embedder
        self.identity = embedder_identity(embedder)
        self.key = sha256_json(self.identity)
        self.url = join(root_url, "cache", "embeddings", self.key[:16])
        self.schema = pa.schema([pa.field("image_id", pa.string(), nullable=False),
                                 pa.field("vector", pa.list_(pa.float32(), int(embedder.dim)), nullable=False)])
        with _locks_guard:
            self._lock = _locks.setdefault(self.url, threading.Lock())
        self.embedded = 0  # images actually sent to the model by this instance (for tests and logs)

    def lookup(self, image_ids: Sequence[str]) -> dict[str, np.ndarray]:
        """Cached vectors of the given ids (those present)."""
        wanted = set(image_ids)
        found: dict[str, np.ndarray] = {}
        art = Artifact(self.url)
        if not wanted or not art.is_complete(self.key):
            return found
        for batch in art.iter_batches(batch_size=4096):
            ids = batch.column("image_id").to_pylist()
            hits = [i for i, x in enumerate(ids) if x in wanted]
            if hits:
                vecs = batch.column("vector").flatten().to_numpy().reshape(len(ids), -1)
                for i in hits:
                    found[ids[i]] = vecs[i]
        return found

    def embed(self, image_ids: Sequence[str], load_images: Callable[[list[int]], list[np.ndarray]]) -> np.ndarray:
        """Vectors for ``image_ids`` in order; ``load_images(positions)`` decodes only the misses."""
        with self._lock:
            cached = self.lookup(image_ids)
            unique_missing: dict[str, int] = {}  # image id → first position (duplicates embed once)
            for pos, image_id in enumerate(image_ids):
                if image_id not in cached:
                    unique_missing.setdefault(image_id, pos)
            if unique_missing:
                positions = list(unique_missing.values())
                vectors = self.embedder.embed(load_images(positions))
                self.embedded += len(positions)
                self._append(list(unique_missing), vectors)
                cached.update(zip(unique_missing, vectors, strict=True))
        return np.stack([cached[x] for x in image_ids]) if image_ids else np.zeros((0, self.embedder.dim), np.float32)

    def embed_artifact(self, artifact: Artifact, columns: Sequence[str],
                       keep: Callable[[dict[str, Any]], bool] | None = None) -> tuple[list[dict[str, Any]], np.ndarray]:
        """Each row's ``columns`` (``keep``: only the rows it accepts) and its vector, in artifact
        order, holding one shard's image bytes at a time: the ids are read first (no bytes), looked
        up in the cache once, and a shard's bytes are read only when it has a miss. Memory: the
        metadata and the vectors (N × dim floats), plus one shard of bytes."""
        rows: list[dict[str, Any]] = []
        ids: list[str] = []
        where: list[tuple[int, int]] = []  # (shard index, row within the shard) of each kept row
        for index, table in artifact.iter_shards(list(dict.fromkeys(["image_id", *columns]))):
            for pos, row in enumerate(table.to_pylist()):
                if keep is None or keep(row):
                    rows.append({k: row[k] for k in columns})
                    ids.append(row["image_id"])
                    where.append((index, pos))
        with self._lock:
            found = self.lookup(ids)
            for index, positions in _misses_by_shard(ids, where, found):
                column = artifact.read_shard(index, ["image_bytes"]).column("image_bytes")
                missing = [ids[k] for k in positions]
                vectors = self.embedder.embed([decode_rgb(column[where[k][1]].as_py()) for k in positions])
                self.embedded += len(missing)
                self._append(missing, vectors)
                found.update(zip(missing, vectors, strict=True))
        out = np.stack([found[i] for i in ids]) if ids else np.zeros((0, self.embedder.dim), np.float32)
        return rows, out

    def _append(self, ids: list[str], vectors: np.ndarray) -> None:
        """One more shard, then the manifest listing it (held under the folder's lock)."""
        writer = ArtifactWriter(self.url, "embedding_cache", self.schema, self.key)
        table = pa.table({"image_id": ids, "vector": pa.array(list(vectors.astype(np.float32)),
                                                              type=self.schema.field("vector").type)})
        with output_lock(self.url, "embedding-cache", wait=True):
            current = Artifact(self.url)
            previous = current.manifest().shards if current.is_complete(self.key) else []
            if not previous:
                writer.begin()  # a new cache (or one under another key): start clean
            shard = writer.write_shard(len(previous), table)  # a new file: no listed shard is rewritten
            writer.finalize([*previous, shard], code_version="embedding-cache",
                            models={"embedder": self.identity}, config={"identity": self.identity})


def _misses_by_shard(ids: Sequence[str], where: Sequence[tuple[int, int]],
                     found: dict[str, np.ndarray]) -> Iterator[tuple[int, list[int]]]:
    """(shard index, positions in ``ids``) of the rows whose vector is not cached, shard by shard;
    an id already met in an earlier shard is not a miss again."""
    by_shard: dict[int, list[int]] = {}
    seen: set[str] = set()
    for k, image_id in enumerate(ids):
        if image_id not in found and image_id not in seen:
            by_shard.setdefault(where[k][0], []).append(k)
            seen.add(image_id)
    yield from sorted(by_shard.items())
