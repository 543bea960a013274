"""The pieces of a training step's update that launch/train.py's loop calls on every rank: log-probs of a
micro-batch, truncated importance weights, and the step's metric sums (one all-reduce at the end)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as torch_dist
from torch import Tensor

from apmpo.config import Config
from apmpo.learner.batching import MicroBatch
from apmpo.learner.logprobs import token_logprobs

# Each micro-batch holds a part of its optimiser step's loss: these add up, the other metrics are token means.
ADDITIVE = ("loss/total", "loss/policy", "loss/kl")


def logprobs(model, mb: MicroBatch, cfg: Config, device, with_entropy: bool = False):
    return token_logprobs(model, mb.input_ids.to(device), mb.attention_mask.to(device), mb.loss_mask.to(device),
                          temperature=cfg.rollout.temperature, chunk_tokens=cfg.train.logprob_chunk_tokens,
                          with_entropy=with_entropy, **{k: v.to(device) for k, v in mb.extras.items()})


def truncated_importance_weights(mb: MicroBatch, cap: float, device) -> Tensor:
    """Sequence-level truncated importance sampling against the generation engine: the learner's old policy
    and the engine differ numerically (and by a step in async set-ups). w_i = min(exp(mean_t(log pi_old -
    log pi_engine)), cap), the geometric mean of the per-token ratios, applied to the advantage so it fits
    every loss alike (a per-token weight has no meaning inside APMPO's power mean)."""
    mask = mb.loss_mask.to(device)
    log_ratio = ((mb.old_logp - mb.engine_logp.to(device)) * mask).sum(-1) / mask.sum(-1)
    return torch.exp(log_ratio).clamp(max=cap)


@dataclass
class StepTotals:
    """This rank's metric sums over one training step; `reduce` all-reduces them once, at the end.

    sums[key]: a token-weighted sum (key in `tokens`: reported as the token mean) or, for ADDITIVE keys, the
    sum of the loss parts (reported per optimiser step). Values stay on the device: no host sync per micro-batch.
    """

    sums: dict[str, Tensor] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)

    def add(self, metrics: dict[str, Tensor], mb: MicroBatch) -> None:
        """One micro-batch's loss metrics (token means over its rows; ADDITIVE ones its part of the loss)."""
        tokens = float(mb.loss_mask.sum()) * mb.weight  # 0 for the dummy micro-batches that keep ranks in step
        for key, value in metrics.items():
            self._add(key, value * (mb.weight if key in ADDITIVE else tokens), None if key in ADDITIVE else tokens)

    def add_entropy(self, entropy: Tensor, mb: MicroBatch, device) -> None:
        self._add("policy/entropy", (entropy * mb.loss_mask.to(device)).sum() * mb.weight,
                  float(mb.loss_mask.sum()) * mb.weight)

    def _add(self, key: str, value: Tensor, tokens: float | None) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value
        if tokens is not None:
            self.tokens[key] = self.tokens.get(key, 0.0) + tokens

    def reduce(self, device, world_size: int, optimizer_steps: int) -> dict[str, float]:
        """Means over all ranks: token means, and the loss per optimiser step."""
        keys = sorted(self.sums)
        values = torch.stack([torch.as_tensor(self.sums[k], dtype=torch.float32, device=device) for k in keys]
                             + [torch.tensor(self.tokens.get(k, 0.0), dtype=torch.float32, device=device) for k in keys])
        if world_size > 1:
            torch_dist.all_reduce(values)
        sums, tokens = values[: len(keys)].tolist(), values[len(keys):].tolist()
        # DeepSpeed averages gradients over ranks, so each rank's loss part is scaled by world_size: undo it.
        return {k: s / (max(optimizer_steps, 1) * world_size) if k in ADDITIVE else s / max(t, 1e-12)
                for k, s, t in zip(keys, sums, tokens)}
