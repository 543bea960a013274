"""Steps 6 and 7 of a training step on every rank: old/reference log-probs, then the optimiser steps.

Both follow the plan of `apmpo.learner.batching.plan_step`, which every rank computes identically.
"""
from __future__ import annotations

import torch
import torch.distributed as torch_dist

from apmpo.config import Config
from apmpo.learner.batching import MicroBatch, Rollout, collate
from apmpo.learner.logprobs import token_logprobs
from apmpo.loss import AdaptiveParams, policy_loss

# Each micro-batch holds a part of its optimiser step's loss: these add up, the other metrics are token means.
ADDITIVE = ("loss/total", "loss/policy", "loss/kl")


def micro_batches(rollouts: list[Rollout], plan: list, rank: int, pad_id: int) -> list[list[MicroBatch]]:
    """This rank's padded micro-batches, per optimiser step."""
    return [[collate(rollouts, indices, pad_id) for indices in ranks[rank]] for ranks in plan]


def logprobs(model, mb: MicroBatch, cfg: Config, device, with_entropy: bool = False):
    return token_logprobs(model, mb.input_ids.to(device), mb.attention_mask.to(device), mb.loss_mask.to(device),
                          temperature=cfg.rollout.temperature, chunk_tokens=cfg.train.logprob_chunk_tokens,
                          with_entropy=with_entropy, **{k: v.to(device) for k, v in mb.extras.items()})


def truncated_importance_weights(mb: MicroBatch, cap: float, device) -> torch.Tensor:
    """Sequence-level truncated importance sampling against the generation engine: the learner's old policy
    and the engine differ numerically (and by a step in async set-ups). w_i = min(exp(mean_t(log pi_old -
    log pi_engine)), cap), the geometric mean of the per-token ratios, applied to the advantage so it fits
    every loss alike (a per-token weight has no meaning inside APMPO's power mean)."""
    mask = mb.loss_mask.to(device)
    log_ratio = ((mb.old_logp - mb.engine_logp.to(device)) * mask).sum(-1) / mask.sum(-1)
    return torch.exp(log_ratio).clamp(max=cap)


@torch.no_grad()
def old_and_reference_logprobs(policy, reference, micro: list[list[MicroBatch]], cfg: Config, device) -> dict:
    """Fills mb.old_logp (and mb.ref_logp) before the first update; returns entropy sums for the metrics."""
    entropy_sum = torch.zeros((), device=device)
    tokens = 0.0
    for mb in (mb for mini in micro for mb in mini):
        mb.old_logp, entropy = logprobs(policy, mb, cfg, device, with_entropy=True)
        entropy_sum += (entropy * mb.loss_mask.to(device)).sum() * mb.weight
        tokens += float(mb.loss_mask.sum()) * mb.weight
        if reference is not None:
            mb.ref_logp, _ = logprobs(reference, mb, cfg, device)
    return {"policy/entropy": entropy_sum, "_tokens": torch.tensor(tokens, device=device)}


def optimize(engine, micro: list[list[MicroBatch]], plan: list, rollouts: list[Rollout], params: AdaptiveParams,
             cfg: Config, world_size: int, device) -> dict:
    """`epochs` passes over the mini-batches, one DeepSpeed optimiser step each. Returns metric sums."""
    groups = torch.tensor([r.group for r in rollouts])
    totals: dict = {}
    for _ in range(cfg.train.epochs):
        for mini, ranks in zip(micro, plan):
            # Global counts of this optimiser step. DeepSpeed averages gradients over ranks, hence / world_size.
            indices = [i for rank in ranks for m in rank for i in m]
            num_seqs = len(indices) / world_size
            num_tokens = sum(len(rollouts[i].completion_ids) for i in indices) / world_size
            for k, mb in enumerate(mini):
                engine.set_gradient_accumulation_boundary(k == len(mini) - 1)
                logp, _ = logprobs(engine.module, mb, cfg, device)
                advantages = mb.advantages.to(device)
                if cfg.train.tis_cap is not None:
                    advantages = advantages * truncated_importance_weights(mb, cfg.train.tis_cap, device)
                loss, metrics = policy_loss(
                    logp, mb.old_logp, advantages, mb.loss_mask.to(device), cfg.loss,
                    params.per_sequence(groups[mb.indices]), ref_logp=mb.ref_logp,
                    num_seqs=num_seqs, num_tokens=num_tokens)
                engine.backward(loss * mb.weight)
                tokens = float(mb.loss_mask.sum())
                for key, value in metrics.items():  # on the device: no host sync per micro-batch
                    totals[key] = totals.get(key, 0.0) + value * (mb.weight if key in ADDITIVE else mb.weight * tokens)
                totals["_weight"] = totals.get("_weight", 0.0) + mb.weight * tokens
            engine.step()
    return totals


def reduce_metrics(totals: dict, device, world_size: int, optimizer_steps: int) -> dict[str, float]:
    """One all-reduce of every rank's sums, then means: loss per optimiser step, token means, and the
    entropy per completion token."""
    keys = sorted(totals)
    values = torch.stack([torch.as_tensor(totals[k], dtype=torch.float32, device=device) for k in keys])
    if world_size > 1:
        torch_dist.all_reduce(values)
    sums = dict(zip(keys, values.tolist()))
    weight, tokens, entropy = sums.pop("_weight", 0.0), sums.pop("_tokens"), sums.pop("policy/entropy")
    # Each rank's loss part is scaled by world_size (DeepSpeed averages gradients over ranks): undo it here.
    means = {k: v / (max(optimizer_steps, 1) * world_size) if k in ADDITIVE else v / max(weight, 1e-12) for k, v in sums.items()}
    return {**means, "policy/entropy": entropy / max(tokens, 1.0)}
