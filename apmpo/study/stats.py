"""The study's statistics over seeds: intervals that hold their coverage at a few seeds, and how many seeds a
question needs.

A study pairs runs by seed (same prompts, same order, same sampling numbers), so its unit is the per-seed paired
difference d_s = score(method, s) - score(reference, s), each score already averaged over the benchmark's problems
and samples. Over n seeds:

    paired_t(d)          mean(d) +- t(0.975, n-1) * sd(d) / sqrt(n): exact under normal d at any n; a percentile
                         bootstrap over 6 seeds covers about 87%, not 95% (docs/study.md, "The report")
    improvement(d)       P(method > reference on the same seed), ties counted half, with a Clopper-Pearson interval
    seeds_needed(sd, h)  the fewest seeds whose paired-t interval has half-width h at the paired sd `sd`:
                         t(0.975, n-1) * sd / sqrt(n) <= h
    sd_bound(sd, n)      a one-sided upper confidence bound of the true sd from n pairs (chi-square): a pilot of a
                         few pairs under-states the sd as often as not, so a plan names both
    more_seeds(d, h, m)  the rule for adding seeds, judged on the interval's width alone: 0 once the interval of
                         the finished pairs d is within +-h (or m seeds are reached), else enough to reach +-h at
                         their sd, at least MIN_MORE

Why a rule on the width alone keeps its 95%: for normal differences the mean of n pairs is independent of the
sequence of sample sds up to n (Helmert's contrasts), so stopping on the width does not pick the mean; it only
stops more often where the sd came out low, which costs a point or two of coverage (a simulation in
tests/test_study_stats.py: 93-96% over true sds 1-6 from a first batch of 14). A rule that looked at the
difference or its sign would not hold its level (optional stopping: five looks at 5% give 14%).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A mean over seeds and its two-sided interval at `level`."""

    mean: float
    low: float
    high: float
    n: int
    sd: float
    level: float = LEVEL

    @property
    def halfwidth(self) -> float:
        return (self.high - self.low) / 2


def paired_t(d: list[float] | np.ndarray, level: float = LEVEL) -> Interval:
    """The paired t-interval of the mean of `d` (at least 2 values)."""
    d = np.asarray(d, dtype=float)
    n = len(d)
    if n < 2:
        raise ValueError(f"a t-interval needs at least 2 paired seeds, got {n}")
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    half = t_quantile(level, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, sd, level)


@functools.lru_cache(maxsize=None)
def t_quantile(level: float, df: int) -> float:
    """The two-sided critical value: P(|T_df| <= q) = level. P(|T| > q) = I_{df/(df+q^2)}(df/2, 1/2)."""
    return _solve(lambda q: 1 - _betainc(df / 2, 0.5, df / (df + q * q)), level, 0.0, 1e4)


@dataclass(frozen=True)
class Improvement:
    """P(method > reference on a seed), ties counted half, and its Clopper-Pearson interval."""

    p: float
    low: float
    high: float
    n: int


def improvement(d: list[float] | np.ndarray, level: float = LEVEL) -> Improvement:
    """rliable's probability of improvement for paired runs: the share of seeds where the method scored above the
    reference (a tie counts one half). The interval is Clopper-Pearson's, exact for a whole count; with ties the
    count is fractional and the beta quantiles take it as it is."""
    d = np.asarray(d, dtype=float)
    n = len(d)
    if n == 0:
        raise ValueError("no paired seeds")
    wins = float((d > 0).sum() + 0.5 * (d == 0).sum())
    alpha = 1 - level
    low = 0.0 if wins == 0 else _solve(lambda x: _betainc(wins, n - wins + 1, x), alpha / 2, 0.0, 1.0)
    high = 1.0 if wins == n else _solve(lambda x: _betainc(wins + 1, n - wins, x), 1 - alpha / 2, 0.0, 1.0)
    return Improvement(wins / n, low, high, n)


def seeds_needed(sd: float, halfwidth: float, level: float = LEVEL) -> int:
    """The fewest paired seeds (at least 2) whose t-interval at paired sd `sd` is no wider than +-halfwidth."""
    if not halfwidth > 0:
        raise ValueError(f"the half-width must be > 0, got {halfwidth}")
    if sd == 0:
        return 2
    n = max(2, math.ceil((NormalDist().inv_cdf((1 + level) / 2) * sd / halfwidth) ** 2))  # z's n: t's no smaller
    while t_quantile(level, n - 1) * sd / math.sqrt(n) > halfwidth:
        n += 1
    return n


def sd_bound(sd: float, n: int, confidence: float = 0.8) -> float:
    """The one-sided `confidence` upper bound of the true sd from a sample sd of n values: (n-1) s^2 / sigma^2 is
    chi-square with n-1 degrees of freedom under normality."""
    if n < 2:
        raise ValueError(f"an sd from {n} value(s) has no bound")
    k = n - 1  # the chi-square quantile q: P(k/2, q/2) = 1 - confidence, P the regularized lower gamma
    return sd * math.sqrt(k / _solve(lambda q: _gammainc(k / 2, q / 2), 1 - confidence, 0.0, 100.0 * k + 100.0))


# ---------------------------------------------------------------------------- the distributions, by hand
# Three quantiles are all the study needs; scipy would give them, but with scipy installed vLLM imports
# scipy.signal in every server process (vllm/multimodal/audio.py). Numerical Recipes' continued fractions, solved
# by bisection: to 1e-12, checked against tables in tests/test_study_stats.py.


def _solve(cdf, p: float, low: float, high: float) -> float:
    """x in [low, high] with cdf(x) = p, cdf increasing."""
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1) / (a + b + 2):  # the continued fraction converges fast below this point: use the symmetry
        return 1 - front * _beta_fraction(b, a, 1 - x) / b
    return front * _beta_fraction(a, b, x) / a


def _beta_fraction(a: float, b: float, x: float) -> float:
    tiny = 1e-300
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h


def _gammainc(a: float, x: float) -> float:
    """The regularized lower incomplete gamma function P(a, x)."""
    if x <= 0:
        return 0.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:  # the series
        term = total = 1 / a
        for n in range(1, 1000):
            term *= x / (a + n)
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return total * math.exp(log_front)
    tiny = 1e-300  # the continued fraction of Q = 1 - P
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for n in range(1, 1000):
        an = -n * (n - a)
        b += 2
        d = an * d + b
        d = 1 / (d if abs(d) > tiny else tiny)
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return 1 - math.exp(log_front) * h


@dataclass(frozen=True)
class Plan:
    """How many seeds a half-width needs, from the paired differences finished so far (the pilot)."""

    pilot: Interval
    halfwidth: float
    seeds: int  # at the pilot's sd
    seeds_at_bound: int  # at its 80% upper bound
    sd_bound: float
    seconds_per_pair: float | None  # measured: the mean wall time of a finished pair

    def hours(self, seeds: int) -> float | None:
        return None if self.seconds_per_pair is None else seeds * self.seconds_per_pair / 3600


def plan(d: list[float] | np.ndarray, halfwidth: float, seconds_per_pair: float | None = None) -> Plan:
    pilot = paired_t(d)
    bound = sd_bound(pilot.sd, pilot.n)
    return Plan(pilot, halfwidth, seeds_needed(pilot.sd, halfwidth), seeds_needed(bound, halfwidth), bound,
                seconds_per_pair)


MIN_MORE = 2  # seeds a batch of the rule adds at least: one more pair at a time would look after every pair


def more_seeds(d: list[float] | np.ndarray, halfwidth: float, max_seeds: int, level: float = LEVEL) -> int:
    """How many seeds the rule adds after the finished pairs `d` (all the planned ones): 0 when their interval is
    within +-halfwidth or max_seeds pairs have finished; otherwise seeds_needed at their sd less those finished, at
    least MIN_MORE, at most up to max_seeds. It reads the interval's width, never its mean."""
    interval = paired_t(d, level)
    n = interval.n
    if interval.halfwidth <= halfwidth or n >= max_seeds:
        return 0
    return min(max_seeds - n, max(MIN_MORE, seeds_needed(interval.sd, halfwidth, level) - n))
