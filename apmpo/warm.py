"""Python programs forked from a process that has imported their modules once: a CPU server's start takes about
3 CPU seconds instead of 18, a learner's about 3 fewer than its 11 of imports.

Most of a short process's start on CPU is imports: torch, transformers and vLLM for a server (about 14 of a tiny
model's 18 CPU seconds, 2026-11-29), torch and transformers' model classes for a learner (about 8). Where such
processes start one after another (a test suite, many short runs or evaluations), a warm process imports them once
and forks each program from there:

    python -m apmpo.warm /tmp/servers.sock &                                  # what a server imports (default)
    python -m apmpo.warm /tmp/learners.sock --imports launch/train.py,deepspeed &
    APMPO_WARM_SERVERS=/tmp/servers.sock python launch/train.py --config configs/quickstart.yaml

The launcher forks its CPU servers through the socket that APMPO_WARM_SERVERS names (`fork_server`); `run` is
subprocess.run for any `python SCRIPT ...` or `python -m MODULE ...` through a given socket; `relay`, called first
by a program that another starts as a fresh `python` (DeepSpeed's launcher its ranks), has it forked there. A program
is started afresh instead where no warm process answers, where its environment differs from the warm process's in a
setting read as a process starts (STARTUP: OpenMP's threads, malloc's arenas, the loader, Python, PyTorch,
DeepSpeed, the hub), or its namespaces, control groups, CPU affinity, limits or ids do (process_context): a fork
keeps the warm process's; but a warm process run by root has its program join the caller's network and mount
namespaces (JOINED: `ip netns exec` changes both, as a node of the two-node tests runs). Either way the program is
the same: the leader of its own session and process group, with the caller's environment, working directory,
standard streams and descriptors, its command line as its title (`ps`), `sys.argv`, `sys.path[0]` and `__main__` as
`python` sets them, freshly seeded `random` and numpy generators, what modules set from the environment as they
loaded set again under its environment (at_start), and the interpreter's exit (threads joined, atexit run, streams
flushed). The warm process answers a request with the program's pid and, once it has exited, its exit code and CPU
seconds; it kills the program's process group when the caller is gone, and ends when the process that started it
does. CPU only: a fork after the CUDA driver is loaded is unsafe, and on a GPU an engine's start outweighs its
imports.
"""
from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import locale
import os
import resource
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable, Iterator

WARM_SERVERS_ENV = "APMPO_WARM_SERVERS"  # where the launcher forks its CPU servers
WARM_PROGRAMS_ENV = "APMPO_WARM_PROGRAMS"  # where `run` and `relay` fork, by default
RELAY_ENV = "APMPO_WARM_RELAY"  # in a relayed program's environment: the pid of its relay
SERVER_IMPORTS = ("uvicorn", "vllm.entrypoints.llm", "apmpo.rollout.server")
# Environment variables read as a process starts (by the loader, libgomp, glibc, Python, or at the import of
# torch, DeepSpeed, transformers and the hub): a forked program keeps the warm process's values, so they must be
# equal.
STARTUP = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "GLIBC_TUNABLES", "MALLOC_", "LD_", "PYTHON", "TORCH",
           "PYTORCH_", "DS_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "USE_TORCH", "USE_TF",
           "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING")
REPLY_TIMEOUT_S = 300.0  # a warm process still importing answers once it is done (about 20 s on 2 busy cores)
_AT_START: list[Callable[[], None]] = []  # at_start's functions
_FORKED = False  # True in a program forked by a warm process
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# The namespaces a forked program joins, the caller's where they differ from the warm process's (setns: root only).
# A caller sends them with every request: the warm process alone knows whether they differ.
JOINED = ("net", "mnt")


def at_start(read_environment: Callable[[], None]) -> None:
    """Runs `read_environment` (a module's own settings made from the environment as it is imported) again in each
    program forked from this process, under that program's environment, as its fresh import would have."""
    _AT_START.append(read_environment)


def startup_settings(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key.startswith(STARTUP)}


def process_context() -> dict[str, object]:
    """What a forked program keeps of the warm process beside its environment: its namespaces (a learner started
    in a network namespace of its own serves there), control groups, CPU affinity, resource limits and ids."""
    namespaces = {f"{name} namespace": os.stat(f"/proc/self/ns/{name}").st_ino for name in os.listdir("/proc/self/ns")}
    limits = {f"limit {name}": resource.getrlimit(getattr(resource, name)) for name in dir(resource)
              if name.startswith("RLIMIT_")}
    return {**namespaces, **limits, "control groups": Path("/proc/self/cgroup").read_text(),
            "CPU affinity": sorted(os.sched_getaffinity(0)),
            "user and groups": [os.getuid(), os.getgid(), os.getgroups()]}


class ForkedProcess:
    """A program forked by the warm process: what its callers use of subprocess.Popen (pid, poll, wait,
    returncode, send_signal, terminate, kill). Its exit code, and its CPU seconds (`cpu_s`, its own and those of
    the children it waited for), come from the warm process, whose child it is."""

    def __init__(self, pid: int, conn: socket.socket):
        self.pid, self.returncode, self.cpu_s, self._conn = pid, None, 0.0, conn

    def poll(self) -> int | None:
        return self.wait(timeout=0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                if timeout == 0:
                    return None
                raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout)
            # The warm process gone (killed) takes the code with it: -1, as for a child lost otherwise.
            reply = json.loads(self._conn.recv(4096) or b'{"returncode": -1}')
            self.returncode, self.cpu_s = reply["returncode"], reply.get("cpu_s", 0.0)
            self._conn.close()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork(command: list[str], path: str | os.PathLike, env: dict[str, str] | None = None,
         fds: dict[int, int] | None = None, explain_to: int | None = None,
         cwd: str | os.PathLike | None = None) -> ForkedProcess | None:
    """`command` (`[sys.executable, ["-u",] SCRIPT | -m MODULE, ARGS...]`) forked by the warm process at `path`,
    with `env` (default: ours), `cwd` (default: ours), and `fds`: {number in the program: our descriptor}
    (default: our standard streams). None where it cannot be (and a line in `explain_to`, if given, saying why):
    the caller starts it afresh."""
    fds = {0: 0, 1: 1, 2: 2} if fds is None else fds
    request = json.dumps({"command": command, "env": dict(os.environ if env is None else env),
                          "cwd": os.path.abspath(cwd or os.getcwd()), "fds": list(fds),
                          "context": process_context()}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    namespaces = [os.open(f"/proc/self/ns/{name}", os.O_RDONLY) for name in JOINED]  # sent after the program's
    try:
        conn.settimeout(REPLY_TIMEOUT_S)
        conn.connect(os.fspath(path))
        socket.send_fds(conn, [request], [*fds.values(), *namespaces])
        reply = json.loads(conn.recv(4096) or b'{"refused": "the warm process closed the connection"}')
        conn.settimeout(None)
    except (OSError, ValueError) as error:
        reply = {"refused": f"no answer from the warm process at {path}: {error}"}
    finally:
        for fd in namespaces:
            os.close(fd)
    if "pid" in reply:
        return ForkedProcess(reply["pid"], conn)
    conn.close()
    if explain_to is not None:
        os.write(explain_to, f"[apmpo] started afresh, not forked: {reply['refused']}\n".encode())
    return None


def relay(path: str | os.PathLike | None = None) -> None:
    """For a program that something else starts as a fresh `python [-u] SCRIPT ARGS` (DeepSpeed's launcher starts its
    ranks so): where the warm process at `path` (default: $APMPO_WARM_PROGRAMS) can fork this program, it does, and
    this process stays as its relay. The signals sent here go to the program, this process ends as the program does
    (its exit code, or the signal that ended it), and where this process is killed the warm process kills the
    program. The program finds its relay's pid in $APMPO_WARM_RELAY. Returns at once otherwise (no warm process
    named, a program already forked, or one that cannot be: a line on stderr says why), and the program runs here.
    Call it first: the imports that follow are what the fork saves."""
    path = path or os.environ.get(WARM_PROGRAMS_ENV)
    if not path or _FORKED:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)  # held from the fork until they can be relayed
    program = fork([sys.executable, *sys.orig_argv[1:]], path, {**os.environ, RELAY_ENV: str(os.getpid())},
                   explain_to=2)  # sys.orig_argv: with the interpreter's -u, if given
    if program is not None:
        for sig in RELAYED:
            signal.signal(sig, lambda signum, _: program.send_signal(signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
    if program is None:
        return
    code = program.wait()
    if code < 0:  # ended by a signal: so ends the relay
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's and SIGSTOP's cannot be set
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def fork_server(args: list[str], env: dict[str, str], stdout: int, pass_fds: tuple[int, ...]) -> ForkedProcess | None:
    """`python -m apmpo.rollout.server ARGS` forked by the warm process of $APMPO_WARM_SERVERS, as the launcher
    starts it: `stdout` as its stdout and stderr, `pass_fds` under the same numbers. None where none is named, or
    (with a line in `stdout` saying why) where it cannot be forked."""
    path = os.environ.get(WARM_SERVERS_ENV)
    if not path:
        return None
    return fork_to_log([sys.executable, "-m", "apmpo.rollout.server", *args], path, env, stdout, pass_fds,
                       explain=True)


def fork_to_log(command: list[str], path: str | os.PathLike, env: dict[str, str] | None, log: int,
                pass_fds: tuple[int, ...] = (), cwd: str | os.PathLike | None = None,
                explain: bool = False) -> ForkedProcess | None:
    """`fork` as a background program is started: stdin from /dev/null, stdout and stderr into `log`, `pass_fds`
    under the same numbers; with `explain`, a line in `log` saying why where it cannot be forked."""
    with open(os.devnull, "rb") as devnull:
        fds = {0: devnull.fileno(), 1: log, 2: log, **{fd: fd for fd in pass_fds}}
        return fork(command, path, env, fds, explain_to=log if explain else None, cwd=cwd)


def run(command: list[str], *, path: str | os.PathLike | None = None, env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None, capture_output: bool = False, text: bool = False,
        timeout: float | None = None, check: bool = False) -> subprocess.CompletedProcess:
    """subprocess.run(command) with stdin from /dev/null, forked by the warm process at `path` where it can be
    (`fork`; the result then has the program's CPU seconds as `cpu_s`), else started afresh. `path` defaults to
    $APMPO_WARM_PROGRAMS; neither: afresh."""
    forked, path = None, path or os.environ.get(WARM_PROGRAMS_ENV)
    if path is not None:
        with contextlib.ExitStack() as stack:
            devnull = stack.enter_context(open(os.devnull, "rb"))
            pipes = [os.pipe() for _ in range(2)] if capture_output else []
            for read, write in pipes:
                stack.callback(os.close, write)  # ours closed once the program holds its own
            fds = {0: devnull.fileno(), **({1: pipes[0][1], 2: pipes[1][1]} if pipes else {1: 1, 2: 2})}
            forked = fork(command, path, env, fds, cwd=cwd)
            if forked is None:
                for read, _ in pipes:
                    os.close(read)
    if forked is None:
        return subprocess.run(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=capture_output,
                              text=text, timeout=timeout, check=check)
    outputs = [b"", b""]

    def drain(k: int, read: int) -> None:
        with open(read, "rb") as stream:
            outputs[k] = stream.read()

    readers = [threading.Thread(target=drain, args=(k, read), daemon=True) for k, (read, _) in enumerate(pipes)]
    for reader in readers:
        reader.start()
    try:
        forked.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(forked.pid, signal.SIGKILL)
        forked.wait()
        raise subprocess.TimeoutExpired(command, timeout) from None
    finally:
        for reader in readers:
            reader.join()
    stdout, stderr = (_text(output) if text else output for output in outputs) if pipes else (None, None)
    done = subprocess.CompletedProcess(command, forked.returncode, stdout, stderr)
    done.cpu_s = forked.cpu_s
    if check:
        done.check_returncode()
    return done


def _text(output: bytes) -> str:
    """As subprocess decodes with text=True: the locale's encoding, universal newlines (tqdm's \r too)."""
    return output.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


@contextlib.contextmanager
def warm_process(path: str | Path, log_path: str | Path, env: dict[str, str] | None = None,
                 imports: tuple[str, ...] = SERVER_IMPORTS) -> Iterator[Path]:
    """A warm process on the unix socket `path` (its output in `log_path`) for as long as the block runs, having
    imported `imports` (modules, or scripts run as modules that are not __main__: their imports and definitions),
    with `env` (default: this process's), the startup environment of the programs it will fork (for servers, the
    launcher's: `server_env`).
    Returns at once: requests made while it imports are answered when it is done."""
    env = dict(os.environ if env is None else env)
    listener = _listen(path)  # bound here: a request made while the warm process imports waits in the backlog
    with open(log_path, "ab") as log, listener:
        process = subprocess.Popen([sys.executable, "-m", "apmpo.warm", "--fd", str(listener.fileno()),
                                    "--imports", ",".join(imports)],
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


def server_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the malloc setting that the launcher starts CPU servers with (read as a process starts)."""
    from apmpo.cpu_memory import with_one_arena

    return {**env, "GLIBC_TUNABLES": with_one_arena(env.get("GLIBC_TUNABLES"))}


def _listen(path: str | Path) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(64)
    return listener


def main(listener: socket.socket, imports: tuple[str, ...]) -> None:
    """The warm process: imports `imports`, then forks a program for each request on `listener` until the
    process that started it exits (or a SIGTERM)."""
    exec_env = dict(os.environ)  # as this process started
    context = json.loads(json.dumps(process_context()))  # as a request carries it (tuples become lists)
    parent = os.pidfd_open(os.getppid())
    listener.setblocking(False)
    path, code = listener.getsockname(), 0
    children: dict[int, socket.socket] = {}  # pid: its caller's connection
    callers: dict[socket.socket, int] = {}  # the connections of callers still there: pid
    try:
        gc.disable()  # as a server does while it imports (apmpo.rollout.server)
        for name in imports:
            if name.endswith(".py"):
                runpy.run_path(name, run_name="__warm__")  # its imports and definitions, not its main()
            else:
                __import__(name)
        gc.freeze()  # what was imported stays out of every collection: a program's first ones stay short
        site_path = sys.path[1 + len(_entries(exec_env.get("PYTHONPATH"))):]  # after the script's folder, PYTHONPATH
        # A setting that the imports made (vLLM's PYTORCH_NVML_BASED_CUDA_CHECK) they make in a fresh process too
        imports_set = {key: value for key, value in os.environ.items() if key not in exec_env}
        wake_read, wake_write = os.pipe()
        for fd in (wake_read, wake_write):
            fcntl.fcntl(fd, fcntl.F_SETFL, os.O_NONBLOCK)
        signal.set_wakeup_fd(wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a byte on the pipe wakes the loop to reap
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        print(f"[apmpo.warm] ready on {path} (pid {os.getpid()}), having imported {', '.join(imports)}", flush=True)
        while True:
            ready = select.select([listener, parent, wake_read, *callers], [], [])[0]
            if parent in ready:
                break
            with contextlib.suppress(BlockingIOError):
                os.read(wake_read, 4096)
            for conn in ready:
                if conn in callers:  # readable only at its end: the caller is gone, and so goes its program
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(callers.pop(conn), signal.SIGKILL)
            with contextlib.suppress(BlockingIOError):
                conn, _ = listener.accept()
                pid = _fork(conn, exec_env, imports_set, context, site_path,
                            closing=(listener, parent, wake_read, wake_write, *children.values()))
                if pid is not None:
                    children[pid], callers[conn] = conn, pid
            _reap(children, callers)
    except SystemExit:  # SIGTERM
        pass
    except BaseException:  # its users start their programs afresh
        traceback.print_exc()
        code = 1
    finally:
        for pid in children:  # none outlives the warm process
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sys.stdout.flush()
        os._exit(code)  # without the interpreter's teardown of everything imported (seconds, and nanobind's warnings)


def _fork(conn: socket.socket, exec_env: dict[str, str], imports_set: dict[str, str], context: dict,
          site_path: list[str], closing: tuple) -> int | None:
    """Forks the program that `conn` asks for and answers with its pid (None: refused, or a request cut short or
    malformed). The received descriptors are closed here either way; the child has its own copies."""
    fds = []
    try:
        conn.setblocking(True)
        conn.settimeout(10.0)  # the request follows the connection at once
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 64)
        request = json.loads(message)
        env = request["env"]
        differ = sorted(key for key in {*startup_settings(exec_env), *startup_settings(env)}
                        if exec_env.get(key) != env.get(key) and key != "PYTHONPATH"
                        and not (key in imports_set and env.get(key) in (None, imports_set[key])))
        joins = {f"{name} namespace" for name in JOINED} if os.geteuid() == 0 else set()
        differ += [key for key in context if context[key] != request["context"].get(key) and key not in joins]
        differ += [f"PYTHONPATH ({shadowing} would have been imported from there)"
                   for shadowing in _shadowed(_entries(env.get("PYTHONPATH")))]
        if differ or len(fds) != len(request["fds"]) + len(JOINED) or _program(request["command"]) is None:
            why = (f"the warm process started with other {', '.join(differ)}" if differ
                   else f"not a Python program it can run: {request['command'][:3]}")
            print(f"[apmpo.warm] refused {request['command'][:3]}: {why}", flush=True)
            conn.send(json.dumps({"refused": why}).encode())
            conn.close()
            return None
        # Closed by the child once it leads a process group of its own: the caller may be gone the moment it has the
        # pid, and a kill of that group made before then reaches no one (ESRCH) and leaves the program running.
        led_read, led_write = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(led_read), os.close(led_write)
            raise
        if pid == 0:
            for item in (*closing, conn, led_read):
                with contextlib.suppress(OSError):
                    item.close() if hasattr(item, "close") else os.close(item)
            _become(request, fds, site_path, led_write)
        os.close(led_write)
        os.read(led_read, 1)  # end of file: the child has called setsid (or is gone)
        os.close(led_read)
        conn.send(json.dumps({"pid": pid}).encode())
        return pid
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"[apmpo.warm] a request failed: {error!r}", flush=True)
        conn.close()
        return None
    finally:
        for fd in fds:
            os.close(fd)


def _program(command: list[str]) -> tuple[bool, str | None, str | None, list[str]] | None:
    """(unbuffered, module, script, args) of `python [-u] (-m MODULE | SCRIPT) ARGS`; None for anything else."""
    if not command or command[0] != sys.executable:
        return None
    rest = command[1:]
    unbuffered = rest[:1] == ["-u"]
    rest = rest[unbuffered:]
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return unbuffered, rest[1], None, rest[2:]
    if rest and not rest[0].startswith("-"):
        return unbuffered, None, rest[0], rest[1:]
    return None


def _entries(pythonpath: str | None) -> list[str]:
    return [os.path.abspath(entry) for entry in (pythonpath or "").split(os.pathsep) if entry]


def _shadowed(entries: list[str]) -> list[str]:
    """The modules imported here that a program with `entries` on PYTHONPATH would have found elsewhere."""
    loaded = {name: getattr(module, "__file__", None) for name, module in list(sys.modules.items()) if "." not in name}
    return sorted(name for name, file in loaded.items() if file is not None and not any(
        file.startswith(entry + os.sep) for entry in entries) and any(
        os.path.exists(os.path.join(entry, name, "__init__.py")) or os.path.exists(os.path.join(entry, name + ".py"))
        for entry in entries))


def _reap(children: dict[int, socket.socket], callers: dict[socket.socket, int]) -> None:
    while True:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:  # none left
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            callers.pop(conn, None)
            with contextlib.suppress(OSError):  # its caller may be gone
                conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status),
                                      "cpu_s": usage.ru_utime + usage.ru_stime}).encode())
            conn.close()


def _become(request: dict, fds: list[int], site_path: list[str], led: int) -> None:
    """In the forked child: the process that `python COMMAND` would be, started by the caller. `led` is closed
    once it leads its own session and process group. `fds`: the program's descriptors, then the caller's JOINED
    namespaces."""
    global _FORKED
    code, _FORKED = 1, True
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()
        os.close(led)
        fds, namespaces = fds[:len(request["fds"])], fds[len(request["fds"]):]
        _join(namespaces)
        above = max([2, *request["fds"]]) + 1  # moved above the numbers the program is given
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, above) for fd in fds]
        for fd in fds:
            os.close(fd)
        if 0 not in request["fds"]:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
        for fd, number in zip(moved, request["fds"], strict=True):
            os.dup2(fd, number)
        for fd in moved:
            os.close(fd)
        unbuffered, module, script, args = _program(request["command"])
        import setproctitle  # vLLM's dependency

        # What `ps` shows, and what finds a program by its arguments. Before the environment changes:
        # setproctitle takes the room of the strings it started with.
        setproctitle.setproctitle(" ".join(request["command"]))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _as_if_started()
        if unbuffered:
            for stream in (sys.stdout, sys.stderr):
                stream.reconfigure(write_through=True)
        # sys.path as `python` makes it: the script's folder (or, for -m, the working directory), then PYTHONPATH
        first = os.getcwd() if module is not None else os.path.dirname(os.path.abspath(script))
        sys.path[:] = [first, *_entries(request["env"].get("PYTHONPATH")), *site_path]
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
    environment as they loaded (at_start)."""
    import random

    gc.enable()
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    for read_environment in _AT_START:
        read_environment()


def cli() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", help="the unix socket to serve on (APMPO_WARM_SERVERS of its users)")
    parser.add_argument("--fd", type=int, help="an inherited listening socket instead (warm_process())")
    parser.add_argument("--imports", help="modules (or scripts, run under another name than __main__) to import "
                                          "once, comma-separated (default: a warm process for servers: what a server "
                                          "imports, under the malloc setting the launcher starts them with)")
    args = parser.parse_args()
    if (args.path is None) == (args.fd is None):
        parser.error("give a socket path or --fd")
    imports = SERVER_IMPORTS if args.imports is None else tuple(args.imports.split(","))
    if args.imports is None and (env := server_env(dict(os.environ))) != os.environ:
        # malloc reads its setting as the process starts: again, with the one the launcher gives servers
        os.execve(sys.executable, [sys.executable, "-m", "apmpo.warm", *sys.argv[1:]], env)
    main(_listen(args.path) if args.fd is None else socket.socket(fileno=args.fd), imports)


if __name__ == "__main__":
    import apmpo.warm  # the module that the imports see (at_start), not this __main__ copy of it

    apmpo.warm.cli()
