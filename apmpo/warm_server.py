"""The warm process: `python -m apmpo.warm_server [PATH] [--imports MODULES]` imports its modules once, then forks the
program that each request on its unix socket asks for (apmpo/warm.py: what for, and its callers' side).

It serves its own user only, whatever the socket file's mode or the request says: a caller whose uid (from the
kernel, SO_PEERCRED) is another is refused, with a line in its log naming the uid, before anything it sent is read.
Its socket is made mode 0600 in a folder only its user may enter (`warm.listen`; by default $XDG_RUNTIME_DIR/apmpo,
else /tmp/apmpo-UID, made mode 700). No caller waits on another: the loop holds each connection as state (an
awaited request with its deadline, a running program's caller) and reads a request only once it has arrived, whole
(a SOCK_SEQPACKET message); a connection that sends none within its timeout is dropped, and past MAX_CONNECTIONS held
a new one is refused at once. A request is checked whole before anything of it is used (apmpo/warm_request.py),
every refusal logged once with its reason, and the descriptors a request brought are closed whatever becomes of it.
The warm process answers a request with the program's pid and, once it has exited, its exit code and CPU seconds;
it kills the program's process group when the caller is gone, and ends when the process that started it does.
"""
from __future__ import annotations

import contextlib
import fcntl
import gc
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from apmpo import warm
from apmpo.warm import JOINED, MAX_CONNECTIONS, PRESETS, listen, peer_uid, process_context, server_env
from apmpo.warm_request import MAX_FDS, MAX_REQUEST_BYTES, Refused, Request, View, entries, program, read

REQUEST_TIMEOUT_S = 10.0  # a caller sends its request as it connects: a connection silent this long is dropped


class WarmProcess:
    """The loop's state: the connections it holds (`awaited`: those yet to send their request, with their deadline;
    `callers`: those whose program runs, with its pid; `children`: each running program's caller's connection), the
    descriptors it waits on, and what a request is checked against (`view`)."""

    def __init__(self, listener: socket.socket, view: View, site_path: list[str], timeout_s: float):
        self.listener, self.view, self.site_path, self.timeout_s = listener, view, site_path, timeout_s
        self.awaited: dict[socket.socket, float] = {}
        self.callers: dict[socket.socket, int] = {}
        self.children: dict[int, socket.socket] = {}
        self.parent = os.pidfd_open(os.getppid())
        self.wake_read, self.wake_write = os.pipe()  # a byte for each signal (SIGCHLD: a program to reap)
        for fd in (self.wake_read, self.wake_write):
            fcntl.fcntl(fd, fcntl.F_SETFL, os.O_NONBLOCK)
        self.selector = selectors.DefaultSelector()
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ, self._accept)
        self.selector.register(self.parent, selectors.EVENT_READ, self._parent_gone)
        self.selector.register(self.wake_read, selectors.EVENT_READ, self._woken)

    def run(self) -> None:
        """Until the process that started it ends (or a SIGTERM: SystemExit)."""
        while True:
            wait = max(0.0, min(self.awaited.values()) - time.monotonic()) if self.awaited else None
            for key, _ in self.selector.select(wait):
                key.data(key.fileobj)
            self._expire()
            self._reap()

    def _accept(self, _) -> None:
        for _ in range(MAX_CONNECTIONS):  # those waiting, a round's worth: a flood does not hold up the rest
            try:
                conn, _ = self.listener.accept()
            except BlockingIOError:
                return
            conn.setblocking(False)
            uid, held = peer_uid(conn), len(self.awaited) + len(self.children)
            if uid != os.geteuid():  # never read: what it sent (descriptors too) goes as the connection closes
                self._refuse(conn, f"a caller of uid {uid}", f"it forks for its own user only, uid {os.geteuid()}")
            elif held >= MAX_CONNECTIONS:
                with contextlib.suppress(OSError):  # its request, if it has come: read, the refusal reaches it
                    for fd in socket.recv_fds(conn, MAX_REQUEST_BYTES, MAX_FDS)[1]:
                        os.close(fd)
                self._refuse(conn, "a connection", f"it holds {held} already, its most")
            else:
                self.awaited[conn] = time.monotonic() + self.timeout_s
                self.selector.register(conn, selectors.EVENT_READ, self._request)

    def _request(self, conn: socket.socket) -> None:
        """Forks the program that `conn`'s request asks for and answers with its pid, or refuses it. The descriptors
        that came with it are closed here either way (the program has its own copies)."""
        del self.awaited[conn]
        self.selector.unregister(conn)
        subject, fds = "a request", []
        try:
            message, fds, flags, _ = socket.recv_fds(conn, MAX_REQUEST_BYTES, MAX_FDS)
            if not message and not fds:
                raise Refused("the connection closed before a request")
            request = read(message, flags, fds)
            subject = f"{request.command[:3]}"
            why = self.view.refusal(request)
            if why is not None:
                raise Refused(why)
            pid = self._fork(conn, request, fds)
            self.children[pid], self.callers[conn] = conn, pid
            self.selector.register(conn, selectors.EVENT_READ, self._caller_gone)
        except Refused as refusal:
            self._refuse(conn, subject, str(refusal))
        except Exception as error:  # its caller starts the program afresh; the warm process goes on
            self._refuse(conn, subject, f"it failed: {error!r}")
        finally:
            for fd in fds:
                os.close(fd)

    def _fork(self, conn: socket.socket, request: Request, fds: list[int]) -> int:
        # Closed by the child once it leads a process group of its own: the caller may be gone the moment it has the
        # pid, and a kill of that group made before then reaches no one (ESRCH) and leaves the program running.
        led_read, led_write = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(led_read), os.close(led_write)
            raise
        if pid == 0:  # the child: never back into the loop (_become ends as the program does)
            try:
                for item in (self.listener, self.selector, conn, *self.awaited, *self.children.values()):
                    item.close()
                for fd in (self.parent, self.wake_read, self.wake_write, led_read):
                    os.close(fd)
            except BaseException:
                os._exit(1)
            _become(request, fds, self.site_path, led_write)
        os.close(led_write)
        os.read(led_read, 1)  # end of file: the child has called setsid (or is gone)
        os.close(led_read)
        with contextlib.suppress(OSError):  # a caller gone already: its connection's end kills the program
            conn.send(json.dumps({"pid": pid}).encode())
        return pid

    def _refuse(self, conn: socket.socket, subject: str, why: str) -> None:
        print(f"[apmpo.warm] refused {subject}: {why}", flush=True)
        with contextlib.suppress(OSError):
            conn.send(json.dumps({"refused": why}).encode())
        conn.close()

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [conn for conn, deadline in self.awaited.items() if deadline <= now]:
            del self.awaited[conn]
            self.selector.unregister(conn)
            self._refuse(conn, "a connection", f"no request within {self.timeout_s:g} s")

    def _caller_gone(self, conn: socket.socket) -> None:
        """`conn` readable while its program runs: at its end (whatever it sends now reads as one), and so goes the
        program."""
        self.selector.unregister(conn)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.callers.pop(conn), signal.SIGKILL)

    def _reap(self) -> None:
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:  # none left
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            if self.callers.pop(conn, None) is not None:
                self.selector.unregister(conn)
            with contextlib.suppress(OSError):  # its caller may be gone
                conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status),
                                      "cpu_s": usage.ru_utime + usage.ru_stime}).encode())
            conn.close()

    def _woken(self, _) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.wake_read, 4096)

    def _parent_gone(self, _) -> None:
        sys.exit(0)

    def kill_children(self) -> None:
        for pid in self.children:  # none outlives the warm process
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def main(listener: socket.socket, imports: tuple[str, ...], timeout_s: float = REQUEST_TIMEOUT_S) -> None:
    """The warm process: imports `imports` (modules, or the names of PRESETS), then forks a program for each request
    on `listener` until the process that started it exits (or a SIGTERM)."""
    exec_env = dict(os.environ)  # as this process started
    context = json.loads(json.dumps(process_context()))  # as a request carries it (tuples become lists)
    path, code, loop = listener.getsockname(), 0, None
    try:
        gc.disable()  # as a server does while it imports (apmpo.rollout.server)
        modules = [module for name in imports for module in PRESETS.get(name, (name,))]
        for module in modules:
            importlib.import_module(module)
        gc.freeze()  # what was imported stays out of every collection: a program's first ones stay short
        site_path = sys.path[1 + len(entries(exec_env.get("PYTHONPATH"))):]  # after the script's folder, PYTHONPATH
        # A setting that the imports made (vLLM's PYTORCH_NVML_BASED_CUDA_CHECK) they make in a fresh process too
        imports_set = {key: value for key, value in os.environ.items() if key not in exec_env}
        joins = frozenset(f"{name} namespace" for name in JOINED) if os.geteuid() == 0 else frozenset()
        view = View(warm.startup_settings(exec_env), imports_set, context, joins)
        loop = WarmProcess(listener, view, site_path, timeout_s)
        signal.set_wakeup_fd(loop.wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a byte on the pipe wakes the loop to reap
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        print(f"[apmpo.warm] ready on {path} (pid {os.getpid()}, uid {os.geteuid()}), having imported "
              f"{', '.join(modules)}", flush=True)
        loop.run()
    except SystemExit:  # SIGTERM, or the process that started it gone
        pass
    except BaseException:  # its users start their programs afresh
        traceback.print_exc()
        code = 1
    finally:
        if loop is not None:
            loop.kill_children()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sys.stdout.flush()
        os._exit(code)  # without the interpreter's teardown of everything imported (seconds, and nanobind's warnings)


def _become(request: Request, fds: list[int], site_path: list[str], led: int) -> None:
    """In the forked child: the process that `python COMMAND` would be, started by the caller. `led` is closed
    once it leads its own session and process group. `fds`: the program's descriptors, then the caller's JOINED
    namespaces."""
    code, warm._FORKED = 1, True
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        os.close(led)
        fds, namespaces = fds[:len(request.fds)], fds[len(request.fds):]
        _join(namespaces)
        above = max([2, *request.fds]) + 1  # moved above the numbers the program is given
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in fds]
        for fd in fds:
            os.close(fd)
        if 0 not in request.fds:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
        for fd, number in zip(moved, request.fds, strict=True):
            os.dup2(fd, number)
        for fd in moved:
            os.close(fd)
        unbuffered, module, script, args = program(request.command)
        import setproctitle  # vLLM's dependency

        # What `ps` shows, and what finds a program by its arguments. Before the environment changes:
        # setproctitle takes the room of the strings it started with.
        setproctitle.setproctitle(" ".join(request.command))
        os.chdir(request.cwd)
        os.environ.clear()
        os.environ.update(request.env)
        _as_if_started()
        if unbuffered:
            for stream in (sys.stdout, sys.stderr):
                stream.reconfigure(write_through=True)
        # sys.path as `python` makes it: the script's folder (or, for -m, the working directory), then PYTHONPATH
        first = os.getcwd() if module is not None else os.path.dirname(os.path.abspath(script))
        sys.path[:] = [first, *entries(request.env.get("PYTHONPATH")), *site_path]
        if module is not None:
            sys.argv = [module, *args]  # run_module sets argv[0] to its file
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):  # as the interpreter ends: its threads joined, atexit run
            threading._shutdown()
            import atexit

            atexit._run_exitfuncs()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _join(namespaces: list[int]) -> None:
    """Into each namespace (a descriptor of /proc/PID/ns/NAME) that this process is not in; closes them. Before
    anything opens a socket or a file: setns changes what later ones reach. A mount namespace takes a process of
    one thread, as a forked child is."""
    import ctypes

    setns = ctypes.CDLL(None, use_errno=True).setns
    for name, fd in zip(JOINED, namespaces, strict=True):
        if os.fstat(fd).st_ino != os.stat(f"/proc/self/ns/{name}").st_ino and setns(fd, 0) != 0:
            raise OSError(ctypes.get_errno(), f"setns into the caller's {name} namespace")
        os.close(fd)


def _as_if_started() -> None:
    """What a fresh interpreter would have under the caller's environment: garbage collection on, the random
    generators seeded anew (not shared with every sibling), and the settings that imported modules made from the
    environment as they loaded (warm.at_start)."""
    import random

    gc.enable()
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    for read_environment in warm._AT_START:
        read_environment()


def default_path() -> Path:
    """servers.sock in $XDG_RUNTIME_DIR/apmpo, else in /tmp/apmpo-UID; the folder made mode 700 where it is not
    there (`listen` refuses one that others may enter)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = Path(runtime) / "apmpo" if runtime else Path(tempfile.gettempdir()) / f"apmpo-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    return folder / "servers.sock"


def cli() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", help="the unix socket to serve on (APMPO_WARM_SERVERS of its users), in "
                                                "a folder that only you may enter (default: default_path())")
    parser.add_argument("--fd", type=int, help="an inherited listening socket instead (warm.warm_process())")
    parser.add_argument("--imports", help="modules to import once, comma-separated; `server` and `learner` name "
                                          "what a server and a learner (launch/train.py) import (default: server, "
                                          "under the malloc setting the launcher starts servers with)")
    parser.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT_S, metavar="S",
                        help="seconds a connection has to send its request (default: %(default)s)")
    args = parser.parse_args()
    if args.path is not None and args.fd is not None:
        parser.error("give a socket path or --fd, not both")
    imports = ("server",) if args.imports is None else tuple(args.imports.split(","))
    if args.imports is None and (env := server_env(dict(os.environ))) != os.environ:
        # malloc reads its setting as the process starts: again, with the one the launcher gives servers
        os.execve(sys.executable, [sys.executable, "-m", "apmpo.warm_server", *sys.argv[1:]], env)
    try:
        listener = socket.socket(fileno=args.fd) if args.fd is not None else listen(args.path or default_path())
    except (PermissionError, FileExistsError) as error:
        parser.error(str(error))
    main(listener, imports, args.request_timeout)


if __name__ == "__main__":
    cli()
