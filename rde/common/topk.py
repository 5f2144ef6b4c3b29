"""Top-K by inner product (cosine for normalised vectors): exact in gallery blocks, or through a
faiss index above a size threshold. Shared by MECF, hard negatives, evaluation and check sets."""

from __future__ import annotations

import numpy as np


def topk_exact(queries: np.ndarray, gallery: np.ndarray, k: int, block: int = 65_536) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by inner product (cosine for normalised vectors), gallery scanned in blocks so
    memory stays at (queries × block). Returns (indices, scores), each queries × k, best first;
    ties broken by the lower gallery index."""
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


def topk_faiss(queries: np.ndarray, gallery: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k through a faiss flat inner-product index (used above ``retrieval.index_above`` items)."""
    import faiss

    index = faiss.IndexFlatIP(gallery.shape[1])
    index.add(np.ascontiguousarray(gallery, dtype=np.float32))
    scores, idx = index.search(np.ascontiguousarray(queries, dtype=np.float32), min(k, len(gallery)))
    return idx.astype(np.int64), scores.astype(np.float32)


def topk(queries: np.ndarray, gallery: np.ndarray, k: int, index_above: int) -> tuple[np.ndarray, np.ndarray]:
    return topk_faiss(queries, gallery, k) if len(gallery) > index_above else topk_exact(queries, gallery, k)
