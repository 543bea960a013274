"""The learner's part of a training step on every rank (steps 6-7 of docs/ARCHITECTURE.md): `train_on_batch` plans
the batch's micro-batches, computes the old and reference log-probs, then runs the optimiser steps, the micro-batch
loop (log-probs, `policy_loss`, backward, step) written out in one place. launch/train.py's loop calls it once a
step; the GPU check, the bf16 benchmark and the learner tests call the same function."""
from __future__ import annotations

import time

import torch

from apmpo.config import Config
from apmpo.learner import lora
from apmpo.learner.batching import collate, plan_step
from apmpo.trajectory import Rollout
from apmpo.learner.engine import Dist, start_micro_batch
from apmpo.learner.logprobs import shares_prompts
from apmpo.learner.update import StepTotals, logprobs, rollout_correction
from apmpo.loss import AdaptiveParams, policy_loss


def train_on_batch(engine, reference, rollouts: list[Rollout], params: AdaptiveParams, cfg: Config, dist: Dist,
                   pad_id: int, seed: int, recompute_old: bool = False) -> dict[str, float]:
    """Steps 6-7 on every rank: old and reference log-probs, then `epochs` passes over the mini-batches, one
    DeepSpeed optimiser step each. Returns the step's metrics, reduced over ranks, with their timings."""
    # Completions of one prompt packed into shared rows (apmpo/learner/logprobs.py): decided here, once, for the plan
    # of micro-batches and for every forward of the step.
    packed = shares_prompts(engine.module) and not any(r.mm for r in rollouts)
    # Without a KL term a row of advantage 0 has no gradient in any loss: it is planned out of every forward.
    plan = plan_step(rollouts, cfg.mini_batches_per_rollout, dist.world_size, cfg.train.micro_batch_tokens, seed,
                     packed, skip_zero_advantage=cfg.loss.kl_beta == 0)
    micro = [[collate(rollouts, indices, pad_id) for indices in step.micro[dist.rank]] for step in plan]
    groups = torch.tensor([r.group for r in rollouts])
    totals, times, device = StepTotals(), {}, dist.device
    # Where the old log-probs come from. "engine" (train.old_logprobs): the engine's own, of the tokens it sampled,
    # and no forward pass. "update": one optimiser step on the batch it sampled, so the old policy is the current
    # one and the old log-probs are the update forward's own, detached (as TRL and verl do): a whole forward pass is
    # saved and the step is the same bit for bit (tests/test_learner.py). "recompute": a forward pass first.
    if cfg.train.old_logprobs == "engine":
        old_from = "engine"
    else:
        old_from = "update" if len(plan) == 1 and cfg.train.epochs == 1 and not recompute_old else "recompute"

    # -------------------------------------------------------------- 6. old and reference log-probs
    tick = time.perf_counter()
    with torch.no_grad():
        for mb in (mb for mini in micro for mb in mini):
            if old_from == "engine":
                mb.old_logp = mb.engine_logp.to(device)  # 0 off the loss mask, as the learner's
            elif old_from == "recompute":
                mb.old_logp, entropy = logprobs(engine.module, mb, cfg, device, packed, with_entropy=True)
                totals.add_entropy(entropy, mb, device)
            if reference is not None:
                with lora.adapter_disabled(reference):
                    mb.ref_logp, _ = logprobs(reference, mb, cfg, device, packed)
    times["time/logprob"] = time.perf_counter() - tick

    # -------------------------------------------------------------- 7. update: epochs x mini-batches
    tick = time.perf_counter()
    skipped = 0
    for epoch in range(cfg.train.epochs):
        for step, mini in zip(plan, micro):
            for k, mb in enumerate(mini):
                start_micro_batch(engine, last=k == len(mini) - 1)
                entropy_here = old_from != "recompute" and epoch == 0  # policy/entropy: once a micro-batch
                logp, entropy = logprobs(engine.module, mb, cfg, device, packed, with_entropy=entropy_here)
                if old_from == "update":
                    mb.old_logp = logp.detach()
                if entropy_here:
                    totals.add_entropy(entropy, mb, device)
                # Importance weights against the engine that sampled (cfg.correction); the mismatch is logged. With
                # the engine's log-probs as the old ones there is no gap to weigh or measure (the config refuses a
                # correction then).
                advantages, token_weights = (rollout_correction(mb, cfg.correction, totals, device)
                                             if old_from != "engine" else (mb.advantages.to(device), None))
                # Global normalisers of this optimiser step; DeepSpeed averages gradients over ranks, hence / world.
                loss, metrics = policy_loss(
                    logp, mb.old_logp, advantages, mb.loss_mask.to(device), cfg.loss,
                    params.per_sequence(groups[mb.indices]), ref_logp=mb.ref_logp,
                    num_seqs=step.num_seqs / dist.world_size, num_tokens=step.num_tokens / dist.world_size,
                    token_weights=token_weights)
                engine.backward(loss * mb.weight)
                totals.add(metrics, mb)
            engine.step()  # skipped by DeepSpeed, gradients cleared, when the gradient norm is not finite
            skipped += not engine.was_step_applied()
    times["time/update"] = time.perf_counter() - tick
    return {**totals.reduce(device, dist.world_size, len(plan) * cfg.train.epochs), **times,
            "optim/grad_norm": float(engine.get_global_grad_norm() or 0.0), "train/skipped_steps": skipped}
