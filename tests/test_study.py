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

from apmpo.study import report
from apmpo.study.__main__ import (BUILTIN_VARIANTS, Settings, StudyError, load_study, method_overrides, save_study,
                                  parse_parallel, parse_variant, saved_methods)

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- statistics


def naive_bootstrap(method, reference, resamples, seed):
    """The paired bootstrap as a loop: the same draws as report.paired_bootstrap, taken in the same order."""
    rng = np.random.default_rng(seed)
    num_seeds = len(method[0])
    seed_draw = rng.integers(0, num_seeds, size=(resamples, num_seeds))
    problem_draws = [rng.integers(0, len(m[0]), size=(resamples, len(m[0]))) for m in method]
    draws = []
    for r in range(resamples):
        per_benchmark = []
        for m, ref, problems in zip(method, reference, problem_draws):
            total = 0.0
            for s in seed_draw[r]:
                total += sum(m[s][i] - ref[s][i] for i in problems[r]) / len(problems[r])
            per_benchmark.append(total / num_seeds)
        draws.append(sum(per_benchmark) / len(per_benchmark))
    return float(np.percentile(draws, 2.5)), float(np.percentile(draws, 97.5))


def test_paired_bootstrap_equals_a_loop_over_the_same_draws():
    rng = np.random.default_rng(3)
    method = [rng.random((3, 7)), rng.random((3, 4))]  # two benchmarks, 3 seeds
    reference = [rng.random((3, 7)), rng.random((3, 4))]
    got = report.paired_bootstrap(method, reference, resamples=300, seed=5)
    low, high = naive_bootstrap([m.tolist() for m in method], [r.tolist() for r in reference], 300, 5)
    assert got["low"] == pytest.approx(low, abs=1e-12) and got["high"] == pytest.approx(high, abs=1e-12)
    # the point estimate: the mean over benchmarks of each one's mean difference
    assert got["diff"] == pytest.approx(((method[0] - reference[0]).mean() + (method[1] - reference[1]).mean()) / 2)
    assert got["pairs"] == 3


def test_paired_bootstrap_hand_cases():
    ones, zeros = np.ones((2, 5)), np.zeros((2, 5))
    # a constant difference of 1 in every problem and seed: every resample is exactly 1
    assert report.paired_bootstrap([ones], [zeros], resamples=50) == {
        "diff": 1.0, "low": 1.0, "high": 1.0, "pairs": 2, "ahead": 2, "significant": True}
    # the same scores: no difference, not significant
    same = report.paired_bootstrap([ones * 0.5], [ones * 0.5], resamples=50)
    assert same["diff"] == 0 and same["low"] == same["high"] == 0 and not same["significant"]
    # pairing matters: a seed effect shared by both methods cancels. Seed 0 scores 0.9 / 0.8, seed 1 0.1 / 0.0:
    # every paired difference is 0.1, so the interval is the point, where unpaired seeds would spread it widely.
    m, r = np.array([[0.9] * 4, [0.1] * 4]), np.array([[0.8] * 4, [0.0] * 4])
    paired = report.paired_bootstrap([m], [r], resamples=200)
    assert paired["low"] == pytest.approx(0.1) and paired["high"] == pytest.approx(0.1)
    # seeds ahead: per seed, the mean difference over benchmarks (here +0.5 and -0.25 on benchmark a, +0.1 and
    # +0.1 on b: seed 0 won, seed 1 lost, seed 2 tied at 0: one pair of three ahead)
    a_m, a_r = np.array([[1.0, 1.0], [0.0, 0.5], [0.5, 0.5]]), np.array([[0.5, 0.5], [0.25, 0.75], [0.5, 0.5]])
    b_m, b_r = np.array([[0.2], [0.2], [0.0]]), np.array([[0.1], [0.1], [0.0]])
    mixed = report.paired_bootstrap([a_m, b_m], [a_r, b_r], resamples=50)
    assert mixed["pairs"] == 3 and mixed["ahead"] == 1  # seed 1: (-0.25 + 0.1) / 2 < 0


def test_paired_bootstrap_interval_covers_a_known_difference():
    rng = np.random.default_rng(0)
    truth = 0.05
    reference = rng.random((3, 400)) < 0.5
    method = rng.random((3, 400)) < 0.5 + truth
    got = report.paired_bootstrap([method.astype(float)], [reference.astype(float)], resamples=2000)
    assert got["low"] < truth < got["high"]
    assert got["high"] - got["low"] < 0.15


def test_validation_auc_is_the_mean_score_over_training():
    # trapezoids: (10-5)(0.1+0.3)/2 + (15-10)(0.3+0.5)/2 = 1.0 + 2.0 = 3.0, over a span of 10 steps
    assert report.validation_auc([(10, 0.3), (5, 0.1), (15, 0.5)]) == pytest.approx(0.3)
    assert report.validation_auc([(5, 0.4)]) == 0.4
    assert report.validation_auc([]) is None


def test_iqm_trims_a_quarter_at_each_end():
    assert report.iqm([4.0, 1.0, 3.0, 2.0]) == 2.5  # (2 + 3) / 2
    assert report.iqm([1.0, 2.0, 30.0]) == 11.0  # fewer than 4 runs: nothing trimmed, the mean
    assert report.iqm([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 100.0]) == 1.0


def fake_result(method, seed, correct, n=4, validation=((5, 0.2), (10, 0.4))):
    """A result.json as the runner writes it, for one benchmark "b" (per-problem correct counts out of n)."""
    ev = {"step": 10, "n": n, "k": [1, n], "benchmarks": {"b": {"correct": correct}}}
    return {"method": method, "seed": seed, "overrides": [f"loss.name={method}"], "steps": 10,
            "validation": [list(v) for v in validation], "seconds": 60.0, "eval": {"last": ev, "best": ev}}


def test_build_pairs_runs_by_seed_and_reports_pass_at_k():
    results = {
        "grpo": {0: fake_result("grpo", 0, [0, 4, 2]), 1: fake_result("grpo", 1, [1, 1, 1]),
                 2: fake_result("grpo", 2, [4, 4, 4])},
        "apmpo": {0: fake_result("apmpo", 0, [4, 4, 2]), 1: fake_result("apmpo", 1, [1, 1, 1])},  # no seed 2
    }
    built = report.build(results, ["apmpo", "grpo"], "grpo", resamples=200)
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
    assert vs["ahead"] == 1 and "| 1/2 |" in text  # seed 0 won (10/12 against 6/12), seed 1 tied


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
    from apmpo.study.__main__ import Run, Slot, commands

    run = Run("grpo", 0, (), ("loss.name=grpo",), tmp_path, load_config("configs/quickstart.yaml"))
    what, argv, _ = next(commands(run, Settings("configs/quickstart.yaml"), Slot("2,3", "4", 29510)))
    assert what == "training"
    assert argv[:7] == [sys.executable, "-m", "deepspeed.launcher.runner", "--include", "localhost:2,3",
                        "--master_port", "29510"]
    assert argv[7].endswith("launch/train.py") and argv[-2:] == ["--set", "rollout.devices=4"]


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


def run_study(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "apmpo.study", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_bad_method_or_override_fails_before_anything_runs(tmp_path):
    out = tmp_path / "s"
    bad = run_study("--config", "configs/quickstart.yaml", "--out", str(out), "--methods", "grpo",
                    "--set", "loss.gama=1", timeout=120)
    assert bad.returncode == 2 and "bad config" in bad.stderr and "loss.gama" in bad.stderr
    bad = run_study("--config", "configs/quickstart.yaml", "--out", str(out), "--methods", "grpo,mine",
                    "--variant", "mine: loss.name=gpro", timeout=120)
    assert bad.returncode == 2 and "loss.name" in bad.stderr
    bad = run_study("--config", "configs/quickstart.yaml", "--out", str(tmp_path / "t"), "--methods", "gpro",
                    timeout=120)
    assert bad.returncode == 2 and "'gpro'" in bad.stderr
    # Nothing was written that a corrected call would have to match.
    assert not out.exists() and not (tmp_path / "t").exists()
    bad = run_study("--out", str(out), "--report", timeout=120)
    assert bad.returncode == 2 and "no study to report on" in bad.stderr
    bad = run_study("--config", "configs/quickstart.yaml", "--out", str(out), "--methods", "grpo",
                    "--parallel", "98+99", timeout=120)
    assert bad.returncode == 2 and "names GPU(s) [98, 99], but this machine has" in bad.stderr
    # A second study in the folder of a running one (here: this process holds its lock)
    from apmpo.study.__main__ import lock_study

    with lock_study(tmp_path / "busy"):
        bad = run_study("--config", "configs/quickstart.yaml", "--out", str(tmp_path / "busy"), "--methods", "grpo",
                        timeout=120)
    assert bad.returncode == 2 and f"another apmpo.study (pid {os.getpid()}) is running" in bad.stderr
    assert not (tmp_path / "busy" / "study.json").exists()
    (tmp_path / "file").write_text("")
    bad = run_study("--config", "configs/quickstart.yaml", "--out", str(tmp_path / "file"), "--methods", "grpo",
                    timeout=120)
    assert bad.returncode == 2 and f"--out {tmp_path / 'file'}: cannot write there" in bad.stderr


# ---------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_study_of_the_quickstart_trains_evaluates_reports_and_resumes(tmp_path):
    """2 methods x 2 seeds of the quickstart, 2 steps each, validated after the last (so the best policy is the
    last one: one evaluation a run, to keep CI short); the report and the figure. Runs go seed by seed (apmpo
    and grpo on seed 0, then seed 1): the first call is killed in its third run's training, after its checkpoint
    of step 1; the second call finishes it and does not rerun the first two."""
    out = tmp_path / "study"
    argv = [sys.executable, "-m", "apmpo.study", "--config", "configs/quickstart.yaml", "--out", str(out),
            "--methods", "apmpo,grpo", "--seeds", "0,1", "--set", "train.steps=2", "--set", "eval.every=2",
            "--set", "rollout.num_servers=1", "--eval-n", "4", "--eval-limit", "12", "--save-every", "1"]
    # As `nohup ... &` from a script starts it: SIGINT ignored (a training run then outlived its study), and stopped
    # with SIGTERM
    first = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    second_run = out / "runs" / "apmpo" / "seed_1" / "checkpoints" / "step_1" / "trainer_state.json"
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

    second = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "4 run(s): 2 finished, 2 to run" in second.stdout
    assert finished.stat().st_mtime == mtime  # never rerun
    resumed = (out / "runs" / "apmpo" / "seed_1" / "train.log").read_text()
    assert "resuming at step 1" in resumed  # from its checkpoint of step 1

    for method in ("apmpo", "grpo"):
        for seed in (0, 1):
            result = json.loads((out / "runs" / method / f"seed_{seed}" / "result.json").read_text())
            assert [s for s, _ in result["validation"]] == [2]
            last = result["eval"]["last"]
            assert result["eval"]["best"] == last and not (out / "runs" / method / f"seed_{seed}" / "eval" / "best").exists()
            assert last["n"] == 4 and len(last["benchmarks"]["quickstart_val"]["correct"]) == 12
    built = json.loads((out / "report.json").read_text())
    vs = built["checkpoints"]["last"]["apmpo"]["vs_reference"]["pass@1"]["average"]
    assert vs["pairs"] == 2 and vs["low"] <= vs["diff"] <= vs["high"]
    text = (out / "report.md").read_text()
    assert "| apmpo | 2 |" in text and "| grpo | 2 |" in text and "Δ Pass@1 vs grpo" in text
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
    from apmpo.study.__main__ import Run, _check_same_config

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
