"""Generation throughput: tokens/s through the HTTP server vs. in-process `vllm.LLM.generate`, same work.

    python benchmarks/generation.py                         # CPU-sized model and workload
    python benchmarks/generation.py --model Qwen/Qwen2.5-1.5B-Instruct --prompts 256 --n 8 --max-tokens 512

Both sides use the same engine arguments (apmpo.rollout.vllm_compat.build_engine), the same prompts and the same
seeded sampling parameters (prompt i: seed + i * n), so they generate the same tokens; the ratio isolates the
server's overhead (HTTP, JSON, validation, the lock). One engine at a time: the server runs first, then stops.
Goal: server >= 90% of in-process.
"""
from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time

import torch

from apmpo.rollout import vllm_compat as compat
from apmpo.rollout.launcher import start_server
from apmpo.sampling import Sampling
from apmpo.tiny import save_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: a random Qwen2 (hidden 512, 4 layers) built here")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    dtype = "auto" if gpu else "float32"
    model = args.model or str(save_tiny_model(tempfile.mkdtemp(), hidden_size=512, num_layers=4, num_heads=8,
                                              num_kv_heads=2, intermediate_size=1536))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    sampling = Sampling(max_tokens=args.max_tokens)

    def best_rate(run) -> tuple[float, int]:
        run()  # warm-up
        best, tokens = 0.0, 0
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokens = run()
            best = max(best, tokens / (time.perf_counter() - start))
        return best, tokens

    server = start_server(model, log_path=f"{tempfile.gettempdir()}/apmpo_generation_server.log", dtype=dtype,
                          max_model_len=1024 if not gpu else None,
                          gpu_memory_utilization=args.gpu_memory_utilization, overlap=False,  # as in-process: every core
                          extra_args=("--max-prompts", str(max(4096, args.prompts))))
    try:
        with server.client() as client:
            def through_server() -> int:
                return sum(len(s.token_ids) for row in client.generate(prompts, sampling, args.n, seed=0) for s in row)
            served, served_tokens = best_rate(through_server)
    finally:
        server.stop()

    llm = compat.build_engine(compat.EngineArgs(model=model, dtype=dtype, max_model_len=1024 if not gpu else None,
                                                gpu_memory_utilization=args.gpu_memory_utilization))
    params = [compat.sampling_params(sampling, n=args.n, seed=i * args.n) for i in range(len(prompts))]

    def in_process() -> int:
        return sum(len(s["token_ids"]) for row in compat.generate(llm, prompts, params) for s in row)

    local, local_tokens = best_rate(in_process)
    del llm
    gc.collect()
    print(f"workload: {args.prompts} prompts x {args.prompt_len} tokens, n={args.n}, max_tokens={args.max_tokens}; "
          f"generated {served_tokens} (server) / {local_tokens} (in-process) tokens; best of {args.repeats}")
    print(f"server (HTTP):           {served:9.0f} tokens/s")
    print(f"in-process LLM.generate: {local:9.0f} tokens/s")
    print(f"ratio server/in-process: {served / local:.0%}  (goal >= 90%)")


if __name__ == "__main__":
    main()
