"""Start a generation server as a subprocess (or connect to a running one) and stop it whatever happens.

Used by the learner and by `python -m apmpo.eval`:

    with serve(model="Qwen/Qwen2.5-1.5B-Instruct", devices="1", log_path="runs/x/server.log") as server:
        client = server.client()                  # a GenerationClient, ready
    with serve(url="http://node2:8000", token=...) as server: ...   # an already running server: not stopped

Devices: `devices="1,2"` gives the server those GPUs (CUDA_VISIBLE_DEVICES) and, by default, tensor parallelism
over them; disjoint from the learner's. To share the learner's GPU, pass that one device and a
`gpu_memory_utilization` fraction that leaves room for training.

The server runs in its own process group, which `stop` kills as a whole (vLLM spawns engine processes). It is
stopped by the context manager, by atexit, and, should the parent die without either (SIGKILL, OOM killer),
by itself: it watches the launching process (APMPO_LAUNCHER_PID) and then kills its whole group.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from apmpo.rollout.client import GenerationClient, ServerUnavailable
from apmpo.rollout.net import bind_socket, is_loopback


class ServerStartError(RuntimeError):
    """The server process exited or never became ready; the message carries the tail of its log."""


class ServerProcess:
    def __init__(self, url: str, token: str | None, process: subprocess.Popen | None = None,
                 log_path: Path | None = None):
        self.url, self.token, self.process, self.log_path = url, token, process, log_path

    def client(self, **kwargs) -> GenerationClient:
        return GenerationClient(self.url, self.token, **kwargs)

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after `grace_s`. A connected server is left alone.
        The group is stopped even when the server itself is already gone (killed -9): vLLM's engine processes
        are in it and outlive it otherwise. (Its pid cannot be reused while the group has members.)"""
        process, self.process = self.process, None
        if process is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                process.poll()  # reaps the server: a zombie would count as a member
                if not _group_alive(process.pid):
                    return
                time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def start_server(model: str, *, log_path: str | Path, devices: str | None = None, host: str = "127.0.0.1",
                 port: int | None = None, token: str | None = None, gpu_memory_utilization: float = 0.9,
                 tensor_parallel_size: int | None = None, max_model_len: int | None = None, dtype: str = "auto",
                 seed: int = 0, extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 ready_timeout_s: float = 900.0) -> ServerProcess:
    """Starts `python -m apmpo.rollout.server` and returns once it is ready (or raises ServerStartError)."""
    # Bound here and inherited by the server, so that no other process can take the port in between.
    if token is not None and not token.strip():
        raise ValueError("token is empty: pass None (a loopback server needs none) or a secret")
    listener = bind_socket(host, port or 0)
    port = listener.getsockname()[1]
    if token is None and not is_loopback(host):
        token = secrets.token_urlsafe(24)
    child_env = {**os.environ, **(env or {})}
    if devices is not None:
        child_env["CUDA_VISIBLE_DEVICES"] = devices
        tensor_parallel_size = tensor_parallel_size or len(devices.split(","))
    if token is not None:
        child_env["APMPO_SERVER_TOKEN"] = token  # not on the command line, where `ps` would show it
    # The server takes its process group (itself and vLLM's engine processes) down once we are gone, even after
    # a SIGKILL of this process (apmpo.rollout.server.follow_launcher).
    child_env["APMPO_LAUNCHER_PID"] = str(os.getpid())
    command = [sys.executable, "-m", "apmpo.rollout.server", "--model", str(model), "--host", host,
               "--port", str(port), "--dtype", dtype, "--gpu-memory-utilization", str(gpu_memory_utilization),
               "--tensor-parallel-size", str(tensor_parallel_size or 1), "--seed", str(seed),
               "--fd", str(listener.fileno()), *extra_args]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file, listener:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=child_env,
                                   start_new_session=True, pass_fds=(listener.fileno(),))
    server = ServerProcess(f"http://{host}:{port}", token, process, log_path)
    atexit.register(server.stop)
    try:
        _wait_until_ready(server, ready_timeout_s)
    except BaseException:  # incl. Ctrl-C during the start
        server.stop()
        raise
    return server


def _wait_until_ready(server: ServerProcess, timeout_s: float) -> None:
    client = server.client(retries=0)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            code = server.process.poll()
            if code is not None:
                raise ServerStartError(f"generation server exited with code {code} during start-up; "
                                       f"log {server.log_path}:\n{server.log_tail()}")
            try:
                client.wait_ready(timeout_s=0)
                return
            except ServerUnavailable:
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(f"generation server not ready after {timeout_s:.0f} s; "
                                       f"log {server.log_path}:\n{server.log_tail()}")
            time.sleep(1.0)
    finally:
        client.close()


@contextlib.contextmanager
def serve(model: str | None = None, *, url: str | None = None, token: str | None = None,
          log_path: str | Path = "server.log", **start_kwargs) -> Iterator[ServerProcess]:
    """Connects to `url` if given (waiting until ready), else starts a server on `model`; stops what it started."""
    if url is not None:
        server = ServerProcess(url, token)
        with server.client() as client:
            client.wait_ready(timeout_s=start_kwargs.get("ready_timeout_s", 300.0))
    elif model is not None:
        server = start_server(model, log_path=log_path, token=token, **start_kwargs)
    else:
        raise ValueError("serve() needs a model to start or the url of a running server")
    try:
        yield server
    finally:
        server.stop()
