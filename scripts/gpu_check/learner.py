"""The learner's checks: one training step's learner part on a random Qwen2.5-1.5B-shaped model under DeepSpeed
(learner_gc, learner_no_gc, learner_fp32_comm, learner_zero3, learner_fp16), and ZeRO-2's gradients against a plain
torch backward (zero2_grads)."""
from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time

import torch

from scripts.gpu_check.measure import (DRY_RUN, CheckFailed, GiB, Outcome, PeakMemory, Shapes, peak_flops,
                                       random_model_dir, synchronize)
from scripts.gpu_check.wheels import require_deepspeed


def check_learner(s: Shapes, gradient_checkpointing: bool, communication_data_type: str | None = None,
                  zero_stage: int = 2, dtype: str | None = None) -> Outcome:
    """Steps 6-7 of a training step (`train_on_batch`, apmpo/learner/step.py) on a random Qwen2.5-1.5B-shaped model.
    `communication_data_type` (train.communication_data_type): fp32 reduce-scatters the gradients in fp32. On one
    rank nothing crosses a wire: its figure is the cost of the casts, and a multi-GPU run adds twice the bytes.
    `zero_stage` 3: the weights are partitioned (on one rank, whole) and gathered a module at a time; the figure is
    the gathers' and hooks' cost on the same shape. `dtype` (model.dtype; None: the shapes'): fp16 runs DeepSpeed's
    fp16 with dynamic loss scaling, whose skipped steps (the scale's search) are reported, not failed."""
    require_deepspeed()
    from apmpo.config import Config, ModelConfig, RolloutConfig, TrainConfig
    from apmpo.trajectory import Rollout
    from apmpo.learner.zero3 import full_shape
    from apmpo.learner.engine import (build_engine, init_distributed, load_model, loss_scale_metrics,
                                      partition_reference)
    from apmpo.learner.step import train_on_batch
    from apmpo.loss import adaptive_params, group_advantages

    dist = init_distributed()
    model_dir = random_model_dir(s)
    dtype = dtype or {torch.bfloat16: "bf16", torch.float32: "fp32"}[s.dtype]
    # Without checkpointing, 16384 tokens of 1.5B activations (~60 GB in bf16) and the ZeRO-2 states (~27 GB)
    # exceed an 80 GB GPU: that run takes a quarter of the budget, and says so.
    micro_batch_tokens = s.micro_batch_tokens if gradient_checkpointing else s.micro_batch_tokens // 4
    cfg = Config(model=ModelConfig(path=model_dir, dtype=dtype, gradient_checkpointing=gradient_checkpointing),
                 rollout=RolloutConfig(prompts_per_step=s.prompts, group_size=s.group_size),
                 train=TrainConfig(mini_batch_size=s.prompts, micro_batch_tokens=micro_batch_tokens,
                                   communication_data_type=communication_data_type, zero_stage=zero_stage))
    g = torch.Generator().manual_seed(0)
    rewards = (torch.rand(s.prompts, s.group_size, generator=g) > 0.5).float()
    advantages = group_advantages(rewards).flatten().tolist()
    vocab = s.model["vocab_size"]
    rollouts = [Rollout(torch.randint(vocab, (s.prompt_tokens,), generator=g).tolist(),
                        torch.randint(vocab, (s.completion_tokens,), generator=g).tolist(),
                        [-1.0] * s.completion_tokens, "stop", group=i // s.group_size, advantage=advantages[i])
                for i in range(s.prompts * s.group_size)]
    params = adaptive_params(rewards, cfg.loss)

    memory = PeakMemory(s.device)
    memory.reset()
    with deepspeed_fp16_on_cpu() if dtype == "fp16" and s.device == "cpu" else contextlib.nullcontext():
        engine = build_engine(load_model(model_dir, cfg, dist.device), cfg, dist)
        reference = partition_reference(load_model(model_dir, cfg, dist.device, trainable=False), cfg) \
            if cfg.loss.kl_beta > 0 else None
    dithered = dithered_share(engine.module) if dtype != "fp32" and zero_stage != 3 else None  # ZeRO-3: partitioned
    models = 1 + (reference is not None)  # that the old (and reference) log-probs run the rows through
    try:
        logprob_s, update_s, metrics, skipped = [], [], {}, 0
        for i in range(1 + s.repeats):  # the first is a warm-up
            synchronize(s.device)
            start = time.perf_counter()
            # recompute_old: the old log-probs get their own forward, as with the paper's 4 optimiser steps per batch
            metrics = train_on_batch(engine, reference, rollouts, params, cfg, dist, pad_id=0, seed=i,
                                     recompute_old=True) | loss_scale_metrics(engine)
            skipped += metrics["train/skipped_steps"]
            synchronize(s.device)
            if i:
                # The log-prob phase is timed inside without a final device sync, so its last forward may end
                # inside the update's time: the update figures are, if anything, understated.
                logprob_s.append(metrics["time/logprob"])
                update_s.append(time.perf_counter() - start - metrics["time/logprob"])
        peak = memory.peak()
        num_params = sum(math.prod(full_shape(p)) for p in engine.module.parameters())
        checkpointing = engine.module.is_gradient_checkpointing  # what load_model made of the setting
        engine_comm_dtype = engine.communication_data_type  # what DeepSpeed made of train.communication_data_type
    finally:
        if hasattr(engine, "destroy"):
            engine.destroy()
        del engine, reference
        gc.collect()
        if s.device == "cuda":
            torch.cuda.empty_cache()
    # fp16: a step skipped for an overflow of the scaled gradients (its grad norm inf) is the loss scaler's search
    scaler_skip = dtype == "fp16" and metrics["train/skipped_steps"] and math.isfinite(metrics["loss/total"])
    bad = {k: v for k, v in metrics.items() if not math.isfinite(v) and not (scaler_skip and k == "optim/grad_norm")}
    if bad or (skipped if dtype != "fp16" else skipped == 1 + s.repeats):
        raise CheckFailed(f"non-finite metrics {bad}, {skipped} of {1 + s.repeats} optimiser steps skipped")

    tokens = sum(r.num_tokens for r in rollouts)
    update, logprob = statistics.median(update_s), statistics.median(logprob_s)
    flops = 6 * num_params * tokens
    m = s.model
    attention = 6 * m["num_hidden_layers"] * m["hidden_size"] * sum(r.num_tokens**2 for r in rollouts)
    peak_flops_per_s = peak_flops(s)
    figures = {
        "params": num_params, "tokens_per_step": tokens, "update_s": update, "tokens_per_s": tokens / update,
        "mfu": flops / update / peak_flops_per_s, "mfu_with_attention": (flops + attention) / update / peak_flops_per_s,
        "logprob_s": logprob, "logprob_tokens_per_s": tokens * models / logprob,
        "peak_memory_gib": peak / GiB, "memory_at_start_gib": memory.base / GiB,
        "grad_norm": metrics["optim/grad_norm"], "reference_model": models == 2,
        "gradient_checkpointing": checkpointing, "peak_tflops": peak_flops_per_s / 1e12,
        "micro_batch_tokens": micro_batch_tokens,
        "communication_data_type": str(engine_comm_dtype).removeprefix("torch."), "zero_stage": zero_stage,
        "dtype": dtype, "masters_dithered_share": dithered, "loss": metrics["loss/total"], "skipped_steps": skipped,
        "steps": 1 + s.repeats,
        **({"loss_scale": metrics["optim/loss_scale"]} if "optim/loss_scale" in metrics else {}),
    }
    return Outcome(figures, f"{tokens / update:,.0f} tokens/s in the update, MFU {figures['mfu']:.1%} "
                            f"({figures['mfu_with_attention']:.1%} with attention), peak memory {peak / GiB:.1f} GiB, "
                            f"{num_params / 1e6:,.1f}M params, {tokens} tokens per step, "
                            f"micro_batch_tokens {micro_batch_tokens}"
                            + (f", loss scale {metrics['optim/loss_scale']:g}, {skipped} of {1 + s.repeats} steps "
                               "skipped" if "optim/loss_scale" in metrics else ""))


def dithered_share(module) -> float:
    """The share of the trainable weights whose fp32 master (optim.dither_master) lies off its bf16 or fp16 weight;
    raises CheckFailed where a master does not round to its weight (the forward would not be the master's)."""
    from deepspeed.utils import safe_get_full_fp32_param

    moved = total = 0
    for param in (p for p in module.parameters() if p.requires_grad):
        master = safe_get_full_fp32_param(param)
        if not torch.equal(master.to(param.dtype), param.detach()):
            raise CheckFailed(f"a master does not round to its {param.dtype} weight")
        moved += int((master != param.detach().float()).sum())
        total += master.numel()
    return moved / total


@contextlib.contextmanager
def deepspeed_fp16_on_cpu():
    """DeepSpeed builds an fp16 engine on this CPU, whose oneDNN has no fp16 (its accelerator's check, which
    apmpo.config.native_fp16 repeats for a run, is lifted meanwhile). A WORKAROUND for the dry run only: its fp16
    matmuls are converted to fp32, slow but right at tiny shapes, so that the fp16 learner's code (loss scaling,
    skipped steps) runs here too."""
    from deepspeed.accelerator import get_accelerator

    accelerator = type(get_accelerator())
    check = accelerator.is_fp16_supported
    accelerator.is_fp16_supported = lambda self: True
    try:
        yield
    finally:
        accelerator.is_fp16_supported = check


def check_zero2_grads(s: Shapes) -> Outcome:
    """ZeRO-2 gradients on one rank equal a plain torch backward of the same loss. The learner runs its forwards
    through `engine.module`, which skips DeepSpeed's forward bookkeeping, and relies on `engine.backward`'s
    epilogue (DeepSpeed 0.19.8) to reduce the gradients at the accumulation boundary: a DeepSpeed upgrade that
    changes this fails here. Two micro-batches, the boundary on the second, in fp32 so that the two agree to
    summation order."""
    require_deepspeed()
    import copy

    from deepspeed.utils import safe_get_full_grad

    from apmpo.config import Config, ModelConfig
    from apmpo.learner.engine import build_engine, init_distributed, load_model
    from apmpo.learner.logprobs import token_logprobs

    dist = init_distributed()
    model_dir = random_model_dir(DRY_RUN)  # a small model: this checks the gradients' path, not speed
    cfg = Config(model=ModelConfig(path=model_dir, dtype="fp32", gradient_checkpointing=False))
    model = load_model(model_dir, cfg, dist.device)
    plain = copy.deepcopy(model)
    engine = build_engine(model, cfg, dist)
    g = torch.Generator().manual_seed(1)
    vocab = DRY_RUN.model["vocab_size"]
    micro_batches = []
    for rows, length in ((3, 40), (2, 56)):
        ids = torch.randint(vocab, (rows, length), generator=g).to(dist.device)
        scored = torch.zeros_like(ids, dtype=torch.bool)
        scored[:, length // 2:] = True
        micro_batches.append((ids, torch.ones_like(ids), scored, torch.randn(rows, 1, generator=g).to(dist.device)))

    def loss(module, ids, mask, scored, advantage):  # the policy-gradient shape: -(A * logp) over scored tokens
        logp, _ = token_logprobs(module, ids, mask, scored, chunk_tokens=32)
        return -(advantage * logp).sum() / 100.0

    try:
        for k, batch in enumerate(micro_batches):
            engine.set_gradient_accumulation_boundary(k == len(micro_batches) - 1)
            engine.backward(loss(engine.module, *batch))
            loss(plain, *batch).backward()
        worst, names = 0.0, 0
        for (name, p), (_, q) in zip(engine.module.named_parameters(), plain.named_parameters(), strict=True):
            got = safe_get_full_grad(p)
            if got is None:
                raise CheckFailed(f"DeepSpeed holds no gradient for {name} after the accumulation boundary")
            scale = q.grad.abs().max().item() or 1.0
            worst = max(worst, (got.float() - q.grad.float()).abs().max().item() / scale)
            names += 1
    finally:
        if hasattr(engine, "destroy"):
            engine.destroy()
    if not worst <= 1e-4:
        raise CheckFailed(f"ZeRO-2 gradients differ from torch's by up to {worst:.3g} of each tensor's largest")
    return Outcome({"tensors": names, "max_relative_diff": worst},
                   f"{names} gradients equal torch's within {worst:.1e} (relative to each tensor's largest)")
