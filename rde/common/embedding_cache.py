"""Image embeddings cached as an artifact, so a rerun (or another stage) never re-embeds.

One cache artifact per embedder identity: (model id, revision, preprocessing, dimension). Rows
are keyed by the image's content hash (``image_id``). New embeddings are appended as a new shard
and the manifest rewritten; a reader streams the shards and keeps only the ids it needs.
Writers in one process are serialised by a lock; separate processes should not append to the
same cache at the same moment (each stage runs its embedding in one task per shard set).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa

from models.backends.interfaces import ImageEmbedder, TextImageExpert
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

    def _append(self, ids: list[str], vectors: np.ndarray) -> None:
        writer = ArtifactWriter(self.url, "embedding_cache", self.schema, self.key)
        previous = Artifact(self.url).manifest().shards if Artifact(self.url).is_complete(self.key) else []
        writer.begin()  # drops the manifest for the moment of the append; shards of this key stay
        table = pa.table({"image_id": ids, "vector": pa.array(list(vectors.astype(np.float32)),
                                                              type=self.schema.field("vector").type)})
        shard = writer.write_shard(len(previous), table)
        writer.finalize([*previous, shard], code_version="embedding-cache", models={"embedder": self.identity},
                        config={"identity": self.identity})
