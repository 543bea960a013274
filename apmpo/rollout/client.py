"""Client of the generation server (apmpo/rollout/server.py).

    client = GenerationClient("http://127.0.0.1:8000", token=None)
    client.wait_ready(timeout_s=300)
    outs = client.generate(prompts, n=8, temperature=1.0, top_p=1.0, max_tokens=512)  # outs[prompt][sample]
    version = client.push_weights(model.named_parameters())
    version = client.load_adapter("/dev/shm/adapter")     # a LoRA server (--enable-lora): a PEFT adapter folder
    client.close()

Every call has a timeout, connection errors are retried a bounded number of times, and a server that stays
unreachable raises `ServerUnavailable` naming its URL.
"""
from __future__ import annotations

import base64
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable
from urllib.parse import urlparse

import requests
import torch

from apmpo.rollout.net import is_loopback
from apmpo.rollout.weight_sync import (DEFAULT_BUCKET_BYTES, Transport, WeightGroup, holds_in_place, pack_in_place,
                                       plan_buckets, select_transport, send_buckets)

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
        self._session = requests.Session()
        if token is not None:
            self._session.headers["Authorization"] = f"Bearer {token}"
        self._group: WeightGroup | None = None
        self._info: dict[str, Any] | None = None
        self.last_push: dict[str, Any] = {}  # the last push_weights: transport, bytes, seconds, engine's reload_s/wait_s

    # --- HTTP ---

    def _request(self, method: str, path: str, *, json: Any = None, timeout_s: float = 30.0,
                 retries: int | None = None) -> Any:
        attempts = 1 + (self.retries if retries is None else retries)
        for attempt in range(attempts):
            try:
                response = self._session.request(method, self.url + path, json=json, timeout=timeout_s)
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
        """Polls /ready until the engine is loaded; returns /info."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._request("GET", "/ready", timeout_s=5.0, retries=0)
                return self.info()
            except ServerUnavailable:
                if time.monotonic() > deadline:
                    raise ServerUnavailable(f"generation server at {self.url} not ready after {timeout_s:.0f} s") from None
                time.sleep(READY_POLL_S)

    def info(self) -> dict[str, Any]:
        self._info = self._request("GET", "/info")
        return self._info

    def generate(self, prompts: list[list[int]], n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 max_tokens: int = 512, seed: int | None = None, stop_token_ids: list[int] | None = None,
                 top_k: int = -1, images: list[list[bytes]] | None = None) -> list[list[Sample]]:
        """prompts as token ids; returns outs[prompt][sample]. Every sampling parameter is sent explicitly.
        images[i]: prompt i's encoded images (PNG/JPEG bytes) for a vision-language model, one <|image_pad|>
        per image in the prompt (apmpo.data.vision.VisionInputs.encode / image_bytes)."""
        body = {"prompts": [list(map(int, p)) for p in prompts], "n": n, "temperature": temperature,
                "top_p": top_p, "top_k": top_k, "max_tokens": max_tokens, "seed": seed,
                "stop_token_ids": list(stop_token_ids or [])}
        if images is not None:
            body["images"] = [[base64.b64encode(image).decode() for image in row] for row in images]
        response = self._request("POST", "/generate", json=body, timeout_s=self.timeout_s)
        version = response["weight_version"]
        return [[Sample(**sample, weight_version=version) for sample in row] for row in response["outputs"]]

    # --- weights ---

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Sends HF-named tensors to the engine; returns the new weight version. Generation pauses meanwhile.

        Floating tensors are cast to the engine's dtype while packing (half the bytes for fp32 master weights).
        A tied model's missing `lm_head.weight` is filled in by the engine's workers.
        """
        info = self._info or self.info()
        named = [(name, tensor.detach()) for name, tensor in named_tensors]
        if not named:
            raise ValueError("push_weights got no tensors")
        engine_dtype = getattr(torch, info["dtype"])
        buckets = plan_buckets(((name, engine_dtype if t.is_floating_point() else t.dtype, tuple(t.shape))
                                for name, t in named), self.bucket_bytes)
        start = time.perf_counter()
        nbytes = sum(b.nbytes for b in buckets)
        group = self._group or self._join_group(named[0][1].device, info, nbytes)
        tensors = [tensor for _, tensor in named]
        declared = [{"nbytes": b.nbytes, "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                                                      "offset": t.offset} for t in b.tensors]} for b in buckets]
        behind_a_generate_s = info["limits"]["generate_timeout_s"] + self.sync_timeout_s
        update, in_place = None, holds_in_place(group, buckets)
        if in_place:
            # shm after the first push: the workers map our segment, so write it all, then one request loads it
            # (on 2 CPU servers of the quickstart model, 12 ms a push instead of 25). Any failure drops the group,
            # so that no later push writes into a segment a stale load may still read.
            try:
                pack_in_place(group, buckets, tensors)
                update = self._request("POST", "/weights/load", json={"segment": group.segment_path,
                                                                      "buckets": declared},
                                       timeout_s=behind_a_generate_s + 60, retries=0)
            except Exception as error:
                self._close_group()
                if not (isinstance(error, ServerError) and error.status == 409):
                    raise
                # Another client's group replaced ours on the server, and nothing was loaded: share anew.
                group, in_place = self._join_group(named[0][1].device, info, nbytes), False
        if update is None:
            self._request("POST", "/weights/begin", json={"buckets": declared}, timeout_s=behind_a_generate_s,
                          retries=0)
            try:
                send_buckets(group, buckets, tensors)
            except Exception:
                self._close_group()  # the group's state is unknown; the next push builds a fresh one
                raise
            finally:
                # Always ask: the answer reports the server-side error, and the server's update thread ends either
                # way.
                update = self._request("POST", "/weights/finish", timeout_s=self.sync_timeout_s + 60, retries=0)
        self.last_push = {"transport": group.transport, "in_place": in_place, "bytes": nbytes,
                          "seconds": time.perf_counter() - start, "reload_s": update["reload_s"],
                          "wait_s": update["wait_s"]}
        return update["weight_version"]

    def load_adapter(self, path: str | os.PathLike) -> int:
        """Loads the PEFT adapter folder `path`, which the server reads itself (this machine, or a filesystem both
        share), as the next weight version; returns it. Generation pauses meanwhile. last_push["bytes"] counts the
        adapter's tensor bytes."""
        info = self._info or self.info()
        start = time.perf_counter()
        update = self._request("POST", "/lora/load", json={"path": os.fspath(path)},
                               timeout_s=info["limits"]["generate_timeout_s"] + self.sync_timeout_s + 60, retries=0)
        self.last_push = {"transport": "folder", "in_place": False,
                          "bytes": safetensors_data_bytes(os.path.join(path, "adapter_model.safetensors")),
                          "seconds": time.perf_counter() - start, "reload_s": update["reload_s"],
                          "wait_s": update["wait_s"]}
        return update["weight_version"]

    def _join_group(self, device: torch.device, info: dict[str, Any], nbytes: int) -> WeightGroup:
        server_host = urlparse(self.url).hostname or "127.0.0.1"
        transport = self.transport or select_transport(device, info["device_uuids"], is_loopback(server_host), nbytes)
        host = self.sync_host or _local_address_towards(server_host)
        world_size = 1 + info["num_workers"]
        store = WeightGroup.create_master(transport, host, world_size, self.sync_timeout_s)
        body = {"transport": transport, "host": host, "port": store.port, "world_size": world_size,
                "timeout_s": self.sync_timeout_s}
        # The workers join inside the /weights/init call while we join in a thread: both block until all ranks
        # meet. The thread is a daemon so that a failed init cannot keep the process alive.
        joined: list[WeightGroup | BaseException] = []

        def join() -> None:
            try:
                joined.append(WeightGroup(transport, host, store.port, 0, world_size, self.sync_timeout_s, store=store))
            except BaseException as error:  # noqa: BLE001 (re-raised below)
                joined.append(error)

        thread = threading.Thread(target=join, name="weight-group-join", daemon=True)
        thread.start()
        self._request("POST", "/weights/init", json=body, timeout_s=self.sync_timeout_s + 60, retries=0)
        thread.join(timeout=self.sync_timeout_s)
        if not joined or isinstance(joined[0], BaseException):
            raise ServerError(f"could not join the weight group of {self.url}: {joined[0] if joined else 'timeout'}")
        group = joined[0]
        self._group = group
        return group

    def _close_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def close(self) -> None:
        self._close_group()
        self._session.close()

    def __enter__(self) -> GenerationClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def safetensors_data_bytes(path: str | os.PathLike) -> int:
    """The bytes of a safetensors file's tensors (its size less the header): what a push of it delivers."""
    with open(path, "rb") as handle:
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    return sum(entry["data_offsets"][1] - entry["data_offsets"][0]
               for name, entry in header.items() if name != "__metadata__")


def _local_address_towards(server_host: str) -> str:
    """The address of this machine that the server can reach back (no packet is sent: UDP connect)."""
    if is_loopback(server_host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((server_host, 9))
        return probe.getsockname()[0]
