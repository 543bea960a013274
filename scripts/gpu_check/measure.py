"""What every check of the GPU check measures with: the shapes of the GPU run and of the dry run, a check's outcome,
timing on the device, peak memory, the matmul peak that MFU is measured against, and the random Qwen2 models the
checks run."""
from __future__ import annotations

import gc
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

# Qwen2.5-1.5B: its config.json, less what does not change the compute.
QWEN25_15B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                  rms_norm_eps=1e-6, max_position_embeddings=32768)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=128, vocab_size=1024, tie_word_embeddings=True, max_position_embeddings=512)
QWEN25_VOCAB = QWEN25_15B["vocab_size"]


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


MODEL_DIRS: dict[Shapes, str] = {}


def random_model_dir(s: Shapes) -> str:
    """The learner's random model saved once per run, so that both variants load it with `load_model`."""
    if s not in MODEL_DIRS:
        path = tempfile.mkdtemp(prefix="apmpo-gpu-check-")
        model = random_qwen2(s.model, s.dtype, s.device)
        model.save_pretrained(path)
        del model
        MODEL_DIRS[s] = path
    return MODEL_DIRS[s]
