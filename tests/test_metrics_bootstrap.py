"""The bootstrap interval over queries, against values worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from rde.common.metrics import ap_per_query, bootstrap_interval, mean_ap_at_k


def test_two_queries_scoring_0_and_1_give_the_interval_0_to_1() -> None:
    # resampled pairs: (0,0) p=1/4 → mean 0, (0,1)/(1,0) p=1/2 → 0.5, (1,1) p=1/4 → 1; the 2.5 % and
    # 97.5 % quantiles of that distribution are 0 and 1, its mean 0.5
    low, high = bootstrap_interval([0.0, 1.0], resamples=20_000, seed=1)
    assert (low, high) == (0.0, 1.0)


def test_three_queries_interval_matches_the_exact_resampling_distribution() -> None:
    # values 0, 0, 1: the resampled mean is k/3 with k ~ Binomial(3, 1/3): P(0) = 8/27 = 0.296,
    # P(1/3) = 12/27, P(2/3) = 6/27, P(1) = 1/27 = 0.037. The 2.5 % quantile is 0 (P(0) > 2.5 %);
    # the 97.5 % quantile is 2/3 (P(≤ 2/3) = 26/27 = 0.963 < 0.975 → it lies in the top atom, 1,
    # only above 0.963; linear interpolation between sorted samples lands on 1 there)
    low, high = bootstrap_interval([0.0, 0.0, 1.0], resamples=50_000, seed=2)
    assert low == 0.0 and high == pytest.approx(1.0)
    # at 90 % the upper quantile (0.95) is inside the 2/3 atom: P(≤ 1/3) = 20/27 = 0.74 < 0.95 ≤ 0.963
    low, high = bootstrap_interval([0.0, 0.0, 1.0], level=0.90, resamples=50_000, seed=2)
    assert low == 0.0 and high == pytest.approx(2 / 3)


def test_constant_values_have_a_point_interval_and_more_queries_narrow_it() -> None:
    assert bootstrap_interval([0.4] * 7) == pytest.approx((0.4, 0.4))
    rng = np.random.default_rng(0)
    few, many = rng.random(8), rng.random(64)
    width = [h - lo for lo, h in (bootstrap_interval(few), bootstrap_interval(many))]
    assert width[1] < width[0]
    with pytest.raises(ValueError, match="at least one value"):
        bootstrap_interval([])


def test_ap_per_query_averages_to_the_map() -> None:
    rankings = [[True, False, True], [False, False, False], [False, True, False]]
    counts = [2, 0, 1]
    aps = ap_per_query(rankings, counts, 3)
    assert aps[1] is None and aps[0] == pytest.approx((1 + 2 / 3) / 2) and aps[2] == pytest.approx(0.5)
    assert mean_ap_at_k(rankings, counts, 3) == pytest.approx(np.mean([aps[0], aps[2]]))
