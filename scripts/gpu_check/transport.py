"""The transport check: the learner's weights sent with apmpo.rollout.weight_sync to a second process (CUDA IPC on the
GPU, shm or gloo in the dry run) and received by the engine's code, bit for bit, against a raw copy of the same bytes;
then a LoRA adapter received by the engine worker's own receive into the file vLLM loads."""
from __future__ import annotations

import multiprocessing
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import torch

from scripts.gpu_check.measure import CheckFailed, GiB, Outcome, Shapes, median_seconds, random_qwen2, synchronize


def payload(buckets: list, device: str, seed: int) -> Iterator[torch.Tensor]:
    """The planned tensors filled from a seeded generator: both processes make the same ones."""
    g = torch.Generator(device=device).manual_seed(seed)
    for bucket in buckets:
        for spec in bucket.tensors:
            yield torch.randn(spec.shape, generator=g, device=device, dtype=spec.torch_dtype)


def _receive_weights(transport: str, port: int, buckets: list, adapter_buckets: list, device: str, rounds: int,
                     seed: int) -> None:
    """The engine's side, in its own process: round 0 compares every tensor with the sender's, the others only
    receive (so the timing holds no comparison); then one adapter push."""
    from apmpo.rollout.weight_sync import WeightGroup, receive_buckets

    if device == "cuda":
        torch.cuda.set_device(0)
    group = WeightGroup(transport, "127.0.0.1", port, 1, 2, timeout_s=120)
    try:
        for k in range(rounds):
            received = receive_buckets(group, buckets, torch.device(device, 0) if device == "cuda" else torch.device(device))
            if k == 0:
                expected = payload(buckets, device, seed)
                same = [torch.equal(tensor, next(expected)) for _, tensor in received]
                failed = len(same) != sum(len(b.tensors) for b in buckets) or not all(same)
            else:
                for _ in received:
                    pass
                failed = False
            group.barrier(failed=failed)
        group.barrier(failed=not _received_adapter_is_exact(group, adapter_buckets, device))
    finally:
        group.close()


def adapter_buckets_of(model: dict, dtype: torch.dtype, bucket_bytes: int, rank: int = 16) -> list:
    """A LoRA adapter's tensors for every linear layer of every block, named as PEFT saves them."""
    from apmpo.rollout.weight_sync import PEFT_PREFIX, plan_buckets

    hidden, ffn = model["hidden_size"], model["intermediate_size"]
    kv = hidden // model["num_attention_heads"] * model["num_key_value_heads"]
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (kv, hidden),
              "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, hidden),
              "mlp.gate_proj": (ffn, hidden), "mlp.up_proj": (ffn, hidden), "mlp.down_proj": (hidden, ffn)}
    specs = []
    for layer in range(model["num_hidden_layers"]):
        for module, (out_features, in_features) in shapes.items():
            name = f"{PEFT_PREFIX}model.layers.{layer}.{module}"
            specs += [(f"{name}.lora_A.weight", dtype, (rank, in_features)),
                      (f"{name}.lora_B.weight", dtype, (out_features, rank))]
    return plan_buckets(specs, bucket_bytes)


def _received_adapter_is_exact(group, buckets: list, device: str) -> bool:
    """The engine worker's own adapter receive (WeightReceiverExtension, as vLLM mixes it into a worker: rank 0,
    joined to the group) writes the file the server loads; it must hold the sender's tensors, bit for bit."""
    from safetensors.torch import load_file

    from apmpo.rollout.weight_sync import ADAPTER_WEIGHTS, WeightReceiverExtension

    worker = WeightReceiverExtension()
    worker.rank, worker._apmpo_group = 0, group
    with tempfile.TemporaryDirectory() as folder:
        worker.apmpo_receive_adapter([asdict(b) for b in buckets], folder)
        saved = load_file(str(Path(folder) / ADAPTER_WEIGHTS))
    expected = payload(buckets, device, seed=1)
    return len(saved) == sum(len(b.tensors) for b in buckets) and all(
        torch.equal(saved[spec.name], next(expected).cpu()) for b in buckets for spec in b.tensors)


_TRAINING_CACHE_BYTES = 8 * GiB


def check_transport(s: Shapes) -> Outcome:
    """The learner's weights (Qwen2.5-1.5B's tensors in the learner's dtype) over CUDA IPC into a second process."""
    from apmpo.rollout.weight_sync import WeightGroup, plan_buckets, select_transport, send_buckets

    shapes = [(name, p.shape) for name, p in random_qwen2(s.model, s.dtype, "meta").named_parameters()]
    buckets = plan_buckets([(name, s.dtype, shape) for name, shape in shapes], s.bucket_bytes)
    nbytes = sum(b.nbytes for b in buckets)
    transport = "cuda_ipc" if s.device == "cuda" else select_transport(torch.device("cpu"), [], True, nbytes)
    tensors = list(payload(buckets, s.device, seed=0))
    rounds = 1 + s.repeats  # round 0 checks the bytes and warms up
    if s.device == "cuda":  # a training step's freed activations, still cached by the allocator when the push comes
        cached = torch.empty(_TRAINING_CACHE_BYTES, dtype=torch.uint8, device="cuda")
        del cached
        reserved_before = torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
    adapter_buckets = adapter_buckets_of(s.model, s.dtype, s.bucket_bytes)
    store = WeightGroup.create_master(transport, "127.0.0.1", 2, timeout_s=120)
    receiver = multiprocessing.get_context("spawn").Process(
        target=_receive_weights, args=(transport, store.port, buckets, adapter_buckets, s.device, rounds, 0),
        daemon=True)
    receiver.start()
    group = WeightGroup(transport, "127.0.0.1", store.port, 0, 2, timeout_s=120, store=store)
    times = []
    try:
        for k in range(rounds):
            synchronize(s.device)
            start = time.perf_counter()
            send_buckets(group, buckets, tensors)
            failed = group.barrier()  # the receiver holds every bucket (and, in round 0, has compared them)
            synchronize(s.device)
            times.append(time.perf_counter() - start)
            if failed:
                raise CheckFailed(f"the receiving process got other bytes than were sent ({transport}, round {k})")
        send_buckets(group, adapter_buckets, list(payload(adapter_buckets, s.device, seed=1)))
        if group.barrier():
            raise CheckFailed(f"the adapter the engine worker wrote holds other bytes than were sent ({transport})")
    finally:
        group.close()
        receiver.join(timeout=60)
        if receiver.is_alive():
            receiver.kill()
    if receiver.exitcode != 0:
        raise CheckFailed(f"the receiving process exited with {receiver.exitcode} (its traceback is above)")
    # On the shared GPU (cuda_ipc) send_buckets returns the cached blocks first: the learner's peak during the push
    # is its live tensors and one bucket, not what the training step had reserved.
    memory = {} if s.device != "cuda" else {
        "learner_reserved_before_push_gib": reserved_before / GiB,
        "learner_peak_reserved_in_push_gib": torch.cuda.max_memory_reserved() / GiB,
        "learner_weights_gib": nbytes / GiB}
    del tensors
    source = torch.empty(nbytes, dtype=torch.uint8, device=s.device).fill_(7)
    target = torch.empty_like(source)
    raw = median_seconds(lambda: target.copy_(source), s.device, repeats=s.repeats)
    sent = statistics.median(times[1:])
    figures = {"transport": transport, "bytes": nbytes, "buckets": len(buckets), "bucket_bytes": s.bucket_bytes,
               "seconds": sent, "bytes_per_s": nbytes / sent, "raw_copy_bytes_per_s": nbytes / raw,
               "ratio_to_raw_copy": raw / sent, "adapter_bytes": sum(b.nbytes for b in adapter_buckets), **memory}
    return Outcome(figures, f"{transport} {nbytes / sent / GiB:.2f} GiB/s, raw copy {nbytes / raw / GiB:.2f} GiB/s: "
                            f"{raw / sent:.0%} ({nbytes / GiB:.2f} GiB in {len(buckets)} buckets, bytes identical); "
                            f"a rank-16 adapter ({figures['adapter_bytes'] / 2**20:.0f} MiB) written by the engine "
                            "worker's receive, bytes identical")
