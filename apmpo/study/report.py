"""A study's report: every finished run's result.json in one table per checkpoint, as the paper's Table 1, plus
what the paper lacks: each method's difference from a reference method with a 95% interval that holds at few
seeds, the probability of improvement, the area under the validation curve, and the answer to the study's
pre-registered question (study.json's plan).

    python -m apmpo.study --out studies/smollm2_arith --report        # rewrites report.md and report.json

The statistics (apmpo/study/stats.py; Agarwal et al. 2021, "Deep RL at the Edge of the Statistical Precipice"):
- A run's score on a benchmark is its mean per-problem Pass@k (apmpo.eval.metrics); a method's cell is the mean
  ± sample std (ddof=1) of its runs' scores over training seeds, as the paper reports over 3 seeds.
- The difference from the reference is paired: runs of both methods that share a training seed saw the same
  prompts in the same order and were evaluated with the same sampling seed. A seed's difference is the mean over
  benchmarks of its mean difference over problems; the interval is the paired t-interval over those seeds, exact
  under normal differences at any number of seeds (a percentile bootstrap over 6 seeds covers about 87%, not
  95%). The problems are the benchmark's, the same for both methods: the question is about this benchmark, and
  their sampling noise is inside each seed's difference. One pair gives no interval.
- Seeds ahead and P: of the pairs, how many the method won, and rliable's probability of improvement for paired
  runs (ties count half) with its Clopper-Pearson interval.
- IQM, the interquartile mean of the runs' scores (scipy's trim_mean at 25%, as rliable): robust to one run that
  diverged. With fewer than 4 runs it trims nothing and equals the mean.
- AUC: the area under a run's validation curve (val/<benchmark>/pass@1 against the step, trapezoids) divided by
  its span of steps, i.e. the mean validation score over training: a method that learns sooner scores higher even
  when every method ends at the same place.
- The pre-registered question (`answer`): the plan's method against its reference on its score, over its seeds
  only, read once all of them have finished; until then the report calls it interim.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np

from apmpo.study import records, stats

CHECKPOINTS = ("last", "best")  # the last step's policy, and the best by validation (checkpoint.keep_best)


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


def paired_difference(method: list[np.ndarray], reference: list[np.ndarray]) -> dict:
    """The mean difference method - reference over the paired seeds, its 95% paired t-interval, the seeds ahead and
    the probability of improvement (apmpo.study.stats).

    `method[b]` and `reference[b]` are [seeds, problems] per-problem scores of benchmark b, rows in the same seed
    order (pairs); a per-seed score (the AUC) is one column. A seed's difference is the mean over benchmarks of its
    mean difference over problems: the seeds are the sample, each holding its problems' evaluation noise."""
    diffs = [np.asarray(m, float) - np.asarray(r, float) for m, r in zip(method, reference, strict=True)]
    if any(d.shape[0] != diffs[0].shape[0] for d in diffs):
        raise ValueError("every benchmark needs the same seeds")
    per_seed = np.mean([d.mean(axis=1) for d in diffs], axis=0)  # each pair's difference, over benchmarks
    pairs, mean = len(per_seed), float(per_seed.mean())
    improve = stats.improvement(per_seed)
    out = {"diff": mean, "low": None, "high": None, "pairs": pairs, "ahead": int((per_seed > 0).sum()),
           "per_seed": per_seed.tolist(), "improvement": [improve.p, improve.low, improve.high],
           "significant": False}
    if pairs >= 2:  # one pair: its seed's variation is unknown, so no interval is given
        t = stats.paired_t(per_seed)
        out |= {"low": t.low, "high": t.high, "sd": t.sd, "significant": bool(t.low > 0 or t.high < 0)}
    return out


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


def validation_tail(curve: list[tuple[int, float]]) -> float | None:
    """The mean validation score over the second half of training (steps past half the last). Where the curves have
    flattened, a run's policy still moves between checkpoints (GRPO on SmolLM2 arithmetic, steps 35-60: sd 6.2
    points between checkpoints 5 steps apart, docs/study.md): several checkpoints say where a run settled better than
    the last one alone. None without points."""
    points = sorted(curve)
    if not points:
        return None
    return statistics.fmean(v for s, v in points if s > points[-1][0] / 2)


CURVE_SCORES = {"auc": validation_auc, "tail": validation_tail}


def mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "iqm": iqm(values), "runs": len(values)}


# ---------------------------------------------------------------------------- the study's results


def build(results: dict[str, dict[int, dict]], methods: list[str], reference: str,
          plan: records.Plan | None = None, separations: dict[int, dict | None] | None = None,
          final_eval: bool = True) -> dict:
    """report.json's content: per checkpoint, per method, per benchmark Pass@1 / Pass@k (mean ± std, IQM), their
    average over benchmarks, the paired difference from `reference` with its interval; the validation AUC; and the
    answer to the plan's question, if any (`separations`: answer's)."""
    methods = [m for m in methods if m in results] + sorted(set(results) - set(methods))
    report: dict = {"reference": reference, "methods": {}, "checkpoints": {}}
    for method in methods:
        runs = results[method]
        report["methods"][method] = {
            "seeds": sorted(runs), "loss": next(iter(runs.values()))["loss"],
            "overrides": next(iter(runs.values()))["overrides"],
            "minutes": mean_std([r["seconds"] / 60 for r in runs.values()]),
            "auc": _auc(runs), "auc_vs_reference": _auc_diff(runs, results.get(reference), method, reference)}
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
                table[method]["vs_reference"] = _paired(evals, ref_evals)
        report["checkpoints"][which] = table
    if not final_eval:
        report["skipped"] = ("the last policy's evaluation after training (--final-eval no"
                             + (f": the question's score, {plan.score}, reads the validation curve alone" if plan else "")
                             + "): no table of the last or best policy, no score 'last'; the validation curve's "
                             "scores (auc, tail) are all computed")
    report["machines"] = _machines(results)
    if failures := {f"{method} seed {seed}": result["failures"] for method, runs in results.items()
                    for seed, result in sorted(runs.items()) if result["failures"]}:
        report["failures"] = failures  # a failed attempt is kept (records.Failure): none in most studies
    if plan is not None:
        report["answer"] = answer(results, plan, separations)
    return report


def _machines(results: dict[str, dict[int, dict]]) -> dict[str, list[str]]:
    """{machine: the runs with an attempt there}; runs recorded before machines were are under "not recorded"."""
    out: dict[str, list[str]] = {}
    for method, runs in results.items():
        for seed, result in sorted(runs.items()):
            for machine in result["machines"] or ["not recorded"]:
                out.setdefault(machine, []).append(f"{method} seed {seed}")
    return out


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


def _paired(evals: dict[int, dict], ref_evals: dict[int, dict]) -> dict:
    seeds = sorted(set(evals) & set(ref_evals))
    if not seeds:
        return {"pairs": 0}
    out: dict = {}
    names = [b for b in _benchmarks(evals) if b in ref_evals[seeds[0]]["benchmarks"]]
    for k in _ks(evals):
        ours, theirs = _pass_rates(evals, seeds, names, k), _pass_rates(ref_evals, seeds, names, k)
        out[f"pass@{k}"] = {"average": paired_difference(ours, theirs),
                            **{b: paired_difference([o], [t]) for b, o, t in zip(names, ours, theirs)}}
    return out


def _pass_rates(evals: dict[int, dict], seeds: list[int], names: list[str], k: int) -> list[np.ndarray]:
    """Per benchmark, each seed's per-problem pass@k: [seeds, problems]."""
    return [np.stack([pass_rates(evals[s]["benchmarks"][b]["correct"], evals[s]["n"], k) for s in seeds])
            for b in names]


def _curve(result: dict) -> list[tuple[int, float]]:
    return [(int(step), float(value)) for step, value in result.get("validation", [])]


def _auc(runs: dict[int, dict]) -> dict | None:
    values = [a for r in runs.values() if (a := validation_auc(_curve(r))) is not None]
    return mean_std(values) if values else None


def _auc_diff(runs, ref_runs, method, reference) -> dict | None:
    if method == reference or not ref_runs:
        return None
    seeds = [s for s in sorted(set(runs) & set(ref_runs))
             if _curve(runs[s]) and _curve(ref_runs[s])]
    if not seeds:
        return None
    ours = np.array([[validation_auc(_curve(runs[s]))] for s in seeds])
    theirs = np.array([[validation_auc(_curve(ref_runs[s]))] for s in seeds])
    return paired_difference([ours], [theirs])


def scores(runs: dict[int, dict], seeds: list[int], score: str) -> list[np.ndarray]:
    """A plan's score of each seed's run, as paired_difference takes it: per benchmark [seeds, problems] pass@1 of
    the last policy ("last"), or one column of the validation curve's mean ("auc") or of its second half's ("tail")."""
    if score in CURVE_SCORES:
        missing = [s for s in seeds if not _curve(runs[s])]
        if missing:
            raise records.RecordError(f"score {score} needs a validation curve: seeds {missing} have none "
                                      "(eval.every 0)")
        return [np.array([[CURVE_SCORES[score](_curve(runs[s]))] for s in seeds])]
    if missing := [s for s in seeds if "last" not in runs[s]["eval"]]:
        raise records.RecordError(f"score last needs the last policy's evaluation: seeds {missing} have none (the "
                                  "study skipped it, --final-eval no)")
    last = {s: runs[s]["eval"]["last"] for s in seeds}
    return _pass_rates(last, seeds, _benchmarks(last), 1)


def separation(a: dict[int, list[int]], b: dict[int, list[int]]) -> dict | None:
    """Where two runs' trained completions part (their digests by step, records.digests): the first step at which
    any differs ("step", None if none did), how many of its completions were still alike, the first step at which
    none was (None if some stayed alike), and the last step both logged. None when they share no logged step."""
    steps = sorted(set(a) & set(b))
    if not steps:
        return None
    alike = {s: sum(x == y for x, y in zip(a[s], b[s])) for s in steps}
    size = {s: max(len(a[s]), len(b[s])) for s in steps}
    first = next((s for s in steps if alike[s] < size[s]), None)
    return {"step": first, "alike": None if first is None else alike[first],
            "of": None if first is None else size[first], "last_step": steps[-1],
            "none_alike_from": None if first is None else next((s for s in steps if s >= first and not alike[s]), None)}


def answer(results: dict[str, dict[int, dict]], plan: records.Plan,
           separations: dict[int, dict | None] | None = None) -> dict:
    """The pre-registered question on the plan's seeds: its difference once any pair has finished, and the verdict
    once all have (and the plan's rule for adding seeds, if it has one, adds none: "more" says how many it adds):
    "difference" (the interval excludes 0), "equal" (it lies within +-halfwidth), "no difference" (it holds 0 and is
    no wider than +-halfwidth, as planned), "wider" (none of these: the spread was larger than planned); before that
    "interim". Pairs whose runs ran on different machines are listed in "split" and left out. Also each finished
    pair: both runs' scores, their difference, and where their completions parted (`separations` by seed)."""
    ours, theirs = results.get(plan.method, {}), results.get(plan.reference, {})
    both = [s for s in plan.seeds if s in ours and s in theirs]
    # A pair whose runs ran on different machines (AVX2 and AVX-512 round differently) differs by more than its
    # methods: reported apart, left out of the answer (the study's runner does not make one: apmpo.study.runner)
    split = [s for s in both if ours[s]["machines"] and theirs[s]["machines"]
             and (len(set(ours[s]["machines"]) | set(theirs[s]["machines"])) > 1)]
    done = [s for s in both if s not in split]
    out = {"plan": plan.model_dump(), "finished": done, "split": split,
           "outside_plan": sorted((set(ours) & set(theirs)) - set(plan.seeds)), "verdict": "interim"}
    if not done:
        return out
    mine, reference = scores(ours, done, plan.score), scores(theirs, done, plan.score)
    d = out["difference"] = paired_difference(mine, reference)
    per_seed = [np.mean([x.mean(axis=1) for x in arrays], axis=0) for arrays in (mine, reference)]
    out["pairs"] = [{"seed": s, "method": float(m), "reference": float(r), "difference": diff,
                     "separation": (separations or {}).get(s)}
                    for s, m, r, diff in zip(done, *per_seed, d["per_seed"], strict=True)]
    h = plan.halfwidth / 100
    if len(both) < len(plan.seeds):
        return out
    if plan.max_seeds is not None and len(done) >= 2:
        out["more"] = stats.more_seeds(d["per_seed"], h, plan.max_seeds)  # the rule, on the interval's width
        if out["more"]:
            return out
    if len(done) >= 2:
        out["verdict"] = ("difference" if d["significant"] else
                          "equal" if -h <= d["low"] and d["high"] <= h else
                          "no difference" if (d["high"] - d["low"]) / 2 <= h else "wider")
    return out


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
    """Seeds ahead, and P(method > reference on a seed) with its 95% interval."""
    if not d or not d.get("pairs"):
        return "–"
    p, low, high = d["improvement"]
    return f"{d['ahead']}/{d['pairs']}, P {p:.2f} [{low:.2f}, {high:.2f}]"


def render(report: dict, title: str = "Study") -> str:
    ref = report["reference"]
    lines = [f"# {title}", "",
             "Cells: percent, mean ± std over training seeds (one run per seed). Δ vs "
             f"{ref}: the paired difference over the seeds both ran, with its 95% paired t-interval (each seed's "
             "difference averaged over the problems; the t-interval holds its coverage at few seeds, where a "
             "percentile bootstrap over 6 seeds covers about 87%); **bold** when it excludes 0, otherwise there is "
             f"no measured difference. Seeds ahead: the pairs (same seed) in which the method beat {ref}, and P, "
             "the probability of improvement (rliable's; ties count half) with its Clopper-Pearson interval.", ""]
    if report.get("answer"):
        lines += _answer(report["answer"])
    if report.get("skipped"):
        lines += [f"Not run, to spend the CPU on what the question reads: {report['skipped']}.", ""]
    machines = report.get("machines") or {}
    if list(machines) == ["not recorded"]:
        lines += ["Where the runs ran: not recorded (runs before 2026-11-29).", ""]
    elif len(machines) == 1:
        lines += [f"Every run on one machine: {next(iter(machines))}.", ""]
    elif machines:
        lines += ["**The runs span machines** (or some did not record theirs): a rerun repeats a run to the last "
                  "digit on one machine, not across machines (other CPU kernels, other roundings), so a pair whose "
                  "runs ran on different machines differs by more than its methods (docs/study.md). Where each ran:",
                  ""] + [f"- {machine}: {', '.join(runs)}" for machine, runs in machines.items()] + [""]
    if failures := report.get("failures"):
        lines += ["Runs that failed and were run again by the study's next start (from their last checkpoint): "
                  "the attempt that finished is the one reported."] + [
            f"- {run}: " + "; ".join(map(records.describe_failure, fs)) for run, fs in failures.items()] + [""]
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


def _answer(a: dict) -> list[str]:
    plan, d, done = a["plan"], a.get("difference"), a["finished"]
    what = {"last": "the last policy's pass@1", "auc": "the mean validation pass@1 over training",
            "tail": "the mean validation pass@1 over the second half of training"}[plan["score"]]
    m, ref, n, h = plan["method"], plan["reference"], len(plan["seeds"]), plan["halfwidth"]
    lines = ["## The pre-registered question", "",
             f"{m} − {ref} on {what}, over {n} seeds ({_seeds(plan['seeds'])}), for a 95% paired t-interval of "
             f"half-width ±{h:.1f} points: fixed in study.json before the first run.", ""]
    if plan.get("first") is not None:
        lines += [f"The rule, fixed with the question: once every planned pair has finished, more seeds (the next in "
                  f"order) only while the interval is wider than ±{h:.1f}, judged on its width alone, up to "
                  f"{plan['max_seeds']} seeds; {n - plan['first']} added so far.", ""]
    if d is None:
        return lines + ["No pair has finished yet.", ""]
    p, low, high = d["improvement"]
    found = (f"{_interval(d)} points, {m} ahead on {d['ahead']} of {d['pairs']} seeds, P({m} > {ref} on a seed) = "
             f"{p:.2f} [{low:.2f}, {high:.2f}]")
    verdict = {
        "interim": f"**Interim, not the answer**: {len(done)} of {n} pairs have finished: {found}. The answer is read "
                   "once all have finished; a study stopped when its interval looked decisive would not hold its 95%."
                   + (f" Its rule adds {a['more']} seeds: the interval is wider than ±{h:.1f}." if a.get("more")
                      else ""),
        "difference": f"**Answer: a measured difference**: {found}.",
        "equal": f"**Answer: equal within ±{h:.1f} points**: {found}.",
        "no difference": f"**Answer: no measured difference**, to ±{h:.1f} points as planned: {found}.",
        "wider": f"**Answer: no measured difference, and not equal within ±{h:.1f}**: {found}; the seeds spread more "
                 "than the plan assumed (a new question needs a new plan, in another study).",
    }[a["verdict"]]
    lines.append(verdict)
    if a["split"]:
        lines.append(f"Seeds {_seeds(a['split'])}: the pair's runs ran on different machines; left out of the answer.")
    if a["outside_plan"]:
        lines.append(f"Seeds {_seeds(a['outside_plan'])} are not in the plan: in the tables below, not in the answer.")
    lines += ["", "Each pair (points); where the two runs' trained completions first differed, sampled with the same "
                  "random numbers (RUN_DIR/rollouts.jsonl):", ""]
    rows = [[str(p["seed"]), f"{100 * p['method']:.1f}", f"{100 * p['reference']:.1f}",
             f"{100 * p['difference']:+.1f}", _separation(p["separation"])] for p in a["pairs"]]
    return lines + _table(["seed", m, ref, "difference", "completions first differ"], rows) + [""]


def _separation(s: dict | None) -> str:
    if s is None:  # no digests: runs from before they were logged
        return "–"
    if s["step"] is None:
        return f"none differed (to step {s['last_step']})"
    text = f"step {s['step']} ({s['alike']} of {s['of']} alike)"
    return text + (f", none alike from step {s['none_alike_from']}" if s["none_alike_from"] is not None else "")


def _seeds(seeds: list[int]) -> str:
    seeds = sorted(seeds)
    return f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 2 else \
        ", ".join(map(str, seeds))


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + [":---:"] * (len(header) - 1)) + "|"]
            + ["| " + " | ".join(row) + " |" for row in rows])


def write(study: Path, methods: list[str], reference: str, title: str, plan: records.Plan | None = None,
          final_eval: bool = True) -> dict:
    """report.json and report.md in the study folder, from its finished runs."""
    results = records.load_results(study)
    separations = None if plan is None else {
        s: separation(*(records.digests(study / "runs" / m / f"seed_{s}") for m in (plan.method, plan.reference)))
        for s in plan.seeds}
    report = build(results, methods, reference, plan, separations, final_eval)
    records.write_atomic(study / "report.json", json.dumps(report, indent=1) + "\n")
    records.write_atomic(study / "report.md", render(report, title))
    return report

