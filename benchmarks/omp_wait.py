"""Processes sharing the CPU's cores: OpenMP teams as large as the machine against teams that split its cores.

    python benchmarks/omp_wait.py                    # 300 steps per process
    python benchmarks/omp_wait.py --steps 2          # CI: every path, not a figure

PyTorch's CPU kernels run on libgomp teams. After each parallel region a thread that finds no work spins (up to
GOMP_SPINCOUNT, 300,000 turns unless OMP_WAIT_POLICY says otherwise) before it sleeps, and libgomp counts only the
cores, not the other processes on them. Two processes with as many threads as cores then take turns at every
barrier: a thread spins on the core its sibling needs until the scheduler preempts it. The workload is a step of a
SmolLM2-sized layer stack (hidden 576, 64 rows: small matmuls, a barrier each), as a CPU engine's decode or a
learner's forward runs them. Each case runs in fresh processes (libgomp reads its settings when it loads):
- whole: every process takes every core (libgomp's default wait);
- passive: the same, OMP_WAIT_POLICY=PASSIVE (a waiting thread sleeps at once);
- split: the processes split the cores (OMP_NUM_THREADS), as apmpo's learner and servers do.
"""
import argparse
import os
import subprocess
import sys

from apmpo.cpu_threads import usable_cores

WORKLOAD = """
import sys, time, torch
steps = int(sys.argv[1])
torch.manual_seed(0)
weights = [torch.randn(576, 576) for _ in range(8)]
x = torch.randn(64, 576)
start = time.perf_counter()
for _ in range(steps):
    y = x
    for w in weights:
        y = torch.nn.functional.gelu(y @ w) * 0.1
print(time.perf_counter() - start)
"""
SETTINGS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def wall(processes: int, steps: int, case: str) -> float:
    """Seconds until the last of `processes` concurrent workloads is done (each times its own loop)."""
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    env["OMP_NUM_THREADS"] = str(max(1, usable_cores() // processes) if case == "split" else usable_cores())
    if case == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    runs = [subprocess.Popen([sys.executable, "-c", WORKLOAD, str(steps)], env=env, stdout=subprocess.PIPE, text=True)
            for _ in range(processes)]
    return max(float(run.communicate()[0]) for run in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    print(f"{usable_cores()} cores, {args.steps} steps per process; seconds until the last process is done")
    times = {}
    for processes in (1, 2):
        times[processes] = {case: wall(processes, args.steps, case) for case in ("whole", "passive", "split")}
        print(f"  {processes} at once: " + ", ".join(f"{case} {s:.2f}" for case, s in times[processes].items()))
    alone, two = times[1], times[2]
    print(f"ratio whole/split time, two at once: {two['whole'] / two['split']:.2f}x (passive/split "
          f"{two['passive'] / two['split']:.2f}x); alone, passive/whole {alone['passive'] / alone['whole']:.2f}x")


if __name__ == "__main__":
    main()
