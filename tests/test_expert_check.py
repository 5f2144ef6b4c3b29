"""Metrics by hand, and the offline experts against random on the hand-labelled check set."""

from __future__ import annotations

import numpy as np
import pytest

from rde.metrics import average_precision_at_k, mean_ap_at_k, rank_by_similarity


def test_average_precision_at_k_hand_computed() -> None:
    # relevant at ranks 1 and 3, R = 2: (1/1 + 2/3) / min(10, 2)
    assert average_precision_at_k([True, False, True, False], 2, 10) == pytest.approx((1 + 2 / 3) / 2)
    # R = 5 > K = 2, both top-2 relevant: perfect at K, denominator min(K, R) = 2
    assert average_precision_at_k([True, True, False], 5, 2) == pytest.approx(1.0)
    # relevant beyond K does not count
    assert average_precision_at_k([False, False, True], 1, 2) == 0.0
    assert average_precision_at_k([False, True], 0, 10) is None  # no relevant item: no AP
    assert mean_ap_at_k([[True], [False, True], []], [1, 1, 0], 10) == pytest.approx((1 + 0.5) / 2)


def test_ranking_breaks_ties_by_gallery_order() -> None:
    q = np.array([[1.0, 0.0]], np.float32)
    g = np.array([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]], np.float32)
    assert rank_by_similarity(q, g, 3).tolist() == [[1, 2, 0]]


@pytest.mark.slow
def test_offline_experts_beat_random_by_a_wide_margin() -> None:
    from models.backends.registry import ModelRegistry
    from rde.expert_check import expert_map, load_check_set, random_map
    from rde.profiles import load_profile

    check = load_check_set()
    baseline = random_map(check, 10)
    registry = ModelRegistry(load_profile("demo").models)
    experts = load_profile("demo").models.experts
    scores = {spec.backend: expert_map(registry.expert(spec), check, 10) for spec in experts}
    assert baseline < 0.03
    for backend, score in scores.items():
        assert score > 5 * baseline, (backend, score, baseline)
