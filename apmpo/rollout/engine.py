"""The generation server's engine (apmpo/rollout/server.py holds its routes): one vLLM engine, the lock and the
thread that serialise its use, the weight version it serves, and what the routes do with it: generate, join the
learner's weight group, load a push or an adapter. Each refusal raises its HTTP status here, where its cause is
known. Imports vLLM: the server imports this module once its engine is to be built."""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any

from fastapi import HTTPException

from apmpo.rollout import vllm_compat as compat
from apmpo.rollout.net import OneThread, in_thread
from apmpo.rollout.protocol import (BeginUpdateRequest, GenerateRequest, InitWeightGroupRequest, Limits,
                                    LoadUpdateRequest)
from apmpo.rollout.push_check import BadPush, ExpectedWeights
from apmpo.rollout.weight_sync import ADAPTER_FOLDER_PREFIX, SHM_DIR, Bucket

log = logging.getLogger("apmpo.rollout.server")

UPDATE_FAILED = "weight update failed after its load began; the server generates nothing until a complete push"


class ServedEngine:
    """An engine and its state. An update returns {weight_version, reload_s, wait_s} (protocol.WeightUpdateResponse);
    a generation its outputs, [prompt][sample] dicts (protocol.Sample), and the weight version that made them."""

    def __init__(self, llm: Any, model: str, limits: Limits, lora_versions: int = 1,
                 engine_thread: OneThread | None = None):
        self.llm, self.model, self.limits, self.lora_versions = llm, model, limits, lora_versions
        self.info = compat.engine_info(llm)
        self.never_sample = compat.placeholder_token_ids(llm)
        self.device_uuids = compat.collective_rpc(llm, "apmpo_device_uuid", rpc_timeout_s=60)
        self.expected = ExpectedWeights.of_model(model, self.info["dtype"])  # what every push must hold
        self.lock = threading.Lock()
        # Generation and the loads of pushed weights and adapters run on it (main()'s comment says why; a push loaded
        # on another thread left a second team behind: SmolLM2 then generated in 11.5 s instead of 8.4 s).
        self.thread = engine_thread or OneThread("engine")
        self.version = 0
        self.update: Future | None = None  # the running weight update
        self.step_at: float | None = None  # when a running generate last heard from the engine
        self.group: str | None = None  # the transport of the workers' weight group, once joined
        # Why the engine's weights are a mix (an update failed after its load began), until a complete push succeeds.
        self.broken: str | None = None
        self.adapters: list = []  # the loaded LoRARequests, oldest first
        self.lora: Any = None  # the one generation uses (None: the model alone)

    # --- refusals ---

    def check_alive(self) -> None:
        if compat.engine_dead(self.llm):
            raise HTTPException(503, "the vLLM engine process is dead; restart the server")
        step_at = self.step_at  # read once: a generate that ends meanwhile sets it to None
        if step_at is not None and time.monotonic() - step_at > self.limits.generate_timeout_s:
            raise HTTPException(503, f"the engine has not finished a step for over "
                                     f"{self.limits.generate_timeout_s:.0f} s")
        self.refuse_if_broken()

    def refuse_if_broken(self) -> None:
        if self.broken is not None:
            raise HTTPException(503, f"the engine's weights are incomplete ({self.broken}): it generates nothing "
                                     "until a complete push succeeds")

    def refuse_without_lora(self) -> None:
        if self.info["max_lora_rank"] is None:
            raise HTTPException(409, "this server was started without --enable-lora: it cannot load adapters")

    # --- generation ---

    def sampling_params(self, req: GenerateRequest) -> list:
        """One vLLM SamplingParams per prompt, with its seed."""
        return [compat.sampling_params(req.sampling, n=req.n, never_sample=self.never_sample,
                                       seed=req.seeds[i] if req.seeds is not None
                                       else None if req.seed is None else req.seed + i * req.n)
                for i in range(len(req.prompts))]

    def generate(self, req: GenerateRequest, params: list, gone: threading.Event) -> tuple[list[list[dict]], int]:
        """In a thread of its own. Ends early, its requests aborted, once the client is `gone` or it has held the
        engine for --generate-timeout-s."""
        limits = self.limits
        wait_until = time.monotonic() + limits.update_timeout_s
        while not self.lock.acquire(timeout=0.5):
            if gone.is_set():
                raise HTTPException(499, "client closed the request")
            if time.monotonic() > wait_until:
                raise HTTPException(503, "engine busy with a weight update; retry")
        try:  # under the lock, which a failing update holds until it has said so
            self.refuse_if_broken()
        except HTTPException:
            self.lock.release()
            raise
        deadline = time.monotonic() + limits.generate_timeout_s

        def should_stop() -> bool:  # asked between engine steps
            self.step_at = time.monotonic()
            return gone.is_set() or self.step_at > deadline

        try:
            # The adapter of this version: loads wait for the engine lock, so a request keeps the one it started with.
            outputs = self.thread.run(compat.generate, self.llm, req.prompts, params, images=req.images,
                                      should_stop=should_stop, lora=self.lora)
            return outputs, self.version
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
            self.step_at = None
            self.lock.release()

    # --- weights ---

    def join_weight_group(self, req: InitWeightGroupRequest) -> None:
        """Blocks until the learner joins the group too, or its timeout."""
        # The learner gives up on the group after timeout_s: workers that joined later would join a group gone.
        if not self.lock.acquire(timeout=req.timeout_s):
            raise HTTPException(503, f"the engine stayed busy (generating) for the join's whole deadline, "
                                     f"{req.timeout_s:g} s: join the weight group before generating")
        try:
            self.group = None  # the workers leave their old group first
            try:
                compat.collective_rpc(self.llm, "apmpo_init_weight_group", rpc_timeout_s=req.timeout_s + 10,
                                      **req.model_dump())
            except Exception as error:
                log.exception("joining the weight group failed")
                raise HTTPException(502, f"the engine could not join the learner's weight group at "
                                         f"{req.host}:{req.port}: {error!r}") from None
            self.group = req.transport
        finally:
            self.lock.release()

    def check_push(self, req: BeginUpdateRequest) -> None:
        """Before anything is received: a server that can take it, a group to receive through, and tensors that fit
        the model (or, for an adapter, its layers)."""
        if req.adapter is not None:
            self.refuse_without_lora()
        if self.group is None:
            raise HTTPException(409, "no weight group: POST /weights/init first")
        buckets = [Bucket.from_json(bucket) for bucket in req.model_dump()["buckets"]]
        try:
            if req.adapter is None:
                self.expected.check(buckets)
            else:
                self.expected.check_adapter(buckets, req.adapter, self.info["max_lora_rank"])
        except BadPush as error:
            raise HTTPException(400, f"push refused, nothing loaded: {error}") from None

    def begin_update(self, req: BeginUpdateRequest) -> None:
        """Returns once generation is paused: the update holds the engine lock, in a thread of its own, until the
        workers have received and loaded the buckets (finish_update says how it went)."""
        running = self.update  # read once: a /weights/finish meanwhile sets it to None
        if running is not None and not running.done():
            raise HTTPException(409, "a weight update is already running")
        self.check_push(req)
        locked = threading.Event()

        def update() -> dict[str, Any]:
            try:
                return self.run_update(req.model_dump()["buckets"], locked, adapter=req.adapter)
            except BaseException:  # reported by /weights/finish
                log.exception("weight update failed")
                locked.set()
                raise

        self.update = in_thread(update)
        # Generation is paused once the lock is ours. A generate holds it at most --generate-timeout-s: an
        # asynchronous learner's push waits behind a whole batch's generation, however long that takes.
        if not locked.wait(timeout=self.limits.generate_timeout_s + self.limits.update_timeout_s):
            raise HTTPException(503, "generation did not drain in time")

    def finish_update(self) -> dict[str, Any]:
        future = self.update
        if future is None:
            raise HTTPException(409, "no weight update was begun")
        try:
            return future.result(timeout=self.limits.update_timeout_s + 30)
        except TimeoutError:
            raise HTTPException(504, "weight update still running") from None
        except HTTPException:  # says itself what it left behind (an adapter's: nothing)
            raise
        except Exception as error:
            raise HTTPException(500, f"{UPDATE_FAILED}: {error!r}") from None
        finally:
            if future.done():
                self.update = None

    def load_update(self, req: LoadUpdateRequest) -> dict[str, Any]:
        """The whole update is in the shm segment already, so the load needs nothing more from the learner and runs
        in the request itself: a learner that dies meanwhile cannot wedge it. It waits behind a generate."""
        self.check_push(req)
        try:  # behind a begun update too: it holds the engine lock until its load ends
            return self.run_update(req.model_dump()["buckets"], threading.Event(), in_place=req.segment,
                                   adapter=req.adapter)
        except HTTPException:
            raise
        except Exception as error:
            log.exception("weight update failed")
            raise HTTPException(500, f"{UPDATE_FAILED}: {error!r}") from None

    def refuse_unmapped_segment(self, buckets: list[dict], in_place: str | None) -> None:
        if in_place is not None and not all(compat.collective_rpc(
                self.llm, "apmpo_maps_segment", rpc_timeout_s=60, path=in_place,
                nbytes=sum(b["nbytes"] for b in buckets))):
            raise HTTPException(409, f"the engine does not map the shared segment {in_place} (another client's "
                                     "group replaced it): push through /weights/begin")

    def run_update(self, buckets: list[dict], locked: threading.Event, in_place: str | None = None,
                   adapter: dict[str, Any] | None = None) -> dict[str, Any]:
        if adapter is not None:
            return self.run_adapter_update(buckets, adapter, locked, in_place)
        with self.lock:
            locked.set()
            self.refuse_unmapped_segment(buckets, in_place)
            try:
                timings = self.thread.run(compat.collective_rpc, self.llm, "apmpo_receive_weights",
                                          rpc_timeout_s=self.limits.update_timeout_s, buckets=buckets,
                                          in_place=in_place)
            except Exception as error:
                # Some layers may hold the new weights: no generation from the mix (on the compiled CPU model a
                # half-loaded tensor crashed the next one) until a complete push.
                self.broken = f"the last weight update failed: {error}"
                raise
            finally:
                # Even a failed load may have changed some layers: stale cached KV (and image embeddings) must
                # not survive either way.
                compat.reset_caches(self.llm)
            self.broken = None
            self.version += 1
            self.lora = None  # the weights are the whole policy now: no adapter on top
            return {"weight_version": self.version, **max(timings, key=lambda t: t["reload_s"])}

    # --- adapters ---

    def run_adapter_update(self, buckets: list[dict], config: dict[str, Any], locked: threading.Event,
                           in_place: str | None) -> dict[str, Any]:
        """The workers receive the adapter's tensors apart from the model and write them to a folder of ours, with
        `config` beside them; that folder is loaded as /lora/load loads one, then removed (vLLM keeps what it
        loaded). Nothing the engine serves changes before that load, so a failure leaves the served version."""
        with self.lock:
            locked.set()
            self.refuse_unmapped_segment(buckets, in_place)
            folder = tempfile.mkdtemp(prefix=f"{ADAPTER_FOLDER_PREFIX}{os.getpid()}-",
                                      dir=SHM_DIR if os.path.isdir(SHM_DIR) else None)
            try:
                try:
                    timings = self.thread.run(compat.collective_rpc, self.llm, "apmpo_receive_adapter",
                                              rpc_timeout_s=self.limits.update_timeout_s, buckets=buckets,
                                              folder=folder, in_place=in_place)
                except Exception as error:
                    log.exception("adapter push failed")
                    raise HTTPException(500, f"the adapter push failed before its load, nothing changed: "
                                             f"{error!r}") from None
                with open(os.path.join(folder, "adapter_config.json"), "w") as handle:
                    json.dump(config, handle)
                loaded = self.load_adapter_version(folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        received = max(timings, key=lambda t: t["reload_s"])
        return {"weight_version": loaded["weight_version"], "wait_s": received["wait_s"],
                "reload_s": received["reload_s"] + loaded["reload_s"]}

    def load_adapter(self, folder: str) -> dict[str, Any]:
        """The adapter folder `folder` as the next version, once generation has drained."""
        if not self.lock.acquire(timeout=self.limits.generate_timeout_s + self.limits.update_timeout_s):
            raise HTTPException(503, "generation did not drain in time")
        try:
            return self.load_adapter_version(folder)
        finally:
            self.lock.release()

    def load_adapter_version(self, folder: str) -> dict[str, Any]:
        """Under the engine lock: the adapter folder as the next version; the oldest beyond --lora-versions are
        unloaded. A failed load changes nothing: the served version stays."""
        start = time.monotonic()
        version = self.version + 1
        try:
            adapter = self.thread.run(compat.add_adapter, self.llm, f"policy-v{version}", version, folder)
        except Exception as error:
            log.exception("adapter load failed")
            raise HTTPException(500, f"loading the adapter in {folder} failed: {error!r}") from None
        self.adapters.append(adapter)
        for old in self.adapters[:-self.lora_versions]:
            compat.remove_adapter(self.llm, old)
        self.adapters = self.adapters[-self.lora_versions:]
        self.version, self.lora = version, adapter
        return {"weight_version": version, "reload_s": time.monotonic() - start, "wait_s": 0.0}
