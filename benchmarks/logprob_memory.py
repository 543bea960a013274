"""Peak memory and time of forward + backward of chunked log-probs against the naive way, at Qwen2.5's vocabulary.

    python benchmarks/logprob_memory.py                         # CPU: 4 x 1024 tokens, vocab 151,936, peak RSS
    python benchmarks/logprob_memory.py --batch 8 --device cuda --dtype bf16   # GPU: max_memory_allocated

Naive: `log_softmax(model(ids).logits.float() / T)` gathered at the next token, which holds several
`[tokens, vocab]` fp32 tensors. Chunked: `apmpo.learner.logprobs.token_logprobs`. Every token after the first
is scored, so the difference is the chunking alone. Each variant runs in a fresh subprocess (peak RSS is a
high-water mark for the whole process); "extra" is the peak minus the memory after building the model and
inputs, i.e. what the forward + backward itself costs. Goal: chunked extra at most a quarter of naive.
"""
import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from apmpo.learner.logprobs import token_logprobs
from apmpo.tiny import build_model, build_tokenizer

QWEN25_VOCAB = 151_936


def peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def naive(model, input_ids, attention_mask, logits_mask, temperature):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float() / temperature
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return logp * logits_mask[:, 1:]


def chunked(model, input_ids, attention_mask, logits_mask, temperature, chunk_tokens):
    return token_logprobs(model, input_ids, attention_mask, logits_mask, temperature=temperature,
                          chunk_tokens=chunk_tokens)[0]


def run_variant(args) -> dict:
    """Child process: build the model and inputs, then time one forward + backward and read the peak."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = build_model(build_tokenizer(), hidden_size=args.hidden, num_layers=args.layers,
                        num_heads=args.hidden // 64, num_kv_heads=1, intermediate_size=4 * args.hidden)
    model.resize_token_embeddings(args.vocab, mean_resizing=False)
    model = model.to(args.device, dtype).train()
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
    attention_mask = torch.ones_like(input_ids)
    logits_mask = torch.ones_like(input_ids, dtype=torch.bool)
    logits_mask[:, 0] = False
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    baseline = peak_bytes(args.device)

    start = time.perf_counter()
    if args.variant == "naive":
        logp = naive(model, input_ids, attention_mask, logits_mask, args.temperature)
    else:
        logp = chunked(model, input_ids, attention_mask, logits_mask, args.temperature, args.chunk_tokens)
    logp.sum().backward()
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = peak_bytes(args.device)
    return {"variant": args.variant, "peak": peak, "extra": peak - baseline, "seconds": seconds,
            "checksum": logp.detach().double().sum().item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=QWEN25_VOCAB)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--variant", choices=["naive", "chunked"], help=argparse.SUPPRESS)  # child process only
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return

    tokens = args.batch * args.seq
    print(f"{args.batch} x {args.seq} = {tokens} tokens, vocab {args.vocab}, hidden {args.hidden}, "
          f"{args.layers} layers, {args.dtype} on {args.device}, chunk {args.chunk_tokens}; "
          f"one [tokens, vocab] fp32 tensor = {tokens * args.vocab * 4 / 2**30:.2f} GiB")
    results = {}
    for variant in ["naive", "chunked"]:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--variant", variant]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[variant] = r = json.loads(out.strip().splitlines()[-1])
        print(f"{variant:8s} peak {r['peak'] / 2**30:6.2f} GiB  extra {r['extra'] / 2**30:6.2f} GiB  "
              f"time {r['seconds']:6.2f} s  (sum logp {r['checksum']:.1f})")
    naive_r, chunked_r = results["naive"], results["chunked"]
    print(f"chunked / naive: peak {chunked_r['peak'] / naive_r['peak']:.3f}, "
          f"extra {chunked_r['extra'] / naive_r['extra']:.3f}, time {chunked_r['seconds'] / naive_r['seconds']:.2f}")


if __name__ == "__main__":
    main()
