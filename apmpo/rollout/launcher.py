"""Start a generation server as a subprocess (or connect to a running one) and stop it whatever happens.

Used by the learner and by `python -m apmpo.eval`:

    with serve(model="Qwen/Qwen2.5-1.5B-Instruct", devices="1", log_path="runs/x/server.log") as server:
        client = server.client()                  # a GenerationClient, ready
    with serve(url="http://node2:8000", token=...) as server: ...   # an already running server: not stopped
    with serve(model, devices="4;5;6;7") as servers:    # several servers (a ServerSet), started together
        client = servers.client()                       # a ServerPool: prompts spread over them, weights to all
    with serve(urls=["http://node2:8000", "http://node3:8000"], token=...) as servers: ...

Devices: `devices="1,2"` gives the server those GPUs (CUDA_VISIBLE_DEVICES) and, by default, tensor parallelism
over them; disjoint from the learner's. Groups separated by ";" are one server each: "4;5;6;7" four servers with
one GPU, "4,5;6,7" two with TP 2. Without GPUs, `num_servers` CPU servers. To share the learner's GPU, pass that
one device and a `gpu_memory_utilization` fraction that leaves room for training (`gpu_memory_utilization`).

Each server runs in its own process group, which `stop` kills as a whole (vLLM spawns engine processes). It is
stopped by the context manager, by atexit, and, should the parent die without either (SIGKILL, OOM killer),
by itself: it watches the launching process (APMPO_LAUNCHER_PID) and then kills its whole group. Several servers
start at once; one that fails to start stops them all. With APMPO_WARM_SERVERS set, CPU servers are forked from
a process that has imported vLLM already (apmpo/warm.py: about 14 CPU seconds less a start).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import torch

from apmpo import warm
from apmpo.cpu_memory import with_one_arena
from apmpo.cpu_threads import usable_cores
from apmpo.rollout.client import READY_POLL_S, GenerationClient, ServerUnavailable
from apmpo.rollout.net import bind_socket, is_loopback
from apmpo.rollout.pool import ServerPool


# vLLM's share of a server GPU's memory (weights, activations, then all the rest as KV cache). On GPUs of its own,
# vLLM's default; on the GPU it shares with learner rank 0 (weights over CUDA IPC), half, the rest for training.
OWN_GPU_MEMORY_UTILIZATION = 0.9
SHARED_GPU_MEMORY_UTILIZATION = 0.5


def gpu_memory_utilization(configured: float | None, shares_learner_gpu: bool) -> float:
    """rollout.gpu_memory_utilization, its default (None) resolved for where the servers run."""
    if configured is not None:
        return configured
    return SHARED_GPU_MEMORY_UTILIZATION if shares_learner_gpu else OWN_GPU_MEMORY_UTILIZATION


class ServerStartError(RuntimeError):
    """The server process exited or never became ready; the message carries the tail of its log."""


class ServerProcess:
    def __init__(self, url: str, token: str | None, process: subprocess.Popen | warm.ForkedProcess | None = None,
                 log_path: Path | None = None):
        self.url, self.token, self.process, self.log_path = url, token, process, log_path

    def client(self, **kwargs) -> GenerationClient:
        return GenerationClient(self.url, self.token, **kwargs)

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        """After `serve(..., wait=False)`: returns once the engine is loaded (or raises ServerStartError)."""
        _wait_until_ready([self], timeout_s)

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


class ServerSet:
    """Several servers serving one model; `client()` is a ServerPool over them."""

    def __init__(self, servers: list[ServerProcess]):
        self.servers = servers

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    def client(self, **kwargs) -> ServerPool:
        return ServerPool([server.client(**kwargs) for server in self.servers])

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        _wait_until_ready(self.servers, timeout_s)

    def stop(self) -> None:
        for server in self.servers:  # SIGTERM to all first: their engines shut down in parallel
            with contextlib.suppress(ProcessLookupError):
                if server.process is not None:
                    os.killpg(server.process.pid, signal.SIGTERM)
        for server in self.servers:
            server.stop()


def device_groups(devices: str) -> list[str]:
    """One CUDA_VISIBLE_DEVICES per server: "4;5;6;7" -> ["4", "5", "6", "7"], "4,5;6,7" -> ["4,5", "6,7"].
    Raises ValueError on an empty group or id, or a GPU named twice."""
    groups = [[d.strip() for d in group.split(",")] for group in devices.split(";")]
    if any(not d for group in groups for d in group):
        raise ValueError(f"{devices!r} has an empty device group or id (groups: '4;5', a group's GPUs: '4,5')")
    named = [d for group in groups for d in group]
    twice = sorted({d for d in named if named.count(d) > 1})
    if twice:
        raise ValueError(f"{devices!r} names GPU {', '.join(twice)} twice: each server needs GPUs of its own")
    return [",".join(group) for group in groups]


def server_groups(devices: str | None, num_servers: int = 1) -> list[str | None]:
    """Each server's CUDA_VISIBLE_DEVICES: one per device group of `devices` (num_servers left at 1 or equal to the
    number of groups), else `num_servers` servers on no named GPUs. Raises ValueError."""
    if devices is None:
        return [None] * num_servers
    groups = device_groups(devices)
    if num_servers not in (1, len(groups)):
        raise ValueError(f"{devices!r} names {len(groups)} server(s) (one device group each, separated by ';'), "
                         f"but {num_servers} servers were asked for")
    return groups


def start_server(model: str, *, log_path: str | Path, devices: str | None = None, **kwargs) -> ServerProcess:
    """Starts `python -m apmpo.rollout.server` and returns once it is ready (or raises ServerStartError)."""
    return start_servers(model, log_paths=[log_path], devices=[devices], **kwargs)[0]


def start_servers(model: str, *, log_paths: list[str | Path], devices: list[str | None], host: str = "127.0.0.1",
                  port: int | None = None, token: str | None = None,
                  gpu_memory_utilization: float = OWN_GPU_MEMORY_UTILIZATION,
                  tensor_parallel_size: int | None = None, max_model_len: int | None = None, dtype: str = "auto",
                  seed: int = 0, extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                  ready_timeout_s: float = 900.0, wait: bool = True, overlap: bool = True
                  ) -> list[ServerProcess]:
    """Starts one server per entry of `devices` (its CUDA_VISIBLE_DEVICES, or None), all at once, and returns once
    every one is ready; if any fails, stops them all and raises ServerStartError naming it. `wait=False` returns
    at once: the caller does other work while the engines load, then calls `wait_ready`. `overlap`: something
    else computes while these servers generate (the learner of an asynchronous run, Config.overlap; the caller by
    default), False where nothing does (the synchronous loop, evaluation); on CPU their OpenMP threads follow
    cpu_server_threads, unless the environment sets OMP_NUM_THREADS."""
    if token is not None and not token.strip():
        raise ValueError("token is empty: pass None (a loopback server needs none) or a secret")
    if port is not None and len(devices) > 1:
        raise ValueError("several servers take free ports: pass port=None")
    if token is None and not is_loopback(host):
        token = secrets.token_urlsafe(24)
    cpu_threads = None if torch.cuda.is_available() else cpu_server_threads(model, len(devices), overlap)
    servers: list[ServerProcess] = []
    try:
        for log_path, group in zip(log_paths, devices, strict=True):
            tp = tensor_parallel_size or (len(group.split(",")) if group is not None else 1)
            servers.append(_launch(model, Path(log_path), group, host, port, token, [
                "--dtype", dtype, "--gpu-memory-utilization", str(gpu_memory_utilization),
                "--tensor-parallel-size", str(tp), "--seed", str(seed), *extra_args,
                *(["--max-model-len", str(max_model_len)] if max_model_len is not None else [])], env, cpu_threads))
        if wait:
            _wait_until_ready(servers, ready_timeout_s)
    except BaseException:  # incl. Ctrl-C during the start
        ServerSet(servers).stop()
        raise
    return servers


def _launch(model: str, log_path: Path, devices: str | None, host: str, port: int | None, token: str | None,
            args: list[str], env: dict[str, str] | None, cpu_threads: int | None) -> ServerProcess:
    # Bound here and inherited by the server, so that no other process can take the port in between.
    listener = bind_socket(host, port or 0)
    port = listener.getsockname()[1]
    child_env = {**os.environ, **(env or {})}
    if devices is not None:
        child_env["CUDA_VISIBLE_DEVICES"] = devices
    elif not torch.cuda.is_available():
        # The CPU engine runs in the server's process (vllm_compat): cpu_server_threads says how many compute
        # threads it gets.
        child_env.setdefault("OMP_NUM_THREADS", str(cpu_threads))
        child_env["GLIBC_TUNABLES"] = with_one_arena(child_env.get("GLIBC_TUNABLES"))
    if token is not None:
        child_env["APMPO_SERVER_TOKEN"] = token  # not on the command line, where `ps` would show it
    # The server takes its process group (itself and vLLM's engine processes) down once we are gone, even after
    # a SIGKILL of this process (apmpo.rollout.server.follow_launcher).
    child_env["APMPO_LAUNCHER_PID"] = str(os.getpid())
    command = [sys.executable, "-m", "apmpo.rollout.server", "--model", str(model), "--host", host,
               "--port", str(port), "--fd", str(listener.fileno()), *args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file, listener:
        # Forked from a warm process where one is named (CPU only: apmpo.warm), else started afresh.
        process = (devices is None and not torch.cuda.is_available()
                   and warm.fork_server(command[3:], child_env, log_file.fileno(), (listener.fileno(),))) or \
            subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=child_env,
                             start_new_session=True, pass_fds=(listener.fileno(),))
    server = ServerProcess(f"http://{host}:{port}", token, process, log_path)
    atexit.register(server.stop)
    return server


def _wait_until_ready(servers: list[ServerProcess], timeout_s: float) -> None:
    clients = {server.url: server.client(retries=0) for server in servers}
    pending = list(servers)
    deadline = time.monotonic() + timeout_s
    try:
        while pending:
            for server in list(pending):
                code = server.process.poll() if server.process is not None else None  # None: not ours
                if code is not None:
                    raise ServerStartError(f"generation server {server.url} exited with code {code} during start-up; "
                                           f"log {server.log_path}:\n{server.log_tail()}")
                try:
                    clients[server.url].wait_ready(timeout_s=0)
                    pending.remove(server)
                except ServerUnavailable:
                    pass
            if pending and time.monotonic() > deadline:
                raise ServerStartError(f"generation server {pending[0].url} not ready after {timeout_s:.0f} s; "
                                       f"log {pending[0].log_path}:\n{pending[0].log_tail()}")
            if pending:
                time.sleep(READY_POLL_S)
    finally:
        for client in clients.values():
            client.close()


# From this hidden size on, a CPU server's matmuls outweigh its engine's Python work per decode step. Measured on
# 2 cores, 16 prompts x 8 samples, 64 tokens, through the server: 4 layers x 512 with a 32k vocabulary took 13.4 s
# with 2 OpenMP threads against 23.3 s with 1; the quickstart's 2 x 128 took 1.5 s with 2 against 0.9-1.4 s with
# 1 (its engine thread, which schedules every step, then shared its core with the OpenMP team).
COMPUTE_BOUND_HIDDEN_SIZE = 512


def cpu_server_threads(model: str, num_servers: int, overlap: bool, cores: int | None = None) -> int:
    """OpenMP threads for each of `num_servers` CPU servers of `model`: every core but one, which the engine's
    scheduling needs; every core for a model whose matmuls dominate when the learner is idle meanwhile (no
    `overlap`: the synchronous loop). The servers split them."""
    from transformers import AutoConfig

    cores = cores or usable_cores()
    # The config is read only when it matters: a server on a bad path then fails with its own error.
    whole = (not overlap
             and AutoConfig.from_pretrained(model).get_text_config().hidden_size >= COMPUTE_BOUND_HIDDEN_SIZE)
    return max(1, (cores if whole else cores - 1) // num_servers)


@contextlib.contextmanager
def serve(model: str | None = None, *, url: str | None = None, urls: list[str] | None = None,
          token: str | None = None, log_path: str | Path = "server.log", devices: str | None = None,
          num_servers: int = 1, url_ready_timeout_s: float = 30.0,
          **start_kwargs) -> Iterator[ServerProcess | ServerSet]:
    """Connects to `url` (or each of `urls`) if given, waiting until ready (at most `url_ready_timeout_s`: they
    are running servers, or ones still loading), else starts servers on `model`: one per device group of
    `devices`, or `num_servers` without devices. Yields a ServerProcess for one server, a ServerSet for several
    (their logs: server.0.log, server.1.log, ... beside `log_path`); stops what it started."""
    urls = urls or ([url] if url is not None else [])
    if urls:
        servers = [ServerProcess(u, token) for u in urls]
        for server in servers:
            with server.client() as client:
                client.wait_ready(timeout_s=url_ready_timeout_s)
    elif model is not None:
        groups = server_groups(devices, num_servers)
        log_path = Path(log_path)
        logs = [log_path] if len(groups) == 1 else \
            [log_path.with_name(f"{log_path.stem}.{k}{log_path.suffix}") for k in range(len(groups))]
        servers = start_servers(model, log_paths=logs, devices=groups, token=token, **start_kwargs)
    else:
        raise ValueError("serve() needs a model to start or the url of a running server")
    group = servers[0] if len(servers) == 1 else ServerSet(servers)
    try:
        yield group
    finally:
        group.stop()


def follow_deepspeed_runner(poll_s: float = 0.5, grace_s: float = 15.0) -> None:
    """For a learner rank under `deepspeed` (its runner starts `deepspeed.launcher.launch`, which starts the
    ranks): once the runner or the launch process is gone, the rank stops as on Ctrl-C (KeyboardInterrupt in its
    main thread: the servers and the reward workers are stopped on the way out), and exits after `grace_s` if it
    has not by then (its servers follow it, apmpo.rollout.server.follow_launcher). On one node the runner forwards
    no signal: a SIGTERM or SIGINT to it alone (a job scheduler's, a supervisor's, `kill PID`) left the launch
    process, every rank, the servers and the reward workers running. A rank started otherwise follows nothing:
    the parent of `python launch/train.py` may be a shell that exits (nohup). A rank forked by a warm process
    follows through its relay, the process that the launch process started (apmpo.warm.relay)."""
    started = int(os.environ.get(warm.RELAY_ENV, os.getpid()))
    launch = _parent_of(started)
    if launch is None or b"deepspeed.launcher.launch" not in _read_proc(launch, "cmdline"):
        return
    runner = _parent_of(launch)

    def watch() -> None:
        while _parent_of(started) == launch and _parent_of(launch) == runner:
            time.sleep(poll_s)
        print(f"[apmpo] the deepspeed runner (pid {runner}) is gone: stopping", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(grace_s)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="follow-deepspeed-runner", daemon=True).start()


def _read_proc(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:  # gone
        return b""


def _parent_of(pid: int) -> int | None:
    stat = _read_proc(pid, "stat")
    return int(stat.rsplit(b")", 1)[1].split()[1]) if stat else None
