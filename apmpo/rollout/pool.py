"""Several generation servers behind the interface of one GenerationClient (data-parallel generation).

    pool = ServerPool([GenerationClient(url) for url in urls])     # or launcher.serve(..., devices="4;5").client()
    outs = pool.generate(prompts, sampling, n=8, seed=s)            # outs[prompt][sample], in prompt order
    version = pool.push_weights(model.named_parameters())           # to every server at once, same version
    version = pool.push_adapter(adapter_tensors, adapter_config)     # LoRA servers: an adapter, the same way
    version = pool.load_adapter(folder)                              # or an adapter folder each server reads

Generation: the prompts are cut into one contiguous chunk per server, of sizes that differ by at most one (all n
samples of a prompt stay in one chunk), and every server gets its chunk at once, as OpenRLHF and verl deal
prompts to their vLLM engines. A server's engine batches all of its chunk together: cut into four chunks per
server taken one after another, 16 prompts x 8 samples of up to 64 tokens took 0.40 s on 2 CPU servers, against
0.20 s in one chunk each (each chunk drains its own tail of long samples), and 0.29 s on one server (step_time's
generate phase).
The server seeds prompt i of a request with `seed + i * n`; a chunk starting at prompt `start` is sent with
`seed + start * n`, so every prompt gets the seed it would get in one request to one server: the samples do
not depend on which server drew them, nor on how many there are.

Weights (and a LoRA adapter's tensors, push_adapter): one weight group holds the learner and every engine worker
of every server (client.WeightSender), so each bucket is broadcast once for all (shm or gloo on CPU, NCCL on GPU).
Servers that reach this machine at different addresses (other networks) cannot share a group: each keeps its own,
and the pushes run in parallel, a thread per server. A push that fails on any server, or servers that then report
different weight versions (one was restarted), raise ServerError naming the servers.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from typing import Any, Iterable

import torch

from apmpo.rollout.client import (GenerationClient, PushReport, Sample, ServerError, ServerUnavailable,
                                  WeightSender)
from apmpo.rollout.net import in_thread
from apmpo.sampling import Sampling
from apmpo.rollout.weight_sync import StreamedTensors

# What every server of a pool must agree on: prompts are encoded once, for one model.
SAME_ON_ALL = ("model", "max_model_len", "vocab_size", "dtype", "multimodal")


class ServerPool:
    def __init__(self, clients: list[GenerationClient]):
        if not clients:
            raise ValueError("ServerPool needs at least one client")
        self.clients = clients
        self.last_push: PushReport | None = None  # as GenerationClient's, over the pool: seconds of the whole fan-out
        # One group for all servers where it reaches them; else None, and each client pushes through its own.
        self.sender = WeightSender(clients) if len(clients) > 1 and WeightSender.one_group_reaches(clients) else None

    def info(self) -> dict[str, Any]:
        """The first server's /info, after checking that all serve the same model at the same weight version."""
        infos = [client.info() for client in self.clients]
        for key in (*SAME_ON_ALL, "weight_version"):
            values = {client.url: info[key] for client, info in zip(self.clients, infos)}
            if len(set(map(str, values.values()))) > 1:
                raise ServerError(f"the generation servers disagree on {key}: {values}")
        return infos[0]

    def generate(self, prompts: list[list[int]], sampling: Sampling, n: int = 1, *, seed: int | None = None,
                 seeds: list[int] | None = None, images: list[list[bytes]] | None = None) -> list[list[Sample]]:
        """As GenerationClient.generate. The first server that fails ends the call with its error (naming its URL);
        the others finish their chunks meanwhile, unread."""
        bounds = [len(prompts) * k // len(self.clients) for k in range(len(self.clients) + 1)]
        chunks = [(client, start, end) for client, start, end in zip(self.clients, bounds, bounds[1:]) if end > start]
        futures = {in_thread(functools.partial(
            client.generate, prompts[start:end], sampling, n, seed=None if seed is None else seed + start * n,
            seeds=None if seeds is None else seeds[start:end],
            images=None if images is None else images[start:end])): client for client, start, end in chunks}
        for future in concurrent.futures.as_completed(futures):
            if future.exception() is not None:
                raise _naming(futures[future].url, future.exception())
        return [row for future in futures for row in future.result()]

    def join_weight_group(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | StreamedTensors) -> None:
        """As GenerationClient.join_weight_group, for every server: before generating."""
        if self.sender is not None:
            self.sender.join_for(named_tensors)
            return
        # A stream's layout is all a join reads (WeightSender._plan), so every server's thread can share it.
        named = named_tensors if isinstance(named_tensors, StreamedTensors) else _materialized(named_tensors)
        futures = [in_thread(client.join_weight_group, named) for client in self.clients]
        self._raise_failures([future.exception() for future in futures])

    def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Pushes to every server, through the one group or in parallel; returns the weight version, the same on
        all."""
        return self._push(named_tensors, adapter=None)

    def push_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any]) -> int:
        """As GenerationClient.push_adapter, to every server as push_weights pushes; returns the version, the same
        on all."""
        return self._push(named_tensors, adapter=config)

    def _push(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | StreamedTensors,
              adapter: dict[str, Any] | None) -> int:
        start = time.perf_counter()
        # Read by every server's thread, unless one group sends each bucket once for all (a stream is read once).
        named = named_tensors if self.sender is not None else _materialized(named_tensors)
        if self.sender is None:
            return self._to_all(lambda client: client.push_weights(named) if adapter is None
                                else client.push_adapter(named, adapter), start)
        try:
            updates = self.sender.push(named, adapter=adapter)
        except Exception as error:  # noqa: BLE001 (named as the per-server path names it)
            raise ServerError(f"weight push failed on the weight group of all {len(self.clients)} generation "
                              f"servers ({', '.join(c.url for c in self.clients)}): {error}") from error
        versions = {client.url: update["weight_version"] for client, update in zip(self.clients, updates)}
        return self._settle(versions, [dataclasses.replace(self.sender.last_push, reload_s=update["reload_s"],
                                                           wait_s=update["wait_s"]) for update in updates], start)

    def load_adapter(self, path) -> int:
        """As GenerationClient.load_adapter, on every server in parallel; returns the version, the same on all."""
        return self._to_all(lambda client: client.load_adapter(path), time.perf_counter())

    def _to_all(self, push, start: float) -> int:
        futures = [in_thread(push, client) for client in self.clients]
        self._raise_failures([future.exception() for future in futures])
        versions = {client.url: future.result() for client, future in zip(self.clients, futures)}
        return self._settle(versions, [client.last_push for client in self.clients], start)

    def _settle(self, versions: dict[str, int], pushes: list[PushReport], start: float) -> int:
        if len(set(versions.values())) > 1:
            raise ServerError(f"the generation servers report different weight versions after the push: {versions} "
                              "(one was restarted, or pushed by another learner): restart them together")
        slowest = max(pushes, key=lambda push: push.reload_s)
        self.last_push = PushReport(",".join(sorted({p.transport for p in pushes})), all(p.in_place for p in pushes),
                                    pushes[0].bytes, time.perf_counter() - start, slowest.reload_s, slowest.wait_s,
                                    servers=tuple(pushes), one_group=self.sender is not None)
        return next(iter(versions.values()))

    def _raise_failures(self, errors: list[BaseException | None]) -> None:
        failed = [_naming(client.url, error) for client, error in zip(self.clients, errors) if error is not None]
        if failed:
            raise ServerError(f"weight push failed on {len(failed)} of {len(self.clients)} generation servers: "
                              + "; ".join(map(str, failed))) from failed[0]

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        for client in self.clients:
            client.close()

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _naming(url: str, error: BaseException) -> BaseException:
    """The error itself when its message already names the server (the client's do), else a ServerError that does."""
    if isinstance(error, (ServerError, ServerUnavailable)) and url in str(error):
        return error
    wrapped = ServerError(f"generation server {url}: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


def _materialized(named_tensors: Iterable[tuple[str, torch.Tensor]] | StreamedTensors
                  ) -> list[tuple[str, torch.Tensor]]:
    """The tensors as a list, to be read by several pushes. A ZeRO-3 stream is read whole here, into host memory:
    only where the servers cannot share one weight group (other networks or settings)."""
    if isinstance(named_tensors, StreamedTensors):
        return [(name, tensor.cpu()) for (name, _, _), tensor in zip(named_tensors.specs, named_tensors.tensors)]
    return [(name, tensor.detach()) for name, tensor in named_tensors]
