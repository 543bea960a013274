"""Learner set-up checks that need a process group of their own (run by tests/test_learner_setup.py).

    python tests/learner_setup_worker.py timeout TIMEOUT_S DELAY_S       # with RANK/WORLD_SIZE/MASTER_* set
    python tests/learner_setup_worker.py bf16_accumulation OUT.pt MICRO_BATCHES
    python tests/learner_setup_worker.py dither OUT_PREFIX
"""
import sys
import time
from pathlib import Path

import torch
import torch.distributed as torch_dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from apmpo.config import load_config  # noqa: E402
from apmpo.learner.engine import build_engine, close_distributed, init_distributed  # noqa: E402
from apmpo.tiny import build_model, build_tokenizer  # noqa: E402


def timeout(timeout_s: str, delay_s: str) -> None:
    """Rank 0 is busy (starting the server, generating) for DELAY_S while the others wait in the broadcast."""
    dist = init_distributed(float(timeout_s))
    if dist.is_main:
        time.sleep(float(delay_s))
    payload = ["batch" if dist.is_main else None]
    torch_dist.broadcast_object_list(payload, src=0)
    print(f"rank {dist.rank} received {payload[0]}", flush=True)
    close_distributed()


def bf16_accumulation(out: str, micro_batches: str) -> None:
    """Gradients of k bf16 micro-batches as accumulated by the DeepSpeed engine, and each micro-batch's own
    gradient from an identical bf16 model, so that the test can sum them in fp32 itself."""
    dist = init_distributed()
    cfg = load_config(None, ["model.dtype=bf16"])
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer).to(torch.bfloat16)
    twin = build_model(tokenizer).to(torch.bfloat16)
    twin.load_state_dict(model.state_dict())
    engine = build_engine(model.train(), cfg, dist)
    g = torch.Generator().manual_seed(1)
    singles = []
    k = int(micro_batches)
    for i in range(k):
        ids = torch.randint(3, len(tokenizer), (2, 24), generator=g)
        engine.set_gradient_accumulation_boundary(i == k - 1)
        engine.backward(engine.module(input_ids=ids, labels=ids).loss)
        twin.zero_grad()
        twin(input_ids=ids, labels=ids).loss.backward()
        singles.append({n: p.grad.clone() for n, p in twin.named_parameters()})
    from deepspeed.utils import safe_get_full_grad

    accumulated = {n: safe_get_full_grad(p).float().clone() for n, p in engine.module.named_parameters()}
    torch.save({"accumulated": accumulated, "singles": singles}, out)
    close_distributed()


def dither(out_prefix: str) -> None:
    """bf16 engines with and without optim.dither_master: their bf16 weights before and after the engine is built,
    their fp32 masters, and the weights after every master drifted up by a tenth of its bf16 interval and an
    optimiser step (of lr 1e-12) copied them into the bf16 weights; and the masters of a dithered ZeRO-3 engine.
    Saved per rank."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    dist = init_distributed()
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    first = build_model(tokenizer).to(torch.bfloat16)
    initial = first.state_dict()
    saved = {"initial": {n: p.detach() for n, p in first.named_parameters()}}
    for on in (True, False):
        cfg = load_config(None, ["model.dtype=bf16", f"optim.dither_master={on}", "optim.lr=1e-12", "train.seed=3"])
        model = build_model(tokenizer).to(torch.bfloat16)
        model.load_state_dict(initial)
        engine = build_engine(model.train(), cfg, dist)
        built = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        masters = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
        for n, p in engine.module.named_parameters():
            inf = torch.full_like(built[n], float("inf"))
            interval = (torch.nextafter(built[n], inf).float() - torch.nextafter(built[n], -inf).float()) / 2
            safe_set_full_fp32_param(p, masters[n] + interval / 10)
        ids = torch.randint(3, len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(1))
        engine.backward(engine.module(input_ids=ids, labels=ids).loss)
        engine.step()
        drifted = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        saved["on" if on else "off"] = {"built": built, "masters": masters, "drifted": drifted}
    cfg = load_config(None, ["model.dtype=bf16", "train.zero_stage=3", "train.seed=3"])  # ZeRO-3's partitions
    model = build_model(tokenizer).to(torch.bfloat16)
    model.load_state_dict(initial)
    engine = build_engine(model.train(), cfg, dist)
    saved["zero3"] = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    torch.save(saved, f"{out_prefix}.{dist.rank}.pt")
    close_distributed()


if __name__ == "__main__":
    {"timeout": timeout, "bf16_accumulation": bf16_accumulation, "dither": dither}[sys.argv[1]](*sys.argv[2:])
