"""Forward + backward time of the APMPO loss against GRPO on the same inputs, in one run.

    python benchmarks/loss_overhead.py                 # N=512 sequences x T=2048 tokens, CPU (and CUDA if present)
    python benchmarks/loss_overhead.py --device cuda --dtype bf16

Goal: APMPO costs at most 1.3x GRPO on CPU and 1.1x on GPU. The inputs are log-probs that require grad,
as the learner hands them to the loss; the model's forward is not timed.
"""
import argparse
import statistics
import time

import torch

from apmpo.loss import LossConfig, adaptive_params, group_advantages, policy_loss


def make_inputs(n, t, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g) * 3
    logp = (old + torch.randn(n, t, generator=g) * 0.2).to(device, dtype)
    lengths = torch.randint(t // 8, t + 1, (n,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).to(device)
    rewards = (torch.rand(n // 8, 8, generator=g) > 0.5).float()
    return logp, old.to(device, dtype), rewards, mask


def fwd_bwd(name, logp, old, rewards, mask):
    """One forward + backward; returns a closure so every loss gets the same set-up outside the timing."""
    cfg = LossConfig(name=name)
    params = adaptive_params(rewards, cfg)  # on the CPU, as in the learner
    adv = group_advantages(rewards).flatten().to(logp.device)

    def run():
        x = logp.detach().requires_grad_(True)
        loss, _ = policy_loss(x, old, adv, mask, cfg, params)
        loss.backward()

    return run


def time_interleaved(names, inputs, repeats, sync):
    """Median time per loss, the losses interleaved in rotating order so that background load hits all alike."""
    runs = {name: fwd_bwd(name, *inputs) for name in names}
    times = {name: [] for name in names}
    for i in range(repeats + 2):  # two warm-up rounds
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            sync()
            start = time.perf_counter()
            runs[name]()
            sync()
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def peak_memory(name, logp, old, rewards, mask):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd_bwd(name, logp, old, rewards, mask)()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--t", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cpu, plus cuda when available)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    devices = [args.device] if args.device else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

    print(f"N={args.n} sequences x T={args.t} tokens, {args.dtype} inputs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} CPU threads")
    for device in devices:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        inputs = make_inputs(args.n, args.t, device, dtype)
        times = time_interleaved(["grpo", "apmpo", "dapo", "gmpo"], inputs, args.repeats, sync)
        grpo = times["grpo"]
        line = f"[{device}] fwd+bwd median: grpo {grpo * 1e3:7.2f} ms"
        for name in ("apmpo", "dapo", "gmpo"):
            line += f" | {name} {times[name] * 1e3:7.2f} ms ({times[name] / grpo:.2f}x)"
        print(line)
        if device == "cuda":
            mem = {name: peak_memory(name, *inputs) for name in ("grpo", "apmpo")}
            print(f"[cuda] peak extra memory: grpo {mem['grpo']:.0f} MiB, apmpo {mem['apmpo']:.0f} MiB "
                  f"({mem['apmpo'] / mem['grpo']:.2f}x)")


if __name__ == "__main__":
    main()
