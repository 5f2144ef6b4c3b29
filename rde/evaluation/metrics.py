"""The metrics of one query from the ranks of its relevant items, and their means over queries with
percentile-bootstrap intervals (one model, or the paired difference of two).

A query's outcome is the sorted 1-based ranks of its relevant items that were ranked (``positions``,
from :func:`rde.evaluation.streamed_ranking.rank_blocks`) and R, the number of its relevant items in the
gallery, ranked or not. With p_1 < p_2 < … those ranks:

- ``mAP@K`` (K = 10, 20, 30): AP@K = (1 / min(K, R)) · Σ_{i ≤ K} P@i · rel_i, as
  :func:`rde.common.metrics.average_precision_at_k` (min(K, R), not R: a perfect top K scores 1
  even when R > K, the multi-match benchmarks' convention; trec_eval's ``map_cut`` divides by R).
- ``R@K`` (K = 1, 5, 10): success at K, 1 when p_1 ≤ K: the usual text-to-image recall.
- ``mINP``: R / p_R, the share of the list one must read to find every match; 0 when some
  relevant item was not ranked (the hardest match was never found).
- ``nDCG@10``: binary gains, DCG = Σ_{p_i ≤ 10} 1 / log2(p_i + 1) over the ideal DCG of
  min(R, 10) relevant items at the top.
- ``MRR``: 1 / p_1, 0 when no relevant item was ranked.

A query with R = 0 has no metrics (a ValueError): it is left out of every mean, not counted as 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from rde.common.metrics import average_precision_at_k, bootstrap_interval
from rde.evaluation.results import METRICS, Interval

AP_CUTOFFS = (10, 20, 30)
RECALL_CUTOFFS = (1, 5, 10)
NDCG_CUTOFF = 10


def query_metrics(positions: Sequence[int], n_relevant: int) -> dict[str, float]:
    """Every metric of ``METRICS`` for one query (definitions in the module docstring), from the
    1-based ranks of its ranked relevant items and its number of relevant items R ≥ 1."""
    ranks = _checked_ranks(positions, n_relevant)
    first = ranks[0] if ranks else None
    out = {f"mAP@{k}": _ap_at(ranks, n_relevant, k) for k in AP_CUTOFFS}
    out |= {f"R@{k}": float(first is not None and first <= k) for k in RECALL_CUTOFFS}
    out["mINP"] = n_relevant / ranks[-1] if len(ranks) == n_relevant else 0.0
    out["nDCG@10"] = _ndcg_at(ranks, n_relevant, NDCG_CUTOFF)
    out["MRR"] = 1.0 / first if first is not None else 0.0
    return {name: float(out[name]) for name in METRICS}


def _checked_ranks(positions: Sequence[int], n_relevant: int) -> list[int]:
    """The ranks sorted, after checking they are distinct, ≥ 1 and no more than R."""
    if n_relevant < 1:
        raise ValueError(f"a query needs at least one relevant item to be scored, got R = {n_relevant}")
    ranks = sorted(int(p) for p in positions)
    if len(ranks) > n_relevant:
        raise ValueError(f"{len(ranks)} ranked relevant items but R = {n_relevant}")
    if ranks and (ranks[0] < 1 or len(set(ranks)) != len(ranks)):
        raise ValueError(f"ranks must be distinct and 1-based, got {ranks}")
    return ranks


def _ap_at(ranks: Sequence[int], n_relevant: int, k: int) -> float:
    """AP@K by :func:`average_precision_at_k` over the top K as relevance flags."""
    flags = [False] * k
    for rank in ranks:
        if rank <= k:
            flags[rank - 1] = True
    ap = average_precision_at_k(flags, n_relevant, k)
    assert ap is not None  # R ≥ 1 was checked
    return ap


def _ndcg_at(ranks: Sequence[int], n_relevant: int, k: int) -> float:
    """nDCG@K with binary gains and the log2(rank + 1) discount."""
    dcg = sum(1.0 / math.log2(rank + 1) for rank in ranks if rank <= k)
    ideal = sum(1.0 / math.log2(rank + 1) for rank in range(1, min(n_relevant, k) + 1))
    return dcg / ideal


def summarize(per_query: Sequence[Mapping[str, float]], metrics: Sequence[str] = METRICS,
              level: float = 0.95, resamples: int = 10_000, seed: int = 0) -> dict[str, Interval]:
    """Each metric's mean over the queries with its percentile-bootstrap interval over queries
    (:func:`bootstrap_interval`). Every metric is given the same ``seed``, and so the same
    resampled query indices: the intervals of all metrics come from one set of resamples."""
    if not per_query:
        raise ValueError("no query was scored: there is nothing to summarize")
    return {name: _interval([q[name] for q in per_query], level, resamples, seed) for name in metrics}


def paired_difference(a: Mapping[str, Mapping[str, float]], b: Mapping[str, Mapping[str, float]],
                      metrics: Sequence[str] = METRICS, level: float = 0.95, resamples: int = 10_000,
                      seed: int = 0) -> dict[str, Interval]:
    """Model a minus model b per metric, over the queries both scored (query id → metrics): the
    mean per-query difference and its paired bootstrap interval, both models seeing the same
    resampled queries, which removes the spread of query difficulty they share. The queries are
    taken in sorted id order, so the interval does not depend on the mappings' order; every
    metric uses the same ``seed`` (the same resamples)."""
    shared = sorted(set(a) & set(b))
    if not shared:
        raise ValueError("the two models share no scored query: there is no paired difference")
    return {name: _interval([a[q][name] - b[q][name] for q in shared], level, resamples, seed)
            for name in metrics}


def _interval(values: Sequence[float], level: float, resamples: int, seed: int) -> Interval:
    """The mean of ``values`` with its bootstrap interval."""
    low, high = bootstrap_interval(values, level=level, resamples=resamples, seed=seed)
    return Interval(mean=float(np.mean(values)), low=low, high=high)
