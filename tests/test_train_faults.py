"""Broken rewards in a real run (`python launch/train.py` on the quickstart, real server and DeepSpeed): a reward
that returns NaN now and then is scored 0 and counted while training goes on. Rewards that crash or hang on every
completion stop the step with the error named: tests/test_collect.py, without a server."""
import math
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

from train_runs import metrics, run, train_command

TESTS = Path(__file__).resolve().parent
# The custom rewards live in tests/failing_rewards.py, named as a user names theirs: pkg.module:function.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def quickstart(out_dir: Path, reward: str, *overrides: str) -> list[str]:
    return train_command("configs/quickstart.yaml", f"logging.output_dir={out_dir}", f"data.reward={reward}",
                         "train.steps=2", *overrides)


@pytest.mark.slow
def test_nan_rewards_are_failures_and_training_goes_on(tmp_path):
    """Before: reward/mean, loss/policy and optim/grad_norm were null every step, reward/failures 0, no warning,
    and the saved weights equalled the starting model."""
    done = run(quickstart(tmp_path, "failing_rewards:nan_every_20th", "checkpoint.save_every=2"), env=ENV)
    records = metrics(tmp_path / "quickstart")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in ("reward/mean", "loss/policy", "optim/grad_norm"):
            assert r[key] is not None and math.isfinite(r[key]), (key, r)
    failures = sum(r["reward/failures"] for r in records)
    assert 0 < failures < 2 * 128 / 2, failures
    assert done.stderr.count("the reward returned nan, not a finite float32 number") == 1  # logged once
    start = load_file(tmp_path / "quickstart/model/model.safetensors")
    trained = load_file(tmp_path / "quickstart/checkpoints/step_2/hf/model.safetensors")
    assert any(not start[name].equal(trained[name]) for name in start)
