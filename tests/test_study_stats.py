"""apmpo.study.stats: intervals and seed planning against hand-computed cases and a simulation of many studies."""
import math

import numpy as np
import pytest

from apmpo.study import stats


def test_paired_t_by_hand():
    # d = 1..6: mean 3.5, sd sqrt(17.5 / 5) = 1.87083; t(0.975, 5) = 2.57058 (tables);
    # half-width 2.57058 * 1.87083 / sqrt(6) = 1.96331
    i = stats.paired_t([1, 2, 3, 4, 5, 6])
    assert i.n == 6 and i.mean == 3.5
    assert i.sd == pytest.approx(1.87083, abs=1e-5)
    assert i.halfwidth == pytest.approx(1.96331, abs=1e-5)
    assert (i.low, i.high) == pytest.approx((3.5 - 1.96331, 3.5 + 1.96331), abs=1e-5)
    with pytest.raises(ValueError, match="at least 2"):
        stats.paired_t([1.0])


def test_paired_t_on_the_first_study_is_wider_than_its_bootstrap():
    # The committed six APMPO - GRPO pairs (last policy, pass@1 points). mean 2.07, sd 9.30:
    # 2.07 +- 2.57058 * 9.30 / sqrt(6) = +-9.76; the report's percentile bootstrap gave [-5.5, +10.1].
    d = [-5.01, -1.30, 17.90, -0.78, -6.64, 8.20]
    i = stats.paired_t(d)
    assert (round(i.low, 1), round(i.high, 1)) == (-7.7, 11.8)


def test_seeds_needed_by_hand():
    # sd 9, +-2: t(0.975, 80) = 1.99006 -> 1.99006 * 9 / 9 = 1.9901 <= 2 at n = 81;
    # at n = 80, t(0.975, 79) = 1.99045 -> 1.99045 * 9 / 8.94427 = 2.0029 > 2.
    assert stats.seeds_needed(9, 2) == 81
    # sd 3, +-2: n = 11 gives 2.22814 * 3 / 3.31662 = 2.0154 > 2; n = 12 gives 2.20099 * 3 / 3.46410 = 1.9061.
    assert stats.seeds_needed(3, 2) == 12
    assert stats.seeds_needed(0, 2) == 2
    with pytest.raises(ValueError, match="half-width"):
        stats.seeds_needed(3, 0)


def test_improvement_by_hand():
    # wins 1, losses 1, a tie (half), and another win: 2.5 of 4
    assert stats.improvement([1, -1, 0, 2]).p == 0.625
    # 6 of 6: Clopper-Pearson's lower bound is (0.025) ** (1 / 6) = 0.54074, the upper bound 1
    i = stats.improvement([1, 2, 3, 4, 5, 6])
    assert (i.p, i.high) == (1.0, 1.0) and i.low == pytest.approx(0.025 ** (1 / 6), abs=1e-9)
    # 0 of 6 mirrors it
    i = stats.improvement([-1] * 6)
    assert (i.p, i.low) == (0.0, 0.0) and i.high == pytest.approx(1 - 0.025 ** (1 / 6), abs=1e-9)


def test_sd_bound_by_hand():
    # 6 pairs, sd 9: chi-square(0.2, 5) = 2.34253 -> 9 * sqrt(5 / 2.34253) = 13.149
    assert stats.sd_bound(9, 6) == pytest.approx(13.149, abs=1e-3)


def test_plan_reads_the_pilot():
    p = stats.plan([-5.01, -1.30, 17.90, -0.78, -6.64, 8.20], 2.0, seconds_per_pair=1800)
    assert p.seeds == stats.seeds_needed(p.pilot.sd, 2.0) and p.seeds_at_bound > p.seeds
    assert p.hours(p.seeds) == pytest.approx(p.seeds / 2)


@pytest.mark.parametrize("draw", ["normal", "skewed"])
def test_planned_seeds_give_the_half_width_and_cover(draw):
    """1,000 simulated studies of pairs with a known spread: the planned number of seeds gives intervals whose
    half-width is within 10% of the target on average, and that cover the true difference about 95% of the time."""
    rng = np.random.default_rng(0)
    sd, delta, target = 6.0, 1.5, 2.0
    n = stats.seeds_needed(sd, target)
    if draw == "normal":
        d = rng.normal(delta, sd, size=(1000, n))
    else:  # a right-skewed difference with the same mean and sd: exponential, shifted
        d = delta + sd * (rng.exponential(1.0, size=(1000, n)) - 1.0)
    intervals = [stats.paired_t(row) for row in d]
    half = np.mean([i.halfwidth for i in intervals])
    covered = np.mean([i.low <= delta <= i.high for i in intervals])
    assert abs(half - target) / target < 0.10, half
    assert 0.93 <= covered <= 0.97, covered
    assert n == 38  # 2.02619 * 6 / sqrt(38) = 1.9722; at 37, 2.02809 * 6 / sqrt(37) = 2.0005


@pytest.mark.parametrize("df, q", [(1, 12.7062), (2, 4.3027), (5, 2.5706), (10, 2.2281), (30, 2.0423),
                                   (100, 1.9840)])
def test_t_quantiles_match_the_tables(df, q):
    assert stats.t_quantile(0.95, df) == pytest.approx(q, abs=1e-4)


@pytest.mark.parametrize("n, q", [(2, 0.064185), (6, 2.342534), (21, 14.578439)])
def test_chi_square_quantiles_match_the_tables(n, q):
    # sd_bound inverts chi-square(0.2, n - 1): sd * sqrt((n - 1) / q)
    assert stats.sd_bound(1.0, n) == pytest.approx(math.sqrt((n - 1) / q), rel=1e-4)


def test_clopper_pearson_matches_the_tables():
    # 3 of 10: the exact 95% interval is [0.0667, 0.6525]
    i = stats.improvement([1, 1, 1] + [-1] * 7)
    assert (i.low, i.high) == pytest.approx((0.0667, 0.6525), abs=1e-4)


def test_the_rule_for_more_seeds_by_hand():
    # 1..6: half-width 1.96331 (above) <= 2: done
    assert stats.more_seeds([1, 2, 3, 4, 5, 6], 2.0, max_seeds=40) == 0
    # at +-1.9 it needs 7 seeds at sd 1.87083 (t(0.975, 6) = 2.44691: 2.44691 * 1.87083 / sqrt(7) = 1.7302, and
    # 6 give 1.96331): one more, but a batch adds at least two
    assert stats.seeds_needed(1.87083, 1.9) == 7
    assert stats.more_seeds([1, 2, 3, 4, 5, 6], 1.9, max_seeds=40) == stats.MIN_MORE == 2
    # 0, 10: sd 7.07107; t(0.975, 50) = 2.00856: 2.00856 * 7.07107 / sqrt(51) = 1.98881, and 50 seeds give
    # t(0.975, 49) = 2.00958 -> 2.00958: 51 seeds, 49 more; the cap allows 38 more, then none
    assert stats.more_seeds([0, 10], 2.0, max_seeds=100) == 49
    assert stats.more_seeds([0, 10], 2.0, max_seeds=40) == 38
    assert stats.more_seeds([0, 10], 2.0, max_seeds=2) == 0


def test_the_rule_reads_the_width_never_the_difference_or_its_sign():
    d = np.array([3.1, -0.4, 5.2, 1.0, 2.2, -1.7, 4.4])
    for shifted in (d + 50, d - 50, -d, d - d.mean()):
        assert stats.more_seeds(shifted, 1.0, max_seeds=60) == stats.more_seeds(d, 1.0, max_seeds=60)


@pytest.mark.parametrize("sd", [1.0, 3.0, 4.5])
def test_studies_that_follow_the_rule_cover_and_reach_the_half_width(sd):
    """1,000 simulated studies from a first batch of 14 pairs (the two-step study's plan) that add seeds by the rule
    until the interval is within +-2: the final interval covers the true difference about 95% of the time and
    its half-width is <= 2 in every one (none reaches the cap of 60 at these sds)."""
    rng = np.random.default_rng(1)
    delta, target, first, cap = 1.5, 2.0, 14, 60
    covered, sizes = [], []
    for _ in range(1000):
        d = list(rng.normal(delta, sd, first))
        while more := stats.more_seeds(d, target, cap):
            d += list(rng.normal(delta, sd, more))
        final = stats.paired_t(d)
        assert final.halfwidth <= target
        covered.append(final.low <= delta <= final.high)
        sizes.append(len(d))
    assert 0.93 <= np.mean(covered) <= 0.97, np.mean(covered)
    if sd == 1.0:  # a first batch already within +-2 is the whole study
        assert set(sizes) == {first}
    else:
        assert np.mean(sizes) >= stats.seeds_needed(sd, target) - 2
