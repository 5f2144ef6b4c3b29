"""Metrics by hand, and the offline experts against random on the hand-labelled check set."""

from __future__ import annotations

import numpy as np
import pytest

from rde.common.metrics import average_precision_at_k, mean_ap_at_k
from rde.common.topk import topk_exact


def test_average_precision_at_k_hand_computed() -> None:
    # relevant at ranks 1 and 3, R = 2: (1/1 + 2/3) / min(10, 2)
    assert average_precision_at_k([True, False, True, False], 2, 10) == pytest.approx((1 + 2 / 3) / 2)
    # R = 5 > K = 2, both top-2 relevant: perfect at K, denominator min(K, R) = 2
    assert average_precision_at_k([True, True, False], 5, 2) == pytest.approx(1.0)
    # relevant beyond K does not count
    assert average_precision_at_k([False, False, True], 1, 2) == 0.0
    assert average_precision_at_k([False, True], 0, 10) is None  # no relevant item: no AP
    assert average_precision_at_k([True] * 10, 10, 10) == pytest.approx(1.0)  # all relevant
    assert average_precision_at_k([True] * 3, 3, 10) == pytest.approx(1.0)  # R < K, all found first
    assert mean_ap_at_k([[True], [False, True], []], [1, 1, 0], 10) == pytest.approx((1 + 0.5) / 2)


def test_ranking_breaks_ties_by_gallery_order() -> None:
    q = np.array([[1.0, 0.0]], np.float32)
    g = np.array([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]], np.float32)
    assert topk_exact(q, g, 3)[0].tolist() == [[1, 2, 0]]


def test_evaluate_rankings_hand_computed() -> None:
    from rde.common.evaluation import evaluate_rankings

    ranked = [["a", "x", "b"], ["y", "z", "c"], ["d"]]
    relevant = [{"a", "b"}, {"c"}, set()]  # the third query has no relevant image: left out
    m = evaluate_rankings(ranked, relevant)
    assert m["queries"] == 2
    assert m["mAP@10"] == pytest.approx(((1 + 2 / 3) / 2 + (1 / 3) / 1) / 2)
    assert m["R@1"] == pytest.approx(0.5) and m["R@5"] == pytest.approx(1.0)


def test_evaluate_expert_ranks_within_the_query_domain() -> None:
    from rde.common.evaluation import evaluate_expert

    q = np.array([[1, 0], [0, 1]], np.float32)
    g = np.array([[1, 0], [0.9, 0.1], [0, 1]], np.float32)
    res = evaluate_expert(q, ["pedestrian", "vehicle"], ["q1", "q2"], g, ["pedestrian", "vehicle", "vehicle"],
                          ["p1", "v1", "v2"], {"q1": {"p1"}, "q2": {"v1"}})
    assert res["pedestrian"]["mAP@10"] == 1.0
    assert res["vehicle"]["mAP@10"] == pytest.approx(0.5)  # v2 (cosine 1) outranks v1 (0.1)
    assert res["all"]["queries"] == 2 and res["all"]["R@1"] == pytest.approx(0.5)
