"""Hard-negative neighbour selection (GTR+ Eq. 1): never self or a duplicate, seeded, order-free."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from conftest import require_module
from ranking import reference_scores, unambiguous_top

from models.backends.interfaces import l2_normalize
from rde.common.topk import AnnSpec, uses_index
from rde.largefine.hard_negatives import (
    hard_negative_neighbours,
    hard_negative_neighbours_blocks,
    hard_negative_neighbours_streamed,
)


def _vectors(n: int, dim: int = 16, seed: int = 0) -> np.ndarray:
    return l2_normalize(np.random.default_rng(seed).normal(size=(n, dim)))


def test_never_self_nor_duplicate_and_k_respected() -> None:
    vecs = _vectors(30)
    vecs[5] = vecs[4]  # an exact duplicate (same content hash) of image 4
    ids = [f"img{i}" for i in range(30)]
    ids[5] = "img4"
    found = hard_negative_neighbours(vecs, ids, k=10, seed=1)
    for row, nb in zip(range(30), found, strict=True):
        assert ids[row] not in nb.neighbour_ids and len(nb.neighbour_ids) == 10
        assert len(set(nb.neighbour_ids)) == 10 and nb.hard_negative_id in nb.neighbour_ids
        assert nb.scores == sorted(nb.scores, reverse=True)


def test_neighbours_are_the_nearest_by_cosine() -> None:
    """The float64 cosine's order (no near-ties in this data, checked) and its values to 1e-6."""
    vecs = _vectors(12)
    found = hard_negative_neighbours(vecs, [str(i) for i in range(12)], k=3)
    sims = reference_scores(vecs, vecs)
    np.fill_diagonal(sims, -np.inf)
    best = unambiguous_top(sims, 3)
    for i, nb in enumerate(found):
        assert nb.neighbour_ids == [str(j) for j in best[i]]
        assert np.allclose(nb.scores, sims[i, best[i]], rtol=0, atol=1e-6)


def test_draw_is_deterministic_seeded_and_independent_of_order() -> None:
    vecs, ids = _vectors(40), [f"x{i}" for i in range(40)]
    a = {n.image_id: n.hard_negative_id for n in hard_negative_neighbours(vecs, ids, k=10, seed=7)}
    b = {n.image_id: n.hard_negative_id for n in hard_negative_neighbours(vecs, ids, k=10, seed=7)}
    perm = np.random.default_rng(3).permutation(40)
    c = {n.image_id: n.hard_negative_id for n in
         hard_negative_neighbours(vecs[perm], [ids[i] for i in perm], k=10, seed=7)}
    other = {n.image_id: n.hard_negative_id for n in hard_negative_neighbours(vecs, ids, k=10, seed=8)}
    assert a == b == c
    assert a != other  # another seed draws other negatives (40 draws from 10: equal by chance ~1e-40)
    picked_rank = [next(i for i, x in enumerate(n.neighbour_ids) if x == n.hard_negative_id)
                   for n in hard_negative_neighbours(vecs, ids, k=10, seed=7)]
    assert len(set(picked_rank)) > 3  # a random pick among the top-10, not always the nearest


def test_faiss_index_path_matches_exact_search() -> None:
    """The IVF index really built (check off, every list probed: an exhaustive index search) finds
    the exact search's neighbours and draws the same negatives (no near-ties here: checked, since
    faiss rounds its own way); above the threshold with too few queries, the search stays exact."""
    require_module("faiss")
    vecs, ids = _vectors(50, seed=2), [str(i) for i in range(50)]
    unambiguous_top(reference_scores(vecs, vecs), 7)
    exact = hard_negative_neighbours(vecs, ids, k=5, seed=0, index_above=10_000)
    ann = AnnSpec(nlist=4, nprobe=4, min_queries=1, check_queries=0)
    assert uses_index(50, 50, 10, ann) and not uses_index(50, 50, 10, AnnSpec())
    indexed = hard_negative_neighbours(vecs, ids, k=5, seed=0, index_above=10, ann=ann)
    assert [n.neighbour_ids for n in exact] == [n.neighbour_ids for n in indexed]
    assert [n.hard_negative_id for n in exact] == [n.hard_negative_id for n in indexed]
    assert np.allclose([n.scores for n in exact], [n.scores for n in indexed], rtol=0, atol=1e-5)
    few_probed = hard_negative_neighbours(vecs, ids, k=5, seed=0, index_above=10,
                                          ann=AnnSpec(nlist=8, nprobe=1, min_queries=1, check_queries=0))
    assert [n.neighbour_ids for n in few_probed] != [n.neighbour_ids for n in exact]  # the index path ran


def test_single_image_or_only_duplicates_has_no_hard_negative() -> None:
    [alone] = hard_negative_neighbours(_vectors(1), ["only"], k=10)
    assert alone.hard_negative_id is None and alone.neighbour_ids == []
    dup = hard_negative_neighbours(_vectors(1).repeat(3, axis=0), ["same"] * 3, k=10)
    assert all(n.hard_negative_id is None for n in dup)


def test_query_rows_restrict_to_one_shard() -> None:
    vecs, ids = _vectors(20), [str(i) for i in range(20)]
    full = hard_negative_neighbours(vecs, ids, k=4)
    part = hard_negative_neighbours(vecs, ids, k=4, query_rows=[3, 7])
    assert [p.neighbour_ids for p in part] == [full[3].neighbour_ids, full[7].neighbour_ids]
    with pytest.raises(ValueError, match="image ids"):
        hard_negative_neighbours(vecs, ids[:5])


def test_one_shard_against_a_gallery_in_blocks_finds_the_same_neighbours() -> None:
    """Queries = one output shard's vectors, the gallery streamed in blocks (as from the embedding
    cache one pool shard at a time, any block size): the same neighbours, scores and hard
    negatives as the search with the whole pool in memory, duplicates excluded the same way.
    Scores are compared exactly: the search's scores are the same bits for any product shape
    (``rde.common.topk.inner_products``), on any CPU."""
    vecs, ids = _vectors(60, seed=4), [f"p{i}" for i in range(60)]
    vecs[9], ids[9] = vecs[8], "p8"  # an exact duplicate
    full = hard_negative_neighbours(vecs, ids, k=6, seed=3)
    for shard in (range(0, 16), range(40, 60)):
        for block in (7, 16, 60):
            got = hard_negative_neighbours_blocks(vecs[list(shard)], [ids[i] for i in shard],
                                                  lambda block=block: (vecs[a:a + block] for a in range(0, 60, block)),
                                                  ids, k=6, seed=3)
            assert got == [full[i] for i in shard], (shard, block)
    assert hard_negative_neighbours_blocks(vecs[:0], [], lambda: iter([vecs]), ids) == []


class CountingVectors:
    """A counting fake of ``CachedVectors``: rows' vectors handed out on demand (``blocks``: ``block``
    rows at a time), recording how many each call gave, so a test sees the most held at once."""

    def __init__(self, vectors: np.ndarray, block: int) -> None:
        self.vectors, self.block = vectors, block
        self.handed: list[int] = []

    def take(self, positions: np.ndarray) -> np.ndarray:
        self.handed.append(len(positions))
        return self.vectors[np.asarray(positions)].copy()

    def blocks(self, positions: np.ndarray) -> Iterator[np.ndarray]:
        positions = np.asarray(positions)
        for at in range(0, len(positions), self.block):
            yield self.take(positions[at:at + self.block])


def test_streamed_search_equals_the_in_memory_one_holding_a_query_batch_and_a_block() -> None:
    """Every row's neighbours, scores and hard negative with the vectors read a query batch and a
    gallery block at a time equal the in-memory search's (duplicates excluded the same way), for
    any batch and block size, and no read hands out more than the larger of the two. Scores are
    compared exactly: they are the same bits for any product shape (a batch of one query is a
    matrix-vector product), on any CPU. Fails when the streamed search reads every vector at once."""
    vecs, ids = _vectors(90, seed=7), [f"q{i}" for i in range(90)]
    vecs[31], ids[31] = vecs[30], "q30"  # an exact duplicate
    full = hard_negative_neighbours(vecs, ids, k=6, seed=2)
    for batch, block in ((1, 90), (16, 7), (25, 25), (200, 16)):
        store = CountingVectors(vecs, block)
        got = hard_negative_neighbours_streamed(store.take, store.blocks, ids, k=6, seed=2, query_batch=batch)
        assert got == full, (batch, block)
        assert max(store.handed) <= max(batch, block), (batch, block, max(store.handed))
    assert hard_negative_neighbours_streamed(store.take, store.blocks, [], k=6) == []
    with pytest.raises(ValueError, match="query_batch"):
        hard_negative_neighbours_streamed(store.take, store.blocks, ids, query_batch=0)


def test_streamed_search_above_the_index_threshold_reads_all_vectors_for_the_ivf_index() -> None:
    """Above ``index_above`` (and with at least ``ann.min_queries`` rows) the IVF index needs every
    vector: one read of all of them, and the in-memory search's result; below ``min_queries`` the
    search is exact, so it streams."""
    vecs, ids = _vectors(300, dim=8, seed=5), [f"v{i}" for i in range(300)]
    ann = AnnSpec(min_queries=100, nlist=4, nprobe=4)
    store = CountingVectors(vecs, 50)
    got = hard_negative_neighbours_streamed(store.take, store.blocks, ids, k=5, index_above=200, ann=ann,
                                            query_batch=40)
    assert store.handed == [300] and got == hard_negative_neighbours(vecs, ids, k=5, index_above=200, ann=ann)
    store = CountingVectors(vecs, 50)
    exact = hard_negative_neighbours_streamed(store.take, store.blocks, ids, k=5, index_above=200,
                                              ann=AnnSpec(min_queries=1000), query_batch=40)
    assert max(store.handed) == 50 and exact == hard_negative_neighbours(vecs, ids, k=5)
