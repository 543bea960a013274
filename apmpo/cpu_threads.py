"""The cores a CPU process may use, which its compute threads are counted from.

PyTorch's CPU kernels run on libgomp teams whose threads spin at each barrier before they sleep, and libgomp
counts cores, not the other processes on them: teams that together outnumber the cores take turns at every
barrier (benchmarks/omp_wait.py). So every count here starts from the cores this process may run on (its
affinity: `taskset`, a container's cpuset; children inherit it), and OMP_NUM_THREADS, where set, wins.
"""
import os


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))
