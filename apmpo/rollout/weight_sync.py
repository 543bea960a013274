"""Learner → engine weight transport: flat buckets over a side process group.

The learner is rank 0 of a standalone group; the engine's workers are ranks 1..W. The group is never the
default one (DeepSpeed owns the learner's, vLLM the workers'), so it is built from a TCP store directly.

Transports (`select_transport` picks one; callers may override):
- `gloo`: CPU tensors, engine on another machine. Buckets are broadcast over gloo.
- `shm`: CPU tensors, engine on this machine. The learner packs the buckets into a file in /dev/shm that the
  workers map, and gloo carries only "bucket k is ready": the bytes never cross a socket, and the engine loads
  straight from the mapping. (Over gloo the socket copies competed with vLLM's CPU reload for the one core
  vLLM binds its worker to: a 0.5B push took 4.3 s over gloo and takes 2.5 s over shm, benchmarks/weight_sync.py.)
  Once the workers map a segment that holds the update, later pushes write all of it in place first and the
  workers load it without any collective (`in_place`): one request to the server, no gloo round trip.
- `nccl`: learner and engine on different GPUs or nodes. Buckets are broadcast over a NCCL group.
- `cuda_ipc`: learner and engine share one GPU (NCCL refuses two ranks on one device). Each bucket stays in the
  learner's memory; a CUDA IPC handle goes over gloo and the worker copies from it.

A bucket is a flat uint8 buffer holding many tensors at aligned offsets. The order, names, dtypes and shapes
are declared up front (`plan_buckets`) and sent with the HTTP request that begins the update, so only raw
bytes travel over the group. Both sides keep two buckets in flight: the learner packs bucket k+1 while k is on
the wire, and the worker receives k+1 while the engine loads k.

Both ends of the wire live here, the learner's (send_buckets) and the engine's (receive_buckets, and the vLLM worker
extension that calls it), beside the bucket format and the group they share: each transport's sending and
receiving must agree byte for byte and step for step (which collective, which buffer, who waits), and read side by
side they can be checked against each other. That is why the module is long: one protocol, four transports, two
ends. What a push must hold, which only the server checks, is apmpo.rollout.push_check's.
"""
from __future__ import annotations

import contextlib
import datetime
import glob
import io
import itertools
import logging
import os
import pickle
import shutil
import time
import uuid
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from apmpo.config import Transport
from apmpo.rollout.net import local_address_towards

logger = logging.getLogger("vllm.apmpo")  # a child of vLLM's logger: the worker prints it without setup
DEFAULT_BUCKET_BYTES = 64 * 2**20  # on CPU 64 MiB overlapped transfer and load better than 256 (45% vs 29%)
_ALIGN = 64  # bytes; every tensor starts at a multiple, so a uint8 slice can be viewed as any dtype
SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "apmpo-weights-"  # + "<the learner's pid>-<a unique id>"
ADAPTER_FOLDER_PREFIX = "apmpo-adapter-"  # + "<the server's pid>-<a unique id>": an adapter push's folder
ABORT_KEY = "apmpo/abort"  # in the group's store: a rank gave up the push in flight (WeightGroup.give_up)
ABORT_POLL_S = 0.05  # how often a waiting worker asks the store for ABORT_KEY
# A LoRA adapter's tensors, named as PEFT's save_pretrained writes them into adapter_model.safetensors (what
# vLLM reads): the layer's name in the HF model under PEFT_PREFIX, then which half of the update B A
# (apmpo.rollout.push_check.ADAPTER_TENSOR).
PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"


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

    @classmethod
    def from_json(cls, bucket: dict) -> Bucket:
        """From the JSON the learner declares (BucketModel on the server)."""
        return cls(bucket["nbytes"], tuple(TensorSpec(t["name"], t["dtype"], tuple(t["shape"]), t["offset"])
                                           for t in bucket["tensors"]))




def all_finite(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on `tensor`'s device: whether the floating `tensor` holds no NaN and no infinity. aminmax
    reads it once and propagates NaN; `isfinite().all()` also wrote a bool tensor of the same length, and took
    10x as long (0.35 s for SmolLM2's 538 MB, a fifth of the engine's reload)."""
    if tensor.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    return torch.stack(torch.aminmax(tensor)).isfinite().all()


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


def select_transport(learner_device: torch.device, engine_device_uuids: list[str], same_machine: bool,
                     nbytes: int) -> Transport:
    """CPU → shm on one machine when /dev/shm holds `nbytes`, else gloo; the learner's GPU is the engine's only
    GPU → cuda_ipc; otherwise → nccl."""
    if learner_device.type != "cuda":
        return "shm" if same_machine and shm_fits(nbytes) else "gloo"
    learner_uuid = str(torch.cuda.get_device_properties(learner_device).uuid)
    return "cuda_ipc" if engine_device_uuids == [learner_uuid] else "nccl"


def shm_fits(nbytes: int) -> bool:
    """Whether /dev/shm can hold `nbytes` more with room to spare (Docker's default is only 64 MiB)."""
    if not os.path.isdir(SHM_DIR):
        return False
    stat = os.statvfs(SHM_DIR)
    return stat.f_bavail * stat.f_frsize >= 2 * nbytes


def bucket_offsets(buckets: list[Bucket]) -> list[int]:
    """Where each bucket starts in a shared segment holding them all, back to back."""
    offsets, end = [], 0
    for bucket in buckets:
        offsets.append(end)
        end += bucket.nbytes
    return offsets


# --- the group (both sides) -------------------------------------------------------------------------------


class WeightGroup:
    """Rank `rank` of a standalone group: a gloo group always (data on CPU, control for cuda_ipc), plus NCCL."""

    def __init__(self, transport: Transport, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                 store: dist.TCPStore | None = None):
        self.transport, self.rank, self.world_size, self.timeout_s = transport, rank, world_size, timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = store or dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(**device) for device in gloo_devices(rank, host)]
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", self.store), rank, world_size, options)
        self.segment: torch.Tensor | None = None  # shm: the mapped file the buckets are packed into
        self.segment_path = ""
        self.abandoned = False  # a push was given up: a collective of this group may never complete
        self._asked_at = time.monotonic()  # when a worker last asked the store whether the learner gave up
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

    def give_up(self, reason: str) -> None:
        """This rank will not complete the push in flight. The others, waiting for bytes that will not come (the
        workers) or to be taken (the learner), learn it at their next poll of the store (`wait`), rather than after
        the group's timeout."""
        self.abandoned = True
        with contextlib.suppress(Exception):  # a store that is gone already tells the workers as much
            self.store.set(ABORT_KEY, reason)

    def wait(self, work: dist.Work) -> None:
        """`work.wait()`, except that it raises PushAbandoned once another rank has given up (`give_up`)."""
        while not work.is_completed():
            self.raise_if_given_up()
            time.sleep(1e-3)
        work.wait()  # raises the collective's own error, if it failed

    def raise_if_given_up(self) -> None:
        """Raises PushAbandoned if a rank has given up the push (asking the store at most every ABORT_POLL_S)."""
        now = time.monotonic()
        if now < self._asked_at + ABORT_POLL_S:
            return
        self._asked_at = now
        if self.store.check([ABORT_KEY]):
            self.abandoned = True
            raise PushAbandoned(self.store.get(ABORT_KEY).decode())

    def barrier(self, failed: bool = False) -> bool:
        """Waits for every rank; returns whether any of them reported `failed` (so no rank waits on one that
        gave up)."""
        flag = torch.tensor([float(failed)])
        self.wait(self.gloo.allreduce([flag]))
        return bool(flag.item())

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Rank 0 sends `payload`; every rank returns it."""
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        self.wait(self.gloo.broadcast([size], dist.BroadcastOptions()))
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None \
            else torch.empty(int(size), dtype=torch.uint8)
        self.wait(self.gloo.broadcast([data], dist.BroadcastOptions()))
        return data.numpy().tobytes()

    def share_segment(self, nbytes: int) -> torch.Tensor:
        """shm: the learner (re)creates a file of at least `nbytes`, the workers map it, then its name is
        unlinked, so that a crash leaks nothing. Both sides return the same memory."""
        if self.rank == 0 and (self.segment is None or self.segment.numel() < nbytes):
            self.segment_path = f"{SHM_DIR}/{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.segment = torch.from_file(self.segment_path, shared=True, size=nbytes, dtype=torch.uint8)
        path = self.broadcast_bytes(self.segment_path.encode() if self.rank == 0 else None).decode()
        error = None
        if self.rank != 0 and path != self.segment_path:
            if os.path.exists(path):
                self.segment = torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)
                self.segment_path = path
            else:
                error = RuntimeError(f"{path} is not visible to the engine: it does not share /dev/shm with the "
                                     "learner (another machine or container), so use the gloo transport")
        try:
            failed = self.barrier(failed=error is not None)
        finally:
            # The name is needed no longer once every rank has mapped the file, nor once the push has failed (the
            # learner gone too): the first rank here unlinks it. (A learner killed before this leaves it to
            # sweep_orphans_in_shm.)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if error is not None:
            raise error
        if failed:
            raise RuntimeError("an engine worker could not map the shared weight segment (see the server's log); "
                               "use the gloo transport if the engine runs in another container")
        return self.segment

    def maps(self, path: str, nbytes: int) -> bool:
        """shm: whether this group's mapped segment is `path` and holds `nbytes`."""
        return (self.transport == "shm" and self.segment is not None and self.segment_path == path
                and self.segment.numel() >= nbytes)

    def close(self) -> None:
        self.segment = None
        if self.rank == 0 and self.segment_path and os.path.exists(self.segment_path):
            os.unlink(self.segment_path)
        groups = [group for group in (self.nccl, self.gloo) if group is not None]
        self.nccl = self.gloo = None
        now = time.monotonic()
        _abandoned[:] = [(until, kept) for until, kept in _abandoned if until > now]
        if self.abandoned:
            # gloo's destructor waits for a collective still pending (bytes the learner never sent) until the
            # group's timeout: the group is kept until then, so that closing it does not block the server.
            _abandoned.append((now + self.timeout_s + 5, groups))
            return
        for group in groups:
            if hasattr(group, "shutdown"):
                group.shutdown()


def gloo_devices(rank: int, learner_host: str, env: Mapping[str, str] = os.environ) -> list[dict[str, str]]:
    """Where this rank's gloo group listens, as `ProcessGroupGloo.create_device` arguments. Each side names its own
    address: gloo's default device resolves the machine's hostname, which may not route to the other side (or
    resolve at all), and torch refuses an empty one. The learner (rank 0) binds the address it gave the workers,
    `learner_host`; a worker binds its own address towards it. GLOO_SOCKET_IFNAME, when set, names the
    interfaces instead, as it does for torch's own gloo groups (init_process_group)."""
    interfaces = env.get("GLOO_SOCKET_IFNAME", "")
    if interfaces:
        return [{"interface": name.strip()} for name in interfaces.split(",")]
    return [{"hostname": learner_host if rank == 0 else local_address_towards(learner_host)}]


class NonFiniteWeights(ValueError):
    """A push held NaN or infinite values (the learner refuses to send them: a bypass, or a bug)."""


class PushAbandoned(RuntimeError):
    """Another rank of the weight group gave up the push in flight (WeightGroup.give_up)."""


_abandoned: list[tuple[float, list]] = []  # (monotonic time after which they may go, process groups)


def sweep_orphans_in_shm() -> list[str]:
    """Unlinks the shm weight segments whose learner is gone, and the adapter folders whose server is gone, and
    returns their paths. A segment's name exists only while the workers map it (share_segment), and a server
    removes an adapter's folder once the engine has loaded it, but a process killed in between leaves the file
    behind, the size of the weights or the adapter, and nothing else would remove it. Called where a server or a
    learner's client starts."""
    removed = []
    for prefix, remove in ((SEGMENT_PREFIX, os.unlink), (ADAPTER_FOLDER_PREFIX, shutil.rmtree)):
        for path in glob.glob(f"{SHM_DIR}/{prefix}*-*"):
            owner = os.path.basename(path).removeprefix(prefix).split("-")[0]
            if owner.isdigit() and not _process_exists(int(owner)):
                with contextlib.suppress(FileNotFoundError):
                    remove(path)
                    removed.append(path)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def wait_done(group: WeightGroup, work: dist.Work, device: torch.device, poll_s: float = 1e-3) -> None:
    """Returns once the collective's bytes are in place. On NCCL `work.wait()` only makes the current stream
    wait for the transfer: the receiver would load (and the server report a new weight version) while bytes are
    still in flight, and a dead sender would hang it until NCCL's watchdog fired. So wait for the stream too,
    polling an event with a deadline (as vLLM's and TRL's receivers synchronise after their broadcasts)."""
    if device.type != "cuda":
        return group.wait(work)  # complete when the data is there; fails after the group's timeout
    work.wait()
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + group.timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"weight transfer not complete after {group.timeout_s:.0f} s: the other side of the "
                               "NCCL weight group died or stalled mid-push")
        group.raise_if_given_up()
        time.sleep(poll_s)


# --- learner side ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamedTensors:
    """Tensors to push that exist only as they are sent: a ZeRO-3 learner gathers a module's at a time
    (apmpo.learner.zero3). Their names, dtypes and whole shapes up front; the tensors, in that order, read once
    and lazily, a bucket's at a time; the device they come on. Their finiteness is the caller's to check."""
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]]
    tensors: Iterable[torch.Tensor]
    device: torch.device


def send_buckets(group: WeightGroup, buckets: list[Bucket], tensors: Iterable[torch.Tensor]) -> None:
    """Broadcasts the planned buckets, packing the next one while the previous one is on the wire."""
    if not buckets:
        return
    tensors = iter(tensors)
    first = next(tensors)
    device, tensors = first.device, itertools.chain([first], tensors)
    if group.transport == "cuda_ipc":
        # The engine shares this GPU, and its reload allocates a copy of each bucket and of each layer, while our
        # caching allocator still holds the training step's freed blocks: give them back first.
        torch.cuda.empty_cache()
    if group.transport == "shm":  # every bucket has its own place, so none is overwritten before it is loaded
        segment = group.share_segment(sum(b.nbytes for b in buckets))
        buffers = [segment[offset:] for offset in bucket_offsets(buckets)]
    else:
        # Two buffers: bucket k+1 is packed while k is on the wire. cuda_ipc sends synchronously (the worker
        # has copied a bucket before the next is packed), so one buffer is enough (~1 GB saved at 7B).
        largest = max(b.nbytes for b in buckets)
        slots = [torch.empty(largest, dtype=torch.uint8, device=device)
                 for _ in range(1 if group.transport == "cuda_ipc" else 2)]
        buffers = [slots[k % len(slots)] for k in range(len(buckets))]
    pending: dist.Work | None = None
    for k, bucket in enumerate(buckets):
        packed = pack([next(tensors) for _ in bucket.tensors], bucket, buffers[k])
        if group.transport == "cuda_ipc":
            _send_ipc_handle(group, packed)  # synchronous: the worker has copied the bucket when it returns
            continue
        if pending is not None:  # on GPU the stream waits (wait_done at the end): packing k+1 overlaps sending k
            pending.wait() if device.type == "cuda" else group.wait(pending)
        pending = group.broadcast(torch.tensor([k]) if group.transport == "shm" else packed)
    if pending is not None:
        wait_done(group, pending, packed.device)


def holds_in_place(group: WeightGroup, buckets: list[Bucket]) -> bool:
    """shm: whether the workers already map a segment of ours large enough for `buckets` (shared by an earlier
    push), so that this one can be written in place and loaded without a collective."""
    return group.maps(group.segment_path, sum(b.nbytes for b in buckets))


def pack_in_place(group: WeightGroup, buckets: list[Bucket], tensors: Iterable[torch.Tensor]) -> None:
    """shm, when `holds_in_place`: packs every bucket into its place in the shared segment."""
    tensors = iter(tensors)
    for bucket, offset in zip(buckets, bucket_offsets(buckets)):
        pack([next(tensors) for _ in bucket.tensors], bucket, group.segment[offset:])


def _send_ipc_handle(group: WeightGroup, packed: torch.Tensor) -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.current_stream(packed.device).synchronize()  # the copy must be done before the worker reads
    group.broadcast_bytes(pickle.dumps(reduce_tensor(packed)))
    group.barrier()  # the worker's copy is done; the buffer may be reused


# --- engine side -------------------------------------------------------------------------------------------


def receive_buckets(group: WeightGroup, buckets: list[Bucket], device: torch.device,
                    in_place: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) in the planned order, receiving bucket k+1 while the caller loads bucket k.
    `in_place` (shm): the path of the segment this group mapped earlier, into which the learner has already
    packed every bucket (`pack_in_place`); nothing is received."""

    if group.transport == "shm" and buckets:
        nbytes = sum(b.nbytes for b in buckets)
        if in_place is not None and not group.maps(in_place, nbytes):  # apmpo_maps_segment said so before
            raise RuntimeError(f"the engine does not map the shared segment {in_place} (or it is too small)")
        segment = group.segment if in_place is not None else group.share_segment(nbytes)
        offsets = bucket_offsets(buckets)
    elif in_place is not None:
        raise RuntimeError(f"an in-place load needs the engine's weight group to be shm, not {group.transport}")

    def start(k: int) -> tuple[torch.Tensor, dist.Work | None]:
        bucket = buckets[k]
        if group.transport == "cuda_ipc":
            return _receive_ipc_bucket(group, bucket, device), None
        if group.transport == "shm":  # the bytes are in place once the learner says so (or before it asked)
            view = segment[offsets[k] : offsets[k] + bucket.nbytes]
            return view, None if in_place else group.broadcast(torch.empty(1, dtype=torch.int64))
        on = device if group.transport == "nccl" else torch.device("cpu")
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8, device=on)  # fresh: the loader may keep views
        return buffer, group.broadcast(buffer)

    upcoming = start(0) if buckets else None
    for k, bucket in enumerate(buckets):
        buffer, work = upcoming
        if work is not None:
            wait_done(group, work, buffer.device)
        upcoming = start(k + 1) if k + 1 < len(buckets) else None
        yield from unpack(buffer, bucket)


def _receive_ipc_bucket(group: WeightGroup, bucket: Bucket, device: torch.device) -> torch.Tensor:
    rebuild, args = pickle.load(io.BytesIO(group.broadcast_bytes(None)))
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
                                timeout_s: float, first_rank: int = 1) -> None:
        """Joins as rank `first_rank` + this worker's rank (a group shared by several servers numbers them on)."""
        self.apmpo_close_weight_group()
        self._apmpo_group = WeightGroup(transport, host, port, first_rank + self.rank, world_size, timeout_s)

    def apmpo_close_weight_group(self) -> None:
        group = getattr(self, "_apmpo_group", None)
        if group is not None:
            group.close()
        self._apmpo_group = None

    def apmpo_maps_segment(self, path: str, nbytes: int) -> bool:
        """Whether an in-place load from `path` can run: this worker's group is the shm group that mapped it (not
        one another learner has put in its place since)."""
        group = getattr(self, "_apmpo_group", None)
        return group is not None and group.maps(path, nbytes)

    def apmpo_receive_weights(self, buckets: list[dict], in_place: str | None = None) -> dict[str, float]:
        """Receives and loads one update (`in_place`: already in that shm segment, see receive_buckets); returns
        the seconds in vLLM's reload, and how many of them were spent waiting for bytes (the rest is the engine's
        own loading, a floor no transport can lower)."""
        group = self._apmpo_joined_group()
        plan = [Bucket.from_json(b) for b in buckets]
        device = _worker_device()
        names = {t.name for b in plan for t in b.tensors}
        model_config = self.model_runner.model_config  # a vision-language model sets the tie on its top config
        tied = any(getattr(c, "tie_word_embeddings", False)
                   for c in (model_config.hf_config, model_config.hf_text_config))
        count, waited = 0, 0.0
        non_finite: list[str] = []
        failed: list[Exception] = []

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count, waited
            received = receive_buckets(group, plan, device, in_place)
            while True:
                start = time.perf_counter()
                try:
                    item = next(received, None)
                except Exception as error:  # noqa: BLE001 (raised once the reload has ended)
                    # The bytes stopped coming. The reload ends as if the update ended here: raised inside it, the
                    # layerwise reload left layers half-replaced, and the next one failed ("'Parameter' object
                    # has no attribute 'weight_loader'"). Ended, layers not reached keep their old weights.
                    failed.append(error)
                    return
                waited += time.perf_counter() - start
                if item is None:
                    return
                name, tensor = item
                count += 1
                if tensor.is_floating_point() and not non_finite and not all_finite(tensor):
                    non_finite.append(name)
                yield name, tensor
                # HF named_parameters() of a tied model omits lm_head.weight. The in-place reload replaces each
                # layer's parameters, which breaks the tie, so the head must be fed explicitly or it keeps the
                # old weights (and on CPU a stale packed copy of them).
                # (Qwen2.5-VL's HF name is model.language_model.embed_tokens.weight; vLLM maps both.)
                if tied and name.endswith("embed_tokens.weight") and "lm_head.weight" not in names:
                    yield "lm_head.weight", tensor

        start = time.perf_counter()
        try:
            self.model_runner.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        except Exception as error:
            failed.append(error)
        if failed:
            if not group.abandoned:  # the learner must not wait for this worker's part of the push any longer
                group.give_up(f"engine worker {self.rank} gave up the push: {failed[0]!r}")
            raise failed[0]
        seconds = time.perf_counter() - start
        logger.info("apmpo: reloaded %d tensors in %.2f s (%.2f s of it waiting for bytes)", count, seconds, waited)
        if non_finite:  # loaded all the same, so that the group stays in step; the server refuses to generate
            raise NonFiniteWeights(f"tensor {non_finite[0]!r} holds NaN or infinite values")
        return {"reload_s": seconds, "wait_s": waited}

    def apmpo_receive_adapter(self, buckets: list[dict], folder: str, in_place: str | None = None) -> dict[str, float]:
        """Receives a LoRA adapter's tensors (`in_place`: as apmpo_receive_weights) into CPU tensors of their own,
        not into the model, and worker 0 writes them to `folder`/adapter_model.safetensors for the server to load
        as an adapter. A failure leaves the served model as it was. Returns the seconds it took, and how many of
        them were spent waiting for bytes."""
        group = self._apmpo_joined_group()
        start = time.perf_counter()
        try:
            # Copies: the received views share one buffer (the shm segment, which the next push overwrites), and
            # safetensors refuses to save tensors that share memory.
            tensors = {name: tensor.to("cpu", copy=True) for name, tensor in
                       receive_buckets(group, [Bucket.from_json(b) for b in buckets], _worker_device(), in_place)}
        except Exception as error:
            if not group.abandoned:  # the learner must not wait for this worker's part of the push any longer
                group.give_up(f"engine worker {self.rank} gave up the adapter push: {error!r}")
            raise
        waited = time.perf_counter() - start
        non_finite = next((name for name, t in tensors.items() if t.is_floating_point() and not all_finite(t)),
                          None)
        if non_finite is not None:
            raise NonFiniteWeights(f"adapter tensor {non_finite!r} holds NaN or infinite values")
        if self.rank == 0:  # every worker of the engine receives the push; one file is enough
            from safetensors.torch import save_file

            save_file(tensors, os.path.join(folder, ADAPTER_WEIGHTS), metadata={"format": "pt"})  # as PEFT's
        logger.info("apmpo: received %d adapter tensors in %.3f s", len(tensors), waited)
        return {"reload_s": time.perf_counter() - start, "wait_s": waited}

    def _apmpo_joined_group(self) -> WeightGroup:
        group = getattr(self, "_apmpo_group", None)
        if group is None:
            raise RuntimeError("no weight group: call init first")
        return group


def _worker_device() -> torch.device:
    """Where an engine worker receives NCCL and CUDA IPC buckets: its GPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
