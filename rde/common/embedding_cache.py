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
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from models.backends.interfaces import ImageEmbedder, TextImageExpert
from rde.common.image_decoding import decode_rgb
from rde.common.run_lock import output_lock
from storage import Artifact, ArtifactWriter
from storage.artifact import shard_name
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
        """Each row's ``columns`` (``keep``: only the rows it accepts; it is called once per row, in
        artifact order) and its vector, in artifact order, holding one shard's image bytes at a
        time: the ids are read first (no bytes), looked up in the cache once, and a shard's bytes
        are read only when it has a miss. Memory: the metadata and the vectors (N × dim floats),
        plus one shard of bytes; :meth:`index_artifact` holds no vectors at all."""
        rows, ids, where = _kept_rows(artifact, columns, keep)
        with self._lock:
            found = self.lookup(ids)
            for missing, vectors, _ in self._embed_misses(artifact, ids, where, found):
                found.update(zip(missing, vectors, strict=True))
        out = np.stack([found[i] for i in ids]) if ids else np.zeros((0, self.embedder.dim), np.float32)
        return rows, out

    def index_artifact(self, artifact: Artifact, columns: Sequence[str],
                       keep: Callable[[dict[str, Any]], bool] | None = None
                       ) -> tuple[list[dict[str, Any]], CachedVectors]:
        """:meth:`embed_artifact` without the vectors: each kept row's ``columns`` and a
        :class:`CachedVectors` that reads any of their vectors from the cache on demand. Misses are
        embedded (and appended) one artifact shard at a time, as there; the cache is searched by its
        ``image_id`` column only. Memory: the metadata and two ints per row, plus one shard of
        bytes (while embedding) or one cache read batch."""
        rows, ids, where = _kept_rows(artifact, columns, keep)
        with self._lock:
            located = self.locate(ids)
            for missing, _, shard in self._embed_misses(artifact, ids, where, located):
                located.update((image_id, (shard, row)) for row, image_id in enumerate(missing))
        places = np.array([located[i] for i in ids], np.int64).reshape(len(ids), 2)
        return rows, CachedVectors(self.url, int(self.embedder.dim), places,
                                   np.array([w[0] for w in where], np.int64))

    def locate(self, image_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
        """(cache shard, row) of the given ids that are cached, read from the cache's ``image_id``
        column one shard at a time (no vectors); an id cached twice: its last copy, as ``lookup``."""
        wanted = set(image_ids)
        found: dict[str, tuple[int, int]] = {}
        art = Artifact(self.url)
        if not wanted or not art.is_complete(self.key):
            return found
        for shard in art.manifest().shards:
            column = art.read_shard(shard.index, ["image_id"]).column("image_id").to_pylist()
            found.update((x, (shard.index, row)) for row, x in enumerate(column) if x in wanted)
        return found

    def _embed_misses(self, artifact: Artifact, ids: list[str], where: list[tuple[int, int]],
                      present: Container[str]) -> Iterator[tuple[list[str], np.ndarray, int]]:
        """Embed and append the ids not in ``present``, one artifact shard's bytes at a time:
        (ids, their vectors, the cache shard now holding them, in that order) per shard."""
        for index, positions in _misses_by_shard(ids, where, present):
            column = artifact.read_shard(index, ["image_bytes"]).column("image_bytes")
            missing = [ids[k] for k in positions]
            vectors = self.embedder.embed([decode_rgb(column[where[k][1]].as_py()) for k in positions])
            self.embedded += len(missing)
            yield missing, vectors, self._append(missing, vectors)

    def _append(self, ids: list[str], vectors: np.ndarray) -> int:
        """One more shard, then the manifest listing it (held under the folder's lock); its index."""
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
        return shard.index


class CachedVectors:
    """The cached vectors of N rows, read on demand: row i's vector is at ``places[i]`` = (cache
    shard, row within it); ``groups[i]`` is the row's shard in the artifact it came from.

    Why an index and not vectors: a pool's N × dim floats (6 GB at 1.2M × 1280) need not be
    alive at once for a stage that reads them block by block (CGDS's streaming k-means) or a
    domain at a time. Cost of the trade: every :meth:`take` reads the cache shards holding the
    rows asked for, up to the last row asked for in each, in batches of ``read_batch`` rows
    (skipping row groups that hold none; a batch is decoded whole). The cache is appended one
    artifact shard's misses at a time, so the rows of one artifact shard sit in one or two cache
    shards and a pass over the artifact in order (:meth:`blocks`) reads each of those about once;
    a cache filled in another order (another pool's misses, an older whole-pool append) is read
    more than once per pass, never held whole.
    """

    read_batch = 4096

    def __init__(self, url: str, dim: int, places: np.ndarray, groups: np.ndarray) -> None:
        self.url, self.dim = url, dim
        self.places, self.groups = places, groups

    def __len__(self) -> int:
        return len(self.places)

    def take(self, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """The vectors of rows ``positions`` (len(positions) × dim float32), in that order."""
        positions = np.asarray(positions, np.int64)
        out = np.empty((len(positions), self.dim), np.float32)
        if not len(positions):
            return out
        shards, rows = self.places[positions, 0], self.places[positions, 1]
        art = Artifact(self.url)
        for shard in np.unique(shards):
            mine = np.flatnonzero(shards == shard)
            out[mine] = self._read(art, int(shard), rows[mine])
        return out

    def _read(self, art: Artifact, shard: int, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` of one cache shard's vectors, in the order given."""
        import pyarrow.parquet as pq

        out = np.empty((len(rows), self.dim), np.float32)
        wanted = np.argsort(rows, kind="stable")
        ordered = rows[wanted]
        with art.fs.open(join(art.path, shard_name(shard)), "rb") as handle:
            parquet = pq.ParquetFile(handle)
            start, groups = 0, []
            for g in range(parquet.metadata.num_row_groups):
                count = parquet.metadata.row_group(g).num_rows
                lo, hi = np.searchsorted(ordered, [start, start + count])
                if hi > lo:
                    groups.append((g, start))
                start += count
            for g, offset in groups:
                for batch in parquet.iter_batches(batch_size=self.read_batch, row_groups=[g], columns=["vector"]):
                    lo, hi = np.searchsorted(ordered, [offset, offset + batch.num_rows])
                    if hi > lo:
                        vectors = batch.column(0).flatten().to_numpy().reshape(batch.num_rows, self.dim)
                        out[wanted[lo:hi]] = vectors[ordered[lo:hi] - offset]
                    offset += batch.num_rows
                    if offset > ordered[-1]:
                        break
        return out

    def blocks(self, positions: Sequence[int] | np.ndarray) -> Iterator[np.ndarray]:
        """The vectors of rows ``positions`` (in the order given) as blocks, a new block wherever
        the artifact shard changes: one artifact shard's rows at a time."""
        positions = np.asarray(positions, np.int64)
        if not len(positions):
            return
        cuts = np.flatnonzero(np.diff(self.groups[positions])) + 1
        for part in np.split(positions, cuts):
            yield self.take(part)


def _kept_rows(artifact: Artifact, columns: Sequence[str], keep: Callable[[dict[str, Any]], bool] | None
               ) -> tuple[list[dict[str, Any]], list[str], list[tuple[int, int]]]:
    """The kept rows' ``columns``, their ids and (shard index, row within the shard), in artifact
    order, read without the bytes; ``keep`` is called once per row, in that order."""
    rows: list[dict[str, Any]] = []
    ids: list[str] = []
    where: list[tuple[int, int]] = []
    for index, table in artifact.iter_shards(list(dict.fromkeys(["image_id", *columns]))):
        for pos, row in enumerate(table.to_pylist()):
            if keep is None or keep(row):
                rows.append({k: row[k] for k in columns})
                ids.append(row["image_id"])
                where.append((index, pos))
    return rows, ids, where


def _misses_by_shard(ids: Sequence[str], where: Sequence[tuple[int, int]],
                     found: Container[str]) -> Iterator[tuple[int, list[int]]]:
    """(shard index, positions in ``ids``) of the rows whose vector is not cached, shard by shard;
    an id already met in an earlier shard is not a miss again."""
    by_shard: dict[int, list[int]] = {}
    seen: set[str] = set()
    for k, image_id in enumerate(ids):
        if image_id not in found and image_id not in seen:
            by_shard.setdefault(where[k][0], []).append(k)
            seen.add(image_id)
    yield from sorted(by_shard.items())


def expert_caches(base: str, registry: Any, experts: Sequence[Any]) -> list[EmbeddingCache]:
    """One embedding cache per configured expert's image side (under ``<base>/cache/``, as the image
    embeddings; keyed by the expert's lineage with its parts): MECF and the evaluation share the
    gallery's vectors, and a re-evaluation after a label import encodes nothing. ``registry``: the
    profile's ``ModelRegistry``."""
    return [EmbeddingCache(base, ExpertImages(registry.expert(spec), registry.lineage(spec))) for spec in experts]
