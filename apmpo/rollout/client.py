"""Client of the generation server (apmpo/rollout/server.py).

    client = GenerationClient("http://127.0.0.1:8000", token=None)
    client.wait_ready(timeout_s=300)
    outs = client.generate(prompts, Sampling(max_tokens=512), n=8, seed=0)  # outs[prompt][sample]
    version = client.push_weights(model.named_parameters())
    version = client.push_adapter(adapter_tensors, adapter_config)   # a LoRA server (--enable-lora): an adapter alone
    version = client.load_adapter("/dev/shm/adapter")     # or a PEFT adapter folder the server reads itself
    client.close()

Every call has a timeout, connection errors are retried a bounded number of times, and a server that stays
unreachable raises `ServerUnavailable` naming its URL.
"""
from __future__ import annotations

import base64
import dataclasses
import functools
import itertools
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable
from urllib.parse import urlparse

import requests
import torch

from apmpo.rollout.net import in_thread, is_loopback, local_address_towards
from apmpo.sampling import Sampling
from apmpo.rollout.weight_sync import (DEFAULT_BUCKET_BYTES, Bucket, StreamedTensors, Transport, WeightGroup,
                                       all_finite, holds_in_place, pack_in_place, plan_buckets, select_transport,
                                       send_buckets, sweep_orphans_in_shm)

# How often a starting server is asked whether it is ready: it refuses connections until its engine is loaded,
# so asking is cheap, and each poll interval is start-up time lost on average by half.
READY_POLL_S = 0.2


class ServerUnavailable(ConnectionError):
    """The server did not answer (refused, reset or timed out) after the retries."""


class ServerError(RuntimeError):
    """The server answered with an error status."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Sample:
    token_ids: list[int]
    text: str
    logprobs: list[float]  # engine log-prob of each sampled token, under the sampling distribution
    finish_reason: str  # "stop" (EOS or a stop token) | "length"
    weight_version: int = -1  # of the weights that generated it (the server's count of pushes); -1: unknown


@dataclass(frozen=True)
class PushReport:
    """What the last weight push took: GenerationClient.last_push, ServerPool.last_push."""
    transport: str  # shm | gloo | nccl | cuda_ipc, or folder (load_adapter: the server read it); a pool's: its servers'
    in_place: bool  # shm after the first push: written into the segment the workers map, loaded in one request
    bytes: int  # sent to each server
    seconds: float  # the whole push, as the learner waited for it
    reload_s: float  # the slowest engine's load
    wait_s: float  # of it, waiting for the learner's bytes
    servers: tuple[PushReport, ...] = ()  # a pool's: each server's
    one_group: bool = False  # a pool's: one weight group held every server's workers


class GenerationClient:
    def __init__(self, url: str, token: str | None = None, *, timeout_s: float = 3600.0, retries: int = 3,
                 transport: Transport | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 sync_host: str | None = None, sync_timeout_s: float = 600.0):
        """timeout_s bounds one generate call; `transport` overrides the automatic choice (weight_sync.py);
        `sync_host` is this machine's address as the server sees it (default: loopback for a local server)."""
        self.url = url.rstrip("/")
        self.timeout_s, self.retries = timeout_s, retries
        self.transport, self.bucket_bytes = transport, bucket_bytes
        self.sync_host, self.sync_timeout_s = sync_host, sync_timeout_s
        if token is not None and not token.strip():
            raise ValueError("token is empty: pass None for a server without one")
        self._token = token
        # One Session per thread: requests does not promise that a Session is thread-safe, and in asynchronous
        # training the rollout thread generates while the main thread pushes weights (a push asks every server
        # from threads of its own).
        self._sessions: dict[threading.Thread, requests.Session] = {}
        self._sessions_lock = threading.Lock()
        self._info: dict[str, Any] | None = None
        self._sender = WeightSender([self])
        sweep_orphans_in_shm()  # of learners or servers killed while sharing weights
        self.last_push: PushReport | None = None

    # --- HTTP ---

    def _session(self) -> requests.Session:
        """The calling thread's session; those of threads that have ended are closed when a new one is made."""
        thread = threading.current_thread()
        with self._sessions_lock:
            session = self._sessions.get(thread)
            if session is None:
                for ended in [t for t in self._sessions if not t.is_alive()]:
                    self._sessions.pop(ended).close()
                session = self._sessions[thread] = requests.Session()
                if self._token is not None:
                    session.headers["Authorization"] = f"Bearer {self._token}"
            return session

    def _request(self, method: str, path: str, *, json: Any = None, timeout_s: float = 30.0,
                 retries: int | None = None) -> Any:
        attempts = 1 + (self.retries if retries is None else retries)
        for attempt in range(attempts):
            try:
                response = self._session().request(method, self.url + path, json=json, timeout=timeout_s)
                break
            except (requests.ConnectionError, requests.Timeout) as error:
                if attempt + 1 == attempts or isinstance(error, requests.ReadTimeout):
                    # A read timeout means the server took the request: resending could run it twice.
                    raise ServerUnavailable(f"generation server at {self.url} is unreachable ({method} {path}): "
                                            f"{type(error).__name__}: {error}") from error
                time.sleep(0.5 * 2**attempt)
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise ServerError(f"{method} {self.url}{path} -> {response.status_code}: {detail}", response.status_code)
        return response.json()

    def wait_ready(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """Polls /ready until the engine is loaded (a starting server refuses connections until then); returns
        /info."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._request("GET", "/ready", timeout_s=5.0, retries=0)
                return self.info()
            except ServerUnavailable as error:
                if time.monotonic() > deadline:
                    silent = isinstance(error.__cause__, requests.Timeout)
                    raise ServerUnavailable(
                        f"generation server at {self.url} not ready after {timeout_s:g} s: "
                        + ("it accepts connections but does not answer" if silent else "nothing answers there")
                        + f" ({type(error.__cause__).__name__})") from None
                time.sleep(READY_POLL_S)

    def info(self) -> dict[str, Any]:
        self._info = self._request("GET", "/info")
        return self._info

    def generate(self, prompts: list[list[int]], sampling: Sampling, n: int = 1, *, seed: int | None = None,
                 seeds: list[int] | None = None, images: list[list[bytes]] | None = None) -> list[list[Sample]]:
        """prompts as token ids; returns outs[prompt][sample]. Every field of `sampling` is sent explicitly.
        seed: prompt i's samples draw with seed + i * n + j; seeds: one per prompt instead (seeds[i] + j).
        images[i]: prompt i's encoded images (PNG/JPEG bytes) for a vision-language model, one <|image_pad|>
        per image in the prompt (apmpo.data.vision.VisionInputs.encode / image_bytes)."""
        body = {"prompts": [list(map(int, p)) for p in prompts], "n": n, **dataclasses.asdict(sampling), "seed": seed}
        if seeds is not None:
            body["seeds"] = [int(s) for s in seeds]
        if images is not None:
            body["images"] = [[base64.b64encode(image).decode() for image in row] for row in images]
        response = self._request("POST", "/generate", json=body, timeout_s=self.timeout_s)
        version = response["weight_version"]
        return [[Sample(**sample, weight_version=version) for sample in row] for row in response["outputs"]]

    # --- weights ---

    def join_weight_group(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Joins the server's weight group now, for pushes of tensors like these. Call it before generating:
        the workers join while the engine is free, and a join that waits behind a long generation gives up after
        `sync_timeout_s` (the first push joins, if this was not called)."""
        self._sender.join_for(named_tensors)

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Sends HF-named tensors to the engine; returns the new weight version. Generation pauses meanwhile.

        Floating tensors are cast to the engine's dtype while packing (half the bytes for fp32 master weights).
        A tied model's missing `lm_head.weight` is filled in by the engine's workers.
        """
        (update,) = self._sender.push(named_tensors)
        self.last_push = self._sender.last_push
        return update["weight_version"]

    def push_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any]) -> int:
        """Sends a LoRA adapter alone to a server started with --enable-lora, through the weight group as
        push_weights sends weights; the server loads it as the next weight version (policy-v<version>) and
        returns it. `named_tensors`: the adapter's tensors under the names PEFT's save_pretrained gives them in
        adapter_model.safetensors (apmpo.learner.lora.adapter_tensors); `config`: its adapter_config.json as a
        dict. Floating tensors are cast to the engine's dtype, as vLLM casts an adapter it loads."""
        (update,) = self._sender.push(named_tensors, adapter=config)
        self.last_push = self._sender.last_push
        return update["weight_version"]

    def load_adapter(self, path: str | os.PathLike) -> int:
        """Loads the PEFT adapter folder `path`, which the server reads itself (this machine, or a filesystem both
        share), as the next weight version; returns it. Generation pauses meanwhile. last_push.bytes counts the
        adapter's tensor bytes. For an adapter written by hand; a learner's goes by push_adapter."""
        info = self._info or self.info()
        start = time.perf_counter()
        update = self._request("POST", "/lora/load", json={"path": os.fspath(path)},
                               timeout_s=info["limits"]["generate_timeout_s"] + self.sync_timeout_s + 60, retries=0)
        self.last_push = PushReport("folder", in_place=False,
                                    bytes=safetensors_data_bytes(os.path.join(path, "adapter_model.safetensors")),
                                    seconds=time.perf_counter() - start, reload_s=update["reload_s"],
                                    wait_s=update["wait_s"])
        return update["weight_version"]

    def close(self) -> None:
        self._sender.close()
        with self._sessions_lock:
            for session in self._sessions.values():
                session.close()
            self._sessions.clear()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



class WeightSender:
    """The learner's end of one weight group that every engine worker of the `clients`' servers joins (ranks
    1.. in server order), so that each bucket is broadcast once for all of them, as vLLM's own RL example
    broadcasts to its engines over one StatelessProcessGroup + PyNcclCommunicator. With 4 NCCL servers a group
    each, rank 0 sent the bytes 4 times and held 2 buckets per group. The settings (transport, bucket size,
    sync host and timeout) are the first client's; `one_group_reaches` says whether the clients can share one."""

    def __init__(self, clients: list[GenerationClient]):
        self.clients = clients
        self.group: WeightGroup | None = None
        self.last_push: PushReport | None = None

    @staticmethod
    def one_group_reaches(clients: list[GenerationClient]) -> bool:
        """Whether one group can hold every server's workers: the same settings, and the same address of this
        machine towards each (servers on other networks, which reach the learner at different addresses, keep a
        group each)."""
        settings = {(c.transport, c.bucket_bytes, c.sync_host, c.sync_timeout_s) for c in clients}
        return len(settings) == 1 and len({c.sync_host or local_address_towards(_host(c.url)) for c in clients}) == 1

    def _plan(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | StreamedTensors
              ) -> tuple[Iterable[torch.Tensor], list[Bucket], torch.device]:
        first = self.clients[0]
        if not isinstance(named_tensors, StreamedTensors):
            named = [(name, tensor.detach()) for name, tensor in named_tensors]
            refuse_non_finite(named)
            named_tensors = StreamedTensors([(name, t.dtype, tuple(t.shape)) for name, t in named],
                                            [t for _, t in named], named[0][1].device if named else None)
        if not named_tensors.specs:
            raise ValueError("a push got no tensors")
        engine_dtype = getattr(torch, (first._info or first.info())["dtype"])
        buckets = plan_buckets(((name, engine_dtype if dtype.is_floating_point else dtype, shape)
                                for name, dtype, shape in named_tensors.specs), first.bucket_bytes)
        return named_tensors.tensors, buckets, named_tensors.device

    def join_for(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | StreamedTensors) -> WeightGroup:
        """The group, joined now if it was not, for pushes of tensors like these."""
        _, buckets, device = self._plan(named_tensors)
        return self.group or self._join(device, sum(b.nbytes for b in buckets))

    def _join(self, device: torch.device, nbytes: int) -> WeightGroup:
        first, timeout_s = self.clients[0], self.clients[0].sync_timeout_s
        infos = [client._info or client.info() for client in self.clients]
        hosts = [_host(client.url) for client in self.clients]
        uuids = [uuid for info in infos for uuid in info["device_uuids"]]
        transport = first.transport or select_transport(device, uuids, all(map(is_loopback, hosts)), nbytes)
        host = first.sync_host or local_address_towards(hosts[0])
        first_ranks = list(itertools.accumulate([info["num_workers"] for info in infos], initial=1))
        world_size = first_ranks.pop()
        store = WeightGroup.create_master(transport, host, world_size, timeout_s)
        # Every rank blocks until all meet: we join in a thread, each server's workers inside its /weights/init.
        # The threads are daemons, so that a failed join cannot keep the process alive.
        learner = in_thread(WeightGroup, transport, host, store.port, 0, world_size, timeout_s, store)
        errors = _failures(self.clients, self._each("POST", "/weights/init", timeout_s=timeout_s + 60, json=[
            {"transport": transport, "host": host, "port": store.port, "world_size": world_size,
             "timeout_s": timeout_s, "first_rank": rank} for rank in first_ranks]))
        if errors:
            raise ServerError(f"could not join the weight group of {', '.join(errors)}")
        try:
            self.group = learner.result(timeout=timeout_s)
        except Exception as error:  # noqa: BLE001 (a timeout, or the group's own error)
            raise ServerError(f"could not join the weight group of {', '.join(c.url for c in self.clients)}: "
                              f"{error!r}") from error
        return self.group

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
             adapter: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Sends HF-named tensors to every server, each bucket once; returns each server's update response
        (weight_version, reload_s, wait_s). Any failure drops the group: the next push builds a fresh one.
        `adapter`: the tensors are a LoRA adapter's and this its config (GenerationClient.push_adapter)."""
        tensors, buckets, device = self._plan(named_tensors)
        start = time.perf_counter()
        nbytes = sum(b.nbytes for b in buckets)
        group = self.group or self._join(device, nbytes)
        declared = {"buckets": [{"nbytes": b.nbytes, "tensors": [{"name": t.name, "dtype": t.dtype,
                                                                  "shape": list(t.shape), "offset": t.offset}
                                                                 for t in b.tensors]} for b in buckets],
                    **({} if adapter is None else {"adapter": adapter})}
        sync_timeout_s = self.clients[0].sync_timeout_s
        behind_a_generate_s = max((c._info or c.info())["limits"]["generate_timeout_s"] for c in self.clients) \
            + sync_timeout_s
        updates, in_place = None, holds_in_place(group, buckets)
        if in_place:
            # shm after the first push: the workers map our segment, so write it all, then one request loads it
            # (on 2 CPU servers of the quickstart model, 12 ms a push instead of 25). Any failure drops the group,
            # so that no later push writes into a segment a stale load may still read.
            try:
                pack_in_place(group, buckets, tensors)
            except Exception:
                self.close()
                raise
            loads = self._each("POST", "/weights/load", json={"segment": group.segment_path, **declared},
                               timeout_s=behind_a_generate_s + 60)
            failed = [r for r in loads if isinstance(r, BaseException)]
            if failed:
                self.close()
                if not all(isinstance(error, ServerError) and error.status == 409 for error in failed) \
                        or not isinstance(tensors, list):  # a stream (ZeRO-3's gathers) cannot be read twice
                    raise failed[0]
                # Another client's group replaced ours on a server, and nothing was loaded there: share anew.
                group, in_place = self._join(device, nbytes), False
            else:
                updates = loads
        if updates is None:
            error: BaseException | None = None
            begun = self._each("POST", "/weights/begin", json=declared, timeout_s=behind_a_generate_s)
            try:
                if _failures(self.clients, begun):
                    raise ServerError(f"weight update not begun on {', '.join(_failures(self.clients, begun))}",
                                      _common_status(begun))
                send_buckets(group, buckets, tensors)
            except Exception as caught:  # noqa: BLE001 (raised below, after the servers' own reports)
                group.give_up(f"the learner gave up the push: {type(caught).__name__}: {caught}")  # heard at once
                self.close()  # the group's state is unknown
                error = caught
            # Always ask: the answer reports a server-side error, and each server's update thread ends either way.
            updates = self._each("POST", "/weights/finish", timeout_s=sync_timeout_s + 60)
            # A server's report says more than our side of a failure; its 409 after one says nothing was begun there.
            reports = [r for r in updates if isinstance(r, BaseException)
                       and not (error is not None and isinstance(r, ServerError) and r.status == 409)]
            if reports:
                raise reports[0] from error
            if error is not None:
                raise error
        slowest = max(updates, key=lambda update: update["reload_s"])
        self.last_push = PushReport(group.transport, in_place, nbytes, time.perf_counter() - start,
                                    slowest["reload_s"], slowest["wait_s"])
        return updates

    def _each(self, method: str, path: str, *, timeout_s: float, json: Any = None) -> list[Any]:
        """The request to every server at once (`json`: one body for all, or a list of one per server); each
        server's answer, or the exception its request raised."""
        bodies = json if isinstance(json, list) else [json] * len(self.clients)
        futures = [in_thread(functools.partial(client._request, method, path, json=body, timeout_s=timeout_s,
                                               retries=0)) for client, body in zip(self.clients, bodies)]
        return [future.exception() or future.result() for future in futures]

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def _host(url: str) -> str:
    return urlparse(url).hostname or "127.0.0.1"


def _failures(clients: list[GenerationClient], results: list[Any]) -> list[str]:
    """'url: error' for each server whose request raised."""
    return [f"{client.url}: {result}" for client, result in zip(clients, results) if isinstance(result, BaseException)]


def _common_status(results: list[Any]) -> int | None:
    """The HTTP status every failed request answered with, if they agree (a 400 or 409 refusal), else None."""
    statuses = {getattr(result, "status", None) for result in results if isinstance(result, BaseException)}
    return statuses.pop() if len(statuses) == 1 else None


def refuse_non_finite(named: list[tuple[str, torch.Tensor]]) -> None:
    """Raises ValueError naming the first tensor that holds NaN or infinity: the learner skips steps whose
    gradient norm is not finite, so such weights are a bug (or a learning rate of inf), and the engine must not
    generate from them. One pass over the weights and one device sync."""
    floating = [(name, tensor) for name, tensor in named if tensor.is_floating_point()]
    if not floating:
        return
    finite = torch.stack([all_finite(tensor) for _, tensor in floating])
    if not finite.all():
        name = floating[int((~finite).nonzero()[0])][0]
        raise ValueError(f"weight push refused: {name!r} holds NaN or infinite values (a diverged update?)")

def safetensors_data_bytes(path: str | os.PathLike) -> int:
    """The bytes of a safetensors file's tensors (its size less the header): what a push of it delivers."""
    with open(path, "rb") as handle:
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    return sum(entry["data_offsets"][1] - entry["data_offsets"][0]
               for name, entry in header.items() if name != "__metadata__")

