"""Worker processes for user code that may hang, crash or allocate without bound: reward functions
(apmpo.rewards.batch) and environments (apmpo.envs.workers) run in them, each pool killing a worker whose call runs
past its time.

- A worker starts from one forkserver, never by forking the caller, which may hold CUDA or DeepSpeed state, and
  without re-running the caller's `__main__` script (`start_worker`): what runs in a worker must live in an
  importable module, not in the script.
- A worker caps its own address space (`limit_memory`: RLIMIT_AS, MEMORY_MB unless configured): a call that
  allocates too much fails at once with MemoryError, instead of swapping the machine or waking the OOM killer, which
  may pick the learner.
- No process a worker's code starts outlives the learner: `kill_tree` ends a process's whole tree, and the
  forkserver (apmpo/forkserver.py, its preload) adopts what dead workers leave and ends it with the learner.
"""
from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
import os
import resource
import signal
import sys
import types
from multiprocessing.connection import Connection
from typing import Any, Callable

MEMORY_MB = 4096  # a worker's address space (RLIMIT_AS); sympy's reward workers use a few hundred MiB
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36  # prctl(2)

_CONTEXT = mp.get_context("forkserver")
# Workers fork from a server that has already imported the verifiers (sympy takes ~1 s to import).
# apmpo.forkserver makes the server keep, and kill at its exit, what its workers' trees leave behind.
_CONTEXT.set_forkserver_preload(["apmpo.rewards", "apmpo.forkserver"])


def start_worker(target: Callable[..., None], *args: Any, name: str | None = None) -> tuple[Connection, mp.Process]:
    """A daemon process running target(conn, *args), started from the forkserver; this side's end of the pipe."""
    conn, child = _CONTEXT.Pipe()
    process = _CONTEXT.Process(target=target, args=(child, *args), daemon=True, name=name)
    with _main_module_hidden():
        process.start()
    child.close()
    return conn, process


def limit_memory(memory_mb: int) -> None:
    """In a worker: caps its address space at `memory_mb` MiB."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))


@contextlib.contextmanager
def _main_module_hidden():
    """A forkserver child re-runs the caller's `__main__` script before it runs its target (multiprocessing's
    spawn.prepare). For launch/train.py that imports torch, DeepSpeed and transformers: ~4 s per worker on 2
    busy cores, so each crashed worker cost its replacement most of a 5 s item timeout, and every worker held
    torch in memory. With no `__main__` file to name, the child skips it."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _children() -> dict[int, list[int]]:
    """Every process's children, from one read of /proc (its per-task `children` files are not in every kernel)."""
    children = collections.defaultdict(list)
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:  # it ended meanwhile
                continue
            children[int(stat[stat.rindex(b")") + 2:].split()[1])].append(int(name))
    return children


def kill_tree(root: int, with_root: bool = True) -> None:
    """SIGKILLs the descendants of process `root` (and `root`). Each is stopped before its children are read, so
    none forks or dies while the tree is walked (a subreaper root keeps its orphans in the tree), then all die."""
    stopped = {root} if with_root else set()
    for pid in stopped:
        _signal(pid, signal.SIGSTOP)
    while True:
        children, tree, todo = _children(), set(), [root]
        while todo:
            below = children.get(todo.pop(), [])
            tree.update(below)
            todo += below
        new = tree - stopped
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped |= new
    for pid in stopped:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
