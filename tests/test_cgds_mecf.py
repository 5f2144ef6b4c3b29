"""CGDS sampling bounds and MECF union (Eq. 1) against hand-computed cases."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import numpy as np
from ranking import reference_scores, unambiguous_top

from rde.common.topk import inner_products, topk_exact, topk_exact_blocks, topk_faiss
from rde.secmm.cgds import (
    SamplingSpec,
    kmeans_clusters,
    kmeans_streaming,
    rebatched,
    reservoir_sample,
    sample_gallery,
    sample_per_cluster,
)
from rde.secmm.mecf import union_candidates


def test_sampling_respects_bounds_and_cluster_sizes() -> None:
    labels = np.array([0] * 50 + [1] * 3 + [2] * 20)
    picked = sample_per_cluster(labels, min_n=5, max_n=10, seed=1)
    counts = np.bincount(labels[picked], minlength=3)
    assert 5 <= counts[0] <= 10 and counts[1] == 3 and 5 <= counts[2] <= 10  # small cluster: all of it
    assert len(set(picked.tolist())) == len(picked)  # without replacement
    assert np.array_equal(picked, sample_per_cluster(labels, 5, 10, seed=1))  # seeded
    assert not np.array_equal(picked, sample_per_cluster(labels, 5, 10, seed=2))
    full = sample_per_cluster(labels, 100, 1000, seed=0)
    assert np.array_equal(full, np.arange(len(labels)))


def test_sample_gallery_accounts_for_every_image_per_domain() -> None:
    """Two domains, two tight groups each: every input is one sampling row; a drawn image whose
    target was not detected (one car group) is ``wrong_category`` and stays out of the gallery;
    the per-cluster draw is bounded by ``max_per_cluster`` (3 of the 5 in a group)."""
    rng = np.random.default_rng(0)
    groups = [rng.normal(c, 0.01, (5, 4)) for c in (0.0, 5.0, 10.0, 15.0)]
    rows = [{"image_id": f"{d}{g}{i}", "domain": d, "identity": None, "source": "x", "width": 1, "height": 1,
             "image_bytes": b"", "target_count": 0 if (d, g) == ("car", 1) else 1}
            for d, gs in (("person", (0, 1)), ("car", (0, 1))) for g in gs for i in range(5)]
    vectors = np.vstack(groups).astype(np.float32)
    drawn = sample_gallery(rows, vectors, SamplingSpec(clusters_per_domain=2, min_per_cluster=3, max_per_cluster=3))
    assert sorted(s["image_id"] for s in drawn.sampling) == sorted(r["image_id"] for r in rows)
    assert [(c["domain"], c["size"], c["sampled"]) for c in drawn.clusters] == \
        [("car", 5, 3), ("car", 5, 3), ("person", 5, 3), ("person", 5, 3)]
    reasons = Counter(s["reason"] for s in drawn.sampling)
    wrong = [s for s in drawn.sampling if s["reason"] == "wrong_category"]
    assert reasons["not_sampled"] == 8 and len(wrong) == 3 and len(drawn.gallery) == 9
    assert all(s["image_id"].startswith("car1") for s in wrong)  # the group whose target was not detected
    assert {g["image_id"] for g in drawn.gallery} == {s["image_id"] for s in drawn.sampling if s["sampled"]}


def test_kmeans_separates_obvious_groups_and_caps_k() -> None:
    rng = np.random.default_rng(0)
    a = rng.normal([5, 0], 0.1, (30, 2))
    b = rng.normal([0, 5], 0.1, (30, 2))
    result = kmeans_clusters(np.vstack([a, b]), k=2, seed=0)
    assert len(set(result.labels[:30])) == 1 and len(set(result.labels[30:])) == 1
    assert result.labels[0] != result.labels[30]
    assert len(set(kmeans_clusters(a[:3], k=10, seed=0).labels)) <= 3
    for backend in ("sklearn-minibatch", "faiss"):
        other = kmeans_clusters(np.vstack([a, b]).astype(np.float32), k=2, seed=0, backend=backend)
        assert len(set(other.labels[:30])) == 1 and other.labels[0] != other.labels[30], backend



def _planted(n: int, dim: int, k: int, noise: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n unit vectors around k random centres, and each one's centre (the true cluster)."""
    rng = np.random.default_rng(seed)
    truth = rng.integers(0, k, n)
    x = rng.normal(size=(k, dim))[truth] + noise * rng.normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32), truth


def test_streaming_kmeans_recovers_planted_clusters_deterministically() -> None:
    """6000 × 16, 8 planted clusters, read in cluster order (a pool in shard order: the hard case
    for running means) in blocks of 500: the streaming k-means finds the clusters (ARI ≥ 0.95), its
    inertia is that of its labels and within 3 % of in-memory KMeans', every pass reads the same
    blocks, and the result depends on the seed and the row order only, not on where blocks end."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import adjusted_rand_score

    x, truth = _planted(6000, 16, 8, 0.3)
    order = np.argsort(truth, kind="stable")
    x, truth = x[order], truth[order]
    calls: list[int] = []

    def blocks(size: int):
        def fresh():
            calls.append(size)
            return (x[at:at + size] for at in range(0, len(x), size))
        return fresh

    got = kmeans_streaming(blocks(500), k=8, seed=0, passes=5, batch_size=1024, init_per_cluster=64)
    assert got.labels.shape == (6000,) and got.centroids.shape == (8, 16)
    assert adjusted_rand_score(truth, got.labels) >= 0.95
    reference = KMeans(n_clusters=8, random_state=0, n_init=3).fit(x)
    assert got.inertia <= 1.03 * reference.inertia_, (got.inertia, reference.inertia_)
    own = float(((x - got.centroids[got.labels]) ** 2).sum())
    assert abs(got.inertia - own) <= 1e-3 * own
    assert 3 <= len(calls) <= 5 + 2  # sample, Lloyd passes (stops when no label changes), labels
    again = kmeans_streaming(blocks(700), k=8, seed=0, passes=5, batch_size=1024, init_per_cluster=64)
    assert np.array_equal(again.labels, got.labels) and np.array_equal(again.centroids, got.centroids)
    assert np.array_equal(kmeans_clusters(x, 8, seed=0, backend="streaming").labels,
                          kmeans_streaming(lambda: [x], 8, seed=0).labels)
    few = kmeans_streaming(lambda: [x[:5]], k=8, seed=0)  # K capped at the rows
    assert few.centroids.shape[0] == 5 and len(few.labels) == 5


def test_reservoir_sample_is_seeded_uniform_and_blind_to_block_ends() -> None:
    rows = np.arange(20_000, dtype=np.float32)[:, None]
    sample, seen = reservoir_sample(rebatched([rows[:7000], rows[7000:]], 1000), 500, np.random.default_rng(3))
    same, _ = reservoir_sample(rebatched([rows[:123], rows[123:9000], rows[9000:]], 1000), 500,
                               np.random.default_rng(3))
    other, _ = reservoir_sample(rebatched([rows], 1000), 500, np.random.default_rng(4))
    assert seen == 20_000 and np.array_equal(sample, same) and not np.array_equal(sample, other)
    assert len(np.unique(sample)) == 500
    quarters = np.bincount((sample[:, 0] // 5000).astype(int), minlength=4)
    assert all(90 <= q <= 160 for q in quarters), quarters  # 125 each expected (sd ≈ 10): not the first rows
    small, seen = reservoir_sample(rebatched([rows[:300]], 1000), 500, np.random.default_rng(0))
    assert seen == 300 and np.array_equal(small, rows[:300])
    assert [len(b) for b in rebatched([rows[:5], rows[5:12], rows[12:13]], 4)] == [4, 4, 4, 1]


def test_topk_exact_blocked_matches_full_sort_and_faiss() -> None:
    """The float64 order (this data has no near-ties among each row's 26 best: checked, so every
    CPU must agree), scores within 1e-5 of float64, and faiss's flat index the same ids."""
    rng = np.random.default_rng(3)
    q = rng.normal(size=(7, 16)).astype(np.float32)
    g = rng.normal(size=(1000, 16)).astype(np.float32)
    idx, val = topk_exact(q, g, 25, block=128)
    reference = reference_scores(q, g)
    full = unambiguous_top(reference, 25)
    assert np.array_equal(idx, full)
    assert np.allclose(val, np.take_along_axis(reference, full, axis=1), rtol=0, atol=1e-5)
    f_idx, _ = topk_faiss(q, g, 25)
    assert np.array_equal(f_idx, full)
    tie_idx, _ = topk_exact(np.ones((1, 2), np.float32), np.ones((4, 2), np.float32), 3, block=2)
    assert tie_idx.tolist() == [[0, 1, 2]]  # ties by gallery order


def test_topk_over_gallery_blocks_from_an_iterator_keeps_the_order_and_tie_break() -> None:
    """Gallery blocks from an iterator, cut anywhere, and ``topk_exact`` in memory with any block:
    the same top-k as a full sort by (higher score, lower gallery index) of the whole matrix's
    scores, also with many ties at the k-th score (integer scores), to the bit (the scores are
    the same for any product shape); fewer gallery rows than k gives that many."""
    rng = np.random.default_rng(5)
    for q, g in ((rng.integers(-1, 2, (9, 8)), rng.integers(-1, 2, (700, 8))),  # integer scores: ties
                 (rng.normal(size=(9, 8)), rng.normal(size=(700, 8)))):
        q, g = q.astype(np.float32), g.astype(np.float32)
        scores = inner_products(q, g)
        full = np.lexsort((np.broadcast_to(np.arange(700), scores.shape), -scores), axis=1)[:, :40]
        for cuts in ([700], [1, 64, 635], [333, 333, 34], [50] * 14):
            ends = np.cumsum([0, *cuts])
            idx, val = topk_exact_blocks(q, (g[a:b] for a, b in pairwise(ends)), 40)
            assert np.array_equal(idx, full), cuts
            assert np.array_equal(val, np.take_along_axis(scores, full, axis=1))
        for block in (128, 7, 700):
            assert np.array_equal(topk_exact(q, g, 40, block=block)[0], full), block
    few, _ = topk_exact_blocks(q, iter([g[:3], g[3:5]]), 40)
    assert few.shape == (9, 5)


def test_union_of_rankings_hand_computed() -> None:
    # expert A: query 0 → items [3, 1], query 1 → [2, 0]; expert B: query 0 → [1, 4], query 1 → [2, 5]
    per_expert = {
        "A": (np.array([[3, 1], [2, 0]]), np.array([[0.9, 0.8], [0.7, 0.6]])),
        "B": (np.array([[1, 4], [2, 5]]), np.array([[0.95, 0.5], [0.9, 0.4]])),
    }
    cands = union_candidates(per_expert)
    got = [(c.query, c.item, c.ranks) for c in cands]
    assert got == [
        (0, 1, {"A": 2, "B": 1}), (0, 3, {"A": 1}), (0, 4, {"B": 2}),
        (1, 2, {"A": 1, "B": 1}), (1, 0, {"A": 2}), (1, 5, {"B": 2}),
    ]
    assert cands[0].scores == {"A": 0.8, "B": 0.95} and cands[0].n_experts == 2
    # |C(q)| = |∪ top-K| ≤ M·K
    assert sum(c.query == 0 for c in cands) == 3
