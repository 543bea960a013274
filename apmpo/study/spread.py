"""Where a study's spread comes from: `python -m apmpo.study --out OUT --spread [--methods M] [--reference R]`.

A paired question needs fewer seeds the smaller the sd of its per-seed differences. For each score the study can
compute (last, auc, tail), over the seeds both methods finished:

- the sd of the paired difference, and each method's sd over seeds: their correlation rho says how much the
  pairing (shared prompts, order and sampling numbers) removes, Var(A - B) = Var(A) + Var(B) - 2 rho sd_A sd_B;
- the part of the paired variance that is the evaluation's own sampling noise, given each run's policy. For the last
  policy: problem i's p_i (1 - p_i) / (n - 1), summed over the m problems and divided by m^2 (p_i its observed rate
  out of n: the unbiased form), both arms, the mean over pairs. For a validation curve only each point's mean is
  kept, so the bound p (1 - p) / (m n) (the most a mean of m problems x n samples varies at mean rate p) is summed
  over the curve's points with the weights the score gives them (trapezoids for auc, equal for tail): an upper
  bound of that part.

What is left after the evaluation's part is the policies themselves: more evaluation samples cannot shrink it,
only more seeds or a score that varies less between them (docs/study.md, "Where the spread comes from").
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from apmpo.study import records, report


def eval_variance(correct: list[int], n: int) -> float:
    """The sampling variance (fraction^2) of a run's pass@1 given its policy, from each problem's correct count of n."""
    p = np.asarray(correct, dtype=float) / n
    return float((p * (1 - p)).sum() / (n - 1) / len(p) ** 2)


def curve_weights(steps: list[int], score: str) -> np.ndarray:
    """The weight of each validation point in the score: the trapezoid rule over the span (auc), or an equal share of
    the points past half the last step (tail), as report.validation_auc and validation_tail compute them."""
    steps = sorted(steps)
    if score == "tail":
        late = np.array([s > steps[-1] / 2 for s in steps], dtype=float)
        return late / late.sum()
    if len(steps) == 1:
        return np.ones(1)
    gaps = np.diff(steps).astype(float)
    w = np.zeros(len(steps))
    w[:-1] += gaps / 2
    w[1:] += gaps / 2
    return w / (steps[-1] - steps[0])


def curve_variance_bound(curve: list[tuple[int, float]], score: str, problems: int, samples: int) -> float:
    """An upper bound of a curve score's sampling variance given the run's policies:
    sum_k w_k^2 p_k (1 - p_k) / (m n)."""
    points = sorted(curve)
    w = curve_weights([s for s, _ in points], score)
    p = np.array([v for _, v in points])
    return float((w ** 2 * p * (1 - p)).sum() / (problems * samples))


def _validation_size(run_dir: Path) -> tuple[int, int] | None:
    """(problems, samples) of a run's validation, from its config.yaml (eval.limit, eval.n); None without a limit."""
    import yaml

    e = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("eval") or {}
    return (int(e["limit"]), int(e["n"])) if e.get("limit") and e.get("n") else None


def spread(out: Path, method: str, reference: str) -> dict:
    """{score: the pairs, the paired sd, each method's sd, rho, and the evaluation's part (an sd, and "bound": True
    where it is an upper bound)} for every score the finished pairs of `out` can give, in points."""
    results = records.load_results(out)
    ours, theirs = results.get(method, {}), results.get(reference, {})
    seeds = sorted(set(ours) & set(theirs))
    found = {}
    for score in records.SCORES:
        if len(seeds) < 2:
            break
        try:  # each seed's score, averaged over benchmarks, as the report pairs them
            mine, refs = (np.mean([x.mean(axis=1) for x in report.scores(runs, seeds, score)], axis=0)
                          for runs in (ours, theirs))
        except records.RecordError:  # no evaluation, or no curve: the study cannot give this score
            continue
        d = mine - refs
        if score == "last":
            parts = [sum(eval_variance(b["correct"], r[s]["eval"]["last"]["n"])
                         for b in r[s]["eval"]["last"]["benchmarks"].values())
                     / len(r[s]["eval"]["last"]["benchmarks"]) ** 2 for s in seeds for r in (ours, theirs)]
            bound = False
        else:
            sizes = {s: _validation_size(out / "runs" / method / f"seed_{s}") for s in seeds}  # a pair's share it
            if None in sizes.values():
                continue
            parts = [curve_variance_bound(report._curve(r[s]), score, *sizes[s]) for s in seeds for r in (ours, theirs)]
            bound = True
        eval_var = 2 * float(np.mean(parts))  # per pair: both arms' noise
        sd_d, sd_a, sd_b = d.std(ddof=1), mine.std(ddof=1), refs.std(ddof=1)
        rho = float(np.corrcoef(mine, refs)[0, 1]) if sd_a > 0 and sd_b > 0 else None
        found[score] = {"pairs": len(seeds), "sd_pair": 100 * sd_d, "sd_method": 100 * sd_a,
                        "sd_reference": 100 * sd_b, "rho": rho, "sd_unpaired": 100 * float(np.hypot(sd_a, sd_b)),
                        "sd_eval": 100 * eval_var ** 0.5, "bound": bound,
                        "eval_share": eval_var / sd_d ** 2 if sd_d > 0 else None}
    return found


def render(found: dict, method: str, reference: str) -> str:
    lines = [f"{method} - {reference}, in points of pass@1 (docs/study.md, \"Where the spread comes from\"):"]
    for score, f in found.items():
        share = "" if f["eval_share"] is None else f" ({100 * min(f['eval_share'], 1):.0f}% of the pairs' variance)"
        rho = "–" if f["rho"] is None else f"{f['rho']:.2f}"
        lines.append(
            f"  {score}: {f['pairs']} pairs, paired sd {f['sd_pair']:.1f}; {method} {f['sd_method']:.1f}, {reference} "
            f"{f['sd_reference']:.1f} over seeds, rho {rho} (unpaired: sd {f['sd_unpaired']:.1f}); the evaluation's "
            f"own sampling noise {'at most ' if f['bound'] else ''}sd {f['sd_eval']:.1f}{share}, the rest the "
            "policies'")
    if not found:
        lines.append("  no score with 2 finished pairs")
    return "\n".join(lines)
