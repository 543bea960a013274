"""Broken rewards in a real run (`launch/train.py` on the quickstart, real server and DeepSpeed, through the
`deepspeed` launcher with 2 learner ranks: conftest's two_rank_run, shared with test_train_cli): a reward that
returns NaN now and then is scored 0 and counted while training goes on. Rewards that crash or hang on every
completion stop the step with the error named: tests/test_collect.py, without a server."""
import math

import pytest
from safetensors.torch import load_file

from train_runs import metrics


@pytest.mark.slow
def test_nan_rewards_are_failures_and_training_goes_on(two_rank_run):
    """Before: reward/mean, loss/policy and optim/grad_norm were null every step, reward/failures 0, no warning,
    and the saved weights equalled the starting model."""
    done, run_dir = two_rank_run  # the reward: tests/failing_rewards.py's nan_every_20th
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in ("reward/mean", "loss/policy", "optim/grad_norm"):
            assert r[key] is not None and math.isfinite(r[key]), (key, r)
    failures = sum(r["reward/failures"] for r in records)
    assert 0 < failures < 2 * 128 / 2, failures
    assert done.stderr.count("the reward returned nan, not a finite float32 number") == 1  # logged once
    start = load_file(run_dir / "model/model.safetensors")
    trained = load_file(run_dir / "checkpoints/step_2/hf/model.safetensors")
    assert any(not start[name].equal(trained[name]) for name in start)
