"""The ranking and metric core of ``rde evaluate``: hand-computed rankings, the counting ranker
against a full stable argsort, and every metric against trec_eval (pytrec_eval), an independent
implementation, on random rankings."""

from __future__ import annotations

import math

import numpy as np
import pytest
from whole_matrix_ranking import rank_scores

from rde.common.metrics import bootstrap_interval
from rde.evaluation.metrics import paired_difference, query_metrics, summarize
from rde.evaluation.results import METRICS, Interval

NEG = -np.inf
log2 = math.log2


def _ranked(scores: list[float], relevant: list[int], top_n: int = 5) -> tuple[list[int], list[int], list[float]]:
    """One query through ``rank_scores``: its positions, top columns and top scores as lists."""
    chunk = rank_scores(np.array([scores], dtype=np.float32), [np.array(relevant)], top_n=top_n)
    return chunk.positions[0].tolist(), chunk.top_idx[0].tolist(), chunk.top_scores[0].tolist()


def test_ties_are_broken_by_gallery_order_and_every_metric_matches_the_hand_computation() -> None:
    # cols:      0    1    2    3    4    5    6    7      relevant: 2, 4, 7 (R = 3)
    scores = [0.9, 0.5, 0.9, 0.2, 0.5, 0.1, 0.7, 0.5]
    # stable order: 0.9 → cols 0, 2 (ranks 1, 2); 0.7 → col 6 (3); 0.5 → cols 1, 4, 7 (4, 5, 6);
    # 0.2 → col 3 (7); 0.1 → col 5 (8). Relevant ranks: col 2 → 2, col 4 → 5, col 7 → 6
    positions, top, top_scores = _ranked(scores, [7, 2, 4])
    assert positions == [2, 5, 6]
    # the top 5 cuts through the 0.5 tie: cols 1 and 4 come before col 7
    assert top == [0, 2, 6, 1, 4]
    assert top_scores == pytest.approx([0.9, 0.9, 0.7, 0.5, 0.5])
    m = query_metrics(positions, 3)
    assert tuple(m) == METRICS
    # AP@K: P@2 = 1/2, P@5 = 2/5, P@6 = 3/6: (0.5 + 0.4 + 0.5) / min(K, 3) = 1.4 / 3 = 0.4667 for every K
    for k in (10, 20, 30):
        assert m[f"mAP@{k}"] == pytest.approx(1.4 / 3)
    # first hit at rank 2: R@1 = 0, R@5 = R@10 = 1; MRR = 1/2
    assert (m["R@1"], m["R@5"], m["R@10"], m["MRR"]) == (0.0, 1.0, 1.0, 0.5)
    # mINP = R / last rank = 3 / 6
    assert m["mINP"] == pytest.approx(0.5)
    # DCG = 1/log2(3) + 1/log2(6) + 1/log2(7) = 0.6309 + 0.3869 + 0.3562 = 1.3740;
    # ideal: 1/log2(2) + 1/log2(3) + 1/log2(4) = 1 + 0.6309 + 0.5 = 2.1309; nDCG = 0.6448
    assert m["nDCG@10"] == pytest.approx((1 / log2(3) + 1 / log2(6) + 1 / log2(7)) / (1 + 1 / log2(3) + 0.5))
    assert m["nDCG@10"] == pytest.approx(0.64478, abs=1e-5)


def test_an_unranked_relevant_item_is_absent_and_zeroes_minp() -> None:
    # cols:      0     1    2    3     4    5      relevant: 3, 4 (R = 2); col 4 is unranked (-inf)
    scores = [0.3, NEG, 0.8, 0.6, NEG, 0.1]
    # order: col 2 (1), col 3 (2), col 0 (3), col 5 (4); cols 1 and 4 are not ranked
    positions, top, top_scores = _ranked(scores, [3, 4])
    assert positions == [2]
    assert top == [2, 3, 0, 5]  # 5 asked for, only 4 ranked
    assert top_scores == pytest.approx([0.8, 0.6, 0.3, 0.1])
    m = query_metrics(positions, 2)
    # AP@K: P@2 = 1/2, divided by min(K, 2) = 2: 0.25
    for k in (10, 20, 30):
        assert m[f"mAP@{k}"] == pytest.approx(0.25)
    assert (m["R@1"], m["R@5"], m["R@10"], m["MRR"]) == (0.0, 1.0, 1.0, 0.5)
    # one of the two relevant items was never ranked: the hardest match was not found
    assert m["mINP"] == 0.0
    # DCG = 1/log2(3) = 0.6309; ideal over min(2, 10) = 2 items: 1 + 0.6309; nDCG = 0.3869
    assert m["nDCG@10"] == pytest.approx((1 / log2(3)) / (1 + 1 / log2(3)))
    # nothing ranked at all: every metric 0
    assert set(query_metrics([], 4).values()) == {0.0}


def test_more_relevant_items_than_k_divide_ap_by_k() -> None:
    # 30 items scored 1 - c/30 (col c at rank c + 1); relevant cols 0..8, 10, 11, 12 → ranks 1..9,
    # 11, 12, 13 (R = 12 > K = 10)
    scores = [1 - c / 30 for c in range(30)]
    positions, _, _ = _ranked(scores, [*range(9), 10, 11, 12])
    assert positions == [*range(1, 10), 11, 12, 13]
    m = query_metrics(positions, 12)
    # AP@10: P@1..P@9 = 1 (sum 9), rank 10 misses: 9 / min(10, 12) = 0.9 (trec_eval's 9 / R = 0.75)
    assert m["mAP@10"] == pytest.approx(0.9)
    # AP@20 = AP@30: (9 + 10/11 + 11/12 + 12/13) / min(K, 12) = (9 + 0.9091 + 0.9167 + 0.9231) / 12 = 0.97907
    assert m["mAP@20"] == m["mAP@30"] == pytest.approx((9 + 10 / 11 + 11 / 12 + 12 / 13) / 12)
    assert (m["R@1"], m["R@5"], m["R@10"], m["MRR"]) == (1.0, 1.0, 1.0, 1.0)
    assert m["mINP"] == pytest.approx(12 / 13)  # the last of the 12 at rank 13
    # DCG = Σ_{p=1..9} 1/log2(p+1) = 4.2545; ideal over min(12, 10) = 10 items adds 1/log2(11) = 0.2891:
    # 4.5436; nDCG = 0.93638
    ideal = sum(1 / log2(p + 1) for p in range(1, 11))
    assert m["nDCG@10"] == pytest.approx((ideal - 1 / log2(11)) / ideal)
    assert m["nDCG@10"] == pytest.approx(0.93638, abs=1e-5)


def test_a_query_without_relevant_items_or_with_impossible_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one relevant"):
        query_metrics([], 0)
    with pytest.raises(ValueError):
        query_metrics([1, 2, 3], 2)
    with pytest.raises(ValueError):
        rank_scores(np.array([[0.1, np.nan]]), [np.array([0])])


def _brute_force(row: np.ndarray, relevant: np.ndarray, top_n: int) -> tuple[list[int], list[int]]:
    """Positions and top columns from a full stable argsort of the row."""
    order = np.argsort(-row, kind="stable")
    rank = np.empty(row.size, dtype=np.int64)
    rank[order] = np.arange(1, row.size + 1)
    ranked = [int(rank[c]) for c in set(relevant.tolist()) if row[c] != NEG]
    return sorted(ranked), [int(c) for c in order[:top_n] if row[c] != NEG]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("top_n", [0, 1, 7, 100, 400])
def test_rank_scores_equals_a_full_stable_argsort_with_ties_and_unranked_items(dtype: type, top_n: int) -> None:
    rng = np.random.default_rng(7)
    n_queries, n_items = 60, 300
    scores = (rng.integers(0, 25, size=(n_queries, n_items)) / 4).astype(dtype)  # many ties
    scores[rng.random(scores.shape) < 0.1] = NEG
    scores[0] = 1.0  # one row all tied
    scores[1] = NEG  # one row ranking nothing
    scores[2, :150] = NEG  # half a row unranked
    relevant = [rng.choice(n_items, size=rng.integers(0, 40), replace=rng.random() < 0.3) for _ in range(n_queries)]
    chunk = rank_scores(scores, relevant, top_n=top_n)
    for i in range(n_queries):
        positions, top = _brute_force(scores[i], relevant[i], top_n)
        assert chunk.positions[i].tolist() == positions, i
        assert chunk.top_idx[i].tolist() == top, i
        assert np.array_equal(chunk.top_scores[i], scores[i, top])


def test_summaries_and_paired_differences() -> None:
    values = np.random.default_rng(3).random(10)
    per_query = {f"q{i}": dict.fromkeys(METRICS, float(v)) for i, v in enumerate(values)}
    summary = summarize(list(per_query.values()), resamples=2_000)
    assert set(summary) == set(METRICS)
    low, high = bootstrap_interval(values, resamples=2_000, seed=0)
    assert summary["MRR"] == Interval(pytest.approx(values.mean()), low, high) and low < values.mean() < high
    # the same resamples for every metric: equal values give equal intervals
    assert len(set(summary.values())) == 1
    # b lacks q0 and has an extra query; a − b over the 9 shared queries is 0.25 everywhere
    other = {q: {k: v - 0.25 for k, v in m.items()} for q, m in per_query.items() if q != "q0"}
    other["extra"] = dict.fromkeys(METRICS, 9.0)
    diff = paired_difference(per_query, other, metrics=("mAP@20",), resamples=500)
    assert diff == {"mAP@20": Interval(0.25, 0.25, 0.25)}
    with pytest.raises(ValueError, match="share no"):
        paired_difference({"a": per_query["q0"]}, {"b": per_query["q1"]})


def _minp_by_hand(row: np.ndarray, relevant: np.ndarray) -> float:
    """R / rank of the last relevant item in a full argsort; 0 when one was not ranked."""
    order = np.argsort(-row, kind="stable")
    hits = np.flatnonzero(np.isin(order, relevant) & (row[order] != NEG)) + 1
    return len(relevant) / hits[-1] if len(hits) == len(relevant) else 0.0


def test_every_metric_agrees_with_trec_eval_on_random_rankings() -> None:
    import pytrec_eval  # a dev dependency: a missing one fails the test rather than skipping it

    rng = np.random.default_rng(11)
    n_queries, n_items = 300, 500
    scores = rng.random((n_queries, n_items))  # float64: tie-free, as trec_eval breaks ties by doc id
    relevant = [rng.choice(n_items, size=rng.integers(1, 61), replace=False) for _ in range(n_queries)]
    for row, rel in zip(scores, relevant, strict=True):  # from a useless to a near-perfect retriever
        row[rel] += rng.uniform(0, 1) * rng.random(len(rel))
    scores[rng.random(scores.shape) < 0.01] = NEG  # unranked: left out of trec_eval's run
    assert all(len(np.unique(row[row != NEG])) == np.count_nonzero(row != NEG) for row in scores)
    assert max(len(r) for r in relevant) > 30  # R > K for every AP@K
    assert any((s[r] == NEG).any() for s, r in zip(scores, relevant, strict=True))  # some relevant unranked
    qrels = {f"q{i}": {f"d{c}": 1 for c in rel} for i, rel in enumerate(relevant)}
    run = {f"q{i}": {f"d{c}": float(s) for c, s in enumerate(row) if s != NEG} for i, row in enumerate(scores)}
    trec = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank", "ndcg_cut", "success", "map_cut"}).evaluate(run)
    ours = rank_scores(scores, relevant)
    worst = 0.0
    for i, rel in enumerate(relevant):
        m, t, r = query_metrics(ours.positions[i], len(rel)), trec[f"q{i}"], len(rel)
        pairs = [(m["MRR"], t["recip_rank"]), (m["nDCG@10"], t["ndcg_cut_10"]),
                 (m["mINP"], _minp_by_hand(scores[i], rel))]
        pairs += [(m[f"R@{k}"], t[f"success_{k}"]) for k in (1, 5, 10)]
        # trec_eval's map_cut divides by R, ours by min(K, R): rescale ours by min(K, R) / R
        pairs += [(m[f"mAP@{k}"] * min(k, r) / r, t[f"map_cut_{k}"]) for k in (10, 20, 30)]
        worst = max(worst, *(abs(a - b) for a, b in pairs))
    assert worst < 1e-6
