"""Top-K search: exact blocked search, the IVF index above a size, and its recall check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rde.common.topk import AnnSpec, fixed_point_bits, inner_products, recall_at_k, search, topk_exact


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


def _unit(n: int, d: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def test_inner_products_are_the_same_bits_for_any_block_and_batch_shape() -> None:
    """Scores of a query against a gallery row do not depend on which other rows share the
    product: a batch of one query (a matrix-vector product), odd query and gallery blocks, and
    the whole matrix give the same float32 bits (a float32 GEMM does not: on this machine's
    Haswell kernel, 7-row blocks of 300 × 1280 unit vectors round other bits than the whole)."""
    x = _unit(300, 1280, seed=2)
    whole = inner_products(x, x)
    rows = np.concatenate([inner_products(x[at:at + 7], x) for at in range(0, 300, 7)])
    one = np.stack([inner_products(x[i:i + 1], x)[0] for i in (0, 151, 299)])
    cols = np.concatenate([inner_products(x, x[at:at + 13]) for at in range(0, 300, 13)], axis=1)
    assert whole.dtype == np.float32
    assert np.array_equal(whole, rows) and np.array_equal(whole[[0, 151, 299]], one) and np.array_equal(whole, cols)


def test_inner_products_by_hand_and_within_their_stated_error() -> None:
    """Values on the grid are exact; a component below the row's grid step (2^-26 against a peak
    of 1 at dim 2: step 2^-25) rounds to the nearest multiple (half to even: 0). Unit vectors:
    within 2^-b·√dim/2 of the float64 product (stated bound), measured ≤ 2e-7 at dims 8-1280."""
    q = np.array([[0.5, 0.25], [2.0 ** -26, 1.0]], np.float32)
    g = np.array([[0.75, -0.125], [1.0, 0.0]], np.float32)
    assert inner_products(q, g).tolist() == [[0.34375, 0.5], [-0.125, 0.0]]  # true last: 2^-26
    assert [fixed_point_bits(d) for d in (1, 2, 384, 1280, 4096)] == [26, 26, 22, 21, 20]
    for dim in (8, 384, 1280):
        x = _unit(200, dim, seed=dim)
        err = np.abs(inner_products(x, x) - x.astype(np.float64) @ x.astype(np.float64).T).max()
        assert err <= min(2e-7, 2.0 ** -fixed_point_bits(dim) * np.sqrt(dim) / 2 + 6e-8), (dim, err)


_KERNEL_NEEDS = {"Prescott": "sse3", "Nehalem": "sse4_2", "Sandybridge": "avx", "Haswell": "avx2",
                 "SkylakeX": "avx512f"}
_SCORES_DIGEST = """
import hashlib, json, numpy as np, threadpoolctl
from rde.common.topk import inner_products
x = np.random.default_rng(0).normal(size=(257, 384)).astype(np.float32)
blas = [i["architecture"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
print(json.dumps([blas, hashlib.sha256(inner_products(x[:33], x).tobytes()).hexdigest(),
                  hashlib.sha256((x[:33] @ x.T).tobytes()).hexdigest()]))
"""


def test_inner_products_are_the_same_bits_under_every_blas_kernel_this_cpu_can_run() -> None:
    """numpy's OpenBLAS picks its GEMM kernel by CPU (OPENBLAS_CORETYPE forces one): each kernel
    this CPU can run, in its own process, gives the same score bits, where the plain float32
    GEMM's differ between kernels (checked below, so the test shows it compares something)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    kernels = [k for k, need in _KERNEL_NEEDS.items() if need in flags]
    if len(kernels) < 2:
        pytest.skip(f"this CPU runs fewer than two OpenBLAS kernels ({kernels})")
    seen = {}
    for kernel in kernels:
        env = {**os.environ, "OPENBLAS_CORETYPE": kernel}
        out = subprocess.run([sys.executable, "-c", _SCORES_DIGEST], env=env, capture_output=True, text=True,
                             check=True, timeout=120).stdout
        blas, exact, plain = json.loads(out)
        seen[kernel] = (tuple(blas), exact, plain)
    assert len({s[0] for s in seen.values()}) >= 2, seen  # the override really switched kernels
    assert len({s[1] for s in seen.values()}) == 1, seen
    assert len({s[2] for s in seen.values()}) >= 2, seen  # float32 GEMM bits do differ by kernel
