"""Retrieval metrics over ranked lists."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def average_precision_at_k(relevance: Sequence[bool], n_relevant: int, k: int) -> float | None:
    """AP@K for one query.

    AP@K = (1 / min(K, R)) · Σ_{i ≤ K} P@i · rel_i, where R is the number of relevant items in the
    whole gallery. Dividing by min(K, R) (not R) lets a perfect top-K score 1 when R > K, the
    usual choice for multi-match benchmarks. Queries with R = 0 have no AP (None) and are left
    out of the mean. Ties must be broken before calling (the ranking is taken as given).
    """
    if n_relevant <= 0:
        return None
    hits, total = 0, 0.0
    for i, rel in enumerate(list(relevance)[:k], start=1):
        if rel:
            hits += 1
            total += hits / i
    return total / min(k, n_relevant)


def ap_per_query(rankings: Sequence[Sequence[bool]], n_relevant: Sequence[int], k: int) -> list[float | None]:
    """AP@K of each query (None where it has no relevant item), for per-query statistics."""
    return [average_precision_at_k(r, n, k) for r, n in zip(rankings, n_relevant, strict=True)]


def mean_ap_at_k(rankings: Sequence[Sequence[bool]], n_relevant: Sequence[int], k: int) -> float:
    """mAP@K over queries that have at least one relevant item."""
    valid = [a for a in ap_per_query(rankings, n_relevant, k) if a is not None]
    return float(np.mean(valid)) if valid else 0.0


def bootstrap_interval(values: Sequence[float], level: float = 0.95, resamples: int = 10_000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean over queries: resample the queries with
    replacement ``resamples`` times, take the (1 − level)/2 and (1 + level)/2 quantiles of the
    resampled means. For a difference between two methods pass the per-query differences (a
    paired bootstrap: both methods see the same resampled queries). Quantiles use numpy's
    default (linear) interpolation. The resamples are drawn in chunks of about 2^22 indices, so
    memory stays flat in the number of queries; the chunks draw the same stream as one draw would."""
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        raise ValueError("bootstrap_interval needs at least one value")
    rng = np.random.default_rng(seed)
    step = max(1, (1 << 22) // data.size)
    means = np.concatenate([data[rng.integers(0, data.size, size=(min(step, resamples - start), data.size))]
                            .mean(axis=1) for start in range(0, resamples, step)])
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)



def person_search_metrics(similarity: np.ndarray, query_ids: Sequence[str], gallery_ids: Sequence[str],
                          ks: Sequence[int] = (1, 5, 10)) -> dict[str, float]:
    """CUHK-PEDES-style text→image metrics over the full gallery: a match is any gallery image of
    the query's identity. R@K (a match in the top K), mAP (AP over the whole ranking, divided by
    the number of matches), mINP (matches / rank of the last match: how deep one must go to find
    them all). Queries without any match are left out. Ties are broken by gallery order."""
    gallery = np.asarray(gallery_ids)
    order = np.argsort(-np.asarray(similarity), axis=1, kind="stable")
    recalls = {k: [] for k in ks}
    aps, inps = [], []
    for row, identity in zip(order, query_ids, strict=True):
        hits = gallery[row] == identity
        n = int(hits.sum())
        if n == 0:
            continue
        positions = np.flatnonzero(hits) + 1  # 1-based ranks of the matches
        for k in ks:
            recalls[k].append(float(positions[0] <= k))
        aps.append(float(np.mean(np.arange(1, n + 1) / positions)))
        inps.append(n / float(positions[-1]))
    out = {f"R@{k}": float(np.mean(v)) if v else 0.0 for k, v in recalls.items()}
    out.update({"mAP": float(np.mean(aps)) if aps else 0.0, "mINP": float(np.mean(inps)) if inps else 0.0,
                "queries": float(len(aps))})
    return out


def person_search_over_vectors(queries: np.ndarray, query_ids: Sequence[str], gallery: np.ndarray,
                               gallery_ids: Sequence[str], ks: Sequence[int] = (1, 5, 10),
                               chunk: int = 1024) -> dict[str, float]:
    """``person_search_metrics`` of the similarities ``queries @ gallery.T``, ``chunk`` queries at a
    time: memory is chunk × gallery, not queries × gallery. Each metric is a mean over the queries
    with a match, so the chunks' means are combined weighted by their such queries."""
    if not len(queries):
        return person_search_metrics(np.zeros((0, len(gallery_ids))), [], gallery_ids, ks)
    totals: dict[str, float] = {}
    counted = 0.0
    for start in range(0, len(queries), chunk):
        part = person_search_metrics(queries[start:start + chunk] @ gallery.T, query_ids[start:start + chunk],
                                     gallery_ids, ks)
        n = part.pop("queries")
        counted += n
        for name, value in part.items():
            totals[name] = totals.get(name, 0.0) + value * n
    return {name: value / counted if counted else 0.0 for name, value in totals.items()} | {"queries": counted}
