"""apmpo.cpu_memory: a CPU process keeps what it frees, so a step's large blocks are not faulted in again."""
import os
import subprocess
import sys

import pytest

from apmpo.cpu_memory import ONE_ARENA, with_one_arena

CHILD = """
import resource, sys, threading, torch
from apmpo.cpu_memory import keep_freed_memory
# A thread that allocated before keep_freed_memory, as those that importing vLLM starts: its arena outlives it
# and the next thread takes it, whatever mallopt says afterwards.
early = threading.Thread(target=lambda: torch.ones(1024))
early.start()
early.join()
if sys.argv[1] == "kept":
    assert keep_freed_memory()
def faults_of_one_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        blocks = [torch.ones(64 * 2**20 // 4) for _ in range(8)]  # 512 MiB of 64 MiB blocks, written
        del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
def in_a_new_thread():  # as the server runs each request
    result = []
    thread = threading.Thread(target=lambda: result.append(faults_of_one_step()))
    thread.start()
    thread.join()
    return result[0]
step = in_a_new_thread if sys.argv[2] == "threads" else faults_of_one_step
step(), step()  # the first steps grow the heap
# The fewest of four steps: the kernel may fault a kept page in again on its own now and then (CI's runs faulted
# 4-7 blocks of 64 MiB once in a while; NUMA balancing's scans can do that), while a heap that gives its memory back
# faults all of it in every step.
print(min(step() for _ in range(4)))
"""


def faults(mode: str, where: str = "main", tunables: str | None = None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | ({"GLIBC_TUNABLES": tunables}
                                                                           if tunables else {})
    done = subprocess.run([sys.executable, "-c", CHILD, mode, where], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def test_a_step_reuses_the_memory_the_last_one_freed():
    # 3 x 512 MiB written is 393,216 pages of 4 KiB: glibc's default maps every 64 MiB block afresh and faults
    # them all in again; kept, the second step reuses the heap (measured: 0 pages).
    default = faults("default")
    assert default > 300_000
    assert faults("kept") < default / 10


def test_steps_on_new_threads_reuse_it_with_one_arena():
    # Each thread got an arena of its own, which glibc gave back: the server's pushes faulted their pages in again
    # on every request thread. With the launcher's GLIBC_TUNABLES every thread takes the kept heap.
    # (measured: 393,248 pages with arenas of their own; 0 with one)
    # Whether a new thread gets a fresh arena depends on timing: beside another process's load (the suite's second
    # worker, a training run) the harm showed only now and then (0 and 49,153 pages). Without it there is nothing
    # to compare the fix with, so that is a skip naming the figures, not a pass.
    tries = []
    for _ in range(3):
        tries.append(faults("kept", "threads"))
        if tries[-1] > 300_000:
            break
    else:
        pytest.skip(f"the harm did not show in 3 tries ({tries} pages faulted, 393,248 when it shows)")
    own_arenas = tries[-1]
    assert faults("kept", "threads", with_one_arena(None)) < own_arenas / 4


def test_with_one_arena_keeps_the_users_tunables():
    assert with_one_arena(None) == with_one_arena("") == ONE_ARENA
    assert with_one_arena("glibc.malloc.tcache_count=0") == f"glibc.malloc.tcache_count=0:{ONE_ARENA}"
    assert with_one_arena("glibc.malloc.arena_max=4") == "glibc.malloc.arena_max=4"
