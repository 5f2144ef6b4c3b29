"""Hard-negative neighbours for the GTR+ intermediate tier (paper Sec. 3.1.2, Eq. 1).

For every image: its top-k nearest neighbours by cosine similarity of image embeddings, never
itself and never an exact duplicate (same content hash), then one of them drawn at random as the
hard negative. The draw uses a generator seeded by (seed, image id), so it does not depend on the
shard layout, the order of the pool or which worker computed it. A pool searched exactly streams
(:func:`hard_negative_neighbours_streamed` over the whole pool, :func:`hard_negative_neighbours_of`
over one search block, as the per-shard stage computes it on any worker): its vectors stay in
their artifact and are read a query batch and a gallery block at a time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from rde.common.embedding_cache import CachedVectors
from rde.common.seeds import draw_seed
from rde.common.topk import AnnSpec, topk, topk_exact_blocks, uses_index
from storage import Artifact


@dataclass(frozen=True)
class Neighbours:
    """The neighbours of one image, best first, and the hard negative drawn from them."""

    image_id: str
    neighbour_ids: list[str]
    scores: list[float]
    hard_negative_id: str | None  # None when the pool holds no other distinct image


def hard_negative_neighbours(embeddings: np.ndarray, image_ids: Sequence[str], k: int = 10, seed: int = 0,
                             index_above: int = 100_000, query_rows: Sequence[int] | None = None,
                             ann: AnnSpec | None = None) -> list[Neighbours]:
    """Top-``k`` neighbours of each query row among all rows, excluding rows with the same image id
    (itself and exact duplicates), and one hard negative drawn uniformly from them.

    ``embeddings`` are L2-normalised (cosine = inner product). Exact blocked search up to
    ``index_above`` rows, the recall-checked IVF index (``ann``) above. ``query_rows`` restricts
    which rows get neighbours (one shard of a large pool); default all.
    """
    ids = list(image_ids)
    if len(ids) != len(embeddings):
        raise ValueError(f"{len(ids)} image ids for {len(embeddings)} embeddings")
    rows = list(range(len(ids))) if query_rows is None else list(query_rows)
    if not rows:
        return []
    copies = Counter(ids)
    # Enough extra results that k survive after dropping the query's own copies.
    search_k = min(len(ids), k + max(copies.values()))
    vectors = np.ascontiguousarray(embeddings, dtype=np.float32)
    idx, val = topk(vectors[rows], vectors, search_k, index_above, ann)
    return _draw([ids[r] for r in rows], ids, idx, val, k, seed)


def hard_negative_neighbours_blocks(queries: np.ndarray, query_ids: Sequence[str],
                                    gallery: Callable[[], Iterable[np.ndarray]], image_ids: Sequence[str],
                                    k: int = 10, seed: int = 0) -> list[Neighbours]:
    """:func:`hard_negative_neighbours` (exact search) for some queries (one output shard's vectors)
    against a gallery that arrives as blocks: ``gallery()`` gives every row of ``image_ids`` in
    order, a block at a time (one pool shard's vectors from the embedding cache), so only the
    queries, one block and the running top-k are in memory. The same neighbours, scores (to the
    bit, on any CPU: ``rde.common.topk.inner_products``) and draw as :func:`hard_negative_neighbours`
    with ``query_rows`` on the whole pool held in memory (exact search); where distinct images tie
    at the last place searched, the lower row wins in both."""
    ids = list(image_ids)
    if len(query_ids) != len(queries):
        raise ValueError(f"{len(query_ids)} query ids for {len(queries)} query vectors")
    if not len(query_ids):
        return []
    search_k = min(len(ids), k + max(Counter(ids).values()))
    idx, val = topk_exact_blocks(np.ascontiguousarray(queries, dtype=np.float32), gallery(), search_k)
    return _draw(list(query_ids), ids, idx, val, k, seed)


def hard_negative_neighbours_streamed(take: Callable[[np.ndarray], np.ndarray],
                                      blocks: Callable[[np.ndarray], Iterable[np.ndarray]],
                                      image_ids: Sequence[str], k: int = 10, seed: int = 0,
                                      index_above: int = 100_000, ann: AnnSpec | None = None,
                                      query_batch: int = 4096) -> list[Neighbours]:
    """:func:`hard_negative_neighbours` of every row with the vectors read on demand, so the memory
    does not grow with the pool: ``take(rows)`` gives those rows' vectors, ``blocks(rows)`` them a
    block at a time (``CachedVectors.take`` / ``blocks``: one pool shard per block).

    Where the search is exact (``rde.common.topk.uses_index`` false: up to ``index_above`` rows, or
    fewer than ``ann.min_queries``) the rows are searched in batches of at most ``query_batch``,
    each against the whole gallery streamed in blocks (:func:`hard_negative_neighbours_blocks`):
    at most a query batch and one block of vectors are alive, whatever N, at the cost of one pass
    over the cached vectors per batch. The same neighbours and scores as the in-memory search, to
    the bit, for any batch and block size. Above that the IVF index is built over all N vectors,
    so they are read whole and searched in memory (``take`` of every row)."""
    if query_batch < 1:
        raise ValueError(f"query_batch must be at least 1, got {query_batch}")
    ids = list(image_ids)
    everything = np.arange(len(ids), dtype=np.int64)
    if uses_index(len(ids), len(ids), index_above, ann):
        return hard_negative_neighbours(take(everything), ids, k, seed, index_above, ann=ann)
    found: list[Neighbours] = []
    # batches of equal size (at most query_batch): the scores do not depend on it, the work per
    # batch stays even
    for rows in np.array_split(everything, -(-len(ids) // query_batch)) if ids else []:
        found += hard_negative_neighbours_blocks(take(rows), [ids[r] for r in rows], lambda: blocks(everything),
                                                 ids, k, seed)
    return found


def _draw(query_ids: list[str], ids: list[str], idx: np.ndarray, val: np.ndarray, k: int,
          seed: int) -> list[Neighbours]:
    """Per query: its top results without its own copies (same image id), the first k distinct,
    and the hard negative drawn among them by a generator seeded by (seed, image id)."""
    out: list[Neighbours] = []
    for own, found, scores in zip(query_ids, idx, val, strict=True):
        kept = [(ids[j], float(s)) for j, s in zip(found, scores, strict=True) if j >= 0 and ids[j] != own]
        seen: set[str] = set()
        unique = [(i, s) for i, s in kept if not (i in seen or seen.add(i))][:k]
        choice = None
        if unique:
            rng = np.random.default_rng(draw_seed(seed, own))
            choice = unique[int(rng.integers(len(unique)))][0]
        out.append(Neighbours(own, [i for i, _ in unique], [s for _, s in unique], choice))
    return out


def hard_negative_neighbours_of(rows: np.ndarray, take: Callable[[np.ndarray], np.ndarray],
                                blocks: Callable[[np.ndarray], Iterable[np.ndarray]], image_ids: Sequence[str],
                                k: int = 10, seed: int = 0, index_above: int = 100_000,
                                ann: AnnSpec | None = None) -> list[Neighbours]:
    """:func:`hard_negative_neighbours_streamed` for the pool rows ``rows`` only (one search block of
    a per-shard stage: any worker computes it from the pool's vectors read on demand). Exact search:
    ``rows``' vectors against the whole gallery streamed in blocks, one pass, the same neighbours and
    scores to the bit as the whole pool's search. Above ``index_above`` (``uses_index``) the IVF
    index is built over all N vectors (read whole) and searched for ``rows``."""
    ids = list(image_ids)
    rows = np.asarray(rows, dtype=np.int64)
    everything = np.arange(len(ids), dtype=np.int64)
    if uses_index(len(ids), len(ids), index_above, ann):
        return hard_negative_neighbours(take(everything), ids, k, seed, index_above, query_rows=rows.tolist(), ann=ann)
    return hard_negative_neighbours_blocks(take(rows), [ids[r] for r in rows], lambda: blocks(everything), ids, k,
                                           seed)


def vector_places(vectors: Artifact, rows: Sequence[dict], positions: Sequence[int], domains: set[str]) -> np.ndarray:
    """Where the vectors of ``rows[positions]`` are in an ``embed-images`` artifact: (shard, row) per
    position. Its shard s holds accepted shard s's rows of ``domains`` in order, so a row's vector
    is at (its ``accepted_shard``, its rank among that shard's rows of ``domains``). The ids at
    those places are checked against the rows (an artifact of another accepted run is refused)."""
    seen: Counter = Counter()
    rank = []
    for row in rows:
        if row["domain"] in domains:
            rank.append(seen[row["accepted_shard"]])
            seen[row["accepted_shard"]] += 1
        else:
            rank.append(-1)
    places = np.array([(rows[p]["accepted_shard"], rank[p]) for p in positions], np.int64).reshape(len(positions), 2)
    for shard in np.unique(places[:, 0]):
        mine = np.flatnonzero(places[:, 0] == shard)
        stored = vectors.read_shard(int(shard), ["image_id"]).column("image_id").to_pylist()
        if len(stored) != seen[int(shard)] or any(stored[places[k, 1]] != rows[positions[k]]["image_id"] for k in mine):
            raise RuntimeError(f"select-images: {vectors.url} shard {int(shard)} does not hold the accepted images "
                               "of this run in their order (the accepted artifact changed after embed-images)")
    return places


def vectors_at(vectors: Artifact, places: np.ndarray) -> CachedVectors:
    """The vectors at ``places`` ((shard, row) per row: :func:`vector_places`) of an ``embed-images``
    artifact, read on demand (its dimension read from the first shard that holds one)."""
    dim = 0
    for shard in np.unique(places[:, 0]) if len(places) else []:
        table = vectors.read_shard(int(shard), ["vector"])
        if table.num_rows:
            dim = len(table.column("vector")[0].as_py())
            break
    return CachedVectors(vectors.url, dim, places, places[:, 0].copy())
