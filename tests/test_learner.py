"""One training update is independent of how the batch is split: micro-batches, accumulation, ranks.

The same synthetic rollout batch goes through the real DeepSpeed ZeRO-2 engine (gloo on CPU) with a large token
budget (one micro-batch per optimiser step), a tiny one (many micro-batches accumulated), and two learner processes
(gloo) as DeepSpeed's launcher starts them. The one-process scenarios of every test run in one worker process (the
`single_rank` fixture): a process per scenario cost most of this module's time. Gradient norms are compared step by
step (a wrong normaliser changes them even where Adam's update would hide it) and the parameters after the steps.
"""
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from train_runs import Ranks

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "learner_update_worker.py"


def run_worker(tmp_path, scenarios: dict[str, dict], ranks=1) -> dict[str, list[dict]]:
    """Runs the named scenarios (tests/learner_update_worker.py) in one worker; their results per rank."""
    spec = [{"out": str(tmp_path / name), **scenario} for name, scenario in scenarios.items()]
    (tmp_path / "scenarios.json").write_text(json.dumps(spec))
    command = [sys.executable, str(WORKER), str(tmp_path / "scenarios.json")]
    codes, outputs = Ranks(command, ranks, tmp_path / "logs", {**os.environ, "PYTHONPATH": str(ROOT)}).finish(600)
    assert codes == [0] * ranks, "".join(output[-3000:] for output in outputs)
    return {name: [torch.load(tmp_path / name / f"rank{r}.pt") for r in range(ranks)] for name in scenarios}


# Truncated IS against the engine's log-probs: all 0 in the synthetic rollouts, so a ratio is pi_old itself,
# 0.001 to 0.004 for the tiny random model; the cap truncates some of them. APMPO with token-level weights through
# DeepSpeed; the other losses and the sequence level are split-invariant in tests/test_loss.py and
# tests/test_correction.py.
SPLIT = ["loss.name=apmpo", "loss.kl_beta=0.05", "loss.stats_scope=group", "correction.mode=tis",
         "correction.level=token", "correction.tis_cap=0.002"]
# One optimiser step per rollout batch, one epoch: the old log-probs are the update forward's own, detached.
ON_POLICY = ["train.mini_batch_size=8", "loss.kl_beta=0.05", "correction.mode=tis", "correction.level=token",
             "train.micro_batch_tokens=60"]
SCENARIOS = {
    "whole": {"set": SPLIT + ["train.micro_batch_tokens=100000"]},
    "split": {"set": SPLIT + ["train.micro_batch_tokens=40"]},
    "reused": {"set": ON_POLICY},
    "recomputed": {"set": ON_POLICY, "recompute_old": True},
    "faulty": {"set": ["train.micro_batch_tokens=100000"], "nan_advantage": True},
    "empty": {"no_rollouts": True},
    # Without a KL term the rows of advantage 0 are left out of the forwards; given 1e-30 instead, they are run.
    "skipping": {"set": ["loss.kl_beta=0", "loss.name=apmpo"], "alike_groups": [1, 4, 6]},
    "not_skipping": {"set": ["loss.kl_beta=0", "loss.name=apmpo"], "alike_groups": [1, 4, 6], "tiny_advantage": True},
}


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory) -> dict[str, dict]:
    return {name: ranks[0] for name, ranks in run_worker(tmp_path_factory.mktemp("update"), SCENARIOS).items()}


TWO_RANKS = SPLIT + ["train.micro_batch_tokens=60"]
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "optim.lr=1e-1"]  # B starts at 0: a large step to compare


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    """One launch of 2 ranks (gloo) for the same batch under ZeRO-2, ZeRO-3, and ZeRO-3 with the optimiser
    offloaded: each scenario's results per rank."""
    return run_worker(tmp_path_factory.mktemp("two_ranks"), {
        "zero2": {"set": TWO_RANKS}, "zero3": {"set": TWO_RANKS + ["train.zero_stage=3"]},
        "offload": {"set": TWO_RANKS + ["train.zero_stage=3", "train.offload_optimizer=cpu"]},
        "lora_zero2": {"set": TWO_RANKS + LORA}, "lora_zero3": {"set": TWO_RANKS + LORA + ["train.zero_stage=3"]}},
        ranks=2)


def assert_same_step(a, b):
    assert a["grad_norms"] == pytest.approx(b["grad_norms"], rel=1e-5)
    for name, value in a["params"].items():
        torch.testing.assert_close(value, b["params"][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_update_is_independent_of_micro_batches_accumulation_and_ranks(single_rank, two_ranks):
    whole, split = single_rank["whole"], single_rank["split"]
    assert max(split["micro_batches"]) > 3 and max(whole["micro_batches"]) == 1
    assert_same_step(whole, split)
    assert len(whole["grad_norms"]) == 2 and all(n > 0 for n in whole["grad_norms"])

    rank0, rank1 = two_ranks["zero2"]
    assert_same_step(rank0, rank1)  # ZeRO-2 keeps the replicas identical
    assert_same_step(whole, rank0)  # and two ranks take the same step as one
    assert not set(rank0["trained"]) & set(rank1["trained"])  # the rollouts were sharded
    assert sorted(rank0["trained"] + rank1["trained"]) == list(range(32))
    # The mismatch metrics are reduced over ranks (sums, and a max-reduce for the ratio's extremes).
    assert 0 < whole["metrics"]["rollout/truncated_frac"] < 1
    for key in ("rollout/mismatch_kl_k1", "rollout/mismatch_kl_k3", "rollout/is_ratio_min", "rollout/is_ratio_max",
                "rollout/truncated_frac"):
        assert rank0["metrics"][key] == rank1["metrics"][key] == pytest.approx(whole["metrics"][key], rel=1e-5)


@pytest.mark.slow
def test_zero3_takes_zero2s_step_with_half_the_parameters_per_rank(two_ranks):
    """ZeRO-3 (and ZeRO-3 with the optimiser offloaded) on the same batch: the weights after the step, gathered
    whole, equal ZeRO-2's, and so does what the push streams (a module's parameters gathered at a time); each
    rank holds half the parameter bytes. (Without counting micro-batches as engine.forward does, ZeRO-3 kept only
    the last micro-batch's gradients: a gradient norm of 1.11 against 2.40.)"""
    zero2 = two_ranks["zero2"][0]
    for name in ("zero3", "offload"):
        rank0, rank1 = two_ranks[name]
        assert_same_step(zero2, rank0)
        assert_same_step(rank0, rank1)  # the gathered weights are the same on both ranks
        assert list(rank0["pushed"]) == list(zero2["params"])  # named as named_parameters() names them
        for param, value in rank0["params"].items():
            assert torch.equal(rank0["pushed"][param], value), param
        assert rank0["metrics"]["rollout/mismatch_kl_k3"] == pytest.approx(zero2["metrics"]["rollout/mismatch_kl_k3"])
    assert zero2["pushed"].keys() == zero2["params"].keys()
    full = sum(v.numel() * v.element_size() for v in zero2["params"].values())
    assert [r["param_bytes"] for r in two_ranks["zero2"]] == [full, full]
    assert [r["param_bytes"] for r in two_ranks["zero3"]] == [pytest.approx(full / 2, rel=0.01)] * 2


@pytest.mark.slow
def test_zero3_takes_zero2s_step_with_a_lora_adapter(two_ranks):
    """With LoRA under ZeRO-3 (the frozen base partitioned too): the same step as ZeRO-2's, and the adapter the push
    reads (all of it gathered at once) is the learner's, under PEFT's names."""
    zero2, zero3 = two_ranks["lora_zero2"][0], two_ranks["lora_zero3"][0]
    assert_same_step(zero2, zero3)
    trained = {name for name in zero3["params"] if ".lora_" in name}
    assert len(zero3["pushed"]) == len(trained) > 0 and all(n.startswith("base_model.model.") for n in zero3["pushed"])
    for name, value in zero3["pushed"].items():
        torch.testing.assert_close(value, zero2["pushed"][name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(value.abs().max() > 0 for name, value in zero3["pushed"].items() if ".lora_B." in name)


def assert_identical(a, b):
    assert a["grad_norms"] == b["grad_norms"]
    for name, value in a["params"].items():
        torch.testing.assert_close(value, b["params"][name], rtol=0, atol=0, msg=name)
    same = {k: v for k, v in a["metrics"].items() if not k.startswith("time/")}
    assert same == {k: v for k, v in b["metrics"].items() if not k.startswith("time/")}


@pytest.mark.slow
def test_on_policy_step_reuses_the_update_forward_bit_for_bit(single_rank):
    # Values, gradients (norms and the parameters after the step) and metrics equal a separate no-grad forward's.
    reused, recomputed = single_rank["reused"], single_rank["recomputed"]
    assert len(reused["grad_norms"]) == 1 and max(reused["micro_batches"]) > 3
    assert_identical(reused, recomputed)
    assert reused["metrics"]["policy/entropy"] > 0


@pytest.mark.slow
def test_rows_of_advantage_zero_are_left_out_and_the_step_is_the_same(single_rank):
    # A group whose samples all scored alike has advantage 0 in every row: with no KL term its rows have no gradient
    # in any loss (tests/test_loss.py), so they are not run; the normalisers count them, so the step is the same.
    skipping, running = single_rank["skipping"], single_rank["not_skipping"]
    assert running["trained"] == list(range(32))
    assert skipping["trained"] == [i for i in range(32) if i // 4 not in (1, 4, 6)]
    assert_same_step(skipping, running)
    assert skipping["metrics"]["loss/policy"] == pytest.approx(running["metrics"]["loss/policy"], rel=1e-5, abs=1e-9)


@pytest.mark.slow
def test_a_non_finite_step_is_skipped_and_counted(single_rank):
    # Rollout 0's advantage is NaN: its optimiser step's gradient norm is not finite, so that step is skipped
    # (no NaN reaches the weights) and counted; the other step of the batch is taken as usual.
    faulty = single_rank["faulty"]
    assert faulty["metrics"]["train/skipped_steps"] == 1
    assert sum(math.isfinite(n) for n in faulty["grad_norms"]) == 1
    assert all(torch.isfinite(p).all() for p in faulty["params"].values())


@pytest.mark.slow
def test_a_batch_with_nothing_to_train_takes_no_step(single_rank):
    # Every completion masked (all truncated under rollout.mask_truncated): the step logs its timings and moves on.
    empty = single_rank["empty"]
    assert empty["grad_norms"] == [] and empty["trained"] == [] and empty["metrics"]["train/skipped_steps"] == 0
    assert {"time/logprob", "time/update"} <= set(empty["metrics"])
