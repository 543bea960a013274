"""Runs the learner's update (`train_on_batch` of apmpo/learner/step.py, steps 6-7) on synthetic rollouts, no server.

    python tests/learner_update_worker.py SCENARIOS.json
    deepspeed --num_gpus 2 tests/learner_update_worker.py SCENARIOS.json

SCENARIOS.json is a list of {"out": dir, "set": [overrides], "recompute_old": bool, "nan_advantage": bool,
"no_rollouts": bool, "alike_groups": [groups], "tiny_advantage": bool}; each scenario builds a fresh model and DeepSpeed engine in this one process (a process and
its DeepSpeed import per scenario cost most of these tests' time), and writes out/rank<r>.pt with the parameters
after the optimiser steps (gathered whole under ZeRO-3), what rank 0's weight push reads of them, the parameter
bytes this rank holds, the gradient norm of each step, the step's metrics and the rollouts this rank trained on. tests/test_learner.py compares scenarios that split the same batch differently.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from apmpo.config import load_config  # noqa: E402
from apmpo.learner import lora  # noqa: E402
from apmpo.learner.batching import plan_step  # noqa: E402
from apmpo.trajectory import Rollout  # noqa: E402
from apmpo.learner.engine import build_engine, close_distributed, init_distributed  # noqa: E402
from apmpo.learner.logprobs import shares_prompts  # noqa: E402
from apmpo.learner.step import train_on_batch  # noqa: E402
from apmpo.learner.zero3 import WholeWeights, gathered_parameters, is_partitioned  # noqa: E402
from apmpo.loss import adaptive_params, group_advantages  # noqa: E402
from apmpo.rollout.weight_sync import StreamedTensors  # noqa: E402
from apmpo.tiny import build_model, build_tokenizer  # noqa: E402


def synthetic_rollouts(num_groups: int, group_size: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(num_groups, group_size, generator=g) > 0.5).float()
    advantages = group_advantages(rewards)
    rollouts = []
    for i in range(num_groups):
        prompt = torch.randint(3, vocab, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        for j in range(group_size):
            n = int(torch.randint(1, 20, (1,), generator=g))
            completion = torch.randint(3, vocab, (n,), generator=g).tolist()
            rollouts.append(Rollout(prompt, completion, [0.0] * n, "stop", group=i, reward=float(rewards[i, j]),
                                    advantage=float(advantages[i, j])))
    return rollouts, rewards


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("scenarios", help="a JSON list of scenarios (the module's docstring)")
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    dist = init_distributed()
    for scenario in json.loads(Path(args.scenarios).read_text()):
        run_scenario(dist, **scenario)
    close_distributed()


def run_scenario(dist, out: str, set: list[str] = (), recompute_old: bool = False,  # noqa: A002
                 nan_advantage: bool = False, no_rollouts: bool = False, alike_groups: list[int] = (),
                 tiny_advantage: bool = False) -> None:
    """recompute_old: old log-probs by a separate forward. nan_advantage: fault injection, rollout 0's advantage is
    NaN (its optimiser step's gradients too). no_rollouts: every completion masked (rollout.mask_truncated with all
    truncated), nothing to train. alike_groups: these groups' samples all scored 1, so their advantages are 0.
    tiny_advantage: the rows of advantage 0 get 1e-30 instead, so that they are
    trained (without a KL term a row of advantage 0 is planned out of the forwards), with a gradient below
    round-off."""
    # adam_eps well above round-off: Adam's first step is ~ lr * sign(g), so with a tiny eps a gradient that is
    # zero up to round-off would turn summation-order noise into +-lr steps and hide what the test compares.
    cfg = load_config(None, ["model.dtype=fp32", "rollout.prompts_per_step=8", "rollout.group_size=4",
                             "train.mini_batch_size=4", "optim.lr=1e-2", "optim.adam_eps=1e-3",
                             "optim.max_grad_norm=1.0", *set])
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, tie_word_embeddings=True, seed=0).train()
    if cfg.model.lora is not None:
        lora.add_adapter(model, cfg.model.lora)
    engine = build_engine(model, cfg, dist)
    reference = build_model(tokenizer, seed=1).requires_grad_(False) if cfg.loss.kl_beta > 0 else None

    rollouts, rewards = synthetic_rollouts(cfg.rollout.prompts_per_step, cfg.rollout.group_size, len(tokenizer))
    for rollout in rollouts:
        if rollout.group in alike_groups:
            rollout.reward, rollout.advantage = 1.0, 0.0
            rewards[rollout.group] = 1.0
    params = adaptive_params(rewards, cfg.loss)
    if nan_advantage:
        rollouts[0].advantage = float("nan")
    if no_rollouts:
        rollouts = []
    if tiny_advantage:
        for rollout in rollouts:
            rollout.advantage = rollout.advantage or 1e-30
    plan = plan_step(rollouts, cfg.mini_batches_per_rollout, dist.world_size, cfg.train.micro_batch_tokens, seed=0,
                     packed=shares_prompts(engine.module), skip_zero_advantage=cfg.loss.kl_beta == 0)  # as train_on_batch plans it
    grad_norms = []
    engine.step = _recording(engine.step, engine, grad_norms)
    metrics = train_on_batch(engine, reference, rollouts, params, cfg, dist, tokenizer.pad_token_id, seed=0,
                             recompute_old=recompute_old)
    Path(out).mkdir(parents=True, exist_ok=True)
    weights = WholeWeights(engine.module, engine, dist.rank, dist.world_size)
    if dist.is_main and cfg.model.lora is not None:
        pushed = {name: t.clone() for name, t in weights.adapter()}
    elif dist.is_main:
        pushed = weights.for_push()  # the push's stream under ZeRO-3, gathered as it is read
        pushed = {name: t.clone() for (name, _, _), t in zip(pushed.specs, pushed.tensors)} \
            if isinstance(pushed, StreamedTensors) else {name: t.detach().clone() for name, t in pushed}
    weights.settle()
    resident = sum((p.ds_tensor if is_partitioned(p) else p).numel() * p.element_size()
                   for p in engine.module.parameters())
    torch.save({"params": {n: t.detach().clone() for n, t in gathered_parameters(engine.module)},
                "pushed": pushed if dist.is_main else None,
                "param_bytes": resident,
                "grad_norms": grad_norms, "micro_batches": [len(step.micro[dist.rank]) for step in plan],
                "metrics": metrics, "trained": sorted(i for step in plan for m in step.micro[dist.rank] for i in m)},
               Path(out) / f"rank{dist.rank}.pt")


def _recording(step, engine, grad_norms):
    def wrapped(*args, **kwargs):
        result = step(*args, **kwargs)
        grad_norms.append(float(engine.get_global_grad_norm()))
        return result

    return wrapped


if __name__ == "__main__":
    main()
