"""Whole weights of a learner under ZeRO-3, which keeps a 1/N slice of every parameter on each rank.

Three things read the weights whole: the push into the generation servers (with LoRA, the adapter's alone), the
checkpoint's hf/ and adapter/ exports, and save_best's. Gathering is a collective, so every rank takes part, in the
same order. The checkpoint is collective anyway; the push and save_best are rank 0's alone (it owns the servers
and the validation), so rank 0 announces each read and the other ranks, waiting in `WholeWeights.settle`, join it.
Gathers go one module's own parameters at a time (a decoder layer's are split between its attention and MLP
modules), so that the push never holds more whole tensors than a bucket and a module's.

Under ZeRO-0/1/2 the weights are whole on every rank, and all of this reads them directly, with no collective.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as torch_dist
from torch import Tensor, nn

from apmpo.rollout.weight_sync import StreamedTensors, all_finite


def is_partitioned(param: Tensor) -> bool:
    """A parameter of ZeRO-3 (its data is this rank's slice, or empty outside a gather)."""
    return hasattr(param, "ds_id")


def full_shape(param: Tensor) -> tuple[int, ...]:
    return tuple(param.ds_shape) if is_partitioned(param) else tuple(param.shape)


def partitioned(model: nn.Module) -> bool:
    return any(is_partitioned(p) for p in model.parameters())


def gathered_parameters(model: nn.Module, keep: bool = True) -> Iterator[tuple[str, Tensor]]:
    """named_parameters(), each one whole. Under ZeRO-3 a collective: one module's own parameters are gathered at
    a time and yielded as copies (`keep`; a rank that only takes part gets the released tensors), since a gathered
    parameter is released when the next module's gather begins."""
    if not partitioned(model):
        yield from model.named_parameters()
        return
    import deepspeed

    seen: set[int] = set()  # tied weights (lm_head.weight) are one parameter, named once, as named_parameters does
    for prefix, module in model.named_modules():
        own = [(name, p) for name, p in module.named_parameters(recurse=False) if id(p) not in seen]
        if not own:
            continue
        seen.update(id(p) for _, p in own)
        with deepspeed.zero.GatheredParameters([p for _, p in own]):
            copies = [(f"{prefix}.{name}" if prefix else name, p.data.clone() if keep else p) for name, p in own]
        yield from copies


def consolidated_state_dict(engine) -> dict[str, Tensor] | None:
    """A ZeRO-3 module's state dict, whole, in host memory, on rank 0 (None elsewhere). Collective: DeepSpeed's own
    consolidation, a layer at a time, tied weights kept shared, in the module's dtype (despite its name)."""
    return engine._zero3_consolidated_16bit_state_dict()


def check_finite(model: nn.Module) -> None:
    """Raises ValueError naming the first parameter that holds NaN or infinity, on every rank. Collective under
    ZeRO-3: each rank checks its slices, and the flags are reduced, before a push begins (a push must not stop
    half-way, with the engines holding half the new weights)."""
    params = [(name, p) for name, p in model.named_parameters() if p.is_floating_point()]
    slices = [p.ds_tensor if is_partitioned(p) else p for _, p in params]
    finite = torch.stack([all_finite(s) for s in slices]).to(torch.int32)
    if partitioned(model) and torch_dist.is_initialized():
        torch_dist.all_reduce(finite, op=torch_dist.ReduceOp.MIN)
    if not finite.all():
        name = params[int((finite == 0).nonzero()[0])][0]
        raise ValueError(f"weight push refused: {name!r} holds NaN or infinite values (a diverged update?)")


class WholeWeights:
    """Rank 0's reads of the policy's whole weights, which the other ranks join under ZeRO-3.

    Rank 0 calls `for_push()` or `adapter()` (the push) and `export_state()` (save_best) as it needs them, then
    `settle()`; every other rank calls `settle()` at the same point of the loop, and there takes part in each read
    rank 0 announces, until rank 0's settle. Without ZeRO-3 nothing is announced and settle() returns at once."""

    def __init__(self, model: nn.Module, engine=None, rank: int = 0, world_size: int = 1):
        """`model`: the policy (`engine.module`); `engine`: its DeepSpeed engine, needed under ZeRO-3."""
        self.model, self.engine, self.rank = model, engine, rank
        self.partitioned = partitioned(model)
        self.collective = self.partitioned and world_size > 1

    def specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """Every parameter's name, dtype and whole shape, without a gather."""
        return [(name, p.dtype, full_shape(p)) for name, p in self.model.named_parameters()]

    def layout(self) -> list[tuple[str, Tensor]] | StreamedTensors:
        """What the push sends, for joining the weight group: the parameters, or their layout under ZeRO-3."""
        if not self.partitioned:
            return list(self.model.named_parameters())
        return StreamedTensors(self.specs(), (), self.device)

    def for_push(self) -> list[tuple[str, Tensor]] | StreamedTensors:
        """(rank 0) What the push sends: the parameters themselves, or under ZeRO-3 a stream that gathers them a
        module at a time as the push packs them."""
        if not self.partitioned:
            return list(self.model.named_parameters())
        self._announce("parameters")
        check_finite(self.model)
        return StreamedTensors(self.specs(), (tensor for _, tensor in gathered_parameters(self.model)), self.device)

    def adapter(self) -> list[tuple[str, Tensor]]:
        """(rank 0) A LoRA adapter's tensors, whole, as apmpo.learner.lora.adapter_tensors names them: under ZeRO-3
        all of its trainable parameters gathered at once (an adapter is a small fraction of the model)."""
        from apmpo.learner.lora import adapter_tensors

        if not self.partitioned:
            return adapter_tensors(self.model)
        self._announce("adapter")
        return adapter_tensors(self.model, dict(self._gathered_trainable(keep=True)))

    def _gathered_trainable(self, keep: bool) -> list[tuple[str, Tensor]]:
        import deepspeed

        trainable = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters([p for _, p in trainable]):
            return [(name, p.data.clone() if keep else p) for name, p in trainable]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def export_state(self) -> dict[str, Tensor] | None:
        """(rank 0) The state dict to export: gathered, on CPU, under ZeRO-3; None where the module's own is whole."""
        if not self.partitioned:
            return None
        self._announce("state_dict")
        return consolidated_state_dict(self.engine)

    def settle(self) -> None:
        """Rank 0: its reads are over. Other ranks: join rank 0's reads until then."""
        if not self.collective:
            return
        if self.rank == 0:
            self._announce(None)
            return
        while (read := self._receive()) is not None:
            if read == "parameters":
                check_finite(self.model)
                for _ in gathered_parameters(self.model, keep=False):
                    pass
            elif read == "adapter":
                self._gathered_trainable(keep=False)
            else:
                consolidated_state_dict(self.engine)

    def _announce(self, read: str | None) -> None:
        if self.collective:
            torch_dist.broadcast_object_list([read], src=0)

    def _receive(self) -> str | None:
        message = [None]
        torch_dist.broadcast_object_list(message, src=0)
        return message[0]
