"""Top-K search: exact blocked search, the IVF index above a size, and its recall check."""

from __future__ import annotations

import numpy as np
import pytest

from rde.common.profiles import AnnSpec
from rde.common.topk import recall_at_k, search, topk_exact


def _clustered(n: int, d: int = 32, clusters: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A unit-norm gallery drawn from a Gaussian mixture and 200 queries near gallery items."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, d))
    x = centres[rng.integers(clusters, size=n)] + 0.35 * rng.normal(size=(n, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = x[rng.choice(n, 200, replace=False)] + 0.05 * rng.normal(size=(200, d))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    return q.astype(np.float32), x.astype(np.float32)


def test_recall_at_k_by_hand() -> None:
    found = np.array([[1, 2, 3], [4, 5, -1]])
    exact = np.array([[1, 2, 9], [4, 5, 6]])
    assert recall_at_k(found, exact) == pytest.approx((2 / 3 + 2 / 3) / 2)
    assert recall_at_k(exact, exact) == 1.0


def test_small_galleries_and_few_queries_are_searched_exactly() -> None:
    q, x = _clustered(500)
    found = search(q, x, 10, index_above=500, ann=AnnSpec(min_queries=1))
    assert found.method == "exact" and found.recall is None
    assert np.array_equal(found.indices, topk_exact(q, x, 10)[0])
    q, x = _clustered(4000)
    assert search(q, x, 10, index_above=1000, ann=AnnSpec(min_queries=201)).method == "exact"  # 200 queries
    assert search(q, x, 10, index_above=1000, ann=AnnSpec(min_queries=200)).method == "ivf"


def test_the_index_above_the_threshold_keeps_its_measured_recall() -> None:
    q, x = _clustered(4000)
    found = search(q, x, 10, index_above=1000, ann=AnnSpec(nprobe=16, check_queries=64, min_queries=100))
    assert found.method == "ivf" and found.checked == 64
    exact = topk_exact(q, x, 10)[0]
    assert found.recall >= 0.99 and recall_at_k(found.indices, exact) >= 0.99  # the sample speaks for all


def test_an_index_below_the_recall_floor_falls_back_to_exact_search() -> None:
    q, x = _clustered(4000)
    ann = AnnSpec(nlist=256, nprobe=1, check_queries=64, min_recall=0.999, min_queries=100)
    found = search(q, x, 10, index_above=1000, ann=ann)
    assert found.method == "exact-fallback" and found.recall < 0.999
    assert np.array_equal(found.indices, topk_exact(q, x, 10)[0])


def test_exact_search_chunks_queries_to_bound_memory_with_the_same_result() -> None:
    """Integer-valued vectors: every dot product is exact, so chunked and whole searches must agree
    to the bit (the OOM this guards: 20k queries × a 65k-row block is 5 GB of scores at once)."""
    rng = np.random.default_rng(1)
    x = rng.integers(-3, 4, size=(300, 8)).astype(np.float32)
    q = rng.integers(-3, 4, size=(97, 8)).astype(np.float32)
    whole = topk_exact(q, x, 7, block=64, max_scores=1 << 20)
    chunked = topk_exact(q, x, 7, block=64, max_scores=64 * 10)  # 10 queries at a time
    assert np.array_equal(whole[0], chunked[0]) and np.array_equal(whole[1], chunked[1])
    best = np.lexsort((np.arange(300), -(q[0] @ x.T)))[:7]  # by hand: highest score, then lower index
    assert np.array_equal(chunked[0][0], best)
