"""Run by the sandbox's forkserver as it starts (its preload: apmpo/sandbox.py), and nowhere else: the server keeps
every process that its workers' trees leave behind, and kills them all once the learner is gone.

A worker is a child subreaper, so what an environment starts (a setsid child, a double-forked daemon) stays in its
worker's tree while the worker lives. A worker that dies (os._exit, or PR_SET_PDEATHSIG when the forkserver goes)
would hand those to init; as a subreaper itself, the forkserver receives them instead. It cannot wait for the EOF
that multiprocessing ends it with: every worker holds the pipe's write end, and so does any process an environment
forks. So a thread follows the learner (its parent), and when the learner exits, even by SIGKILL of it or of its
process group, it kills the server's whole tree and the server.
"""
import atexit
import ctypes
import os
import select
import threading
import time
import warnings

from apmpo.sandbox import PR_SET_CHILD_SUBREAPER, kill_tree


def _end_with(parent: int) -> None:
    """Waits until the parent has exited, then kills this server's tree and the server."""
    try:
        pidfd = os.pidfd_open(parent)
    except ProcessLookupError:  # gone already
        pass
    except OSError:  # a kernel before 5.3
        while os.getppid() == parent:
            time.sleep(1.0)
    else:
        if os.getppid() == parent:  # else it exited before its pidfd was opened
            select.select([pidfd], [], [])  # readable once it has exited
    kill_tree(os.getpid(), with_root=False)
    os._exit(0)


# A session of its own: a SIGKILL to the learner's process group (`kill -9 -PGID`) does not take it with the learner
# before it has killed its tree.
os.setsid()
ctypes.CDLL("libc.so.6").prctl(PR_SET_CHILD_SUBREAPER, 1)
threading.Thread(target=_end_with, args=(os.getppid(),), daemon=True, name="apmpo-end-with-learner").start()
atexit.register(kill_tree, os.getpid(), with_root=False)  # it also ends by SystemExit, at that EOF
# Its SIGCHLD loop reaps the orphans it adopts, and warns of each pid it did not fork.
warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")
