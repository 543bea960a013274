"""CPU servers forked from a process that has imported vLLM once: about 4 CPU seconds a start instead of 18.

Most of a CPU server's start is imports (torch, transformers, fastapi, vLLM: about 14 of a tiny model's 18 CPU
seconds, 2026-11-29). Where servers start one after another (a test suite, many short runs or evaluations), a warm
process imports them once and forks every server from there:

    python -m apmpo.rollout.warm /tmp/servers.sock &
    APMPO_WARM_SERVERS=/tmp/servers.sock python launch/train.py --config configs/quickstart.yaml

The launcher forks a CPU server through the socket that APMPO_WARM_SERVERS names, and starts it afresh when the
variable is unset, when no warm process answers, or when the server's environment differs from the warm process's
in a setting read as a process starts (STARTUP: OpenMP's threads, malloc's arenas, the loader, Python, PyTorch,
the hub), or its namespaces, control groups, CPU affinity, limits or ids do (process_context): a fork keeps the
warm process's. Either way the server is the same: the leader of its own session and process group, with the
launcher's environment and working directory, its log as stdout and stderr, its command line as its title (`ps`),
and it follows its launcher (APMPO_LAUNCHER_PID). The warm process answers a request with the server's pid and,
once the server has exited, its exit code; it ends when the process that started it does. CPU only: a fork after
the CUDA driver is loaded is unsafe, and on a GPU an engine's start outweighs its imports.
"""
from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Iterator

WARM_SERVERS_ENV = "APMPO_WARM_SERVERS"
# Environment variables read as a process starts (by the loader, libgomp, glibc, Python, or at the import of
# torch, transformers and the hub): a forked server keeps the warm process's values, so they must be equal.
STARTUP = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "GLIBC_TUNABLES", "MALLOC_", "LD_", "PYTHON", "TORCH",
           "HF_", "TRANSFORMERS_", "TOKENIZERS_", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING")
REPLY_TIMEOUT_S = 300.0  # a warm process still importing answers once it is done (about 20 s on 2 busy cores)


def startup_settings(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key.startswith(STARTUP)}


def process_context() -> dict[str, object]:
    """What a forked server keeps of the warm process beside its environment: its namespaces (a learner started in
    a network namespace of its own serves there), control groups, CPU affinity, resource limits and ids."""
    namespaces = {f"{name} namespace": os.stat(f"/proc/self/ns/{name}").st_ino for name in os.listdir("/proc/self/ns")}
    limits = {f"limit {name}": resource.getrlimit(getattr(resource, name)) for name in dir(resource)
              if name.startswith("RLIMIT_")}
    return {**namespaces, **limits, "control groups": Path("/proc/self/cgroup").read_text(),
            "CPU affinity": sorted(os.sched_getaffinity(0)), "user and groups": [os.getuid(), os.getgid(), os.getgroups()]}


class ForkedProcess:
    """A server forked by the warm process: what the launcher uses of subprocess.Popen (pid, poll, wait,
    returncode). Its exit code comes from the warm process, whose child it is."""

    def __init__(self, pid: int, conn: socket.socket):
        self.pid, self.returncode, self._conn = pid, None, conn

    def poll(self) -> int | None:
        return self.wait(timeout=0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                if timeout == 0:
                    return None
                raise subprocess.TimeoutExpired(f"forked server {self.pid}", timeout)
            message = self._conn.recv(4096)
            # The warm process gone (killed) takes the code with it: -1, as for a child lost otherwise.
            self.returncode = json.loads(message)["returncode"] if message else -1
            self._conn.close()
        return self.returncode


def fork_server(args: list[str], env: dict[str, str], stdout: int, pass_fds: tuple[int, ...]) -> ForkedProcess | None:
    """`python -m apmpo.rollout.server ARGS`, forked by the warm process of $APMPO_WARM_SERVERS with `env`, the
    working directory, `stdout` as its stdout and stderr, and `pass_fds` under the same numbers. None (and a line
    in `stdout` saying why, unless no warm process is named) where it cannot be: the caller starts it afresh."""
    path = os.environ.get(WARM_SERVERS_ENV)
    if not path:
        return None
    request = json.dumps({"args": args, "env": env, "cwd": os.getcwd(), "fds": list(pass_fds),
                          "context": process_context()}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.settimeout(REPLY_TIMEOUT_S)
        conn.connect(path)
        socket.send_fds(conn, [request], [stdout, *pass_fds])
        reply = json.loads(conn.recv(4096) or b'{"refused": "the warm process closed the connection"}')
        conn.settimeout(None)
    except (OSError, ValueError) as error:
        reply = {"refused": f"no answer from the warm process at {path}: {error}"}
    if "pid" in reply:
        return ForkedProcess(reply["pid"], conn)
    conn.close()
    os.write(stdout, f"[apmpo] started afresh, not forked: {reply['refused']}\n".encode())
    return None


@contextlib.contextmanager
def warm_servers(path: str | Path, log_path: str | Path, env: dict[str, str] | None = None) -> Iterator[Path]:
    """A warm process on the unix socket `path` (its output in `log_path`) for as long as the block runs, with
    `env` (default: this process's, with the malloc setting that the launcher gives CPU servers). Returns at once:
    requests made while it imports are answered when it is done. Set APMPO_WARM_SERVERS to `path` to use it."""
    from apmpo.cpu_memory import with_one_arena

    env = dict(os.environ if env is None else env)
    env["GLIBC_TUNABLES"] = with_one_arena(env.get("GLIBC_TUNABLES"))
    listener = _listen(path)  # bound here: a request made while the warm process imports waits in the backlog
    with open(log_path, "ab") as log, listener:
        process = subprocess.Popen([sys.executable, "-m", "apmpo.rollout.warm", "--fd", str(listener.fileno())],
                                   env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True, pass_fds=(listener.fileno(),))
    try:
        yield Path(path)
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
        process.kill()
        process.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _listen(path: str | Path) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(64)
    return listener


def main(listener: socket.socket) -> None:
    """The warm process: imports what a server imports, then forks a server for each request on `listener` until
    the process that started it exits (or a SIGTERM)."""
    exec_env = dict(os.environ)  # as this process started; vllm_compat adds vLLM's settings on import
    context = json.loads(json.dumps(process_context()))  # as a request carries it (tuples become lists)
    parent = os.pidfd_open(os.getppid())
    listener.setblocking(False)
    path, code = listener.getsockname(), 0
    try:
        gc.disable()  # as a server does while it imports (apmpo.rollout.server)
        import uvicorn  # noqa: F401
        import vllm.entrypoints.llm  # noqa: F401

        from apmpo.rollout import server, vllm_compat  # noqa: F401

        gc.freeze()  # what was imported stays out of every collection: a server's first ones stay short
        wake_read, wake_write = os.pipe()
        for fd in (wake_read, wake_write):
            fcntl.fcntl(fd, fcntl.F_SETFL, os.O_NONBLOCK)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a byte on the pipe wakes the loop to reap
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        print(f"[apmpo.warm] ready on {path} (pid {os.getpid()})", flush=True)
        children: dict[int, socket.socket] = {}
        while parent not in select.select([listener, parent, wake_read], [], [])[0]:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_read, 4096)
            with contextlib.suppress(BlockingIOError):
                conn, _ = listener.accept()
                conn.setblocking(True)
                conn.settimeout(10.0)  # the request follows the connection at once
                try:
                    pid = _fork(conn, exec_env, context, closing=(listener, parent, wake_read, wake_write, *children.values()))
                except (OSError, ValueError, KeyError) as error:  # a request cut short or malformed
                    print(f"[apmpo.warm] a request failed: {error!r}", flush=True)
                    conn.close()
                    pid = None
                if pid is not None:
                    children[pid] = conn
            _reap(children)
    except SystemExit:  # SIGTERM
        pass
    except BaseException:  # its users start their servers afresh
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sys.stdout.flush()
        os._exit(code)  # without the interpreter's teardown of everything imported (seconds, and nanobind's warnings)


def _fork(conn: socket.socket, exec_env: dict[str, str], context: dict, closing: tuple) -> int | None:
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 16)
    request = json.loads(message)
    differ = sorted(key for key in {*startup_settings(exec_env), *startup_settings(request["env"])}
                    if exec_env.get(key) != request["env"].get(key))
    differ += [key for key in context if context[key] != request["context"].get(key)]
    if differ:
        conn.send(json.dumps({"refused": f"the warm process started with other {', '.join(differ)}"}).encode())
        conn.close()
        for fd in fds:
            os.close(fd)
        return None
    pid = os.fork()
    if pid == 0:
        for item in (*closing, conn):
            with contextlib.suppress(OSError):
                item.close() if hasattr(item, "close") else os.close(item)
        _become_server(request, fds)
    for fd in fds:
        os.close(fd)
    conn.send(json.dumps({"pid": pid}).encode())
    return pid


def _reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # none left
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):  # its launcher may be gone
                conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
            conn.close()


def _become_server(request: dict, fds: list[int]) -> None:
    """In the forked child: the process that `python -m apmpo.rollout.server` started by the launcher would be."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        above = max([2, *request["fds"]]) + 1  # moved above the numbers the server is given
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in fds]
        for fd in fds:
            os.close(fd)
        stdout, *passed = moved
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.dup2(stdout, 1)
        os.dup2(stdout, 2)
        for fd, number in zip(passed, request["fds"], strict=True):
            os.dup2(fd, number)
        for fd in moved:
            os.close(fd)
        import setproctitle  # vLLM's dependency

        # What `ps` shows, and what finds a server by its arguments. Before the environment changes: setproctitle
        # takes the room of the strings it started with.
        setproctitle.setproctitle(" ".join([sys.executable, "-m", "apmpo.rollout.server", *request["args"]]))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        from apmpo.rollout import server, vllm_compat

        vllm_compat.set_process_env()  # its defaults, under the server's environment
        sys.argv = [server.__file__, *request["args"]]  # as `python -m` sets it
        server.main(request["args"])  # ends with os._exit
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", help="the unix socket to serve on (APMPO_WARM_SERVERS of its users)")
    parser.add_argument("--fd", type=int, help="an inherited listening socket instead (warm_servers())")
    args = parser.parse_args()
    if (args.path is None) == (args.fd is None):
        parser.error("give a socket path or --fd")
    main(_listen(args.path) if args.fd is None else socket.socket(fileno=args.fd))
