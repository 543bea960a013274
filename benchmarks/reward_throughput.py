"""Math rewards per second over MATH500: serial in this process against the worker pool.

    python benchmarks/reward_throughput.py [--workers 2] [--repeat 1]

Two workloads, each over the 500 problems: gold-vs-gold (the completion boxes the gold answer, so the
exact-string fast path answers most items) and gold-vs-wrong (it boxes the next problem's gold, so
every item goes through math-verify's parse and verify). The pool's time includes dispatch, but not
starting its workers, which a training run does once.
"""
from __future__ import annotations

import argparse
import time

from apmpo.data import load_records
from apmpo.rewards import RewardPool, math_reward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1, help="passes over MATH500 per workload")
    args = parser.parse_args()

    records = load_records("math500") * args.repeat
    workloads = {
        "gold-vs-gold": [f"The answer is \\boxed{{{r['answer']}}}." for r in records],
        "gold-vs-wrong": [f"The answer is \\boxed{{{records[(i + 1) % len(records)]['answer']}}}."
                          for i, r in enumerate(records)],
    }
    print(f"{'workload':<14} {'items':>6} {'serial/s':>10} {'pool/s':>10} {'pool/serial':>12} {'mean':>6}")
    with RewardPool(num_workers=args.workers, timeout_s=30.0) as pool:
        pool.score("math", ["\\boxed{1}"] * args.workers, [{"answer": "1"}] * args.workers)  # warm the workers
        for name, completions in workloads.items():
            start = time.perf_counter()
            serial = [math_reward(c, r) for c, r in zip(completions, records)]
            serial_rate = len(records) / (time.perf_counter() - start)
            start = time.perf_counter()
            pooled, summary = pool.score("math", completions, records)
            pool_rate = len(records) / (time.perf_counter() - start)
            assert pooled == serial, "the pool must score exactly as the serial loop"
            print(f"{name:<14} {len(records):>6} {serial_rate:>10.1f} {pool_rate:>10.1f} "
                  f"{pool_rate / serial_rate:>11.2f}x {sum(serial) / len(serial):>6.3f}"
                  + (f"  failures: {summary}" if summary.failures else ""))


if __name__ == "__main__":
    main()
