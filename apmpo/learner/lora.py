"""LoRA: the policy as a base model plus a PEFT adapter (config `model.lora`), trained, pushed and saved as such.

The adapter is added to the HF model in place (transformers' PEFT integration, `model.add_adapter`), so the model
keeps its own interface (`model.model` is still the backbone that apmpo.learner.logprobs runs) and only the
adapter's parameters require gradients: DeepSpeed's optimiser holds only them. The KL reference is the same model
with its adapter off (`adapter_disabled`), not a second copy. A push sends the adapter's tensors alone through the
weight group that full pushes use (shm or gloo on CPU, NCCL or CUDA IPC on GPU), with its PEFT config; each
generation server writes them as PEFT's folder of its own and loads it as the next weight version (`policy-v<k>`,
rollout/server.py), so servers on other machines receive it too.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from apmpo.config import Config, LoraConfig
from apmpo.rollout.weight_sync import PEFT_PREFIX


def add_adapter(model, cfg: LoraConfig) -> None:
    """Adds a fresh LoRA adapter (B = 0: the policy starts as the base model) and freezes everything else."""
    import peft

    model.add_adapter(peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                      target_modules=list(cfg.target_modules), bias="none"))
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)


def has_adapter(model) -> bool:
    return bool(getattr(model, "_hf_peft_config_loaded", False))


@contextlib.contextmanager
def adapter_disabled(model):
    """The base model: `model` with its adapter off inside (a model without one is itself)."""
    if not has_adapter(model):
        yield model
        return
    model.disable_adapters()
    try:
        yield model
    finally:
        model.enable_adapters()


def adapter_tensors(model, state_dict: dict[str, torch.Tensor] | None = None) -> list[tuple[str, torch.Tensor]]:
    """The adapter's tensors under the names PEFT's save_pretrained gives them in adapter_model.safetensors, the
    names vLLM loads: `base_model.model.<layer>.lora_A.weight` and `.lora_B.weight`. `state_dict`: the model's
    whole tensors where its own are partitioned (ZeRO-3)."""
    adapter = model.get_adapter_state_dict(state_dict=state_dict)
    return [(PEFT_PREFIX + name, tensor) for name, tensor in adapter.items()]


def adapter_config(model) -> dict:
    """The adapter's adapter_config.json as save_pretrained writes it (PEFT's to_dict, sets as lists)."""
    config = model.peft_config[model.active_adapters()[0]].to_dict()
    return {key: list(value) if isinstance(value, set) else value for key, value in config.items()}


def push_policy(client, weights) -> int:
    """Pushes the policy (apmpo.learner.zero3.WholeWeights) into the generation server(s) (a GenerationClient or a
    ServerPool); returns the new weight version. With an adapter only the adapter goes (push_adapter), else every
    weight (push_weights), both through the weight group."""
    model = weights.model
    if not has_adapter(model):
        return client.push_weights(weights.for_push())
    return client.push_adapter(weights.adapter(), adapter_config(model))


def policy_tensors(weights) -> list[tuple[str, torch.Tensor]]:
    """What push_policy sends: the adapter's tensors, or every weight's layout (for join_weight_group)."""
    return weights.adapter() if has_adapter(weights.model) else weights.layout()


def server_args(cfg: Config) -> tuple[str, ...]:
    """The generation server's flags for this run's adapters: a rank limit, and how many versions it keeps (a
    batch generated up to train.max_staleness pushes ago may still be in flight with its own)."""
    lora = cfg.model.lora
    if lora is None:
        return ()
    return ("--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-versions", str(cfg.train.max_staleness + 1))


def merged_state_dict(model, state_dict: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The base model's state dict with the adapter merged in (W + scale * B A), under the base model's names:
    merge_and_unload's result, computed without copying the (DeepSpeed-wrapped) model. `state_dict`: the model's
    whole tensors where its own are partitioned (ZeRO-3); the deltas are then computed from them, as PEFT's
    get_delta_weight computes them from the modules."""
    from peft.tuners.lora import LoraLayer

    state = model.state_dict() if state_dict is None else state_dict
    deltas = {f"{name}.weight": module.get_delta_weight(module.active_adapters[0]) if state_dict is None
              else _delta_weight(module, state, name) for name, module in model.named_modules()
              if isinstance(module, LoraLayer)}
    merged = {}
    for key, tensor in state.items():
        if ".lora_" in key:
            continue
        plain = key.replace(".base_layer.", ".")
        merged[plain] = (tensor + deltas[plain]).detach() if plain in deltas else tensor.detach()
    return merged


def _delta_weight(module, state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """PEFT's LoRA Linear get_delta_weight, on the A and B of `state`: B A scaled, computed in fp32 from bf16 or
    fp16 on CPU, in the adapter's dtype."""
    from peft.utils.other import transpose

    adapter = module.active_adapters[0]
    a, b = state[f"{name}.lora_A.{adapter}.weight"], state[f"{name}.lora_B.{adapter}.weight"]
    upcast = b.device.type == "cpu" and b.dtype in (torch.float16, torch.bfloat16)
    delta = transpose(b.float() @ a.float() if upcast else b @ a, module.fan_in_fan_out) * module.scaling[adapter]
    return delta.to(b.dtype)


def save_merged(model, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Writes the policy with its adapter merged as a plain HF model: from_pretrained and a fresh generation
    server load it with no PEFT involved. `state_dict`: as merged_state_dict's."""
    with torch.device("meta"):
        plain = type(model)(model.config)
    plain.load_state_dict(merged_state_dict(model, state_dict), assign=True, strict=True)
    plain.tie_weights()
    plain.save_pretrained(directory, safe_serialization=True)
