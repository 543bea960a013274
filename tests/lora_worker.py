"""A LoRA policy on the real DeepSpeed engine, one rank, no server (run by tests/test_lora.py).

    python tests/lora_worker.py MODEL_DIR RUN_DIR OUT.json

Engine A: one optimiser step, a checkpoint (adapter/ and a merged hf/), a second step. Engine B, built afresh:
resumes from that checkpoint and takes the same second step. OUT.json: what the test compares.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from apmpo.config import load_config  # noqa: E402
from apmpo.learner import checkpoint, lora  # noqa: E402
from apmpo.learner.engine import build_engine, close_distributed, init_distributed, load_model  # noqa: E402

IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])


def step(engine):
    engine.backward(engine(IDS).logits.float().pow(2).mean())
    engine.step()


def adapter(engine):
    return {name: t.detach().clone() for name, t in engine.module.get_adapter_state_dict().items()}


def main(model_dir: str, run_dir: str, out: str) -> None:
    cfg = load_config(None, ["model.dtype=fp32", "optim.lr=1e-2", "model.lora.rank=4"])
    dist = init_distributed(120.0)
    base = load_model(model_dir, cfg, dist.device, trainable=False)
    engine = build_engine(load_model(model_dir, cfg, dist.device), cfg, dist)
    optimised = {id(p) for group in engine.optimizer.bit16_groups for p in group}
    trainable = sorted(n for n, p in engine.module.named_parameters() if id(p) in optimised)
    step(engine)
    with torch.no_grad():
        with lora.adapter_disabled(engine.module):
            reference_gap = (engine.module(IDS).logits - base(IDS).logits).abs().max().item()
        policy_gap = (engine.module(IDS).logits - base(IDS).logits).abs().max().item()
        base_moved = max((p - base.state_dict()[n.replace(".base_layer.", ".")]).abs().max().item()
                         for n, p in engine.module.named_parameters() if ".lora_" not in n)
        saved = checkpoint.save_checkpoint(engine, Path(run_dir), 1, {}, _tokenizer(model_dir), 0, keep_last=2)
        logits = engine.module(IDS).logits
    step(engine)
    continued = adapter(engine)

    resumed = build_engine(load_model(model_dir, cfg, dist.device), cfg, dist)
    state = checkpoint.resume(resumed, Path(run_dir), "auto", 0)
    step(resumed)
    resume_gap = max((continued[n] - t).abs().max().item() for n, t in adapter(resumed).items())
    torch.save(logits, Path(out).with_suffix(".pt"))
    Path(out).write_text(json.dumps({
        "trainable": trainable, "all": [n for n, _ in engine.module.named_parameters()],
        "optimiser_numel": sum(p.numel() for group in engine.optimizer.bit16_groups for p in group),
        "reference_gap": reference_gap, "policy_gap": policy_gap, "base_moved": base_moved,
        "checkpoint": str(saved), "resumed_step": state["step"], "resume_gap": resume_gap}))
    close_distributed()


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


if __name__ == "__main__":
    main(*sys.argv[1:])
