"""DeepSpeed ZeRO set-up for the policy (stage 2 by default, 3 for a model that does not fit replicated), and the
frozen reference model.

Gradient accumulation is ours, not DeepSpeed's: micro-batches come from a token budget, so their number
varies per optimiser step. DeepSpeed is configured with gradient_accumulation_steps=1 (its backward then
applies no 1/GAS scaling) and told where each step ends with `set_gradient_accumulation_boundary`; the loss
carries the global normalisers (see apmpo.loss.policy_loss), so a step is independent of the split.
"""
from __future__ import annotations

import datetime
import importlib
import math
import os
from dataclasses import dataclass

import torch

from apmpo.config import Config, ConfigError
from apmpo.cpu_memory import keep_freed_memory
from apmpo.cpu_threads import usable_cores
from apmpo.learner.logprobs import attach_logprob_head


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_s: float = 7200.0, overlap: bool = True) -> Dist:
    """Starts torch.distributed through DeepSpeed (gloo on CPU, NCCL on GPU); also works without a launcher.
    `timeout_s` bounds every collective: ranks 1..N wait in the batch broadcast while rank 0 starts the server
    and generates, so it must exceed the longest rollout (train.dist_timeout_s). `overlap`: a
    generation server computes while the learner does (Config.overlap); on CPU it then keeps a core."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        from apmpo.rollout.net import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        # DeepSpeed compiles a shared-memory all-reduce op (~60 s on a fresh machine) when it creates its
        # communication backend. Only its inference all-reduce uses it; ZeRO's collectives go through gloo.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # else torch took it when it loaded
            torch.set_num_threads(cpu_threads(usable_cores(), int(os.environ["WORLD_SIZE"]), overlap))
        keep_freed_memory()
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo",
                               timeout=datetime.timedelta(seconds=timeout_s))
    return Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device)


def close_distributed() -> None:
    """Tears this rank's process group down once every rank is past its last collective. Every rank of a
    several-rank group ends with it (launch/train.py, the tests' workers): a rank that exited while another's gloo
    threads still ran aborted that one ('terminate called without an active exception', exit -6), now and then,
    under load. A lone rank has no peer to abort (scripts/gpu_check/ runs its checks in one)."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def cpu_threads(cores: int, world_size: int, overlap: bool) -> int:
    """Compute threads of each CPU learner rank. In the synchronous loop the server is idle while the learner
    computes, so the ranks share every core: on 2 cores, 2 threads against 1 took the quickstart's log-probs from
    0.21 to 0.14 s and its update from 0.67 to 0.46 s (64 tokens; the CPU engine in the server's process, its
    one OpenMP thread idle). When the server generates meanwhile, it keeps a core: oversubscribed OpenMP teams
    spin against each other (with vLLM's engine processes busy beside it, 2 threads made a step 3-4x slower)."""
    return max(1, cores // (world_size + overlap))


def visible_gpus(env: dict[str, str] = os.environ, gpu_count: int | None = None) -> list[str]:
    """The physical ids of the GPUs this process may use: CUDA_VISIBLE_DEVICES's, or 0 to the count without it."""
    gpu_count = torch.cuda.device_count() if gpu_count is None else gpu_count
    visible = env.get("CUDA_VISIBLE_DEVICES")
    return [d.strip() for d in visible.split(",")] if visible else [str(i) for i in range(gpu_count)]


def check_devices(cfg: Config, env: dict[str, str] = os.environ, gpu_count: int | None = None) -> bool:
    """Before anything starts: a config that names server GPUs needs a learner that sees CUDA (else it would
    quietly train on the CPU), and every server's GPUs must not overlap the learner's, except the one shared-GPU
    set-up (a single server on exactly rank 0's GPU, weights over CUDA IPC). Several servers on a GPU machine need
    GPUs named for each. Device ids are physical, as in CUDA_VISIBLE_DEVICES. Raises ConfigError naming
    rollout.devices. Returns whether a server this run starts shares rank 0's GPU."""
    from apmpo.rollout.launcher import device_groups

    devices, num_servers = cfg.rollout.devices, cfg.rollout.num_servers
    gpu_count = torch.cuda.device_count() if gpu_count is None else gpu_count
    if devices is None:
        started_here = gpu_count > 0 and cfg.rollout.url is None and cfg.rollout.urls is None
        if num_servers > 1 and started_here:
            raise ConfigError(f"rollout.num_servers={num_servers} on a GPU machine needs rollout.devices, one group "
                              "of GPUs per server (e.g. \"4;5;6;7\"): without it every server would take GPU 0")
        return started_here  # on the first visible GPU, rank 0's
    if gpu_count == 0:
        raise ConfigError(
            f"rollout.devices={devices!r} names GPUs, but this learner sees no CUDA device (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda}): it would train on the CPU. Check the driver and the torch build "
            "(bash scripts/install.sh checks both), or set rollout.devices: null to run everything on the CPU.")
    groups = [group.split(",") for group in device_groups(devices)]  # valid: checked at load
    visible = visible_gpus(env, gpu_count)
    local_ranks = int(env.get("LOCAL_SIZE") or env.get("LOCAL_WORLD_SIZE") or env.get("WORLD_SIZE") or 1)
    learner = visible[:local_ranks]
    shared = [d for group in groups for d in group if d in learner]
    if not shared:
        return False
    if groups == [learner[:1]] and cfg.rollout.weight_sync in ("auto", "cuda_ipc"):
        return True  # one server on one GPU shared with rank 0: cuda_ipc (gpu_memory_utilization must leave room)
    raise ConfigError(
        f"rollout.devices={devices!r} overlaps the learner's GPUs {learner} (GPU {', '.join(shared)}): NCCL cannot "
        "put two ranks of the weight-sync group on one GPU. Give every server GPUs of its own, or share exactly "
        f"rank 0's GPU with a single server (rollout.devices: \"{learner[0]}\", weight_sync auto or cuda_ipc).")


def torch_dtype(cfg: Config) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.model.dtype]


def head_dtype(cfg: Config) -> torch.dtype | None:
    """The learner's LM-head dtype for apmpo.learner.logprobs: fp32, or None for the model's (model.head_dtype)."""
    return torch.float32 if cfg.model.head_dtype == "fp32" else None


def load_model(path: str, cfg: Config, device: torch.device, trainable: bool = True):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from apmpo.data.vision import is_vision_language

    vision = is_vision_language(path)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch_dtype(cfg))
    model.to(device)
    if cfg.model.dtype == "fp16":  # a bf16 or fp32 checkpoint's weights past fp16's range (65504) became infinite
        beyond = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
        if beyond:
            raise ValueError(f"model.dtype: fp16: {len(beyond)} weight(s) of {path} lie beyond fp16's range "
                             f"(65504), e.g. {beyond[0]}; use bf16")
    if not trainable:
        return model.eval().requires_grad_(False)
    if cfg.model.lora is not None:  # only the adapter trains (the vision tower and merger too stay frozen)
        from apmpo.learner.lora import add_adapter

        add_adapter(model, cfg.model.lora)
    elif vision and cfg.model.freeze_vision_tower:
        # The vision encoder's blocks; the merger (the projector into the language model) stays trainable.
        tower = model.model.visual
        for name, param in tower.named_parameters():
            param.requires_grad_(name.startswith("merger."))
    if checkpoints_activations(cfg, device):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if cfg.model.compile:
        from apmpo.learner.compiled import compile_elementwise

        print(f"[apmpo] {compile_elementwise(model)}", flush=True)
    # from_pretrained returns eval mode, and transformers checkpoints activations only in train mode. Train
    # mode also turns dropout on: Qwen2/2.5 have none (attention_dropout 0), so log-probs are unchanged; a model
    # with dropout would make the ratio pi/pi_old noisy, hence the check.
    _check_no_dropout(model)
    return model.train()


def checkpoints_activations(cfg: Config, device: torch.device) -> bool:
    """model.gradient_checkpointing, its default (None) resolved: on for a GPU learner, off on CPU."""
    setting = cfg.model.gradient_checkpointing
    return device.type == "cuda" if setting is None else setting


def _check_no_dropout(model) -> None:
    active = sorted({f"{name}={m.p}" for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Dropout) and m.p > 0})
    rates = {k: v for k, v in model.config.to_dict().items() if "dropout" in k and isinstance(v, float) and v > 0}
    if active or rates:
        raise ValueError(f"the policy has dropout ({active or rates}): RL ratios need deterministic log-probs; "
                         "set those rates to 0 in the model's config.json")


def partition_reference(model, cfg: Config):
    """Under ZeRO-3 the frozen reference model is partitioned as the policy is (a DeepSpeed engine with no
    optimiser, whose forward gathers a layer at a time), rather than replicated whole on every rank; otherwise it
    is returned as it is."""
    if cfg.train.zero_stage != 3:
        return model
    import deepspeed

    attach_logprob_head(model)
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
        "bf16": {"enabled": cfg.model.dtype == "bf16"}, "fp16": {"enabled": cfg.model.dtype == "fp16"},
        "steps_per_print": 1 << 30})
    return engine.module


def lr_lambda(cfg: Config):
    """Linear warm-up, then constant, cosine or linear decay to 0 over the remaining optimiser steps."""
    warmup = cfg.optim.warmup_steps
    total = cfg.total_optimizer_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1 + math.cos(math.pi * progress)) if cfg.optim.schedule == "cosine" else 1.0 - progress

    return factor


def build_engine(model, cfg: Config, dist: Dist):
    """The DeepSpeed engine around the policy: ZeRO (train.zero_stage), AdamW (torch's, so nothing is
    JIT-compiled), clipping."""
    import deepspeed

    if cfg.train.zero_stage == 3:
        attach_logprob_head(model)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=deepspeed_config(cfg, dist),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)),
    )
    if cfg.model.dtype in ("bf16", "fp16") and cfg.optim.dither_master:
        dither_master_weights(engine.module, cfg.train.seed, torch_dtype(cfg))
    return engine


def dither_master_weights(module: torch.nn.Module, seed: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """Moves each trainable weight's fp32 master (DeepSpeed's) to a uniformly random point of the interval that
    rounds to its `dtype` (bf16, fp16) value, which stays as it was. Why: the forward computes with round(master),
    and a master made from bf16 weights sits on the grid, so a weight's forward value moves only once its master has
    drifted by half a bf16 step (2^-9 of the weight), and Adam's updates of lr 1e-5 in noisy directions mostly do
    not get there. Dithered, a drift d moves the forward value by a whole step with probability d / step: the
    forward sees the update in expectation. On SmolLM2 after 24 optimiser steps (docs/precision.md) 7% of the bf16
    weights had moved and the forward saw 0.48x of what the master gained on held-out rollouts; dithered, 10% and
    0.72x. A resumed run's checkpoint then replaces these masters with its own. The same noise on every rank: each
    sets its own partition from the same whole tensor. fp16's grid is 8x finer, its dead zone as much narrower:
    2^-12 of the weight, still above a 1e-5 update of a weight of 0.1 (not measured in learning)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    generator = None
    for param in module.parameters():
        master = safe_get_full_fp32_param(param) if param.requires_grad else None
        if master is None:
            continue
        if generator is None:
            generator = torch.Generator(master.device).manual_seed(seed)
        grid = master.to(dtype)
        inf, exact = torch.full_like(grid, float("inf")), grid.float()
        # The interval that rounds to grid: halfway to each neighbour on the grid (exact in fp32).
        low = (exact + torch.nextafter(grid, -inf).float()) / 2
        high = (exact + torch.nextafter(grid, inf).float()) / 2
        dithered = low + torch.rand(master.shape, generator=generator, device=master.device) * (high - low)
        # At the very ends a tie may round to the neighbour: that weight keeps its value.
        safe_set_full_fp32_param(param, torch.where(dithered.to(dtype) == grid, dithered, exact))


def zero_extras(cfg: Config, dist: Dist) -> dict:
    """ZeRO-3's and ZeRO-Offload's keys. The whole weights are gathered by apmpo.learner.zero3 (a layer at a
    time, for the push and the hf/ export), so DeepSpeed's own gather on save stays off: its checkpoint holds the
    partitions."""
    extras = {}
    if cfg.train.zero_stage == 3:
        extras["stage3_gather_16bit_weights_on_model_save"] = False
    if cfg.train.offload_optimizer == "cpu":
        # torch's AdamW steps the offloaded fp32 state (torch_adam below): DeepSpeedCPUAdam would be JIT-compiled.
        extras["offload_optimizer"] = {"device": "cpu", "pin_memory": dist.device.type == "cuda"}
    return extras


def loss_scale_metrics(engine) -> dict[str, float]:
    """fp16: the dynamic loss scale after the step, optim/loss_scale (bf16 and fp32 scale nothing: none)."""
    return {"optim/loss_scale": float(engine.optimizer.loss_scale)} if engine.fp16_enabled() else {}


def step_failed(cfg: Config, metrics: dict[str, float]) -> bool:
    """Whether a training step's skipped optimiser steps (train/skipped_steps) count toward
    train.max_skipped_in_a_row. In fp16 a step skipped with a finite loss is the loss scaler's search for its scale
    (an overflow of the scaled gradients: the scale is halved), not a failure; DeepSpeed itself stops a run whose
    gradients overflow at min_loss_scale. A non-finite loss counts in every dtype."""
    return bool(metrics["train/skipped_steps"]) and (cfg.model.dtype != "fp16"
                                                     or not math.isfinite(metrics.get("loss/total", 0.0)))


def start_micro_batch(engine, last: bool) -> None:
    """Before a micro-batch's forward: whether its backward ends the optimiser step, and what engine.forward does
    first, since our forwards run the module's parts directly (apmpo.learner.logprobs): ZeRO-3 counts micro-batches
    there, and copies the first one's gradients into its partitions but adds the later ones (uncounted, every
    micro-batch overwrote the last)."""
    engine.set_gradient_accumulation_boundary(last)
    if hasattr(engine.optimizer, "clear_backward_seen_flag"):  # a ZeRO optimiser
        engine.optimizer.clear_backward_seen_flag()


def deepspeed_config(cfg: Config, dist: Dist) -> dict:
    """build_engine's DeepSpeed configuration."""
    o = cfg.optim
    return {
        "train_micro_batch_size_per_gpu": 1,  # a placeholder: micro-batches are sized by tokens, not rows
        "gradient_accumulation_steps": 1,
        "gradient_clipping": o.max_grad_norm,
        "zero_optimization": {"stage": cfg.train.zero_stage, "overlap_comm": dist.device.type == "cuda",
                              "contiguous_gradients": True, **zero_extras(cfg, dist)},
        # A non-finite gradient norm skips the step and clears the gradients (DeepSpeed does so in fp32 always,
        # in bf16 only when asked): train_on_batch counts the skips.
        "bf16": {"enabled": cfg.model.dtype == "bf16", "check_grad_overflow": True},
        # fp16: the loss is scaled before the backward so that small gradients do not flush to zero (fp16's
        # smallest normal is 6.1e-5), and unscaled before clipping and the step. Dynamic scaling (loss_scale 0):
        # from 2^16, a step whose scaled gradients overflow is skipped, the scale halved after `hysteresis` such
        # steps and doubled after `loss_scale_window` clean ones; DeepSpeed stops the run at min_loss_scale
        # (DeepSpeed's defaults, as Oat runs the FP16 paper's fp16). The scale is in the optimiser's checkpoint.
        "fp16": {"enabled": cfg.model.dtype == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        # Micro-batch gradients are summed in fp32: a step has ~60 micro-batches at paper scale, and a bf16 sum
        # (DeepSpeed's default, the model's dtype) loses 2^-9 relative per addition.
        "data_types": {"grad_accum_dtype": "fp32"},
        # Each micro-batch's reduce-scatter, in the model's dtype unless train.communication_data_type says fp32.
        **({"communication_data_type": cfg.train.communication_data_type}
           if cfg.train.communication_data_type is not None else {}),
        "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": [o.adam_beta1, o.adam_beta2],
                                                  "eps": o.adam_eps, "weight_decay": o.weight_decay,
                                                  "torch_adam": True}},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
