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


def mean_ap_at_k(rankings: Sequence[Sequence[bool]], n_relevant: Sequence[int], k: int) -> float:
    """mAP@K over queries that have at least one relevant item."""
    aps = [average_precision_at_k(r, n, k) for r, n in zip(rankings, n_relevant, strict=True)]
    valid = [a for a in aps if a is not None]
    return float(np.mean(valid)) if valid else 0.0

