"""Where the spread of the study's paired differences comes from (docs/study.md, "Where the spread comes from").

    .venv/bin/python studies/spread/analyse.py      # reads studies/smollm2_arith and studies/spread/runs

Every figure is in points of pass@1 (variance in points squared). Sources:
- evaluation samples: each run's last policy is scored on 96 problems x 16 samples; the variance of that score
  given the policy is sum_i p_i (1 - p_i) / (16 - 1) / 96^2 (p_i: problem i's observed pass rate; unbiased), and a
  paired difference carries both arms'. The problems are the same for both arms, so they are not a source.
- validation samples (64 problems x 2): the same formula at n = 2 over the last policy's p_i, checked against the
  gap between a run's step-30 validation and its last-policy evaluation (the same policy scored twice).
- which checkpoint: the paired sd of scores taken at other steps or averaged over the last ones.
- training: a GRPO run against the study's seed-0 run (train.seed = data.seed = 0) with one of them changed:
  train.seed (the engine's sampling numbers and the learner's torch seed) or data.seed (the prompts' order).
- the plateau: the train.seed runs continued to step 60 (the learning rate is constant): does the sd shrink?
- a rerun: the study's seed-0 APMPO and GRPO runs again for 15 steps; their logged metrics compared number for
  number, and their completions' digests (rollouts.jsonl) with each other: how fast coupled trajectories part.
- the pilots (studies/pilot_one_machine on arithmetic, studies/twostep_pilot on two-step problems) and the
  pre-registered study (studies/apmpo_vs_grpo): APMPO-GRPO pairs run by `python -m apmpo.study` on one idle
  machine, with today's engine sampling: their paired sd on each score, where each pair's trajectories part, and
  whether arithmetic's seed 0 repeats the spread runs of the same cell to the last digit.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from apmpo.plot import read_metrics  # noqa: E402
from apmpo.study import records, report, stats  # noqa: E402

STUDY = ROOT / "studies" / "smollm2_arith" / "runs"
# study folder: its benchmark. The pilots, and the pre-registered study's pairs so far (its answer is its report's)
PAIRED = {"pilot_one_machine": "arith_test", "twostep_pilot": "twostep_test", "apmpo_vs_grpo": "arith_test"}
RUNS = ROOT / "studies" / "spread" / "runs"
KEY = "val/arith_test/pass@1"


def study_run(method: str, seed: int) -> dict:
    return json.loads((STUDY / method / f"seed_{seed}" / "result.json").read_text())


def last_correct(result: dict) -> np.ndarray:
    return np.asarray(result["eval"]["last"]["benchmarks"]["arith_test"]["correct"], dtype=float)


def eval_variance(correct: np.ndarray, n: int) -> float:
    """The sampling variance, in points squared, of a pass@1 score of n samples a problem given the policy, whose
    pass rates p_i are estimated by the 16-sample evaluation `correct`: sum_i p_i (1 - p_i) / n / m^2, with n - 1
    for the evaluation's own score (p_i estimated from the same samples, the unbiased form)."""
    p = correct / 16
    return float((p * (1 - p)).sum() / (n - 1 if n == 16 else n) / len(p) ** 2 * 1e4)


def validation(result: dict) -> dict[int, float]:
    return {step: 100 * value for step, value in result["validation"]}


def spread_eval(name: str) -> dict | None:
    """A spread run's last-policy evaluation on arith_test (results.json's), None before it."""
    results = RUNS / name / "eval" / "last" / "results.json"
    return json.loads(results.read_text())["benchmarks"]["arith_test"] if results.is_file() else None


def spread_run(name: str) -> tuple[dict[int, dict], float | None]:
    """A spread run's metrics by step and its last-policy pass@1 (points), None before its evaluation."""
    d = RUNS / name
    metrics = read_metrics(d / "metrics.jsonl") if (d / "metrics.jsonl").is_file() else {}
    evaluation = spread_eval(name)
    return metrics, 100 * evaluation["pass@1"]["mean"] if evaluation else None


def training(score: dict[int, tuple[float, float]], ve: float) -> None:
    """GRPO runs that differ from the reference cell in one thing, and the same runs at the plateau. `score`: the
    study's (APMPO, GRPO) last-policy pass@1 by seed; `ve`: the mean evaluation variance of one of its runs."""
    # The reference cell, trained again with today's engine sampling (the study's seed 0 predates it), and scored
    # on two evaluation seeds: the same policy measured twice.
    metrics0, grpo0 = spread_run("grpo_t0_d0")
    if grpo0 is None:
        return
    per_seed = [100 * v for v in spread_eval("grpo_t0_d0")["pass@1"]["per_seed"]]  # the mean's two halves
    print(f"the reference GRPO run (train.seed 0, data.seed 0) again: {grpo0:.1f}; by evaluation seed "
          + " / ".join(f"{v:.1f}" for v in per_seed) + f" (one policy scored twice: {per_seed[0] - per_seed[1]:+.1f}, "
          f"predicted sd {np.sqrt(2 * ve):.1f}, the study's runs' mean)")
    print(f"  the study's seed-0 GRPO, same prompts and order, sampled by the engine before its inverse-CDF "
          f"sampling and on another machine: {score[0][1]:.1f} ({score[0][1] - grpo0:+.1f}): other sampling numbers")
    print("training (GRPO, last policy; against the reference run):")
    for name, what in [("grpo_t1_d0", "train.seed 1"), ("grpo_t2_d0", "train.seed 2"),
                       ("grpo_t0_d1", "data.seed 1"), ("grpo_t0_d2", "data.seed 2")]:
        metrics, s = spread_run(name)
        if s is not None:
            print(f"  {what}: {s:.1f} (against {grpo0:.1f}: {s - grpo0:+.1f}); step-30 validation "
                  f"{100 * metrics[30][KEY]:.1f} (against {100 * metrics0[30][KEY]:.1f})")
    for fixed, names in [("data.seed 0, train.seed 0-2", ["grpo_t1_d0", "grpo_t2_d0"]),
                         ("train.seed 0, data.seed 0-2", ["grpo_t0_d1", "grpo_t0_d2"])]:
        values = [grpo0] + [s for s in (spread_run(n)[1] for n in names) if s is not None]
        if len(values) >= 2:
            print(f"  {fixed}: sd {np.std(values, ddof=1):.1f} over {len(values)} runs")
    study_sd = np.std([g for _, g in score.values()], ddof=1)
    print(f"  for scale: GRPO's sd over the study's 6 seeds (both changed): {study_sd:.1f}")
    # The plateau: the same runs (data.seed 0, train.seed 0-2) continued to step 60.
    at = {steps: {t: spread_run(f"grpo_t{t}_d0" + suffix)[1] for t in range(3)}
          for steps, suffix in ((30, ""), (60, "_60"))}
    both = [t for t in range(3) if at[30][t] is not None and at[60][t] is not None]
    if both:
        print("the plateau (GRPO, data.seed 0): last policy at step 30 -> step 60: "
              + ", ".join(f"train.seed {t} {at[30][t]:.1f} -> {at[60][t]:.1f}" for t in both))
    if len(both) >= 2:
        print(f"  sd over train.seed at step 30 {np.std([at[30][t] for t in both], ddof=1):.1f}, at step 60 "
              f"{np.std([at[60][t] for t in both], ddof=1):.1f} ({len(both)} runs)")
    # At the plateau a run's policy still moves between checkpoints (the entropy is near 0 by step 30): the mean of
    # its validations over steps 35-60 is another score, at no cost beyond the 60 steps.
    tails = {}
    for t in range(3):
        metrics = spread_run(f"grpo_t{t}_d0_60")[0]
        if 60 in metrics:
            tails[t] = [100 * metrics[s][KEY] for s in range(35, 61, 5)]
            # a step whose groups all have equal rewards has no gradient, and no policy/ metrics
            entropy = [metrics[s]["policy/entropy"] for s in range(31, 61) if "policy/entropy" in metrics[s]]
            uniform = sum(metrics[s]["rollout/informative_groups_frac"] == 0 for s in range(31, 61))
            print(f"  train.seed {t}: validation at steps 35-60 " + " ".join(f"{v:.1f}" for v in tails[t])
                  + f": mean {np.mean(tails[t]):.1f}, sd between checkpoints {np.std(tails[t], ddof=1):.1f}; "
                  f"entropy {metrics[30]['policy/entropy']:.3f} at step 30, {np.mean(entropy):.3f} over steps "
                  f"31-60; {uniform} of those 30 steps without a gradient (every group's rewards equal)")
    if len(tails) >= 2:
        print(f"  sd over train.seed of the validation's mean over steps 35-60: "
              f"{np.std([np.mean(v) for v in tails.values()], ddof=1):.1f} ({len(tails)} runs)")


def pairs(name: str, benchmark: str) -> None:
    """A study's APMPO-GRPO pairs (studies/NAME, one idle machine): the paired difference on the last policy, the
    validation's tail and its AUC; each pair's first step with a differing completion; its seed 0 against the
    spread runs of the same cell (arithmetic only)."""
    folder = ROOT / "studies" / name
    if not folder.is_dir():
        return
    runs = records.load_results(folder)
    runs = {m: runs.get(m, {}) for m in ("apmpo", "grpo")}
    seeds = sorted(set(runs["apmpo"]) & set(runs["grpo"]))
    if not seeds:
        return
    print(f"{name}, APMPO - GRPO on {benchmark}, seeds {seeds}:")
    for score in ("last", "tail", "auc"):
        d = 100 * np.array(report.paired_difference(report.scores(runs["apmpo"], seeds, score),
                                                    report.scores(runs["grpo"], seeds, score))["per_seed"])
        sd = f", sd {d.std(ddof=1):.1f}, {stats.seeds_needed(d.std(ddof=1), 2.0)} seeds for +-2" if len(d) > 1 else ""
        print(f"  {score:5s} " + " ".join(f"{x:+.1f}" for x in d) + f": mean {d.mean():+.1f}{sd}")
    for s in seeds:
        a, g = runs["apmpo"][s], runs["grpo"][s]
        da, dg = (records.digests(folder / "runs" / m / f"seed_{s}") for m in ("apmpo", "grpo"))
        part = next((step for step in sorted(set(da) & set(dg)) if da[step] != dg[step]), None)
        va, vg = validation(a), validation(g)
        rho = np.corrcoef([va[k] for k in sorted(va)], [vg[k] for k in sorted(vg)])[0, 1]
        print(f"  seed {s}: last {100 * a['eval']['last']['benchmarks'][benchmark]['pass@1']:.1f} / "
              f"{100 * g['eval']['last']['benchmarks'][benchmark]['pass@1']:.1f}; completions first differ at step "
              f"{part}; validation over steps correlates at {rho:.2f}")
    for m in ("apmpo", "grpo"):  # the same cell as the spread runs: a rerun on one machine repeats them
        if benchmark == "arith_test" and 0 in runs[m] and (RUNS / f"{m}_t0_d0" / "metrics.jsonl").is_file():
            ours = read_metrics(folder / "runs" / m / "seed_0" / "metrics.jsonl")
            theirs = spread_run(f"{m}_t0_d0")[0]
            keys = [k for k in theirs[1] if not k.startswith("time/")]
            same = all(ours[s].get(k) == theirs[s].get(k) for s in theirs for k in keys)
            print(f"  {m} seed 0 against the spread run {m}_t0_d0: every non-time metric at every step "
                  + ("equal" if same else "NOT equal"))


def main() -> None:
    seeds = range(6)
    A = {s: study_run("apmpo", s) for s in seeds}
    G = {s: study_run("grpo", s) for s in seeds}
    score = {s: (100 * A[s]["eval"]["last"]["benchmarks"]["arith_test"]["pass@1"],
                 100 * G[s]["eval"]["last"]["benchmarks"]["arith_test"]["pass@1"]) for s in seeds}
    d = np.array([a - g for a, g in score.values()])
    total = d.var(ddof=1)
    print(f"paired difference APMPO - GRPO, last policy, 6 seeds: mean {d.mean():+.1f}, sd {d.std(ddof=1):.1f} "
          f"(variance {total:.0f})")

    ev = np.mean([eval_variance(last_correct(A[s]), 16) + eval_variance(last_correct(G[s]), 16) for s in seeds])
    print(f"evaluation samples (96 x 16): variance {ev:.2f} of the paired difference ({100 * ev / total:.1f}%), "
          f"sd {np.sqrt(ev):.2f}")
    vv = np.mean([eval_variance(last_correct(r), 2) * 96 / 64 for r in [*A.values(), *G.values()]])
    gap = np.array([validation(r)[30] - 100 * r["eval"]["last"]["benchmarks"]["arith_test"]["pass@1"]
                    for r in [*A.values(), *G.values()]])
    ve = np.mean([eval_variance(last_correct(r), 16) for r in [*A.values(), *G.values()]])
    print(f"validation samples (64 x 2), one run: sd {np.sqrt(vv):.2f}; the same policy's step-30 validation minus "
          f"its evaluation: predicted sd {np.sqrt(vv + ve):.2f}, measured {gap.std(ddof=1):.2f} over 12 runs "
          f"(mean {gap.mean():+.2f})")

    print("which checkpoint, paired sd over the 6 seeds (validation, 64 x 2 each):")
    va, vg = ({s: validation(r) for s, r in X.items()} for X in (A, G))
    for label, f in [("step 30", lambda v: v[30]), ("step 25", lambda v: v[25]),
                     ("mean of steps 25-30", lambda v: np.mean([v[25], v[30]])),
                     ("mean of steps 20-30", lambda v: np.mean([v[20], v[25], v[30]])),
                     ("area under the curve, steps 5-30", lambda v: np.mean(list(v.values())))]:
        dd = np.array([f(va[s]) - f(vg[s]) for s in seeds])
        print(f"  {label:34s} mean {dd.mean():+5.1f}  sd {dd.std(ddof=1):5.1f}")
    rho = np.corrcoef([a for a, _ in score.values()], [g for _, g in score.values()])[0, 1]
    print(f"the arms' correlation over seeds: {rho:.2f}")

    training(score, ve)

    print("a rerun (15 steps) of the study's GRPO seed 3 (run after the engines' sampling changes):")
    metrics, _ = spread_run("grpo_t3_d3_15")
    if metrics:
        study_metrics = read_metrics(STUDY / "grpo" / "seed_3" / "metrics.jsonl")
        keys = [k for k in metrics[1] if not k.startswith("time/") and k in study_metrics[1]]
        steps = sorted(set(metrics) & set(study_metrics))
        first = next((s for s in steps for k in keys if metrics[s].get(k) != study_metrics[s].get(k)), None)
        sampled = [k for k in ("reward/mean", "response/length_mean") if k in keys]
        same_samples = all(metrics[s][k] == study_metrics[s][k] for s in steps for k in sampled)
        print(f"  grpo: {len(steps)} steps, {len(keys)} metrics each: "
              + ("every value equal" if first is None else f"first difference at step {first}")
              + f"; rewards and lengths {'equal' if same_samples else 'differ'} on every step")
    da, dg = records.digests(RUNS / "apmpo_t0_d0_15"), records.digests(RUNS / "grpo_t0_d0_15")
    if da and dg:
        same = [(s, np.mean([x == y for x, y in zip(da[s], dg[s])])) for s in sorted(set(da) & set(dg))]
        print("APMPO and GRPO on seed 0, share of identical completions by step: "
              + " ".join(f"{s}:{f:.2f}" for s, f in same))
        va, vg = spread_run("apmpo_t0_d0_15")[0], spread_run("grpo_t0_d0_15")[0]
        both = [s for s in sorted(set(va) & set(vg)) if KEY in va[s] and KEY in vg[s]]
        print("  their validation: " + " ".join(f"{s}: {100 * va[s][KEY]:.1f}/{100 * vg[s][KEY]:.1f}" for s in both))
    for name, benchmark in PAIRED.items():
        pairs(name, benchmark)
    print("planning at this design: "
          f"{stats.seeds_needed(d.std(ddof=1), 2.0)} seeds for +-2 points at the paired sd {d.std(ddof=1):.1f}")


if __name__ == "__main__":
    main()
