"""The study's statistics over seeds: intervals that hold their coverage at a few seeds, and how many seeds a
question needs.

A study pairs runs by seed (same prompts, same order, same sampling numbers), so its unit is the per-seed paired
difference d_s = score(method, s) - score(reference, s), each score already averaged over the benchmark's problems
and samples. Over n seeds:

    paired_t(d)          mean(d) +- t(0.975, n-1) * sd(d) / sqrt(n): exact under normal d at any n; a percentile
                         bootstrap over 6 seeds covers about 87%, not 95% (../shared/NOTES-study.md, section 1)
    improvement(d)       P(method > reference on the same seed), ties counted half, with a Clopper-Pearson interval
    seeds_needed(sd, h)  the fewest seeds whose paired-t interval has half-width h at the paired sd `sd`:
                         t(0.975, n-1) * sd / sqrt(n) <= h
    sd_bound(sd, n)      a one-sided upper confidence bound of the true sd from n pairs (chi-square): a pilot of a
                         few pairs under-states the sd as often as not, so a plan names both
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

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


def t_quantile(level: float, df: int) -> float:
    """The two-sided critical value: P(|T_df| <= q) = level."""
    return float(stats.t.ppf((1 + level) / 2, df))


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
    low = 0.0 if wins == 0 else float(stats.beta.ppf(alpha / 2, wins, n - wins + 1))
    high = 1.0 if wins == n else float(stats.beta.ppf(1 - alpha / 2, wins + 1, n - wins))
    return Improvement(wins / n, low, high, n)


def seeds_needed(sd: float, halfwidth: float, level: float = LEVEL) -> int:
    """The fewest paired seeds (at least 2) whose t-interval at paired sd `sd` is no wider than +-halfwidth."""
    if not halfwidth > 0:
        raise ValueError(f"the half-width must be > 0, got {halfwidth}")
    if sd == 0:
        return 2
    n = max(2, math.ceil((stats.norm.ppf((1 + level) / 2) * sd / halfwidth) ** 2))  # z's n: t's is no smaller
    while t_quantile(level, n - 1) * sd / math.sqrt(n) > halfwidth:
        n += 1
    return n


def sd_bound(sd: float, n: int, confidence: float = 0.8) -> float:
    """The one-sided `confidence` upper bound of the true sd from a sample sd of n values: (n-1) s^2 / sigma^2 is
    chi-square with n-1 degrees of freedom under normality."""
    if n < 2:
        raise ValueError(f"an sd from {n} value(s) has no bound")
    return sd * math.sqrt((n - 1) / stats.chi2.ppf(1 - confidence, n - 1))


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
