"""The checks of one device's kernels: the matmul peak (matmul_peak), the APMPO loss against GRPO's (loss), chunked
log-probs' memory against the naive log_softmax (logprobs), and the learner's log-prob error in each precision
against fp64 (precision_error), the last two with benchmarks/' own functions."""
from __future__ import annotations

import importlib.util
import math
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from scripts.gpu_check.measure import (CheckFailed, GiB, Outcome, PeakMemory, Shapes, peak_flops, random_qwen2,
                                       synchronize)


def check_matmul_peak(s: Shapes) -> Outcome:
    flops = peak_flops(s)
    dtype = str(s.dtype).removeprefix("torch.")
    return Outcome({"tflops": flops / 1e12, "n": s.matmul_n, "dtype": dtype},
                   f"{flops / 1e12:.1f} TFLOP/s ({s.matmul_n}^3 {dtype} matmul, best of {3 + 2 * s.repeats})")


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


ROOT = Path(__file__).resolve().parents[2]  # the repository: benchmarks/


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
