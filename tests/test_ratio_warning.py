"""With one optimiser step per rollout batch every ratio is 1: APMPO's, GMPO's and GSPO's gradients then equal
GRPO's (measured here), and a config that trains one of them that way is warned at load."""
import warnings

import pytest
import torch

from apmpo.config import RATIO_LOSSES, ConfigWarning, load_config
from apmpo.loss import LossConfig, adaptive_params, advantages_for, policy_loss


@pytest.mark.parametrize("name", RATIO_LOSSES)
def test_at_ratio_one_the_gradient_is_grpos(name):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (4, 4), generator=g).float()
    rewards[0] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # a mixed group, whatever the draw
    mask = torch.rand(16, 12, generator=g) < 0.8
    mask[:, 0] = True  # every sequence has a token
    old = -torch.rand(16, 12, generator=g, dtype=torch.float64) * 3

    def gradient(loss_name: str) -> torch.Tensor:
        cfg = LossConfig(name=loss_name, kl_beta=0.0)
        logp = old.clone().requires_grad_()  # the current policy is the old one: ratio exactly 1
        loss, _ = policy_loss(logp, old, advantages_for(rewards, cfg).flatten(), mask, cfg,
                              adaptive_params(rewards, cfg))
        loss.backward()
        return logp.grad

    grpo = gradient("grpo")
    assert grpo.abs().max() > 1e-3  # a gradient that is there to compare
    torch.testing.assert_close(gradient(name), grpo, rtol=0, atol=1e-7)


def _caught(overrides):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config("configs/quickstart.yaml", overrides)
    return [w for w in caught if issubclass(w.category, ConfigWarning)]


@pytest.mark.parametrize("name", RATIO_LOSSES)
def test_one_step_per_batch_warns_for_ratio_losses(name):
    one_step = [f"loss.name={name}", "train.mini_batch_size=16"]  # quickstart: 16 prompts per step
    [warning] = _caught(one_step)
    assert f"loss.name {name} with one optimiser step per rollout batch" in str(warning.message)
    assert "the gradient equals GRPO's" in str(warning.message)


@pytest.mark.parametrize("overrides", [
    ["loss.name=apmpo"],  # quickstart: 2 mini-batches of 8 prompts
    ["loss.name=apmpo", "train.mini_batch_size=16", "train.epochs=2"],
    ["loss.name=apmpo", "train.mini_batch_size=16", "train.max_staleness=1"],
    ["loss.name=grpo", "train.mini_batch_size=16"],
    ["loss.name=dapo", "train.mini_batch_size=16"],
])
def test_no_warning_when_ratios_move_or_the_loss_is_grpo_like(overrides):
    assert _caught(overrides) == []
