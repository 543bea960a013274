"""One process at a time in a directory: a study's folder, a training run's directory."""
from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import TextIO


class Busy(RuntimeError):
    """Another live process holds the directory."""


def hold(directory: Path, what: str) -> TextIO:
    """Locks DIRECTORY/.lock until this process ends (or the returned file is closed), and writes this pid there.
    A POSIX record lock: the kernel lets go when the process dies, however (kill -9 too), and the processes it
    forks (reward workers) never hold it, so a killed run's leftovers cannot block its resume. Raises Busy, naming
    the holder's pid, when another process holds it; on a file system without locks, goes on unlocked."""
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / ".lock", "a+")
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EAGAIN):
            return handle
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise Busy(f"another {what} (pid {holder}) is running in {directory}") from None
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
