"""The learner's forward and backward eager vs with `model.compile: true` (its MLP and RMSNorm blocks through
torch.compile, apmpo/learner/compiled.py), on the same rows, in alternation.

    python benchmarks/learner_compile.py                               # SmolLM2-135M-Instruct, fp32, the step's batch
    python benchmarks/learner_compile.py --dtype bf16 --repeats 5     # where bf16 is native (AVX512-BF16, AMX)
    python benchmarks/learner_compile.py --model PATH --prompts 2 --n 2 --tokens 8 --repeats 1   # CI's tiny size

The rows are the step benchmark's shape (benchmarks/step_time.py --sizes smollm2): `--prompts` prompts of
`--prompt-tokens` tokens, `--n` completions each of 10 to `--tokens` tokens (random tokens: the time depends on the
shapes, not the text), through `token_logprobs` as an update computes them (prompts shared, chunked head) and a
backward of their mean. Both models are loaded in one process; the compiled one's compilation (printed) happens
before the timing. Each repeat times eager and compiled back to back, alternating which goes first; the ratio is the
median of the repeats' ratios (this 2-core machine's speed drifts from minute to minute).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


def rows(vocab: int, prompts: int, n: int, prompt_tokens: int, tokens: int, seed: int = 0):
    """input_ids, attention_mask, logits_mask of `prompts` x `n` right-padded rows; a prompt's n rows share it."""
    g = torch.Generator().manual_seed(seed)
    width = prompt_tokens + tokens
    ids = torch.randint(0, vocab, (prompts * n, width), generator=g)
    ids[:, :prompt_tokens] = torch.randint(0, vocab, (prompts, prompt_tokens), generator=g).repeat_interleave(n, 0)
    lengths = prompt_tokens + torch.randint(min(10, tokens), tokens + 1, (prompts * n,), generator=g)
    position = torch.arange(width)[None]
    mask = position < lengths[:, None]
    return ids * mask, mask.long(), mask & (position >= prompt_tokens)


def forward_backward(model, batch) -> tuple[float, torch.Tensor]:
    from apmpo.learner.logprobs import token_logprobs

    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    logp, _ = token_logprobs(model, *batch)
    (logp.sum() / batch[2].sum()).backward()
    return time.perf_counter() - start, logp.detach()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a path or a name of apmpo.models")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=41)
    p.add_argument("--tokens", type=int, default=64, help="the longest completion")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    from apmpo import models
    from apmpo.learner.compiled import compile_elementwise

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    eager = AutoModelForCausalLM.from_pretrained(models.resolve(args.model), dtype=dtype).train()
    compiled = copy.deepcopy(eager)
    print(compile_elementwise(compiled), flush=True)
    batch = rows(eager.config.vocab_size, args.prompts, args.n, args.prompt_tokens, args.tokens)
    print(f"{args.prompts} prompts x {args.n} rows, {args.prompt_tokens} + up to {args.tokens} tokens, {args.dtype}, "
          f"{torch.get_num_threads()} threads; forward + backward, s")
    first = {"eager": forward_backward(eager, batch), "compiled": forward_backward(compiled, batch)}  # warm
    print(f"first call: eager {first['eager'][0]:.2f}, compiled {first['compiled'][0]:.2f}")
    ratios = []
    for repeat in range(args.repeats):
        order = ("eager", "compiled") if repeat % 2 == 0 else ("compiled", "eager")
        seconds = {mode: forward_backward(eager if mode == "eager" else compiled, batch)[0] for mode in order}
        ratios.append(seconds["eager"] / seconds["compiled"])
        print(f"repeat {repeat + 1}: eager {seconds['eager']:.3f}, compiled {seconds['compiled']:.3f}")
    gap = (first["eager"][1] - first["compiled"][1]).abs().max().item()
    print(f"max |logp eager - logp compiled|: {gap:.2e} nats")
    print(f"ratio compiled/eager speed: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
