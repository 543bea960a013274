"""Learner → engine weight transport: flat buckets over a side process group.

The learner is rank 0 of a standalone group; the engine's workers are ranks 1..W. The group is never the
default one (DeepSpeed owns the learner's, vLLM the workers'), so it is built from a TCP store directly.

Transports (`select_transport` picks one; callers may override):
- `gloo`: CPU tensors. Buckets are broadcast over gloo.
- `nccl`: learner and engine on different GPUs or nodes. Buckets are broadcast over a NCCL group.
- `cuda_ipc`: learner and engine share one GPU (NCCL refuses two ranks on one device). Each bucket stays in the
  learner's memory; a CUDA IPC handle goes over gloo and the worker copies from it.

A bucket is a flat uint8 buffer holding many tensors at aligned offsets. The order, names, dtypes and shapes
are declared up front (`plan_buckets`) and sent with the HTTP request that begins the update, so only raw
bytes travel over the group. Both sides keep two buckets in flight: the learner packs bucket k+1 while k is on
the wire, and the worker receives k+1 while the engine loads k.
"""
from __future__ import annotations

import datetime
import io
import logging
import pickle
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Literal

import torch
import torch.distributed as dist

logger = logging.getLogger("vllm.apmpo")  # a child of vLLM's logger: the worker prints it without setup
Transport = Literal["gloo", "nccl", "cuda_ipc"]
DEFAULT_BUCKET_BYTES = 64 * 2**20  # on CPU 64 MiB overlapped transfer and load better than 256 (45% vs 29%)
_ALIGN = 64  # bytes; every tensor starts at a multiple, so a uint8 slice can be viewed as any dtype


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # bytes into the bucket

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=self.torch_dtype).element_size()


@dataclass(frozen=True)
class Bucket:
    nbytes: int
    tensors: tuple[TensorSpec, ...]


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def plan_buckets(specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> list[Bucket]:
    """Groups (name, dtype, shape) in order into buckets of at most `bucket_bytes` (a larger tensor gets its own)."""
    buckets: list[Bucket] = []
    current: list[TensorSpec] = []
    offset = 0
    for name, dtype, shape in specs:
        spec = TensorSpec(name, str(dtype).removeprefix("torch."), tuple(shape), 0)
        if current and offset + spec.nbytes > bucket_bytes:
            buckets.append(Bucket(offset, tuple(current)))
            current, offset = [], 0
        current.append(TensorSpec(spec.name, spec.dtype, spec.shape, offset))
        offset += -(-spec.nbytes // _ALIGN) * _ALIGN
    if current:
        buckets.append(Bucket(offset, tuple(current)))
    return buckets


def pack(tensors: list[torch.Tensor], bucket: Bucket, out: torch.Tensor) -> torch.Tensor:
    """Copies `tensors` (casting to the planned dtype) into the flat uint8 `out`; returns its used prefix."""
    for tensor, spec in zip(tensors, bucket.tensors, strict=True):
        view = out[spec.offset : spec.offset + spec.nbytes].view(spec.torch_dtype).view(spec.shape)
        view.copy_(tensor.detach())
    return out[: bucket.nbytes]


def unpack(buffer: torch.Tensor, bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """Views into `buffer`, no copy: the buffer must outlive them."""
    for spec in bucket.tensors:
        yield spec.name, buffer[spec.offset : spec.offset + spec.nbytes].view(spec.torch_dtype).view(spec.shape)


def select_transport(learner_device: torch.device, engine_device_uuids: list[str]) -> Transport:
    """CPU → gloo; the learner's GPU is the engine's only GPU → cuda_ipc; otherwise → nccl."""
    if learner_device.type != "cuda":
        return "gloo"
    learner_uuid = str(torch.cuda.get_device_properties(learner_device).uuid)
    return "cuda_ipc" if engine_device_uuids == [learner_uuid] else "nccl"


# --- the group (both sides) -------------------------------------------------------------------------------


class WeightGroup:
    """Rank `rank` of a standalone group: a gloo group always (data on CPU, control for cuda_ipc), plus NCCL."""

    def __init__(self, transport: Transport, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                 store: dist.TCPStore | None = None):
        self.transport, self.rank, self.world_size = transport, rank, world_size
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = store or dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # Loopback must be named explicitly: gloo's default device resolves the hostname, which may not route.
        loopback = host in ("127.0.0.1", "localhost", "::1")
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host if loopback else "")]
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", self.store), rank, world_size, options)
        self.nccl = None
        if transport == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", self.store), rank, world_size, options)

    @classmethod
    def create_master(cls, transport: Transport, host: str, world_size: int, timeout_s: float) -> dist.TCPStore:
        """The learner's store, on a free port (`store.port`); `WeightGroup(..., store=store)` then joins."""
        return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))

    def broadcast(self, buffer: torch.Tensor) -> dist.Work:
        group = self.nccl if buffer.is_cuda and self.nccl is not None else self.gloo
        return group.broadcast([buffer], dist.BroadcastOptions())  # root 0 = learner

    def barrier(self) -> None:
        self.gloo.allreduce([torch.zeros(1)]).wait()

    def close(self) -> None:
        for group in (self.nccl, self.gloo):
            if group is not None and hasattr(group, "shutdown"):
                group.shutdown()


# --- learner side ------------------------------------------------------------------------------------------


def send_buckets(group: WeightGroup, buckets: list[Bucket], tensors: list[torch.Tensor]) -> None:
    """Broadcasts the planned buckets, packing the next one while the previous one is on the wire."""
    if not buckets:
        return
    device = tensors[0].device
    largest = max(b.nbytes for b in buckets)
    buffers = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(2)]
    pending: dist.Work | None = None
    start = 0
    for k, bucket in enumerate(buckets):
        packed = pack(tensors[start : start + len(bucket.tensors)], bucket, buffers[k % 2])
        start += len(bucket.tensors)
        if group.transport == "cuda_ipc":
            _send_ipc_handle(group, packed)  # synchronous: the worker has copied the bucket when it returns
            continue
        if pending is not None:
            pending.wait()
        pending = group.broadcast(packed)
    if pending is not None:
        pending.wait()


def _send_ipc_handle(group: WeightGroup, packed: torch.Tensor) -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.current_stream(packed.device).synchronize()  # the copy must be done before the worker reads
    payload = pickle.dumps(reduce_tensor(packed))
    group.gloo.broadcast([torch.tensor([len(payload)], dtype=torch.int64)], dist.BroadcastOptions()).wait()
    group.gloo.broadcast([torch.frombuffer(bytearray(payload), dtype=torch.uint8)], dist.BroadcastOptions()).wait()
    group.barrier()  # the worker's copy is done; the buffer may be reused


# --- engine side -------------------------------------------------------------------------------------------


def receive_buckets(group: WeightGroup, buckets: list[Bucket], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) in the planned order, receiving bucket k+1 while the caller loads bucket k."""

    def start(bucket: Bucket) -> tuple[torch.Tensor, dist.Work | None]:
        if group.transport == "cuda_ipc":
            return _receive_ipc_bucket(group, bucket, device), None
        on = device if group.transport == "nccl" else torch.device("cpu")
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=on)  # fresh: the loader may keep views
        return buffer, group.broadcast(buffer)

    upcoming = start(buckets[0]) if buckets else None
    for k, bucket in enumerate(buckets):
        buffer, work = upcoming
        if work is not None:
            work.wait()
        upcoming = start(buckets[k + 1]) if k + 1 < len(buckets) else None
        yield from unpack(buffer, bucket)


def _receive_ipc_bucket(group: WeightGroup, bucket: Bucket, device: torch.device) -> torch.Tensor:
    size = torch.zeros(1, dtype=torch.int64)
    group.gloo.broadcast([size], dist.BroadcastOptions()).wait()
    payload = torch.empty(int(size), dtype=torch.uint8)
    group.gloo.broadcast([payload], dist.BroadcastOptions()).wait()
    rebuild, args = pickle.load(io.BytesIO(payload.numpy().tobytes()))
    args = list(args)
    args[6] = device.index if device.index is not None else torch.cuda.current_device()  # storage_device: our numbering
    copy = rebuild(*args)[: bucket.nbytes].clone()
    torch.cuda.current_stream(device).synchronize()
    group.barrier()
    return copy


class WeightReceiverExtension:
    """Mixed into every vLLM worker (`LLM(worker_extension_cls=...)`); the server calls these by name."""

    def apmpo_device_uuid(self) -> str:
        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid) if torch.cuda.is_available() else ""

    def apmpo_init_weight_group(self, transport: Transport, host: str, port: int, world_size: int,
                                timeout_s: float) -> None:
        self.apmpo_close_weight_group()
        self._apmpo_group = WeightGroup(transport, host, port, 1 + self.rank, world_size, timeout_s)

    def apmpo_close_weight_group(self) -> None:
        group = getattr(self, "_apmpo_group", None)
        if group is not None:
            group.close()
        self._apmpo_group = None

    def apmpo_receive_weights(self, buckets: list[dict]) -> int:
        group = getattr(self, "_apmpo_group", None)
        if group is None:
            raise RuntimeError("no weight group: call init first")
        plan = [Bucket(b["nbytes"], tuple(TensorSpec(t["name"], t["dtype"], tuple(t["shape"]), t["offset"])
                                           for t in b["tensors"])) for b in buckets]
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        names = {t.name for b in plan for t in b.tensors}
        model_config = self.model_runner.model_config  # a vision-language model sets the tie on its top config
        tied = any(getattr(c, "tie_word_embeddings", False)
                   for c in (model_config.hf_config, model_config.hf_text_config))
        count, waited = 0, 0.0

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count, waited
            received = receive_buckets(group, plan, device)
            while True:
                start = time.perf_counter()
                item = next(received, None)
                waited += time.perf_counter() - start
                if item is None:
                    return
                name, tensor = item
                count += 1
                yield name, tensor
                # HF named_parameters() of a tied model omits lm_head.weight. The in-place reload replaces each
                # layer's parameters, which breaks the tie, so the head must be fed explicitly or it keeps the
                # old weights (and on CPU a stale packed copy of them).
                # (Qwen2.5-VL's HF name is model.language_model.embed_tokens.weight; vLLM maps both.)
                if tied and name.endswith("embed_tokens.weight") and "lm_head.weight" not in names:
                    yield "lm_head.weight", tensor

        start = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        logger.info("apmpo: reloaded %d tensors in %.2f s (%.2f s of it waiting for bytes)", count,
                    time.perf_counter() - start, waited)
        return count
