"""A study's report: every finished run's result.json in one table per checkpoint, as the paper's Table 1, plus
what the paper lacks: each method's difference from a reference method with a 95% bootstrap confidence interval,
and the area under the validation curve.

    python -m apmpo.study --out studies/smollm2_arith --report        # rewrites report.md and report.json

The statistics (Agarwal et al. 2021, "Deep RL at the Edge of the Statistical Precipice"):
- A run's score on a benchmark is its mean per-problem Pass@k (apmpo.eval.metrics); a method's cell is the mean
  ± sample std (ddof=1) of its runs' scores over training seeds, as the paper reports over 3 seeds.
- The difference from the reference is paired: runs of both methods that share a training seed saw the same
  prompts in the same order and were evaluated with the same sampling seed. Each bootstrap resample draws the
  shared seeds with replacement and, per benchmark, the problems with replacement (the same draw for both
  methods); the difference of the resample's means is one draw. The 95% interval is the 2.5th and 97.5th
  percentiles of 10,000 draws. An interval that holds 0 is no measured difference. One pair gives no interval:
  the variation between seeds, the larger part in RL, would be unknown.
- Seeds ahead: of the pairs, how many the method won (its mean over problems higher). The interval is read with
  it: resampling few seeds cannot reach past what they showed, so with 2 or 3 pairs an interval excludes 0 about
  when all pairs differ the same way, which two equal methods do 1 time in 2 with two pairs, 1 in 4 with three
  (an exact sign test needs 6 pairs of 6 for p < 0.05). Few seeds make the interval a description of the seeds
  run, not a test.
- IQM, the interquartile mean of the runs' scores (scipy's trim_mean at 25%, as rliable): robust to one run that
  diverged. With fewer than 4 runs it trims nothing and equals the mean.
- AUC: the area under a run's validation curve (val/<benchmark>/pass@1 against the step, trapezoids) divided by
  its span of steps, i.e. the mean validation score over training: a method that learns sooner scores higher even
  when every method ends at the same place. Its interval resamples seeds only (validation keeps no per-problem
  scores).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from apmpo.study import records

CHECKPOINTS = ("last", "best")  # the last step's policy, and the best by validation (checkpoint.keep_best)
RESAMPLES = 10_000


# ---------------------------------------------------------------------------- statistics (pure)


def pass_rates(correct: list[int], n: int, k: int) -> np.ndarray:
    """Per-problem unbiased Pass@k from each problem's count of correct samples out of n (apmpo.eval.metrics)."""
    from apmpo.eval.metrics import pass_at_k

    return np.array([pass_at_k(n, c, k) for c in correct])


def iqm(values: list[float]) -> float:
    """Interquartile mean: the mean after cutting int(0.25 * len) values from each end (scipy.stats.trim_mean)."""
    cut = int(0.25 * len(values))
    kept = sorted(values)[cut:len(values) - cut]
    return statistics.fmean(kept)


def paired_bootstrap(method: list[np.ndarray], reference: list[np.ndarray], resamples: int = RESAMPLES,
                     seed: int = 0, problems: bool = True) -> dict:
    """The mean difference method - reference and its 95% percentile interval.

    `method[b]` and `reference[b]` are [seeds, problems] per-problem scores of benchmark b, rows in the same seed
    order (pairs). A draw resamples the seeds (once, shared by every benchmark) and, when `problems`, each
    benchmark's problems (shared by the two methods); the statistic is the mean over benchmarks of the mean
    difference. With `problems=False` the arrays may have one column (a per-seed score, as the AUC)."""
    diffs = [np.asarray(m, float) - np.asarray(r, float) for m, r in zip(method, reference, strict=True)]
    num_seeds = diffs[0].shape[0]
    if any(d.shape[0] != num_seeds for d in diffs):
        raise ValueError("every benchmark needs the same seeds")
    rng = np.random.default_rng(seed)
    seed_draw = rng.integers(0, num_seeds, size=(resamples, num_seeds))
    draws = np.zeros(resamples)
    for d in diffs:
        if problems:
            problem_draw = rng.integers(0, d.shape[1], size=(resamples, d.shape[1]))
            # per seed, the mean over each draw's problems: [seeds, resamples]
            per_seed = np.stack([row[problem_draw].mean(axis=1) for row in d])
        else:
            per_seed = np.repeat(d.mean(axis=1, keepdims=True), resamples, axis=1)
        draws += per_seed[seed_draw, np.arange(resamples)[:, None]].mean(axis=1)
    draws /= len(diffs)
    low, high = np.percentile(draws, [2.5, 97.5])
    per_seed = np.mean([d.mean(axis=1) for d in diffs], axis=0)  # each pair's difference, over benchmarks
    mean, ahead = float(per_seed.mean()), int((per_seed > 0).sum())  # ahead: the pairs the method won
    if num_seeds < 2:  # one pair: its seed's variation is unknown, so no interval is given
        return {"diff": mean, "low": None, "high": None, "pairs": num_seeds, "ahead": ahead, "significant": False}
    return {"diff": mean, "low": float(low), "high": float(high), "pairs": num_seeds, "ahead": ahead,
            "significant": bool(low > 0 or high < 0)}


def validation_auc(curve: list[tuple[int, float]]) -> float | None:
    """The trapezoid area under (step, score) points divided by their span of steps: the mean score over
    training. One point: its score. None without points."""
    points = sorted(curve)
    if not points:
        return None
    if len(points) == 1:
        return points[0][1]
    area = sum((s1 - s0) * (v0 + v1) / 2 for (s0, v0), (s1, v1) in zip(points, points[1:]))
    return area / (points[-1][0] - points[0][0])


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "iqm": iqm(values), "runs": len(values)}


# ---------------------------------------------------------------------------- the study's results


def build(results: dict[str, dict[int, dict]], methods: list[str], reference: str,
          resamples: int = RESAMPLES) -> dict:
    """report.json's content: per checkpoint, per method, per benchmark Pass@1 / Pass@k (mean ± std, IQM), their
    average over benchmarks, the paired difference from `reference` with its interval; and the validation AUC."""
    methods = [m for m in methods if m in results] + sorted(set(results) - set(methods))
    report: dict = {"reference": reference, "resamples": resamples, "methods": {}, "checkpoints": {}}
    for method in methods:
        runs = results[method]
        report["methods"][method] = {
            "seeds": sorted(runs), "loss": next(iter(runs.values()))["loss"],
            "overrides": next(iter(runs.values()))["overrides"],
            "minutes": mean_std([r["seconds"] / 60 for r in runs.values()]),
            "auc": _auc(runs), "auc_vs_reference": _auc_diff(runs, results.get(reference), method, reference,
                                                              resamples)}
    for which in CHECKPOINTS:
        table = {}
        for method in methods:
            evals = {s: r["eval"][which] for s, r in results[method].items() if r["eval"].get(which)}
            if not evals:
                continue
            table[method] = _scores(evals)
            ref_evals = {s: r["eval"][which] for s, r in (results.get(reference) or {}).items()
                         if r["eval"].get(which)}
            if method != reference and ref_evals:
                table[method]["vs_reference"] = _paired(evals, ref_evals, resamples)
        report["checkpoints"][which] = table
    return report


def _benchmarks(evals: dict[int, dict]) -> list[str]:
    return list(next(iter(evals.values()))["benchmarks"])


def _ks(evals: dict[int, dict]) -> list[int]:
    return next(iter(evals.values()))["k"]


def _scores(evals: dict[int, dict]) -> dict:
    """Per benchmark and averaged: each Pass@k as mean ± std over the runs, and the step evaluated."""
    out: dict = {"benchmarks": {}, "steps": {str(s): e["step"] for s, e in sorted(evals.items())}}
    ks = _ks(evals)
    for name in _benchmarks(evals):
        out["benchmarks"][name] = {}
        for k in ks:
            per_run = [float(pass_rates(e["benchmarks"][name]["correct"], e["n"], k).mean())
                       for e in evals.values()]
            out["benchmarks"][name][f"pass@{k}"] = {**mean_std(per_run), "per_run": per_run}
    out["average"] = {}
    for k in ks:
        per_run = [statistics.fmean(float(pass_rates(e["benchmarks"][b]["correct"], e["n"], k).mean())
                                    for b in _benchmarks(evals)) for e in evals.values()]
        out["average"][f"pass@{k}"] = {**mean_std(per_run), "per_run": per_run}
    return out


def _paired(evals: dict[int, dict], ref_evals: dict[int, dict], resamples: int) -> dict:
    seeds = sorted(set(evals) & set(ref_evals))
    if not seeds:
        return {"pairs": 0}
    out: dict = {}
    for k in _ks(evals):
        def per_problem(e, name):
            return pass_rates(e["benchmarks"][name]["correct"], e["n"], k)

        names = [b for b in _benchmarks(evals) if b in ref_evals[seeds[0]]["benchmarks"]]
        ours = [np.stack([per_problem(evals[s], b) for s in seeds]) for b in names]
        theirs = [np.stack([per_problem(ref_evals[s], b) for s in seeds]) for b in names]
        out[f"pass@{k}"] = {"average": paired_bootstrap(ours, theirs, resamples),
                            **{b: paired_bootstrap([o], [t], resamples) for b, o, t in zip(names, ours, theirs)}}
    return out


def _curve(result: dict) -> list[tuple[int, float]]:
    return [(int(step), float(value)) for step, value in result.get("validation", [])]


def _auc(runs: dict[int, dict]) -> dict | None:
    values = [a for r in runs.values() if (a := validation_auc(_curve(r))) is not None]
    return mean_std(values) if values else None


def _auc_diff(runs, ref_runs, method, reference, resamples) -> dict | None:
    if method == reference or not ref_runs:
        return None
    seeds = [s for s in sorted(set(runs) & set(ref_runs))
             if _curve(runs[s]) and _curve(ref_runs[s])]
    if not seeds:
        return None
    ours = np.array([[validation_auc(_curve(runs[s]))] for s in seeds])
    theirs = np.array([[validation_auc(_curve(ref_runs[s]))] for s in seeds])
    return paired_bootstrap([ours], [theirs], resamples, problems=False)


# ---------------------------------------------------------------------------- Markdown


def _pct(metric: dict | None, digits: int = 1) -> str:
    if not metric:
        return "–"
    text = f"{metric['mean'] * 100:.{digits}f}"
    return text + (f" ± {metric['std'] * 100:.{digits}f}" if metric["runs"] > 1 else "")


def _interval(d: dict | None) -> str:
    if not d or not d.get("pairs"):
        return "–"
    if d["low"] is None:
        return f"{d['diff'] * 100:+.1f} (1 seed: no interval)"
    text = f"{d['diff'] * 100:+.1f} [{d['low'] * 100:+.1f}, {d['high'] * 100:+.1f}]"
    return f"**{text}**" if d["significant"] else text


def _ahead(d: dict | None) -> str:
    return f"{d['ahead']}/{d['pairs']}" if d and d.get("pairs") else "–"


def render(report: dict, title: str = "Study") -> str:
    ref = report["reference"]
    lines = [f"# {title}", "",
             "Cells: percent, mean ± std over training seeds (one run per seed). Δ vs "
             f"{ref}: the paired difference with its 95% bootstrap interval over seeds and problems "
             f"({report['resamples']:,} resamples); **bold** when the interval excludes 0, otherwise there is no "
             f"measured difference. Seeds ahead: the pairs (same seed) in which the method beat {ref}. With few "
             "seeds read the two together: an interval excludes 0 about when all pairs went the same way, which two "
             "equal methods do 1 time in 2 with two pairs and 1 in 4 with three (a sign test needs 6 of 6 for "
             "p < 0.05).", ""]
    for which in CHECKPOINTS:
        table = report["checkpoints"].get(which)
        if not table:
            continue
        first = next(iter(table.values()))
        names = list(first["benchmarks"])
        ks = sorted(int(k.split("@")[1]) for k in first["average"])
        kmax = max(ks)
        what = ("the last step's policy" if which == "last" else
                "the best policy by validation (checkpoint.keep_best; chosen on validation problems, which may "
                "overlap the evaluated ones: read it as an upper estimate)")
        lines += [f"## Evaluation of {what}", ""]
        header = ["Method", "runs"] + [f"{b} Pass@1" for b in names] + (
            [f"{b} Pass@{kmax}" for b in names] if kmax > 1 else [])
        if len(names) > 1:
            header += ["Avg. Pass@1"]
        header += [f"Δ Pass@1 vs {ref}", "seeds ahead"] + ([f"Δ Pass@{kmax} vs {ref}"] if kmax > 1 else []) + [
            "IQM Pass@1"]
        rows = []
        for method, scores in table.items():
            row = [method, str(len(scores["steps"]))]
            row += [_pct(scores["benchmarks"][b]["pass@1"]) for b in names]
            if kmax > 1:
                row += [_pct(scores["benchmarks"][b][f"pass@{kmax}"]) for b in names]
            if len(names) > 1:
                row += [_pct(scores["average"]["pass@1"])]
            vs = scores.get("vs_reference") or {}
            pass1 = (vs.get("pass@1") or {}).get("average")
            row += [_interval(pass1), _ahead(pass1)]
            if kmax > 1:
                row += [_interval((vs.get(f"pass@{kmax}") or {}).get("average"))]
            row += [f"{scores['average']['pass@1']['iqm'] * 100:.1f}"]
            rows.append(row)
        lines += _table(header, rows) + [""]
        if which == "best":
            steps = "; ".join(f"{m}: {', '.join(map(str, t['steps'].values()))}" for m, t in table.items())
            lines += [f"Steps chosen: {steps}.", ""]
    lines += ["## Learning speed: area under the validation curve", "",
              "The mean validation Pass@1 over training (trapezoids over the validated steps, divided by their span); "
              f"Δ vs {ref}: paired over seeds only. Loss trained: loss.name in the runs' config.yaml.", ""]
    rows = []
    for method, info in report["methods"].items():
        rows.append([method, ", ".join(map(str, info["seeds"])), info["loss"],
                     " ".join(info["overrides"]) or "(base config)",
                     _pct(info["auc"]), _interval(info["auc_vs_reference"]), _ahead(info["auc_vs_reference"]),
                     f"{info['minutes']['mean']:.1f}"])
    lines += _table(["Method", "seeds", "loss trained", "overrides", "val AUC", f"Δ AUC vs {ref}", "seeds ahead",
                     "minutes a run"], rows)
    return "\n".join(lines) + "\n"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + [":---:"] * (len(header) - 1)) + "|"]
            + ["| " + " | ".join(row) + " |" for row in rows])


def write(study: Path, methods: list[str], reference: str, title: str, resamples: int = RESAMPLES) -> dict:
    """report.json and report.md in the study folder, from its finished runs."""
    report = build(records.load_results(study), methods, reference, resamples)
    records.write_atomic(study / "report.json", json.dumps(report, indent=1) + "\n")
    records.write_atomic(study / "report.md", render(report, title))
    return report

