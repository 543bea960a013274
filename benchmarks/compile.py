"""Generation with the server's default engine (the model through torch.compile) vs the same engine eager
(`--enforce-eager`), same prompts and seeded sampling, so the same tokens.

    python benchmarks/compile.py                                    # quickstart model, 16 prompts x 8, 8/64/128 tokens
    python benchmarks/compile.py --model PATH --prompts 64 --tokens 256

Two engine processes, one per mode, started first (their start-ups are printed: compiling is what costs there);
then each workload runs on both in turn, alternating which goes first, and the ratio is the median of the pairs'
ratios. Paired runs because this 2-core machine's speed drifts by up to 2x from minute to minute.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("compiled", "eager")


def worker(model: str, mode: str, prompts: int, n: int) -> None:
    """Builds the engine as the server does, then for each line `max_tokens` on stdin prints `seconds tokens`."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own output goes to stderr, replies alone to stdout
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # as the server: a fixed KV cache on CPU (GiB)
    from transformers import AutoTokenizer

    from apmpo.data import encode_prompt, stop_token_ids
    from apmpo.quickstart import make_samples
    from apmpo.rollout import vllm_compat as compat
    from apmpo.sampling import Sampling

    llm = compat.build_engine(compat.EngineArgs(model=model, dtype="float32", max_model_len=512,
                                                enforce_eager=mode == "eager"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = [encode_prompt(sample, tokenizer) for sample in make_samples(prompts)]  # the prompts as training encodes them
    stop = stop_token_ids(model, tokenizer)

    def run(max_tokens: int) -> int:
        params = [compat.sampling_params(Sampling(max_tokens, stop_token_ids=stop), n=n, seed=1000 + i)
                  for i in range(len(ids))]
        return sum(len(s["token_ids"]) for row in compat.generate(llm, ids, params) for s in row)

    run(8)  # warm-up
    print(f"READY {compat.engine_info(llm)['compiled']}", file=replies)
    for line in sys.stdin:
        start = time.perf_counter()
        tokens = run(int(line))
        print(f"{time.perf_counter() - start:.5f} {tokens}", file=replies)
    compat.shutdown(llm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the quickstart model, built here")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", nargs="+", type=int, default=[8, 64, 128], help="max new tokens")
    parser.add_argument("--repeats", type=int, default=10, help="pairs per workload")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.model, args.worker, args.prompts, args.n)

    from apmpo.quickstart import save_quickstart_model
    from apmpo.rollout.launcher import cpu_server_threads

    model = args.model or str(save_quickstart_model(tempfile.mkdtemp(prefix="apmpo_compile_")))
    # The threads a server started by the launcher gets in the synchronous loop (an exported value wins).
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(cpu_server_threads(model, 1, False))}
    engines = {}
    for mode in MODES:
        start = time.perf_counter()
        engines[mode] = subprocess.Popen(
            [sys.executable, __file__, "--worker", mode, "--model", model, "--prompts", str(args.prompts),
             "--n", str(args.n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = engines[mode].stdout.readline().split()
        if line[:1] != ["READY"]:
            raise RuntimeError(f"the {mode} engine failed to start (its log is above)")
        print(f"{mode} engine ready in {time.perf_counter() - start:.1f} s (compiled: {line[1]})", flush=True)
    print(f"workload: {args.prompts} prompts x {args.n} samples; median of {args.repeats} pairs")
    try:
        for max_tokens in args.tokens:
            seconds = {mode: [] for mode in MODES}
            for k in range(args.repeats):
                for mode in MODES if k % 2 else MODES[::-1]:
                    engines[mode].stdin.write(f"{max_tokens}\n")
                    engines[mode].stdin.flush()
                    took, tokens = engines[mode].stdout.readline().split()
                    seconds[mode].append(float(took))
            ratio = statistics.median(e / c for c, e in zip(seconds["compiled"], seconds["eager"]))
            print(f"{max_tokens:4d} new tokens ({tokens} generated): compiled {statistics.median(seconds['compiled']):.3f} s, "
                  f"eager {statistics.median(seconds['eager']):.3f} s; ratio compiled/eager speed: {ratio:.2f}x",
                  flush=True)
    finally:
        for engine in engines.values():
            engine.stdin.close()
            engine.wait(timeout=120)


if __name__ == "__main__":
    main()
