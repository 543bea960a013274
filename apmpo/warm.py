"""Python programs forked from a process that has imported their modules once: a CPU server's start takes about
3 CPU seconds instead of 18, a learner's about 3 fewer than its 11 of imports.

Most of a short process's start on CPU is imports: torch, transformers and vLLM for a server (about 14 of a tiny
model's 18 CPU seconds, 2026-11-29), torch and transformers' model classes for a learner (about 8). Where such
processes start one after another (a test suite, many short runs or evaluations), a warm process imports them once
and forks each program from there:

    warm=$(mktemp -d)                                      # a folder that only you may enter (mode 700)
    python -m apmpo.warm_server $warm/servers.sock &       # what a server imports (default)
    python -m apmpo.warm_server $warm/learners.sock --imports learner,deepspeed &   # what a learner imports
    APMPO_WARM_SERVERS=$warm/servers.sock python launch/train.py --config configs/quickstart.yaml

This module is the callers' side. The launcher forks its CPU servers through the socket that APMPO_WARM_SERVERS
names (`fork_server`); `run` is subprocess.run for any `python SCRIPT ...` or `python -m MODULE ...` through a given
socket; `relay`, called first by a program that another starts as a fresh `python` (DeepSpeed's launcher its ranks),
has it forked there. The warm process is apmpo/warm_server.py, what it accepts of a request apmpo/warm_request.py.
It serves its own user only (docs/server.md, "Who a warm process serves"): it forks for a caller whose uid, as the
kernel has it, is its own, and a caller sends nothing (its environment, its descriptors) to a socket whose listener
runs as another user, but starts its program afresh and says why. Nothing is forked unless a socket is named.

A program is started afresh instead where no warm process answers, where its environment differs from the warm
process's in a setting read as a process starts (STARTUP: OpenMP's threads, malloc's arenas, the loader, Python,
PyTorch, DeepSpeed, the hub), or its namespaces, control groups, CPU affinity, limits or ids do (process_context): a
fork keeps the warm process's; but a warm process run by root has its program join the caller's network and mount
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
import errno
import json
import locale
import os
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator

WARM_SERVERS_ENV = "APMPO_WARM_SERVERS"  # where the launcher forks its CPU servers
WARM_PROGRAMS_ENV = "APMPO_WARM_PROGRAMS"  # where `run` and `relay` fork, by default
RELAY_ENV = "APMPO_WARM_RELAY"  # in a relayed program's environment: the pid of its relay
SERVER_IMPORTS = ("uvicorn", "vllm.entrypoints.llm", "apmpo.rollout.server")
# What launch/train.py imports at module level, as modules (tests/test_warm.py holds the two together): a learners'
# warm process imports these, not the script.
LEARNER_IMPORTS = ("torch", "torch.distributed", "transformers.models.auto.tokenization_auto", "apmpo.dirlock",
                   "apmpo.preflight", "apmpo.config", "apmpo.learner.checkpoint", "apmpo.learner.driver",
                   "apmpo.learner.engine", "apmpo.learner.nodes", "apmpo.learner.prepare", "apmpo.learner.step",
                   "apmpo.learner.zero3", "apmpo.rollout.launcher")
PRESETS = {"server": SERVER_IMPORTS, "learner": LEARNER_IMPORTS}  # what a warm process's --imports may name so
# Environment variables read as a process starts (by the loader, libgomp, glibc, Python, or at the import of
# torch, DeepSpeed, transformers and the hub): a forked program keeps the warm process's values, so they must be
# equal.
STARTUP = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "GLIBC_TUNABLES", "MALLOC_", "LD_", "PYTHON", "TORCH",
           "PYTORCH_", "DS_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "USE_TORCH", "USE_TF",
           "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING")
REPLY_TIMEOUT_S = 300.0  # a warm process still importing answers once it is done (about 20 s on 2 busy cores)
MAX_CONNECTIONS = 256  # a warm process holds at most this many (requests awaited, programs running); it refuses more
_AT_START: list[Callable[[], None]] = []  # at_start's functions
_FORKED = False  # True in a program forked by a warm process (set there: apmpo/warm_server.py)
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


def peer_uid(conn: socket.socket) -> int:
    """The effective uid of the process at the other end of the unix socket `conn`, from the kernel (SO_PEERCRED:
    the one it had as it connected, or as it listened), whatever the other end says."""
    return struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]


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
    the caller starts it afresh. Where the process listening at `path` runs as another user it is sent nothing, and
    the line goes to stderr where no `explain_to` is given."""
    fds = {0: 0, 1: 1, 2: 2} if fds is None else fds
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.settimeout(REPLY_TIMEOUT_S)
        conn.connect(os.fspath(path))
        owner = peer_uid(conn)
        reply = _ask(conn, command, env, fds, cwd) if owner == os.geteuid() else {"stranger": True, "refused": (
            f"the process listening at {path} runs as uid {owner}, not as this one ({os.geteuid()}): sent it nothing")}
        conn.settimeout(None)
    except (OSError, ValueError) as error:
        reply = {"refused": f"no answer from the warm process at {path}: {error}"}
    if "pid" in reply:
        return ForkedProcess(reply["pid"], conn)
    conn.close()
    if explain_to is not None or "stranger" in reply:
        os.write(2 if explain_to is None else explain_to,
                 f"[apmpo] started afresh, not forked: {reply['refused']}\n".encode())
    return None


def _ask(conn: socket.socket, command: list[str], env: dict[str, str] | None, fds: dict[int, int],
         cwd: str | os.PathLike | None) -> dict:
    """The warm process's reply to the request for `command` (apmpo/warm_request.py: the request's form)."""
    request = json.dumps({"command": command, "env": dict(os.environ if env is None else env),
                          "cwd": os.path.abspath(cwd or os.getcwd()), "fds": list(fds),
                          "context": process_context()}).encode()
    namespaces = [os.open(f"/proc/self/ns/{name}", os.O_RDONLY) for name in JOINED]  # sent after the program's
    try:
        socket.send_fds(conn, [request], [*fds.values(), *namespaces])
    except BrokenPipeError:  # refused as it connected (a warm process that holds its most): the reply says why
        pass
    finally:
        for fd in namespaces:
            os.close(fd)
    return json.loads(conn.recv(4096) or b'{"refused": "the warm process closed the connection"}')


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
                 imports: tuple[str, ...] = SERVER_IMPORTS, request_timeout_s: float | None = None) -> Iterator[Path]:
    """A warm process on the unix socket `path` (`listen`; its output in `log_path`) for as long as the block runs,
    having imported `imports` (modules, or the names of PRESETS), with `env` (default: this process's), the startup
    environment of the programs it will fork (for servers, the launcher's: `server_env`), dropping a connection that
    sends no request within `request_timeout_s` (default: the warm process's).
    Returns at once: requests made while it imports are answered when it is done."""
    env = dict(os.environ if env is None else env)
    listener = listen(path)  # bound here: a request made while the warm process imports waits in the backlog
    timeout = [] if request_timeout_s is None else ["--request-timeout", str(request_timeout_s)]
    with open(log_path, "ab") as log, listener:
        process = subprocess.Popen([sys.executable, "-m", "apmpo.warm_server", "--fd", str(listener.fileno()),
                                    "--imports", ",".join(imports), *timeout],
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


def listen(path: str | os.PathLike) -> socket.socket:
    """A warm process's socket, listening at `path`: mode 0600 from its start (bound under umask 177), in a folder
    that only this user may enter (mode 700; PermissionError otherwise). A socket at `path` that no process listens
    on (a warm process killed) is replaced; one that still answers is not (FileExistsError)."""
    folder = os.path.dirname(os.path.abspath(path))
    stat = os.stat(folder)
    if stat.st_uid != os.geteuid() or stat.st_mode & 0o077:
        raise PermissionError(f"{folder} (uid {stat.st_uid}, mode {stat.st_mode & 0o777:o}) is open to others: a "
                              f"warm process's socket goes into a folder that only its user may enter, mode 700 "
                              f"($XDG_RUNTIME_DIR, or one that `mktemp -d` makes)")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    umask = os.umask(0o177)  # the process's, for the moment of the bind: so no one may connect before a chmod
    try:
        try:
            listener.bind(os.fspath(path))
        except OSError as error:
            if error.errno != errno.EADDRINUSE or not _left_behind(path):
                listener.close()
                raise
            os.unlink(path)
            listener.bind(os.fspath(path))
    finally:
        os.umask(umask)
    listener.listen(MAX_CONNECTIONS)
    return listener


def _left_behind(path: str | os.PathLike) -> bool:
    """Whether `path` is a socket that no process listens on; FileExistsError where one does."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        try:
            probe.connect(os.fspath(path))
        except ConnectionRefusedError:
            return True
        except OSError:  # not a socket of this type, say
            return False
    raise FileExistsError(f"a warm process already listens at {path}")


if __name__ == "__main__":
    sys.exit("the warm process is `python -m apmpo.warm_server` (this module is its callers' side)")
