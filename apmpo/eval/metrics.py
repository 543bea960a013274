"""Pass@k and the aggregation of scored samples into results.json.

    pass_at_k(n=16, c=3, k=1)      # 0.1875 = 3/16
    results = summarize(rows, benchmarks={"aime24": "math"}, n=16, seeds=[0, 1, 2], ks=[1, 16])

Pass@k per problem is the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k): the chance that k
of the n samples, drawn without replacement, hold at least one correct one. Pass@1 is the mean correctness.
A benchmark's score under one eval seed is the mean over its problems; results.json reports the mean and the
sample standard deviation (ddof=1, as the paper's ± values) of those per-seed scores.

The average row follows the paper's Table 1: Pass@1 averaged over the six math benchmarks, Pass@k (k > 1) over
AIME24, AIME25 and AMC23, per seed and then across seeds; it names the benchmarks it covers.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Iterable

MATH_SIX = ("math500", "aime24", "aime25", "amc23", "minerva", "olympiadbench")
PASS_AT_K_BENCHMARKS = ("aime24", "aime25", "amc23")  # the paper's Pass@16 columns


def pass_at_k(n: int, c: int, k: int) -> float:
    """1 - C(n-c, k) / C(n, k), as the product form that stays exact for large n (no big binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "per_seed": values}


def summarize_benchmark(rows: Iterable[dict], n: int, seeds: list[int], ks: list[int]) -> dict:
    """Scores of one benchmark from its sample rows (keys index, seed, sample, correct, reward, ...).

    Every (problem, seed) must have its n samples; the caller filters rows to the requested ones."""
    correct: dict[tuple[int, int], int] = defaultdict(int)
    counts: dict[tuple[int, int], int] = defaultdict(int)
    lengths, truncated = [], 0
    for row in rows:
        key = (row["seed"], row["index"])
        counts[key] += 1
        correct[key] += bool(row["correct"])
        lengths.append(row.get("num_tokens", 0))
        truncated += row.get("finish_reason") == "length"
    incomplete = [key for key, count in counts.items() if count != n]
    if incomplete:
        raise ValueError(f"{len(incomplete)} (seed, problem) pairs do not have exactly n={n} samples, "
                         f"e.g. {incomplete[0]}")
    problems = sorted({index for _, index in counts})
    per_k: dict[str, dict] = {}
    for k in ks:
        per_seed = [statistics.fmean(pass_at_k(n, correct[(s, i)], k) for i in problems) for s in seeds]
        per_k[f"pass@{k}"] = mean_std(per_seed)
    num_samples = sum(counts.values())
    return {
        "num_problems": len(problems), "n": n, "seeds": seeds, "num_samples": num_samples,
        "num_correct": sum(correct.values()), **per_k,
        "mean_tokens": statistics.fmean(lengths) if lengths else 0.0,
        "truncated_frac": truncated / num_samples if num_samples else 0.0,
    }


def average(benchmarks: dict[str, dict], ks: list[int]) -> dict | None:
    """The paper's Avg. column over the math benchmarks present (None when none is)."""
    out: dict = {}
    for k in ks:
        names = [b for b in (MATH_SIX if k == 1 else PASS_AT_K_BENCHMARKS) if f"pass@{k}" in benchmarks.get(b, {})]
        if not names:
            continue
        seeds = len(benchmarks[names[0]][f"pass@{k}"]["per_seed"])
        per_seed = [statistics.fmean(benchmarks[b][f"pass@{k}"]["per_seed"][s] for b in names) for s in range(seeds)]
        out[f"pass@{k}"] = {**mean_std(per_seed), "benchmarks": names,
                            "complete": len(names) == len(MATH_SIX if k == 1 else PASS_AT_K_BENCHMARKS)}
    return out or None
