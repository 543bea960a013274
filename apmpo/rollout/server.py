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

The engine is not thread-safe and an update must not interleave with generation, so one lock serialises
engine access. An update holds it from /weights/begin until its load ends (success, failure or timeout), in a
thread of its own, so a learner that dies mid-update cannot wedge the server. A generation runs one engine step
at a time and is aborted between steps when its client goes away or after --generate-timeout-s.
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
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from apmpo.cpu_memory import ONE_ARENA, keep_freed_memory, sets_arena_max
from apmpo.rollout import no_torchvision
from apmpo.rollout.net import OneThread, bind_socket, in_thread, is_loopback
from apmpo.rollout.sampling import Sampling, check_sampling
from apmpo.rollout.weight_sync import (ADAPTER_FOLDER_PREFIX, SHM_DIR, BadPush, Bucket, ExpectedWeights, Transport,
                                       sweep_orphans_in_shm)

# Here at import, not only in vllm_compat: the engine's spawned processes import this module (as __mp_main__),
# and they load vLLM's Qwen2-VL code too.
no_torchvision.install()

log = logging.getLogger("apmpo.rollout.server")

# --- request and response models ----------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt sampling parameter is an error, not a default


MAX_SEED = 2**64 - 1  # vLLM sends each sample's seed to its engine process as a msgpack uint64


class GenerateRequest(_Strict):
    # Numbers out of range fail here (422), before the engine sees them: an unserialisable seed once wedged it.
    prompts: list[list[int]] = Field(min_length=1)
    n: int = Field(ge=1)
    # The fields of a Sampling, each required: no silent default. Their ranges: check_sampling, below.
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = Field(default=None, ge=0)  # prompt i uses seed + i * n, its samples seed + i * n + j
    # Or one seed per prompt (its samples: seeds[i] + j): multi-turn episodes draw each turn with the seed of the
    # episode and turn, whichever other episodes share the request (apmpo.envs).
    seeds: list[int] | None = None
    # Vision-language models: images[i] are prompt i's images, base64 PNG/JPEG, in the order of its image pads;
    # the prompt holds ONE <|image_pad|> per image (the engine expands it).
    images: list[list[str]] | None = None

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.max_tokens, self.temperature, self.top_p, self.top_k, tuple(self.stop_token_ids))

    @model_validator(mode="after")
    def _engine_ranges(self) -> GenerateRequest:
        check_sampling(self.sampling, self.n)
        if self.seed is not None and self.seed + len(self.prompts) * self.n - 1 > MAX_SEED:
            raise ValueError(f"seed: the last sample's seed, seed + prompts * n - 1, exceeds {MAX_SEED}")
        if self.seeds is not None and (self.seed is not None or len(self.seeds) != len(self.prompts)
                                       or not all(0 <= s <= MAX_SEED - self.n + 1 for s in self.seeds)):
            raise ValueError(f"seeds: one per prompt, each in [0, {MAX_SEED} - n + 1], and not with seed")
        return self


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
    multimodal: bool
    kv_block_size: int  # the n samples of a prompt share its whole blocks of this many tokens (prefix cache)
    compiled: bool  # the model runs through torch.compile (--enforce-eager: no; on CPU, --enable-lora: no)
    max_lora_rank: int | None  # --enable-lora: vLLM's adapter rank limit; None: no adapters
    lora_ids: list[int]  # the adapters loaded, by weight version (policy-v<id>), oldest first
    device_uuids: list[str]  # one per worker; empty strings on CPU
    limits: dict[str, float]


class InitWeightGroupRequest(_Strict):
    transport: Transport
    host: str
    port: int = Field(gt=0, lt=65536)
    world_size: int = Field(ge=2)
    timeout_s: float = Field(gt=0)
    first_rank: int = Field(default=1, ge=1)  # of this server's workers; a group shared with other servers: later


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
    # --enable-lora: the buckets hold a LoRA adapter's tensors (as adapter_model.safetensors names them), and this
    # is its adapter_config.json; the server loads them as the next adapter version, not into the model.
    adapter: dict[str, Any] | None = None


class LoadUpdateRequest(BeginUpdateRequest):
    segment: str  # the shm segment the workers mapped in an earlier push (its path, a unique name)


class LoadAdapterRequest(_Strict):
    path: str  # a folder as PEFT's save_pretrained writes it (adapter_config.json, adapter_model.safetensors)


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
    generate_timeout_s: float = 3600.0  # one /generate's hold on the engine; then its requests are aborted (504)


def check_generate(req: GenerateRequest, limits: Limits, max_model_len: int, vocab_size: int,
                   multimodal: bool = False) -> None:
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
    if req.images is not None and not multimodal and any(req.images):
        fail("images were sent, but the served model is not a vision-language model")
    if req.images is not None and len(req.images) != len(req.prompts):
        fail(f"images has {len(req.images)} entries for {len(req.prompts)} prompts")


# --- the app ------------------------------------------------------------------------------------------------


def check_token(token: str | None) -> None:
    """An empty token would let `Authorization: Bearer ` in."""
    if token is not None and not token.strip():
        raise ValueError("the bearer token is empty")


def create_app(llm: Any, model: str, limits: Limits, token: str | None, lora_versions: int = 1,
               engine_thread: OneThread | None = None, adapter_root: str | None = None) -> FastAPI:
    """`lora_versions`: adapters kept loaded, the newest ones (--lora-versions). `engine_thread`: the one thread
    that generates, best the one that built the engine (main does so). `adapter_root`: the folder /lora/load may
    read adapters under (--adapter-root); None: it reads none."""
    from apmpo.rollout import vllm_compat as compat

    check_token(token)
    engine = compat.engine_info(llm)
    never_sample = compat.placeholder_token_ids(llm)
    device_uuids = compat.collective_rpc(llm, "apmpo_device_uuid", rpc_timeout_s=60)
    expected = ExpectedWeights.of_model(model, engine["dtype"])  # what every push must hold
    engine_lock = threading.Lock()
    # Generation and the loads of pushed weights and adapters run on it (main()'s comment says why; a push loaded
    # on another thread left a second team behind: SmolLM2 then generated in 11.5 s instead of 8.4 s).
    engine_thread = engine_thread or OneThread("engine")
    # update: Future of the running weight update; step_at: when a running generate last heard from the engine;
    # group: the transport of the workers' weight group, once joined; broken: why the engine's weights are a mix
    # (an update failed after its load began), until a complete push succeeds; adapters: the loaded LoRARequests,
    # oldest first; lora: the one generation uses (None: the model alone)
    state: dict[str, Any] = {"version": 0, "update": None, "step_at": None, "group": None, "broken": None,
                             "adapters": [], "lora": None}

    def authorize(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(status_code=401, detail="missing or wrong bearer token")

    app = FastAPI(title="apmpo generation server")
    auth = [Depends(authorize)]

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        # FastAPI's 422 echoes the input, which cannot be JSON when it holds a NaN: that 422 became a 500.
        errors = [{"loc": e["loc"], "msg": e["msg"], "type": e["type"]} for e in error.errors()]
        return JSONResponse(status_code=422, content={"detail": errors})

    def check_engine() -> None:
        if compat.engine_dead(llm):
            raise HTTPException(503, "the vLLM engine process is dead; restart the server")
        step_at = state["step_at"]
        if step_at is not None and time.monotonic() - step_at > limits.generate_timeout_s:
            raise HTTPException(503, f"the engine has not finished a step for over {limits.generate_timeout_s:.0f} s")
        refuse_if_broken()

    def refuse_if_broken() -> None:
        if state["broken"] is not None:
            raise HTTPException(503, f"the engine's weights are incomplete ({state['broken']}): it generates nothing "
                                     "until a complete push succeeds")

    @app.get("/health")
    def health() -> dict[str, str]:
        check_engine()
        return {"status": "ok"}

    @app.get("/ready", dependencies=auth)
    def ready() -> WeightVersionResponse:
        check_engine()
        return WeightVersionResponse(weight_version=state["version"])

    @app.get("/info", dependencies=auth)
    def info() -> InfoResponse:
        return InfoResponse(model=model, weight_version=state["version"], device_uuids=device_uuids,
                            lora_ids=[adapter.lora_int_id for adapter in state["adapters"]],
                            limits={"max_prompts": limits.max_prompts, "max_n": limits.max_n,
                                    "max_tokens": limits.max_tokens, "generate_timeout_s": limits.generate_timeout_s},
                            **engine)

    def run_generate(req: GenerateRequest, params: list, gone: threading.Event) -> GenerateResponse:
        """In a thread of its own. Ends early, its requests aborted, once the client is `gone` or it has held the
        engine for --generate-timeout-s."""
        wait_until = time.monotonic() + limits.update_timeout_s
        while not engine_lock.acquire(timeout=0.5):
            if gone.is_set():
                raise HTTPException(499, "client closed the request")
            if time.monotonic() > wait_until:
                raise HTTPException(503, "engine busy with a weight update; retry")
        try:  # under the lock, which a failing update holds until it has said so
            refuse_if_broken()
        except HTTPException:
            engine_lock.release()
            raise
        deadline = time.monotonic() + limits.generate_timeout_s

        def should_stop() -> bool:  # asked between engine steps
            state["step_at"] = time.monotonic()
            return gone.is_set() or state["step_at"] > deadline

        try:
            # The adapter of this version: loads wait for the engine lock, so a request keeps the one it started with.
            outputs = engine_thread.run(compat.generate, llm, req.prompts, params, images=req.images,
                                        should_stop=should_stop, lora=state["lora"])
            return GenerateResponse(outputs=[[Sample(**s) for s in row] for row in outputs],
                                    weight_version=state["version"])
        except compat.Aborted:
            if gone.is_set():
                raise HTTPException(499, "client closed the request") from None
            raise HTTPException(504, f"generation took over --generate-timeout-s {limits.generate_timeout_s:g}; "
                                     "aborted") from None
        except compat.RequestRejected as error:
            raise HTTPException(400, f"the engine rejected the request: {error}") from None
        except Exception as error:  # the request failed, the server goes on (compat.generate cleaned up)
            log.exception("generate failed")
            raise HTTPException(500, f"engine error: {error!r}") from None
        finally:
            state["step_at"] = None
            engine_lock.release()

    @app.post("/generate", dependencies=auth)
    async def generate(req: GenerateRequest, request: Request) -> GenerateResponse:
        check_generate(req, limits, engine["max_model_len"], engine["vocab_size"], engine["multimodal"])
        params = [
            compat.sampling_params(req.sampling, n=req.n, never_sample=never_sample,
                                   seed=req.seeds[i] if req.seeds is not None
                                   else None if req.seed is None else req.seed + i * req.n)
            for i in range(len(req.prompts))
        ]
        # The engine runs in a thread; this coroutine watches the connection meanwhile, so that a client that gives
        # up (disconnects, times out) frees the engine at its next step.
        gone = threading.Event()
        result = asyncio.wrap_future(in_thread(run_generate, req, params, gone))
        try:
            while not (await asyncio.wait({result}, timeout=0.5))[0]:
                if await request.is_disconnected():
                    gone.set()
            return result.result()
        finally:
            gone.set()  # also when uvicorn cancels this handler (shutdown)

    @app.post("/weights/init", dependencies=auth)
    def init_weight_group(req: InitWeightGroupRequest) -> dict[str, str]:
        if req.first_rank + engine["num_workers"] > req.world_size:
            raise HTTPException(400, f"world_size {req.world_size} has no ranks {req.first_rank}.."
                                     f"{req.first_rank + engine['num_workers'] - 1} for this server's engine workers")
        store = f"{req.host}:{req.port}"
        try:  # the workers would retry a store they cannot reach until the timeout, then fail without its address
            socket.create_connection((req.host, req.port), timeout=5).close()
        except OSError as error:
            raise HTTPException(502, f"cannot reach the learner's weight-group store at {store}: {error}") from None
        # The learner gives up on the group after timeout_s: workers that joined later would join a group gone.
        if not engine_lock.acquire(timeout=req.timeout_s):
            raise HTTPException(503, f"the engine stayed busy (generating) for the join's whole deadline, "
                                     f"{req.timeout_s:g} s: join the weight group before generating")
        try:  # blocks until the learner joins the group too, or the timeout
            state["group"] = None  # the workers leave their old group first
            try:
                compat.collective_rpc(llm, "apmpo_init_weight_group", rpc_timeout_s=req.timeout_s + 10,
                                      **req.model_dump())
            except Exception as error:
                log.exception("joining the weight group failed")
                raise HTTPException(502, f"the engine could not join the learner's weight group at {store}: "
                                         f"{error!r}") from None
            state["group"] = req.transport
        finally:
            engine_lock.release()
        return {"status": "ok"}

    def refuse_unmapped_segment(buckets: list[dict], in_place: str | None) -> None:
        if in_place is not None and not all(compat.collective_rpc(
                llm, "apmpo_maps_segment", rpc_timeout_s=60, path=in_place, nbytes=sum(b["nbytes"] for b in buckets))):
            raise HTTPException(409, f"the engine does not map the shared segment {in_place} (another client's "
                                     "group replaced it): push through /weights/begin")

    def run_update(buckets: list[dict], locked: threading.Event, in_place: str | None = None,
                   adapter: dict[str, Any] | None = None) -> WeightUpdateResponse:
        if adapter is not None:
            return run_adapter_update(buckets, adapter, locked, in_place)
        with engine_lock:
            locked.set()
            refuse_unmapped_segment(buckets, in_place)
            try:
                timings = engine_thread.run(compat.collective_rpc, llm, "apmpo_receive_weights",
                                            rpc_timeout_s=limits.update_timeout_s, buckets=buckets, in_place=in_place)
            except Exception as error:
                # Some layers may hold the new weights: no generation from the mix (on the compiled CPU model a
                # half-loaded tensor crashed the next one) until a complete push.
                state["broken"] = f"the last weight update failed: {error}"
                raise
            finally:
                # Even a failed load may have changed some layers: stale cached KV (and image embeddings) must
                # not survive either way.
                compat.reset_caches(llm)
            state["broken"] = None
            state["version"] += 1
            state["lora"] = None  # the weights are the whole policy now: no adapter on top
            return WeightUpdateResponse(weight_version=state["version"], **max(timings, key=lambda t: t["reload_s"]))

    def run_adapter_update(buckets: list[dict], config: dict[str, Any], locked: threading.Event,
                           in_place: str | None) -> WeightUpdateResponse:
        """The workers receive the adapter's tensors apart from the model and write them to a folder of ours, with
        `config` beside them; that folder is loaded as /lora/load loads one, then removed (vLLM keeps what it
        loaded). Nothing the engine serves changes before that load, so a failure leaves the served version."""
        with engine_lock:
            locked.set()
            refuse_unmapped_segment(buckets, in_place)
            folder = tempfile.mkdtemp(prefix=f"{ADAPTER_FOLDER_PREFIX}{os.getpid()}-",
                                      dir=SHM_DIR if os.path.isdir(SHM_DIR) else None)
            try:
                try:
                    timings = engine_thread.run(compat.collective_rpc, llm, "apmpo_receive_adapter",
                                                rpc_timeout_s=limits.update_timeout_s, buckets=buckets,
                                                folder=folder, in_place=in_place)
                except Exception as error:
                    log.exception("adapter push failed")
                    raise HTTPException(500, f"the adapter push failed before its load, nothing changed: "
                                             f"{error!r}") from None
                with open(os.path.join(folder, "adapter_config.json"), "w") as handle:
                    json.dump(config, handle)
                loaded = load_adapter_version(folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        received = max(timings, key=lambda t: t["reload_s"])
        return WeightUpdateResponse(weight_version=loaded.weight_version, wait_s=received["wait_s"],
                                    reload_s=received["reload_s"] + loaded.reload_s)

    def check_push(req: BeginUpdateRequest) -> None:
        """Before anything is received: a server that can take it, a group to receive through, and tensors that fit
        the model (or, for an adapter, its layers)."""
        if req.adapter is not None:
            refuse_without_lora()
        if state["group"] is None:
            raise HTTPException(409, "no weight group: POST /weights/init first")
        buckets = [Bucket.from_json(bucket) for bucket in req.model_dump()["buckets"]]
        try:
            if req.adapter is None:
                expected.check(buckets)
            else:
                expected.check_adapter(buckets, req.adapter, engine["max_lora_rank"])
        except BadPush as error:
            raise HTTPException(400, f"push refused, nothing loaded: {error}") from None

    @app.post("/weights/begin", dependencies=auth)
    def begin_update(req: BeginUpdateRequest) -> dict[str, str]:
        running = state["update"]
        if running is not None and not running.done():
            raise HTTPException(409, "a weight update is already running")
        check_push(req)
        locked = threading.Event()

        def update() -> WeightUpdateResponse:
            try:
                return run_update(req.model_dump()["buckets"], locked, adapter=req.adapter)
            except BaseException:  # reported by /weights/finish
                log.exception("weight update failed")
                locked.set()
                raise

        state["update"] = in_thread(update)
        # Generation is paused once the lock is ours. A generate holds it at most --generate-timeout-s: an
        # asynchronous learner's push waits behind a whole batch's generation, however long that takes.
        if not locked.wait(timeout=limits.generate_timeout_s + limits.update_timeout_s):
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
        except HTTPException:  # says itself what it left behind (an adapter's: nothing)
            raise
        except Exception as error:
            raise HTTPException(500, f"weight update failed after its load began; the server generates nothing until a "
                                     f"complete push: {error!r}") from None
        finally:
            if future.done():
                state["update"] = None

    @app.post("/weights/load", dependencies=auth)
    def load_update(req: LoadUpdateRequest) -> WeightUpdateResponse:
        # The bytes are all in place before the request, so the load needs nothing more from the learner and runs
        # in the request itself: a learner that dies meanwhile cannot wedge it. It waits behind a generate.
        check_push(req)
        try:  # behind a begun update too: it holds the engine lock until its load ends
            return run_update(req.model_dump()["buckets"], threading.Event(), in_place=req.segment,
                              adapter=req.adapter)
        except HTTPException:
            raise
        except Exception as error:
            log.exception("weight update failed")
            raise HTTPException(500, f"weight update failed after its load began; the server generates nothing until a "
                                     f"complete push: {error!r}") from None

    @app.post("/lora/load", dependencies=auth)
    def load_adapter(req: LoadAdapterRequest) -> WeightUpdateResponse:
        """The adapter in `req.path` as the next weight version. No prefix-cache reset: vLLM's block hashes include
        the adapter's name, so no version reuses another's KV. Adapters older than the newest --lora-versions are
        unloaded."""
        refuse_without_lora()
        if adapter_root is None:
            raise HTTPException(403, "this server was started without --adapter-root: /lora/load reads no folder "
                                     "(the learner's adapter pushes need none)")
        root = os.path.realpath(adapter_root)
        if os.path.commonpath([root, os.path.realpath(req.path)]) != root:  # symlinks and .. resolved first
            raise HTTPException(403, f"{req.path} is not under this server's --adapter-root {adapter_root}")
        if not os.path.isfile(os.path.join(req.path, "adapter_config.json")):
            raise HTTPException(400, f"{req.path} holds no adapter_config.json: not a PEFT adapter folder on this "
                                     "machine (the server reads the path itself)")
        if not engine_lock.acquire(timeout=limits.generate_timeout_s + limits.update_timeout_s):
            raise HTTPException(503, "generation did not drain in time")
        try:
            return load_adapter_version(req.path)
        finally:
            engine_lock.release()

    def refuse_without_lora() -> None:
        if engine["max_lora_rank"] is None:
            raise HTTPException(409, "this server was started without --enable-lora: it cannot load adapters")

    def load_adapter_version(path: str) -> WeightUpdateResponse:
        """Under the engine lock: the adapter folder `path` as the next version; the oldest beyond --lora-versions
        are unloaded. A failed load changes nothing: the served version stays."""
        start = time.monotonic()
        version = state["version"] + 1
        try:
            adapter = engine_thread.run(compat.add_adapter, llm, f"policy-v{version}", version, path)
        except Exception as error:
            log.exception("adapter load failed")
            raise HTTPException(500, f"loading the adapter in {path} failed: {error!r}") from None
        state["adapters"].append(adapter)
        for old in state["adapters"][:-lora_versions]:
            compat.remove_adapter(llm, old)
        state["adapters"] = state["adapters"][-lora_versions:]
        state["version"], state["lora"] = version, adapter
        return WeightUpdateResponse(weight_version=version, reload_s=time.monotonic() - start, wait_s=0.0)

    @app.post("/shutdown", dependencies=auth)
    def shutdown() -> dict[str, str]:
        # SIGINT lets uvicorn finish this response and shut down cleanly (the engine's finalizers then run).
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        return {"status": "shutting down"}

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
