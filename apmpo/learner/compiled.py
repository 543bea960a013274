"""`model.compile: true`: torch.compile (Inductor) of the learner's elementwise blocks, each decoder layer's MLP
and RMSNorms, in place (state-dict keys unchanged, so checkpoints, the weight push and exports are the same).

Why these blocks: the prompt-sharing forward's KV cache and 4-D masks break whole decoder layers into pieces (no
gain), and the whole backbone took 12 minutes to compile on a busy machine; the MLP's SiLU-and-multiply and
RMSNorm's square, mean, rsqrt and scale are where the elementwise work is, and Inductor fuses each into one loop.
What it buys depends on how much of the update is not matmul: SmolLM2-135M-Instruct's update in fp32 on a 2-core
AVX2 CPU is 81% matmul, and compiling gained 1.02x (benchmarks/learner_compile.py, docs/benchmarks.md); a bf16
update on a CPU with AVX512-BF16 spent about 2 of its 6.5 s in elementwise work. Compiling takes 5-40 s once a
process (Inductor caches its kernels on disk).

Compiled values differ from eager ones by the order of fused float operations (about 1e-6 relative in fp32), so
a compiled run does not repeat an eager one to the last digit; it repeats itself. The blocks are compiled and run
once, forward and backward, at load: a model or a platform that Inductor cannot compile trains eager, and the log
says why.
"""
from __future__ import annotations

import time

import torch
from torch import nn

BLOCKS = ("MLP", "RMSNorm")  # class-name endings: LlamaMLP, Qwen2MLP, Qwen2RMSNorm, ...


def compile_elementwise(model: nn.Module) -> str:
    """Compiles the MLP and RMSNorm modules of `model`'s text decoder in place; returns a line for the log: how many
    and how long, or why it fell back to eager (every block then runs eager, as before)."""
    decoder = model.get_decoder()
    blocks = [m for m in decoder.modules() if type(m).__name__.endswith(BLOCKS)]
    if not blocks:
        return f"model.compile: no MLP or RMSNorm block in {type(decoder).__name__}; eager"
    start = time.perf_counter()
    for block in blocks:
        block.compile(dynamic=True)
    try:
        for block in {type(b): b for b in blocks}.values():  # one of each class: the others share its code
            _run_once(block, model.config.get_text_config().hidden_size)
    except Exception as error:  # noqa: BLE001 - any failure of the compiler means: run eager
        for block in blocks:
            block._compiled_call_impl = None  # nn.Module.compile's wrapper, removed
        return f"model.compile: fell back to eager: {type(error).__name__}: {str(error).splitlines()[0]}"
    return f"model.compile: {len(blocks)} MLP and RMSNorm blocks compiled in {time.perf_counter() - start:.1f} s"


def _run_once(block: nn.Module, hidden: int) -> None:
    """The block's graphs: for training (forward and backward), for an input without gradients (the first layer's
    where the embeddings are frozen) and for log-probs without gradients."""
    param = next(block.parameters())
    x = torch.randn(2, 3, hidden, dtype=param.dtype, device=param.device)
    block(x.clone().requires_grad_()).float().sum().backward()
    block(x)
    block.zero_grad(set_to_none=True)
    with torch.no_grad():
        block(x)
