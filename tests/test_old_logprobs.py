"""train.old_logprobs: where the ratio's old log-probs come from in `train_on_batch` (apmpo/learner/step.py).

"recompute" (the default) runs the learner over the batch before its optimiser steps; "engine" takes the engine's
log-probs of the tokens it sampled and runs nothing. The step runs in this process on a tiny model with synthetic
rollouts, through a stand-in for DeepSpeed's engine (plain SGD: what is tested is which log-probs reach the loss, and
that the default step does not depend on the engine's; tests/test_learner.py runs the real engine).
"""
import copy

import pytest
import torch

from apmpo.config import ConfigError, load_config
from apmpo.learner import step as step_module
from apmpo.learner.engine import Dist
from apmpo.learner.update import logprobs
from apmpo.loss import adaptive_params
from apmpo.tiny import build_model, build_tokenizer
from learner_update_worker import synthetic_rollouts

BASE = ["model.dtype=fp32", "rollout.prompts_per_step=8", "rollout.group_size=4", "loss.kl_beta=0"]
SEVERAL_STEPS = BASE + ["train.mini_batch_size=4", "train.micro_batch_tokens=60"]  # 2 optimiser steps, packed
ONE_STEP = BASE + ["train.mini_batch_size=8", "loss.name=grpo"]  # (apmpo would warn: its ratios are all 1)


class PlainEngine:
    """What train_on_batch asks of DeepSpeed's engine, in one process: SGD on the module's parameters."""

    def __init__(self, module, lr: float = 0.5):
        self.module = module
        self.optimizer = torch.optim.SGD(module.parameters(), lr=lr)

    def set_gradient_accumulation_boundary(self, last: bool) -> None:
        pass

    def backward(self, loss) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def was_step_applied(self) -> bool:
        return True

    def get_global_grad_norm(self) -> float:
        return 0.0


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tokenizer()
    return tokenizer, build_model(tokenizer, tie_word_embeddings=True, seed=0).train()


def run_step(tiny, overrides, engine_logprobs, monkeypatch) -> dict:
    """One train_on_batch from the tiny model's weights on the synthetic batch, rollout i carrying the engine
    log-probs engine_logprobs(i, rollout); returns what the step handed the loss, its micro-batches, how many
    log-prob passes it ran, the weights after and the metrics."""
    tokenizer, model = tiny
    cfg = load_config(None, overrides)
    rollouts, rewards = synthetic_rollouts(8, 4, len(tokenizer))
    for i, rollout in enumerate(rollouts):
        rollout.engine_logprobs = engine_logprobs(i, rollout)
    seen = {"old_logp": [], "micro": [], "passes": 0}

    def policy_loss(logp, old_logp, *args, **kwargs):
        seen["old_logp"].append(old_logp.clone())
        return real["policy_loss"](logp, old_logp, *args, **kwargs)

    def collate(*args, **kwargs):
        seen["micro"].append(real["collate"](*args, **kwargs))
        return seen["micro"][-1]

    def logprobs_pass(*args, **kwargs):
        seen["passes"] += 1
        return real["logprobs"](*args, **kwargs)

    real = {name: getattr(step_module, name) for name in ("policy_loss", "collate", "logprobs")}
    for name, stand_in in (("policy_loss", policy_loss), ("collate", collate), ("logprobs", logprobs_pass)):
        monkeypatch.setattr(step_module, name, stand_in)
    learner = copy.deepcopy(model)
    metrics = step_module.train_on_batch(PlainEngine(learner), None, rollouts, adaptive_params(rewards, cfg.loss),
                                         cfg, Dist(0, 1, torch.device("cpu")), tokenizer.pad_token_id, seed=0)
    monkeypatch.undo()
    return {**seen, "cfg": cfg, "metrics": metrics,
            "params": {n: p.detach().clone() for n, p in learner.named_parameters()}}


def learners_logprobs(tiny, run) -> list[torch.Tensor]:
    """The log-probs of each of the run's micro-batches under the tiny model's weights (those before the step)."""
    model = copy.deepcopy(tiny[1])
    with torch.no_grad():
        return [logprobs(model, mb, run["cfg"], torch.device("cpu"), packed=True)[0] for mb in run["micro"]]


def hand_made(i, rollout) -> list[float]:
    """Engine log-probs no learner computes: -0.1, -0.2, ... along the completion."""
    return [-0.1 * (t + 1) for t in range(len(rollout.completion_ids))]


def without(metrics: dict, *prefixes: str) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(prefixes)}


def test_the_default_recomputes_the_old_logprobs_and_ignores_the_engines(tiny, monkeypatch):
    default = run_step(tiny, SEVERAL_STEPS, hand_made, monkeypatch)
    assert default["cfg"].train.old_logprobs == "recompute"
    # Every micro-batch's old log-probs are the learner's own of the weights before the step, bit for bit: a
    # no-grad pass per micro-batch before the update's pass per micro-batch.
    assert len(default["old_logp"]) == len(default["micro"]) > 2
    for old, learner in zip(default["old_logp"], learners_logprobs(tiny, default)):
        assert torch.equal(old, learner)
    assert default["passes"] == 2 * len(default["micro"])
    # Other engine log-probs (correction off, the default): the same step to the last bit; only the logged
    # mismatch moves.
    zeros = run_step(tiny, SEVERAL_STEPS, lambda i, r: [0.0] * len(r.completion_ids), monkeypatch)
    for name, value in default["params"].items():
        assert torch.equal(value, zeros["params"][name]), name
    assert without(default["metrics"], "time/", "rollout/") == without(zeros["metrics"], "time/", "rollout/")
    assert default["metrics"]["rollout/mismatch_kl_k1"] != zeros["metrics"]["rollout/mismatch_kl_k1"]


@pytest.mark.parametrize("plan", [SEVERAL_STEPS, ONE_STEP], ids=["two_optimiser_steps", "one_optimiser_step"])
def test_engine_old_logprobs_are_the_engines_and_nothing_is_recomputed(tiny, monkeypatch, plan):
    engine = run_step(tiny, plan + ["train.old_logprobs=engine"], hand_made, monkeypatch)
    assert len(engine["old_logp"]) == len(engine["micro"])
    for old, mb in zip(engine["old_logp"], engine["micro"]):
        assert torch.equal(old, mb.engine_logp)  # -0.1, -0.2, ... on each completion, 0 elsewhere
        assert float(old[0][mb.loss_mask[0]][0]) == pytest.approx(-0.1)
    assert engine["passes"] == len(engine["micro"])  # the update's passes alone
    assert engine["metrics"]["policy/entropy"] > 0  # measured in the update's passes
    assert not any(key.startswith("rollout/mismatch") for key in engine["metrics"])  # no gap to measure


def test_engine_logprobs_equal_to_the_learners_give_the_default_step(tiny, monkeypatch):
    # Engine log-probs that are the learner's recomputation, bit for bit: the option then takes the default's step
    # exactly, weights and loss; only where the entropy is measured (and the mismatch, 0 here) differ.
    default = run_step(tiny, SEVERAL_STEPS, hand_made, monkeypatch)
    learner = {}
    for mb, logp in zip(default["micro"], learners_logprobs(tiny, default)):
        for row, i in enumerate(mb.indices):
            learner[i] = logp[row][mb.loss_mask[row]].tolist()
    # (rows of advantage 0 are not trained, so not in `learner`: their engine log-probs are never read)
    engine = run_step(tiny, SEVERAL_STEPS + ["train.old_logprobs=engine"],
                      lambda i, r: learner.get(i, [0.0] * len(r.completion_ids)), monkeypatch)
    for name, value in default["params"].items():
        assert torch.equal(value, engine["params"][name]), name
    assert without(engine["metrics"], "time/", "policy/entropy") == without(
        default["metrics"], "time/", "policy/entropy", "rollout/")


def test_the_config_refuses_a_bad_value_and_what_engine_logprobs_cannot_serve():
    assert load_config(None).train.old_logprobs == "recompute"
    with pytest.raises(ConfigError, match=r"train.old_logprobs must be one of \['recompute', 'engine'\], got 'learner'"):
        load_config(None, ["train.old_logprobs=learner"])
    with pytest.raises(ConfigError, match=r"train.old_logprobs: engine .* correction.mode: tis"):
        load_config(None, ["train.old_logprobs=engine", "correction.mode=tis"])
    with pytest.raises(ConfigError, match=r"train.old_logprobs: engine needs rollout.top_p: 1.0"):
        load_config(None, ["train.old_logprobs=engine", "rollout.top_p=0.9"])
