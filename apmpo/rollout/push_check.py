"""What a push must hold, checked on the server before anything is loaded (apmpo/rollout/engine.py): the tensors the
learner declares in its buckets (apmpo.rollout.weight_sync, which carries them) against the served model, every
parameter by its HF name, shape and the engine's dtype, or a LoRA adapter's layers at its rank. A push that does not
fit raises BadPush naming the first tensor at fault, which the server answers with 400."""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Iterator

import torch

from apmpo.rollout.weight_sync import PEFT_PREFIX, Bucket, TensorSpec

# An adapter's tensor name: the layer's name in the HF model, then which half of the update B A.
ADAPTER_TENSOR = re.compile(re.escape(PEFT_PREFIX) + r"(.+)\.lora_([AB])\.weight")


class BadPush(ValueError):
    """A push that does not fit the served model; the message names the first tensor at fault."""


@dataclass(frozen=True)
class ExpectedWeights:
    """What a push must hold: every parameter of the served model as the learner's HF model names it
    (`named_parameters()`), with its shape, in the engine's dtype. Checked before anything is loaded: vLLM's
    loader fails only partway (the served model then a mix of old and new layers), or not at all (a tensor of
    half the size once loaded, and the compiled CPU model then read past its end and crashed the server)."""

    shapes: dict[str, tuple[int, ...]]  # every parameter, tied aliases included
    optional: frozenset[str]  # tied aliases that named_parameters() omits (lm_head.weight): allowed, not required
    dtype: str  # the engine's: the learner casts floating tensors to it

    @classmethod
    def of_model(cls, model: str, dtype: str) -> ExpectedWeights:
        """`model`'s parameters from its config alone (a model on the meta device: no weights are read), built
        by the class the learner trains (apmpo.learner.engine.load_model)."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        from apmpo.data.vision import is_vision_language

        auto = AutoModelForImageTextToText if is_vision_language(model) else AutoModelForCausalLM
        with torch.device("meta"):
            hf = auto.from_config(AutoConfig.from_pretrained(model))
        required = {name for name, _ in hf.named_parameters()}
        shapes = {name: tuple(p.shape) for name, p in hf.named_parameters(remove_duplicate=False)}
        return cls(shapes, frozenset(shapes.keys() - required), dtype)

    def check(self, buckets: list[Bucket]) -> None:
        """Raises BadPush naming the first tensor that does not belong in a full push of this model, or the first
        parameter it lacks."""
        seen: set[str] = set()
        for spec in self._declared(buckets):
            name = spec.name
            seen.add(name)
            if name not in self.shapes:
                near = difflib.get_close_matches(name, list(self.shapes), n=1)
                raise BadPush(f"tensor {name!r} is not a parameter of the served model"
                              + (f" (did you mean {near[0]!r}?)" if near else ""))
            if tuple(spec.shape) != self.shapes[name]:
                raise BadPush(f"tensor {name!r} has shape {list(spec.shape)}; the served model's is "
                              f"{list(self.shapes[name])}")
        missing = [name for name in self.shapes if name not in seen and name not in self.optional]
        if missing:
            raise BadPush(f"a partial push: {len(missing)} of the served model's "
                          f"{len(self.shapes) - len(self.optional)} parameters are missing, the first {missing[0]!r}; "
                          "a push must hold every parameter")

    def check_adapter(self, buckets: list[Bucket], config: dict, max_rank: int) -> None:
        """Raises BadPush naming the first tensor that does not belong in a LoRA adapter of this model with
        `config` (adapter_config.json as a dict), as PEFT's save_pretrained writes one: each tensor is
        `base_model.model.<layer>.lora_A.weight` [r, in] or `.lora_B.weight` [out, r] of a 2-D weight
        `<layer>.weight` [out, in] of the served model, r is the config's, and every layer has both."""
        rank = config.get("r")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= max_rank:  # true is not rank 1
            raise BadPush(f"the adapter's rank r={rank!r} must be an integer in [1, {max_rank}] (the server's "
                          "--max-lora-rank)")
        if config.get("rank_pattern") or config.get("alpha_pattern"):
            raise BadPush("an adapter with a rank_pattern or alpha_pattern is not checked here: load its folder "
                          "(POST /lora/load)")
        halves: dict[str, set[str]] = {}
        for spec in self._declared(buckets):
            match = ADAPTER_TENSOR.fullmatch(spec.name)
            weight = self.shapes.get(f"{match[1]}.weight") if match else None
            if weight is None or len(weight) != 2:
                raise BadPush(f"tensor {spec.name!r} is not a LoRA tensor of the served model (expected "
                              f"'{PEFT_PREFIX}<a linear layer>.lora_A.weight' or '.lora_B.weight')")
            out_features, in_features = weight
            shape = (rank, in_features) if match[2] == "A" else (out_features, rank)
            if tuple(spec.shape) != shape:
                raise BadPush(f"tensor {spec.name!r} has shape {list(spec.shape)}; with r={rank} it must be "
                              f"{list(shape)}")
            halves.setdefault(match[1], set()).add(match[2])
        if not halves:
            raise BadPush("an adapter push holds no tensors")
        lacking = next((layer for layer, found in halves.items() if found != {"A", "B"}), None)
        if lacking is not None:
            half = "B" if "A" in halves[lacking] else "A"
            raise BadPush(f"'{PEFT_PREFIX}{lacking}.lora_{half}.weight' is missing: the adapter's layers need "
                          "both halves")

    def _declared(self, buckets: list[Bucket]) -> Iterator[TensorSpec]:
        """Every declared tensor, after the checks that any push passes: declared once, in the engine's dtype,
        inside its bucket."""
        seen: set[str] = set()
        for bucket in buckets:
            for spec in bucket.tensors:
                if spec.name in seen:
                    raise BadPush(f"tensor {spec.name!r} is declared twice")
                seen.add(spec.name)
                if spec.dtype != self.dtype:
                    raise BadPush(f"tensor {spec.name!r} has dtype {spec.dtype}; the engine's is {self.dtype}")
                if spec.offset + spec.nbytes > bucket.nbytes:
                    raise BadPush(f"tensor {spec.name!r} ends past its bucket's {bucket.nbytes} bytes")
                yield spec
