"""The GPU check: what the learner side does on an NVIDIA GPU, measured with the project's own code.

    bash scripts/gpu_check.sh [--out gpu_check.json] [--only loss,transport]
    bash scripts/gpu_check.sh --dry-run      # the same code on CPU at tiny shapes; CI runs it (tests/test_gpu_check.py)

It prints one PASS/FAIL line per check and writes every figure, with the device, driver and library versions,
to `--out`. A check that fails prints its reason and the others still run; the exit code is 1 if any failed.
Goals are judged on the GPU only: a tiny CPU run says that the code works, not how fast it is.

Covered (nothing here needs vLLM, which the GPU box we borrow cannot carry):
- matmul_peak: a large matmul in the learner's dtype (bf16), the peak that MFU is measured against.
- learner_gc, learner_no_gc: Qwen2.5-1.5B's shape, randomly initialised, under DeepSpeed ZeRO-2 in bf16 with
  micro_batch_tokens 16384 with gradient checkpointing, 4096 without (16384 would not fit in 80 GB): one
  training step's learner part as launch/train.py runs it (`train_on_batch` of apmpo/learner/step.py: old and
  reference log-probs, then the optimiser step). Tokens/s, MFU and peak memory. MFU = 6 x parameters x tokens /
  update time / matmul peak (the LM head is counted for every token, though only completion tokens go through it,
  and the recomputed forward of checkpointing is not counted); `mfu_with_attention` adds causal attention's QK^T
  and AV products, 6 x layers x hidden x the sum of squared row lengths per step.
- loss: forward + backward of APMPO against GRPO at N=512 x T=2048, fp32 log-probs as the learner hands them
  (goal: APMPO <= 1.1x GRPO); torch.compile of the same call is measured beside it.
- logprobs: peak memory of chunked log-probs + entropy (apmpo.learner.logprobs) against the naive full
  log_softmax, at vocabulary 151,936 (goal <= 0.25x), and that both give the same log-probs.
- transport: weights sent with apmpo.rollout.weight_sync over CUDA IPC to a second process on the same GPU and
  received by the engine's receiving code (`receive_buckets`), checked bit for bit; bytes/s against a raw
  device-to-device copy of the same bytes. Then a LoRA adapter of that model (rank 16 on every linear layer of
  every block), received by the engine worker's own `apmpo_receive_adapter` into the file vLLM loads, which is
  read back and compared bit for bit. (--dry-run: shm, or gloo where /dev/shm is small.)
- learner_zero3: learner_gc under ZeRO-3 (train.zero_stage 3): on one GPU the weights are whole in one partition,
  so beside learner_gc it is the gathers' and hooks' cost and the memory they add, not ZeRO-3's saving.
- learner_fp32_comm: learner_gc with train.communication_data_type fp32 (ZeRO's reduce-scatter in fp32); on one
  GPU the figure is the casts' cost only, a multi-GPU run also sends twice the bytes.
- learner_fp16: learner_gc under model.dtype fp16 (DeepSpeed's fp16, dynamic loss scaling): tokens/s, peak memory,
  the loss scale, skipped steps (the scaler's search, reported) and the share of masters dithered on fp16's grid.
  (--dry-run: DeepSpeed's refusal of fp16 on a CPU without oneDNN fp16 is lifted for it, deepspeed_fp16_on_cpu.)
- precision_error: the learner's per-token log-prob error against an fp64 forward (fp32, bf16, bf16 + fp32 head,
  fp16; benchmarks/precision_error.py's functions) on the random Qwen2.5-1.5B-shaped model and random tokens.
- zero2_grads: ZeRO-2 gradients on one rank (DeepSpeed's fp32 partition, read with safe_get_full_grad) equal a
  plain torch backward of the same loss over two micro-batches: the learner's forwards call `engine.module` and
  rely on `engine.backward` to reduce at the boundary, which a DeepSpeed upgrade could break.
- transport also reports, on the GPU, the learner's reserved memory before a push (8 GiB of freed activations
  left cached) and its peak during it: send_buckets empties the cache before a CUDA IPC push.
- no_vllm: nothing the check imported pulled in vllm or apmpo.rollout.vllm_compat.
Not covered: anything of vLLM's (generation, the in-place reload of pushed weights, NCCL to a server).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import multiprocessing
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

# Qwen2.5-1.5B: its config.json, less what does not change the compute.
QWEN25_15B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                  rms_norm_eps=1e-6, max_position_embeddings=32768)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=128, vocab_size=1024, tie_word_embeddings=True, max_position_embeddings=512)
QWEN25_VOCAB = QWEN25_15B["vocab_size"]
# DeepSpeed's install requirements (its wheel's Requires-Dist, extras left out); a test keeps this in step with
# the DeepSpeed of .venv. The GPU box is told which of them it lacks.
DEEPSPEED_REQUIRES = ("einops", "hjson", "msgpack", "ninja", "numpy", "packaging", "psutil", "py-cpuinfo",
                      "pydantic", "torch", "tqdm")


@dataclass(frozen=True)
class Shapes:
    """Everything that differs between the GPU run and the dry-run."""

    device: str
    dtype: torch.dtype  # the learner's (and the peak matmul's)
    matmul_n: int
    model: dict = field(hash=False)  # Qwen2Config arguments of the learner and transport checks
    prompts: int  # per training step, all in one optimiser step
    group_size: int
    prompt_tokens: int
    completion_tokens: int
    micro_batch_tokens: int
    loss_n: int
    loss_t: int
    logprob_model: dict = field(hash=False)  # Qwen2.5's vocabulary and head; two layers, so the logits dominate
    logprob_rows: int
    logprob_seq: int
    logprob_chunk_tokens: int
    bucket_bytes: int
    repeats: int
    compile_backend: str  # torch.compile's backend for the loss; "eager" in the dry-run traces without building code


GPU = Shapes(device="cuda", dtype=torch.bfloat16, matmul_n=8192, model=QWEN25_15B, prompts=4, group_size=8,
             prompt_tokens=256, completion_tokens=1792, micro_batch_tokens=16384, loss_n=512, loss_t=2048,
             logprob_model={**QWEN25_15B, "num_hidden_layers": 2}, logprob_rows=4, logprob_seq=2048,
             logprob_chunk_tokens=1024, bucket_bytes=256 << 20, repeats=5, compile_backend="inductor")
DRY_RUN = Shapes(device="cpu", dtype=torch.float32, matmul_n=256, model=TINY, prompts=2, group_size=2,
                 prompt_tokens=8, completion_tokens=24, micro_batch_tokens=64, loss_n=16, loss_t=64,
                 logprob_model={**TINY, "vocab_size": QWEN25_VOCAB}, logprob_rows=2, logprob_seq=64,
                 logprob_chunk_tokens=32, bucket_bytes=64 << 10, repeats=2, compile_backend="eager")


class CheckFailed(Exception):
    """A check's own verdict (wrong numbers, a missing package), as opposed to an exception it ran into."""


@dataclass
class Outcome:
    figures: dict
    summary: str
    goal: tuple[float, str, float] | None = None  # (value, "<=" or ">=", limit): judged on the GPU only

    def missed(self) -> bool:
        if self.goal is None:
            return False
        value, op, limit = self.goal
        return not (value <= limit if op == "<=" else value >= limit)


# --------------------------------------------------------------------------- measuring


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], object], device: str, repeats: int, warmup: int = 1) -> float:
    times = []
    for i in range(warmup + repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


class PeakMemory:
    """Peak memory since `reset()`. CUDA: the caching allocator's counters. CPU: the process's resident-set
    high-water mark (VmHWM), reset through /proc/self/clear_refs; it also counts memory that the C allocator
    keeps after a free, so CPU figures are indicative only."""

    def __init__(self, device: str):
        self.device, self.base = device, 0

    def reset(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self.base = _proc_status_bytes("VmRSS")

    def peak(self) -> int:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return _proc_status_bytes("VmHWM")

    def extra(self) -> int:
        return self.peak() - self.base


def _proc_status_bytes(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024


ROOT = Path(__file__).resolve().parents[1]  # the repository: benchmarks/
GiB = 2**30
_PEAK_FLOPS: dict[Shapes, float] = {}


def peak_flops(s: Shapes) -> float:
    """Best of `repeats` n x n x n matmuls in the learner's dtype, once per run (MFU's denominator)."""
    if s not in _PEAK_FLOPS:
        a, b = (torch.randn(s.matmul_n, s.matmul_n, device=s.device, dtype=s.dtype) for _ in range(2))
        seconds = min(median_seconds(lambda: a @ b, s.device, repeats=1, warmup=0) for _ in range(3 + 2 * s.repeats))
        _PEAK_FLOPS[s] = 2 * s.matmul_n**3 / seconds
    return _PEAK_FLOPS[s]


def random_qwen2(config: dict, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A randomly initialised Qwen2 causal LM, built on the device (a 1.5B model initialises in seconds there)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(Qwen2Config(**config), dtype=dtype)


# --------------------------------------------------------------------------- checks


def check_matmul_peak(s: Shapes) -> Outcome:
    flops = peak_flops(s)
    dtype = str(s.dtype).removeprefix("torch.")
    return Outcome({"tflops": flops / 1e12, "n": s.matmul_n, "dtype": dtype},
                   f"{flops / 1e12:.1f} TFLOP/s ({s.matmul_n}^3 {dtype} matmul, best of {3 + 2 * s.repeats})")


DEEPSPEED_MISSING = """DeepSpeed is not importable here ({error}). It has no wheel on PyPI, so build one where pip
has the internet and this repo's .venv, and carry it here with the requirements this machine lacks:
  there: .venv/bin/python -m pip wheel --no-deps --no-build-isolation -w wheels/ \\
             "deepspeed==$(.venv/bin/python -c 'import deepspeed; print(deepspeed.__version__)')"
{download}  here:  {python} -m pip install --no-index --find-links wheels/ deepspeed
The checks that need no DeepSpeed ran all the same."""


def _require_deepspeed() -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError as error:
        missing = [name for name in DEEPSPEED_REQUIRES if not _installed(name)]
        download = f"         {download_command(missing)}\n" if missing else ""
        raise CheckFailed(DEEPSPEED_MISSING.format(error=error, download=download, python=sys.executable)) from None


# Modules whose distribution has another name (pip download yaml finds nothing).
DISTRIBUTION_OF = {"yaml": "pyyaml", "math_verify": "math-verify", "PIL": "pillow"}


def download_command(modules: list[str]) -> str:
    """pip, on a machine with the internet, fetching wheels of these modules for this machine's Python and platform
    (bash scripts/gpu_wheels.sh fetches all that the checks need at once)."""
    return (f".venv/bin/python -m pip download -d wheels/ --only-binary=:all: --python-version "
            f"{sys.version_info.major}.{sys.version_info.minor} --platform manylinux2014_{platform.machine()} "
            f"{' '.join(DISTRIBUTION_OF.get(module, module) for module in modules)}")


def _installed(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
        return True
    except PackageNotFoundError:
        return False


def check_learner(s: Shapes, gradient_checkpointing: bool, communication_data_type: str | None = None,
                  zero_stage: int = 2, dtype: str | None = None) -> Outcome:
    """Steps 6-7 of a training step (`train_on_batch`, apmpo/learner/step.py) on a random Qwen2.5-1.5B-shaped model.
    `communication_data_type` (train.communication_data_type): fp32 reduce-scatters the gradients in fp32. On one
    rank nothing crosses a wire: its figure is the cost of the casts, and a multi-GPU run adds twice the bytes.
    `zero_stage` 3: the weights are partitioned (on one rank, whole) and gathered a module at a time; the figure is
    the gathers' and hooks' cost on the same shape. `dtype` (model.dtype; None: the shapes'): fp16 runs DeepSpeed's
    fp16 with dynamic loss scaling, whose skipped steps (the scale's search) are reported, not failed."""
    _require_deepspeed()
    from apmpo.config import Config, ModelConfig, RolloutConfig, TrainConfig
    from apmpo.trajectory import Rollout
    from apmpo.learner.zero3 import full_shape
    from apmpo.learner.engine import (build_engine, init_distributed, load_model, loss_scale_metrics,
                                      partition_reference)
    from apmpo.learner.step import train_on_batch
    from apmpo.loss import adaptive_params, group_advantages

    dist = init_distributed()
    model_dir = _random_model_dir(s)
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


_MODEL_DIRS: dict[Shapes, str] = {}


def _random_model_dir(s: Shapes) -> str:
    """The learner's random model saved once per run, so that both variants load it with `load_model`."""
    if s not in _MODEL_DIRS:
        path = tempfile.mkdtemp(prefix="apmpo-gpu-check-")
        model = random_qwen2(s.model, s.dtype, s.device)
        model.save_pretrained(path)
        del model
        _MODEL_DIRS[s] = path
    return _MODEL_DIRS[s]


def check_loss(s: Shapes) -> Outcome:
    """Forward + backward of the APMPO and GRPO losses on the same fp32 log-probs, interleaved; also compiled."""
    from benchmarks.loss_overhead import make_inputs

    from apmpo.loss import LossConfig, adaptive_params, group_advantages, policy_loss

    logp, old, rewards, mask = make_inputs(s.loss_n, s.loss_t, s.device, torch.float32)
    advantages = group_advantages(rewards).flatten().to(s.device)

    def run(name: str, loss_fn) -> Callable[[], None]:
        cfg = LossConfig(name=name)
        params = adaptive_params(rewards, cfg)

        def fwd_bwd() -> None:
            x = logp.detach().requires_grad_(True)
            loss, _ = loss_fn(x, old, advantages, mask, cfg, params)
            loss.backward()
        return fwd_bwd

    eager = _interleaved({name: run(name, policy_loss) for name in ("grpo", "apmpo")}, s)
    figures = {"n": s.loss_n, "t": s.loss_t, "grpo_ms": eager["grpo"] * 1e3, "apmpo_ms": eager["apmpo"] * 1e3,
               "apmpo_over_grpo": eager["apmpo"] / eager["grpo"]}
    try:  # what compiling the loss would give; training runs it eagerly, so only the eager ratio is judged
        compiled = _interleaved({name: run(name, torch.compile(policy_loss, backend=s.compile_backend))
                                 for name in ("grpo", "apmpo")}, s, warmup=3)
        figures |= {"compile_backend": s.compile_backend, "compiled_grpo_ms": compiled["grpo"] * 1e3,
                    "compiled_apmpo_ms": compiled["apmpo"] * 1e3,
                    "compiled_apmpo_over_grpo": compiled["apmpo"] / compiled["grpo"],
                    "compiled_apmpo_over_eager_grpo": compiled["apmpo"] / eager["grpo"]}
        compiled_text = f"; compiled ({s.compile_backend}) apmpo {compiled['apmpo'] * 1e3:.2f} ms, " \
                        f"{figures['compiled_apmpo_over_grpo']:.2f}x compiled grpo"
    except Exception as error:  # noqa: BLE001  (a figure we could not get, not a defect of the training path)
        figures["compile_error"] = f"{type(error).__name__}: {error}"[:500]
        compiled_text = f"; torch.compile failed: {figures['compile_error'][:120]}"
    return Outcome(figures, f"apmpo/grpo {figures['apmpo_over_grpo']:.2f}x (grpo {eager['grpo'] * 1e3:.2f} ms, "
                            f"apmpo {eager['apmpo'] * 1e3:.2f} ms, N={s.loss_n} x T={s.loss_t}){compiled_text}",
                   goal=(figures["apmpo_over_grpo"], "<=", 1.1))


def _interleaved(runs: dict[str, Callable[[], None]], s: Shapes, warmup: int = 2) -> dict[str, float]:
    """Median seconds per run, the runs in rotating order so that background load hits all alike."""
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + 2 * s.repeats):
        for name in names[i % len(names):] + names[: i % len(names)]:
            synchronize(s.device)
            start = time.perf_counter()
            runs[name]()
            synchronize(s.device)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def check_precision_error(s: Shapes) -> Outcome:
    """The learner's per-token log-prob error against an fp64 forward of the same tokens, in each precision of
    benchmarks/precision_error.py (its functions), on a random Qwen2.5-1.5B-shaped model and random tokens: the
    GPU's kernels' rounding (cuBLAS, SDPA's fp16 and bf16 kernels), where the CPU's figures come from oneDNN and
    emulated fp16. A random model's next-token distributions are near uniform (log-probs about -log(vocab)), so
    these figures compare the candidates, not a trained model's error (benchmarks/precision_error.py)."""
    import copy

    bench = _benchmark_module("precision_error")
    base = random_qwen2(s.model, torch.float32, s.device).eval()
    g = torch.Generator().manual_seed(0)
    vocab, prompt = s.model["vocab_size"], s.prompt_tokens
    samples = [(torch.randint(vocab, (prompt,), generator=g).tolist(),
                torch.randint(vocab, (s.logprob_seq - prompt,), generator=g).tolist(), [])
               for _ in range(s.logprob_rows)]
    fp64 = copy.deepcopy(base).double()
    reference = bench.fp64_logprobs(fp64, samples, pad_id=0)
    del fp64
    figures = {"tokens": len(reference), "mean_logp64": float(reference.mean())}
    for name, (dtype, head) in bench.CANDIDATES.items():
        model = copy.deepcopy(base).to(bench.TORCH[dtype])
        rms_rel, abs_nats = bench.errors(bench.learner_logprobs(model, samples, 0, head), reference)
        figures |= {f"rms_rel_{name}": rms_rel, f"abs_nats_{name}": abs_nats}
        del model
    errors = {name: figures[f"rms_rel_{name}"] for name in bench.CANDIDATES}
    if not all(map(math.isfinite, errors.values())) or not errors["fp32"] < errors["fp16"] < errors["bf16"]:
        raise CheckFailed(f"RMS relative errors against fp64 out of the order fp32 < fp16 < bf16: {errors}")
    return Outcome(figures, "RMS rel. error against fp64: " + ", ".join(
        f"{name} {bench.percent(e)}" for name, e in errors.items())
        + f" ({len(reference)} random tokens; bf16/fp16 {errors['bf16'] / errors['fp16']:.1f}x)")


def _benchmark_module(name: str):
    """benchmarks/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(f"apmpo_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_logprobs(s: Shapes) -> Outcome:
    """Forward + backward peak memory of chunked log-probs + entropy against the naive full log_softmax."""
    from apmpo.learner.logprobs import token_logprobs

    model = random_qwen2(s.logprob_model, s.dtype, s.device).train()
    g = torch.Generator().manual_seed(0)
    vocab = s.logprob_model["vocab_size"]
    input_ids = torch.randint(vocab, (s.logprob_rows, s.logprob_seq), generator=g).to(s.device)
    attention_mask = torch.ones_like(input_ids)
    logits_mask = torch.ones_like(input_ids, dtype=torch.bool)
    logits_mask[:, 0] = False  # every token after the first is scored: the difference is the chunking alone

    def chunked() -> tuple[torch.Tensor, torch.Tensor]:
        return token_logprobs(model, input_ids, attention_mask, logits_mask, chunk_tokens=s.logprob_chunk_tokens,
                              with_entropy=True)

    def naive() -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
        log_probs = torch.log_softmax(logits[:, :-1], dim=-1)
        logp = log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        with torch.no_grad():
            entropy = -(log_probs.exp() * log_probs).sum(-1)
        zero = logp.new_zeros(logp.shape[0], 1)
        return torch.cat([zero, logp], 1) * logits_mask, torch.cat([zero, entropy], 1) * logits_mask

    memory = PeakMemory(s.device)
    results, extra = {}, {}
    # Chunked first: on CPU the naive variant's freed buffers would stay in the resident set and hide the
    # chunked one's peak (see PeakMemory); the other way round the naive peak can only be overstated, if anything.
    for name, fn in (("chunked", chunked), ("naive", naive)):
        model.zero_grad(set_to_none=True)
        memory.reset()
        logp, entropy = fn()
        logp.sum().backward()
        extra[name] = memory.extra()
        results[name] = (logp.detach(), entropy.detach())
        del logp, entropy
    (logp_c, entropy_c), (logp_n, entropy_n) = results["chunked"], results["naive"]
    logp_diff = (logp_c - logp_n).abs().max().item()
    entropy_diff = (entropy_c - entropy_n).abs().max().item()
    tolerance = 5e-2 if s.dtype == torch.bfloat16 else 1e-4  # bf16 heads round a chunk's logits differently
    tokens = int(logits_mask.sum())
    figures = {"tokens": tokens, "vocab": vocab, "chunk_tokens": s.logprob_chunk_tokens,
               "chunked_extra_gib": extra["chunked"] / GiB, "naive_extra_gib": extra["naive"] / GiB,
               "chunked_over_naive": extra["chunked"] / extra["naive"], "max_abs_logp_diff": logp_diff,
               "max_abs_entropy_diff": entropy_diff,
               "one_fp32_logits_gib": tokens * vocab * 4 / GiB}
    if not (logp_diff <= tolerance and entropy_diff <= tolerance):
        raise CheckFailed(f"chunked and naive disagree: max |logp diff| {logp_diff:.3g}, max |entropy diff| "
                          f"{entropy_diff:.3g} (tolerance {tolerance})")
    return Outcome(figures, f"peak memory chunked/naive {figures['chunked_over_naive']:.3f}x "
                            f"({extra['chunked'] / GiB:.2f} / {extra['naive'] / GiB:.2f} GiB over the model, "
                            f"{tokens} tokens, vocab {vocab}), log-probs agree within {logp_diff:.1e}",
                   goal=(figures["chunked_over_naive"], "<=", 0.25))


def payload(buckets: list, device: str, seed: int) -> Iterator[torch.Tensor]:
    """The planned tensors filled from a seeded generator: both processes make the same ones."""
    g = torch.Generator(device=device).manual_seed(seed)
    for bucket in buckets:
        for spec in bucket.tensors:
            yield torch.randn(spec.shape, generator=g, device=device, dtype=spec.torch_dtype)


def _receive_weights(transport: str, port: int, buckets: list, adapter_buckets: list, device: str, rounds: int,
                     seed: int) -> None:
    """The engine's side, in its own process: round 0 compares every tensor with the sender's, the others only
    receive (so the timing holds no comparison); then one adapter push."""
    from apmpo.rollout.weight_sync import WeightGroup, receive_buckets

    if device == "cuda":
        torch.cuda.set_device(0)
    group = WeightGroup(transport, "127.0.0.1", port, 1, 2, timeout_s=120)
    try:
        for k in range(rounds):
            received = receive_buckets(group, buckets, torch.device(device, 0) if device == "cuda" else torch.device(device))
            if k == 0:
                expected = payload(buckets, device, seed)
                same = [torch.equal(tensor, next(expected)) for _, tensor in received]
                failed = len(same) != sum(len(b.tensors) for b in buckets) or not all(same)
            else:
                for _ in received:
                    pass
                failed = False
            group.barrier(failed=failed)
        group.barrier(failed=not _received_adapter_is_exact(group, adapter_buckets, device))
    finally:
        group.close()


def adapter_buckets_of(model: dict, dtype: torch.dtype, bucket_bytes: int, rank: int = 16) -> list:
    """A LoRA adapter's tensors for every linear layer of every block, named as PEFT saves them."""
    from apmpo.rollout.weight_sync import PEFT_PREFIX, plan_buckets

    hidden, ffn = model["hidden_size"], model["intermediate_size"]
    kv = hidden // model["num_attention_heads"] * model["num_key_value_heads"]
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
              "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden), "mlp.down_proj": (hidden, ffn)}
    specs = []
    for layer in range(model["num_hidden_layers"]):
        for module, (out_features, in_features) in shapes.items():
            name = f"{PEFT_PREFIX}model.layers.{layer}.{module}"
            specs += [(f"{name}.lora_A.weight", dtype, (rank, in_features)),
                      (f"{name}.lora_B.weight", dtype, (out_features, rank))]
    return plan_buckets(specs, bucket_bytes)


def _received_adapter_is_exact(group, buckets: list, device: str) -> bool:
    """The engine worker's own adapter receive (WeightReceiverExtension, as vLLM mixes it into a worker: rank 0,
    joined to the group) writes the file the server loads; it must hold the sender's tensors, bit for bit."""
    from safetensors.torch import load_file

    from apmpo.rollout.weight_sync import ADAPTER_WEIGHTS, WeightReceiverExtension

    worker = WeightReceiverExtension()
    worker.rank, worker._apmpo_group = 0, group
    with tempfile.TemporaryDirectory() as folder:
        worker.apmpo_receive_adapter([asdict(b) for b in buckets], folder)
        saved = load_file(str(Path(folder) / ADAPTER_WEIGHTS))
    expected = payload(buckets, device, seed=1)
    return len(saved) == sum(len(b.tensors) for b in buckets) and all(
        torch.equal(saved[spec.name], next(expected).cpu()) for b in buckets for spec in b.tensors)


_TRAINING_CACHE_BYTES = 8 * GiB


def check_transport(s: Shapes) -> Outcome:
    """The learner's weights (Qwen2.5-1.5B's tensors in the learner's dtype) over CUDA IPC into a second process."""
    from apmpo.rollout.weight_sync import WeightGroup, plan_buckets, select_transport, send_buckets

    shapes = [(name, p.shape) for name, p in random_qwen2(s.model, s.dtype, "meta").named_parameters()]
    buckets = plan_buckets([(name, s.dtype, shape) for name, shape in shapes], s.bucket_bytes)
    nbytes = sum(b.nbytes for b in buckets)
    transport = "cuda_ipc" if s.device == "cuda" else select_transport(torch.device("cpu"), [], True, nbytes)
    tensors = list(payload(buckets, s.device, seed=0))
    rounds = 1 + s.repeats  # round 0 checks the bytes and warms up
    if s.device == "cuda":  # a training step's freed activations, still cached by the allocator when the push comes
        cached = torch.empty(_TRAINING_CACHE_BYTES, dtype=torch.uint8, device="cuda")
        del cached
        reserved_before = torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
    adapter_buckets = adapter_buckets_of(s.model, s.dtype, s.bucket_bytes)
    store = WeightGroup.create_master(transport, "127.0.0.1", 2, timeout_s=120)
    receiver = multiprocessing.get_context("spawn").Process(
        target=_receive_weights, args=(transport, store.port, buckets, adapter_buckets, s.device, rounds, 0),
        daemon=True)
    receiver.start()
    group = WeightGroup(transport, "127.0.0.1", store.port, 0, 2, timeout_s=120, store=store)
    times = []
    try:
        for k in range(rounds):
            synchronize(s.device)
            start = time.perf_counter()
            send_buckets(group, buckets, tensors)
            failed = group.barrier()  # the receiver holds every bucket (and, in round 0, has compared them)
            synchronize(s.device)
            times.append(time.perf_counter() - start)
            if failed:
                raise CheckFailed(f"the receiving process got other bytes than were sent ({transport}, round {k})")
        send_buckets(group, adapter_buckets, list(payload(adapter_buckets, s.device, seed=1)))
        if group.barrier():
            raise CheckFailed(f"the adapter the engine worker wrote holds other bytes than were sent ({transport})")
    finally:
        group.close()
        receiver.join(timeout=60)
        if receiver.is_alive():
            receiver.kill()
    if receiver.exitcode != 0:
        raise CheckFailed(f"the receiving process exited with {receiver.exitcode} (its traceback is above)")
    # On the shared GPU (cuda_ipc) send_buckets returns the cached blocks first: the learner's peak during the push
    # is its live tensors and one bucket, not what the training step had reserved.
    memory = {} if s.device != "cuda" else {
        "learner_reserved_before_push_gib": reserved_before / GiB,
        "learner_peak_reserved_in_push_gib": torch.cuda.max_memory_reserved() / GiB,
        "learner_weights_gib": nbytes / GiB}
    del tensors
    source = torch.empty(nbytes, dtype=torch.uint8, device=s.device).fill_(7)
    target = torch.empty_like(source)
    raw = median_seconds(lambda: target.copy_(source), s.device, repeats=s.repeats)
    sent = statistics.median(times[1:])
    figures = {"transport": transport, "bytes": nbytes, "buckets": len(buckets), "bucket_bytes": s.bucket_bytes,
               "seconds": sent, "bytes_per_s": nbytes / sent, "raw_copy_bytes_per_s": nbytes / raw,
               "ratio_to_raw_copy": raw / sent, "adapter_bytes": sum(b.nbytes for b in adapter_buckets), **memory}
    return Outcome(figures, f"{transport} {nbytes / sent / GiB:.2f} GiB/s, raw copy {nbytes / raw / GiB:.2f} GiB/s: "
                            f"{raw / sent:.0%} ({nbytes / GiB:.2f} GiB in {len(buckets)} buckets, bytes identical); "
                            f"a rank-16 adapter ({figures['adapter_bytes'] / 2**20:.0f} MiB) written by the engine "
                            "worker's receive, bytes identical")


def check_zero2_grads(s: Shapes) -> Outcome:
    """ZeRO-2 gradients on one rank equal a plain torch backward of the same loss. The learner runs its forwards
    through `engine.module`, which skips DeepSpeed's forward bookkeeping, and relies on `engine.backward`'s
    epilogue (DeepSpeed 0.19.8) to reduce the gradients at the accumulation boundary: a DeepSpeed upgrade that
    changes this fails here. Two micro-batches, the boundary on the second, in fp32 so that the two agree to
    summation order."""
    _require_deepspeed()
    import copy

    from deepspeed.utils import safe_get_full_grad

    from apmpo.config import Config, ModelConfig
    from apmpo.learner.engine import build_engine, init_distributed, load_model
    from apmpo.learner.logprobs import token_logprobs

    dist = init_distributed()
    model_dir = _random_model_dir(DRY_RUN)  # a small model: this checks the gradients' path, not speed
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


def check_no_vllm(s: Shapes) -> Outcome:
    loaded = sorted(name for name in sys.modules
                    if name.split(".")[0] == "vllm" or name == "apmpo.rollout.vllm_compat")
    if loaded:
        raise CheckFailed(f"imported: {', '.join(loaded[:10])}")
    return Outcome({"vllm_modules": loaded}, "nothing imported vllm or apmpo.rollout.vllm_compat")


CHECKS: dict[str, Callable[[Shapes], Outcome]] = {
    "matmul_peak": check_matmul_peak,
    "loss": check_loss,
    "logprobs": check_logprobs,
    "transport": check_transport,
    "learner_gc": lambda s: check_learner(s, gradient_checkpointing=True),
    "learner_no_gc": lambda s: check_learner(s, gradient_checkpointing=False),
    "learner_fp32_comm": lambda s: check_learner(s, gradient_checkpointing=True, communication_data_type="fp32"),
    "learner_zero3": lambda s: check_learner(s, gradient_checkpointing=True, zero_stage=3),
    "learner_fp16": lambda s: check_learner(s, gradient_checkpointing=True, dtype="fp16"),
    "precision_error": check_precision_error,
    "zero2_grads": check_zero2_grads,
    "no_vllm": check_no_vllm,  # last: it looks at what the others imported
}


# --------------------------------------------------------------------------- running


def environment(s: Shapes) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("deepspeed", "transformers"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda, **versions,
            "device": "cpu", "driver": None, "cpu_threads": torch.get_num_threads()}
    if s.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info |= {"device": props.name, "gpu_memory_gib": props.total_memory / GiB,
                 "multiprocessors": props.multi_processor_count, "driver": _driver_version()}
    return info


def _driver_version() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def run_checks(s: Shapes, names: list[str], dry_run: bool) -> dict[str, dict]:
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            outcome = CHECKS[name](s)
        except CheckFailed as error:
            results[name] = {"status": "fail", "reason": str(error)}
        except ModuleNotFoundError as error:  # a package the GPU box lacks: it cannot fetch one, so say how to carry it
            traceback.print_exc()
            results[name] = {"status": "fail", "reason": (
                f"{error}. Carry it as a wheel: where pip has the internet, {download_command([error.name])} "
                f"(or bash scripts/gpu_wheels.sh, everything the checks need); here, {sys.executable} -m pip install "
                f"--no-index --find-links wheels/ {DISTRIBUTION_OF.get(error.name, error.name)}")}
        except Exception as error:  # noqa: BLE001  (one check's crash, an OOM say, must not stop the others)
            traceback.print_exc()
            results[name] = {"status": "fail", "reason": f"{type(error).__name__}: {error}"[:2000]}
        else:
            judged = "" if outcome.goal is None else (
                f" [goal {outcome.goal[1]} {outcome.goal[2]}x" + (", not judged in --dry-run]" if dry_run else "]"))
            missed = outcome.missed() and not dry_run
            results[name] = {"status": "fail" if missed else "pass", "summary": outcome.summary + judged,
                             "figures": outcome.figures}
            if missed:
                results[name]["reason"] = f"missed the goal: {outcome.summary}{judged}"
        finally:
            gc.collect()
            if s.device == "cuda":
                torch.cuda.empty_cache()
        results[name]["seconds"] = time.perf_counter() - start
        r = results[name]
        print(f"{r['status'].upper()} {name}: {r.get('reason') or r['summary']}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="run on CPU at tiny shapes (no goal is judged)")
    parser.add_argument("--out", default="gpu_check.json", help="where the figures go (JSON)")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated checks, of: {', '.join(CHECKS)}")
    args = parser.parse_args(argv)
    names = [name for name in args.only.split(",") if name]
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        parser.error(f"--only: unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    s = DRY_RUN if args.dry_run else GPU
    if s.device == "cuda" and not torch.cuda.is_available():
        print(f"FAIL cuda: torch {torch.__version__} sees no CUDA device (on a CPU machine run --dry-run)", flush=True)
        return 1
    mode = "dry-run (CPU, tiny shapes)" if args.dry_run else "GPU"
    print(f"apmpo GPU check, {mode}; not covered: vLLM (generation, its weight reload), which this check never "
          "imports", flush=True)
    env = environment(s)
    print("  " + ", ".join(f"{k} {v}" for k, v in env.items() if v is not None), flush=True)
    try:
        results = run_checks(s, names, args.dry_run)
    finally:
        for path in _MODEL_DIRS.values():
            shutil.rmtree(path, ignore_errors=True)
    passed = all(r["status"] == "pass" for r in results.values())
    report = {"mode": "dry-run" if args.dry_run else "gpu", "passed": passed, "environment": env,
              "shapes": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in asdict(s).items()},
              "not_covered": "vLLM: generation, the engine's in-place weight reload, NCCL to a server",
              "checks": results}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'all checks passed' if passed else 'FAILED: ' + ', '.join(n for n, r in results.items() if r['status'] != 'pass')}"
          f"; figures in {args.out}", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
