"""apmpo.cpu_memory: a CPU process keeps what it frees, so a step's large blocks are not faulted in again."""
import subprocess
import sys

CHILD = """
import resource, sys, torch
from apmpo.cpu_memory import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory()
def faults_of_one_step():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        blocks = [torch.ones(64 * 2**20 // 4) for _ in range(8)]  # 512 MiB of 64 MiB blocks, written
        del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_one_step()  # the first step grows the heap
print(faults_of_one_step())
"""


def faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


def test_a_step_reuses_the_memory_the_last_one_freed():
    # 3 x 512 MiB written is 393,216 pages of 4 KiB: glibc's default maps every 64 MiB block afresh and faults
    # them all in again; kept, the second step reuses the heap (measured: 0 pages, or one block's 16,384).
    default = faults("default")
    assert default > 300_000
    assert faults("kept") < default / 10
