"""Top-K by inner product (cosine for normalised vectors): exact in gallery blocks, or through a
faiss IVF index above a size threshold, its recall measured on a sample of queries against exact
search on every call. Shared by MECF, hard negatives, evaluation and check sets."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from rde.common.profiles import AnnSpec

logger = logging.getLogger(__name__)


def topk_exact(queries: np.ndarray, gallery: np.ndarray, k: int, block: int = 65_536,
               max_scores: int = 1 << 26) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by inner product (cosine for normalised vectors), gallery scanned in blocks and
    queries in chunks, so at most ``max_scores`` scores (256 MB of float32) are alive at once, for
    any number of queries (every image of a pool asks, for hard negatives). Returns (indices,
    scores), each queries × k, best first; ties broken by the lower gallery index."""
    rows = max(1, max_scores // max(1, min(block, len(gallery))))
    if len(queries) > rows:
        parts = [topk_exact(queries[at:at + rows], gallery, k, block, max_scores)
                 for at in range(0, len(queries), rows)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    k = min(k, len(gallery))
    n_q = len(queries)
    best_idx = np.zeros((n_q, 0), np.int64)
    best_val = np.zeros((n_q, 0), np.float32)
    for start in range(0, len(gallery), block):
        scores = queries @ gallery[start : start + block].T
        idx = np.broadcast_to(np.arange(start, start + scores.shape[1]), scores.shape)
        cand_val = np.concatenate([best_val, scores.astype(np.float32)], axis=1)
        cand_idx = np.concatenate([best_idx, idx], axis=1)
        if cand_val.shape[1] > k:
            part = np.argpartition(-cand_val, k - 1, axis=1)[:, :k]
            cand_val = np.take_along_axis(cand_val, part, axis=1)
            cand_idx = np.take_along_axis(cand_idx, part, axis=1)
        best_val, best_idx = cand_val, cand_idx
    order = np.lexsort((best_idx, -best_val), axis=1)
    return np.take_along_axis(best_idx, order, axis=1), np.take_along_axis(best_val, order, axis=1)


def topk_exact_blocks(queries: np.ndarray, blocks: Iterable[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`topk_exact` over a gallery that arrives as blocks from an iterator (one pool shard's
    vectors at a time, read from the embedding cache): a gallery row's index is its position in
    the blocks put end to end. The running top-k is merged with each block, so queries × (k +
    block) scores and one block are alive, never the gallery. Same order as :func:`topk_exact`:
    higher score first, then the lower gallery index, whatever the block ends (fewer than k
    gallery rows: that many columns). Where several rows tie at the k-th score, the lowest
    indices are kept; :func:`topk_exact` (left as it was, so MECF's and the hard negatives'
    results do not move) keeps whichever of them argpartition leaves, so the two can differ
    only on such a tie (duplicate vectors)."""
    n_q = len(queries)
    best_idx = np.zeros((n_q, 0), np.int64)
    best_val = np.zeros((n_q, 0), np.float32)
    start = 0
    for block in blocks:
        scores = (queries @ np.asarray(block).T).astype(np.float32)
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
