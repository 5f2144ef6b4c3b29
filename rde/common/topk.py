"""Top-K by inner product (cosine for normalised vectors): exact in gallery blocks, or through a
faiss IVF index above a size threshold, its recall measured on a sample of queries against exact
search on every call. Shared by MECF, hard negatives, evaluation and check sets.

Exact scores are the same bits on any CPU and for any block or batch shape
(:func:`inner_products`): a float32 GEMM's rounding depends on the BLAS kernel the CPU selects and
on the product's shape, so a blocked search and a whole one could order near-equal neighbours
differently, and two machines could write different shards from the same vectors.

The index's profile parameters (``AnnSpec``: ``retrieval.ann``, ``largefine.neighbour_ann``) sit here
beside it, below both pipelines whose sections hold them."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from pydantic import Field

from models.specs import Strict

logger = logging.getLogger(__name__)

# float64 holds every integer up to 2**53 exactly: a sum of products of integers that stays below
# it is the same whatever the order of its additions (BLAS kernel, blocking, threads, FMA)
_EXACT_INTEGER_BITS = 53


class AnnSpec(Strict):
    """The approximate top-K index used above a gallery size (faiss IVF-Flat, inner product), and the
    recall check that guards it: ``check_queries`` sampled queries are also searched exactly; below
    ``min_recall`` (recall@K against exact) the search falls back to exact. Defaults measured in
    benchmarks/ann_recall.py (recall@10 ≥ 0.99 on clustered 768-d embeddings at 100k)."""

    nlist: int | None = Field(None, ge=1, description="Inverted lists of the index; null = 4·√N for N "
                              "indexed vectors.")
    nprobe: int = Field(32, ge=1, description="Lists visited per query.")
    train_per_list: int = Field(64, ge=1, description="Training vectors per list (a seeded sample of the "
                                "indexed vectors).")
    # building the index costs ~30× an exact search of 200 queries at 100k (benchmarks/ann_recall.py)
    min_queries: int = Field(5_000, ge=1, description="Fewer queries than this are searched exactly at any "
                             "gallery size, since building the index would cost more than it saves.")
    check_queries: int = Field(64, ge=0, description="Queries also searched exactly to measure the index's "
                               "recall; 0 = no check.")
    min_recall: float = Field(0.99, ge=0.0, le=1.0, description="Below this recall@K against the exact search, "
                              "the search falls back to exact.")
    seed: int = Field(0, description="Seed of the training sample and the checked queries.")


def fixed_point_bits(dim: int) -> int:
    """Bits b of the fixed-point grid :func:`inner_products` puts each row on: the largest b with
    dim · 2^(2b) ≤ 2^53, so a dot product of two rows of integers of magnitude ≤ 2^b is exact in
    float64 (dim 384: 22 bits, 1280: 21, 4096: 20)."""
    return (_EXACT_INTEGER_BITS - math.ceil(math.log2(max(dim, 1)))) // 2


def on_grid(rows: np.ndarray, bits: int) -> np.ndarray:
    """Each row rounded to a fixed-point grid of its own, as float64: 2^e is the power of two just
    above the row's largest magnitude (frexp; e = 0 for a row of zeros), and every value becomes
    a multiple of 2^(e − bits), i.e. m · 2^(e − bits) with an integer |m| ≤ 2^bits. The grid is
    the row's own, so a row's values never depend on the block it arrives in."""
    x = np.asarray(rows, dtype=np.float32).astype(np.float64)
    peak = np.abs(x).max(axis=1) if x.shape[1] else np.zeros(len(x))
    _, exponent = np.frexp(peak)
    step = np.ldexp(1.0, exponent - bits)[:, None]  # powers of two: scaling by them is exact
    x /= step
    np.rint(x, out=x)
    x *= step
    return x


def inner_products(queries: np.ndarray, gallery: np.ndarray) -> np.ndarray:
    """queries × gallery inner products as float32, the same bits on any CPU, in any block or
    batch shape. Each row is rounded to a fixed-point grid of its own with
    :func:`fixed_point_bits` bits (:func:`on_grid`: relative error ≤ 2^-(b+1) of its largest
    component), and the products are summed in float64. Every term of one score is an integer
    times the same power of two, 2^(e_q + e_g − 2b), and every partial sum is one too, below
    2^53 in magnitude: each addition is exact, so neither the BLAS kernel's order of additions
    nor its blocking, threads or FMA can change the sum, which is rounded once to float32. For
    unit vectors the score is within about 2^-b·√dim of the true one (measured in tests:
    ≤ 2e-7 at dim 1280, where a float32 GEMM is off by up to 5e-7, differently per CPU)."""
    q = np.asarray(queries, dtype=np.float32)
    g = np.asarray(gallery, dtype=np.float32)
    bits = fixed_point_bits(q.shape[1])
    return (on_grid(q, bits) @ on_grid(g, bits).T).astype(np.float32)


def topk_exact(queries: np.ndarray, gallery: np.ndarray, k: int, block: int = 65_536,
               max_scores: int = 1 << 25) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by inner product (cosine for normalised vectors), gallery scanned in blocks and
    queries in chunks, so at most ``max_scores`` scores (12 bytes each while a block is scored:
    the float64 sums and their float32 copy) are alive at once, for any number of queries (every
    image of a pool asks, for hard negatives). Returns (indices, scores), each queries × k, best
    first; ties broken by the lower gallery index. The scores are :func:`inner_products`, so the
    result is the same on any CPU and for any ``block`` or ``max_scores``."""
    rows = max(1, max_scores // max(1, min(block, len(gallery))))
    if len(queries) > rows:
        parts = [topk_exact(queries[at:at + rows], gallery, k, block, max_scores)
                 for at in range(0, len(queries), rows)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    return topk_exact_blocks(queries, (gallery[at:at + block] for at in range(0, len(gallery), block)), k)


def topk_exact_blocks(queries: np.ndarray, blocks: Iterable[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`topk_exact` over a gallery that arrives as blocks from an iterator (one pool shard's
    vectors at a time, read from the embedding cache): a gallery row's index is its position in
    the blocks put end to end. The running top-k is merged with each block, so queries × (k +
    block) scores and one block are alive, never the gallery. Higher score first, then the lower
    gallery index, whatever the block ends (fewer than k gallery rows: that many columns); where
    several rows tie at the k-th score, the lowest indices are kept. Scores are
    :func:`inner_products`: the same bits for any blocks, so the neighbours are too."""
    n_q = len(queries)
    best_idx = np.zeros((n_q, 0), np.int64)
    best_val = np.zeros((n_q, 0), np.float32)
    start = 0
    for block in blocks:
        scores = inner_products(queries, block)
        idx = np.broadcast_to(np.arange(start, start + scores.shape[1]), scores.shape)
        best_val, best_idx = _best_k(np.concatenate([best_val, scores], axis=1),
                                     np.concatenate([best_idx, idx], axis=1), k)
        start += scores.shape[1]
    order = np.lexsort((best_idx, -best_val), axis=1)
    return np.take_along_axis(best_idx, order, axis=1), np.take_along_axis(best_val, order, axis=1)


def _best_k(vals: np.ndarray, idx: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's k best candidates by (higher score, lower gallery index), unordered. argpartition
    keeps any of the candidates tied at the k-th score; a row where it dropped one is redone by a
    full sort, so which tied rows survive never depends on where blocks end."""
    if vals.shape[1] <= k:
        return vals, idx
    part = np.argpartition(-vals, k - 1, axis=1)[:, :k]
    kept_val, kept_idx = np.take_along_axis(vals, part, axis=1), np.take_along_axis(idx, part, axis=1)
    kth = kept_val.min(axis=1, keepdims=True)
    for r in np.flatnonzero((vals == kth).sum(axis=1) > (kept_val == kth).sum(axis=1)):
        order = np.lexsort((idx[r], -vals[r]))[:k]
        kept_val[r], kept_idx[r] = vals[r, order], idx[r, order]
    return kept_val, kept_idx


def topk_faiss(queries: np.ndarray, gallery: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k through a faiss flat inner-product index (the reference in benchmarks)."""
    import faiss

    index = faiss.IndexFlatIP(gallery.shape[1])
    index.add(np.ascontiguousarray(gallery, dtype=np.float32))
    scores, idx = index.search(np.ascontiguousarray(queries, dtype=np.float32), min(k, len(gallery)))
    return idx.astype(np.int64), scores.astype(np.float32)


def ivf_lists(n: int, params: AnnSpec) -> int:
    """Inverted lists of an IVF index over ``n`` vectors: ``params.nlist``, by default 4·√N; at most N."""
    return min(n, params.nlist or max(1, round(4 * float(np.sqrt(n)))))


def topk_ivf(queries: np.ndarray, gallery: np.ndarray, k: int, params: AnnSpec) -> tuple[np.ndarray, np.ndarray]:
    """Approximate top-k through a faiss IVF-Flat inner-product index: ``nlist`` lists (default
    4·√N) trained by k-means on a seeded sample of ``train_per_list`` vectors per list, ``nprobe``
    lists visited per query. Missing results (a query whose lists hold fewer than k) are -1."""
    import faiss

    x = np.ascontiguousarray(gallery, dtype=np.float32)
    nlist = ivf_lists(len(x), params)
    rng = np.random.default_rng(params.seed)
    n_train = min(len(x), nlist * params.train_per_list)
    train = x[np.sort(rng.choice(len(x), size=n_train, replace=False))]
    quantizer = faiss.IndexFlatIP(x.shape[1])
    index = faiss.IndexIVFFlat(quantizer, x.shape[1], nlist, faiss.METRIC_INNER_PRODUCT)
    index.cp.seed = params.seed
    index.train(train)
    index.add(x)
    index.nprobe = min(nlist, params.nprobe)
    scores, idx = index.search(np.ascontiguousarray(queries, dtype=np.float32), min(k, len(x)))
    return idx.astype(np.int64), scores.astype(np.float32)


def recall_at_k(found: np.ndarray, exact: np.ndarray) -> float:
    """Mean over queries of |found ∩ exact| / |exact| (each row a query's top-k ids; -1 = none)."""
    if exact.size == 0:
        return 1.0
    hits = [len(set(f[f >= 0].tolist()) & set(e[e >= 0].tolist())) / max(1, int((e >= 0).sum()))
            for f, e in zip(found, exact, strict=True)]
    return float(np.mean(hits))


@dataclass(frozen=True)
class TopK:
    """A top-k search's result and how it was done: ``method`` exact | ivf | exact-fallback, and
    the recall@k measured on ``checked`` sampled queries when the index was used."""

    indices: np.ndarray
    scores: np.ndarray
    method: str
    recall: float | None = None
    checked: int = 0


def uses_index(n_queries: int, n_gallery: int, index_above: int, ann: AnnSpec | None = None) -> bool:
    """Whether :func:`search` builds the IVF index: above ``index_above`` gallery items and for at least
    ``ann.min_queries`` queries (building it costs more than a few hundred exact queries)."""
    return n_gallery > index_above and n_queries >= (ann or AnnSpec()).min_queries


def search(queries: np.ndarray, gallery: np.ndarray, k: int, index_above: int,
           ann: AnnSpec | None = None) -> TopK:
    """Exact blocked top-k up to ``index_above`` gallery items or below ``ann.min_queries`` queries
    (building the index costs more than a few hundred exact queries); otherwise the IVF index, whose
    recall@k is measured on ``ann.check_queries`` seeded sampled queries against exact search.
    Below ``ann.min_recall`` the whole search is redone exactly (``exact-fallback``), so an index
    that does not fit the data costs time, never results."""
    params = ann or AnnSpec()
    if not uses_index(len(queries), len(gallery), index_above, params):
        idx, val = topk_exact(queries, gallery, k)
        return TopK(idx, val, "exact")
    idx, val = topk_ivf(queries, gallery, k, params)
    if params.check_queries <= 0 or len(queries) == 0:
        return TopK(idx, val, "ivf")
    rng = np.random.default_rng(params.seed)
    sample = np.sort(rng.choice(len(queries), size=min(len(queries), params.check_queries), replace=False))
    exact_idx, _ = topk_exact(queries[sample], gallery, k)
    recall = recall_at_k(idx[sample], exact_idx)
    if recall < params.min_recall:
        logger.warning("ANN recall@%d %.4f on %d queries is below %.4f: searching exactly instead (raise "
                       "nprobe or nlist)", k, recall, len(sample), params.min_recall)
        idx, val = topk_exact(queries, gallery, k)
        return TopK(idx, val, "exact-fallback", recall, len(sample))
    return TopK(idx, val, "ivf", recall, len(sample))


def topk(queries: np.ndarray, gallery: np.ndarray, k: int, index_above: int,
         ann: AnnSpec | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(indices, scores) of :func:`search`."""
    found = search(queries, gallery, k, index_above, ann)
    return found.indices, found.scores
