"""The pieces of a training step's update that `train_on_batch` (step.py) calls on every rank: log-probs of a
micro-batch, rollout-correction weights against the engine, and the step's metric sums (one all-reduce at the end)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as torch_dist
from torch import Tensor

from apmpo.config import Config, CorrectionConfig
from apmpo.learner.batching import MicroBatch
from apmpo.learner.engine import head_dtype
from apmpo.learner.logprobs import token_logprobs

# Each micro-batch holds a part of its optimiser step's loss: these add up, the other metrics are token means.
ADDITIVE = ("loss/total", "loss/policy", "loss/kl")


def logprobs(model, mb: MicroBatch, cfg: Config, device, packed: bool, with_entropy: bool = False):
    """`packed`: the step's decision (train_on_batch), which its plan of micro-batches was made for."""
    return token_logprobs(model, mb.input_ids.to(device), mb.attention_mask.to(device), mb.loss_mask.to(device),
                          temperature=cfg.rollout.temperature, chunk_tokens=cfg.train.logprob_chunk_tokens,
                          with_entropy=with_entropy, share_prompts=packed, head_dtype=head_dtype(cfg),
                          **{k: v.to(device) for k, v in mb.extras.items()})


class Mismatch(NamedTuple):
    """Engine vs learner on one micro-batch's rows, detached. The ratio is r = pi_old / pi_engine on the engine's
    samples, so k1 = -log r and k3 = r - 1 - log r estimate KL(pi_engine || pi_old)."""

    kl_k1: Tensor  # token means
    kl_k3: Tensor
    ratio_min: Tensor  # over the level's units (tokens or sequences), before truncation or masking
    ratio_max: Tensor
    truncated_frac: Tensor | None  # share of the level's units with r > tis_cap (mode tis)
    masked_frac: Tensor | None  # share of the level's units outside [mis_low, mis_high] (mode mis)


def importance_weights(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, cfg: CorrectionConfig
                       ) -> tuple[Tensor | None, Mismatch]:
    """Rollout-correction weights and the mismatch between the learner's old policy and the engine that sampled.

    old_logp, engine_logp, mask: [N, T]. Level sequence: r_i = exp(mean_t(log pi_old - log pi_engine)), the
    geometric mean of the token ratios, and the weights [N] multiply the advantages; level token: r_t, weights
    [N, T] for policy_loss(token_weights=). tis: w = min(r, tis_cap); mis: w = 1 for r in [mis_low, mis_high],
    else 0. Mode off: no weights (None); the mismatch is measured all the same."""
    log_ratio = (old_logp - engine_logp) * mask  # 0 off the mask
    maskf = mask.to(log_ratio.dtype)
    n_tokens = maskf.sum()
    if cfg.level == "sequence":
        ratio, units = torch.exp(log_ratio.sum(-1) / mask.sum(-1)), torch.ones_like(maskf[:, 0])
    else:
        ratio, units = torch.exp(log_ratio), maskf
    in_range = ((ratio >= cfg.mis_low) & (ratio <= cfg.mis_high)).to(ratio.dtype)
    weights = ratio.clamp(max=cfg.tis_cap) if cfg.mode == "tis" else in_range if cfg.mode == "mis" else None

    def unit_mean(x: Tensor) -> Tensor:
        return (x.to(units.dtype) * units).sum() / units.sum()

    with torch.no_grad():
        mismatch = Mismatch(
            kl_k1=-log_ratio.sum() / n_tokens,
            kl_k3=((torch.expm1(log_ratio) - log_ratio) * maskf).sum() / n_tokens,
            ratio_min=torch.where(units > 0, ratio, math.inf).amin(),
            ratio_max=torch.where(units > 0, ratio, -math.inf).amax(),
            truncated_frac=unit_mean(ratio > cfg.tis_cap) if cfg.mode == "tis" else None,
            masked_frac=unit_mean(1 - in_range) if cfg.mode == "mis" else None)
    return weights, mismatch


def rollout_correction(mb: MicroBatch, cfg: CorrectionConfig, totals: "StepTotals", device
                       ) -> tuple[Tensor, Tensor | None]:
    """The micro-batch's advantages and token weights for policy_loss under `cfg` (sequence-level weights are
    folded into the advantages), after adding its mismatch to `totals`."""
    mask = mb.loss_mask.to(device)
    weights, mismatch = importance_weights(mb.old_logp, mb.engine_logp.to(device), mask, cfg)
    totals.add_mismatch(mismatch, mb, cfg.level)
    advantages = mb.advantages.to(device)
    if weights is None:
        return advantages, None
    return (advantages * weights, None) if cfg.level == "sequence" else (advantages, weights)


@dataclass
class StepTotals:
    """This rank's metric sums over one training step; `reduce` all-reduces them once, at the end.

    sums[key]: a weighted sum (key in `tokens`: reported as the mean over its count, tokens or sequences) or, for
    ADDITIVE keys, the sum of the loss parts (reported per optimiser step). maxima and minima: extremes, reduced
    by a max over ranks (a minimum as -max(-x)). Values stay on the device: no host sync per micro-batch.
    """

    sums: dict[str, Tensor] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, Tensor] = field(default_factory=dict)
    minima: dict[str, Tensor] = field(default_factory=dict)

    def add(self, metrics: dict[str, Tensor], mb: MicroBatch) -> None:
        """One micro-batch's loss metrics (token means over its rows; ADDITIVE ones its part of the loss)."""
        tokens = float(mb.loss_mask.sum()) * mb.weight  # 0 for the dummy micro-batches that keep ranks in step
        for key, value in metrics.items():
            self._add(key, value * (mb.weight if key in ADDITIVE else tokens), None if key in ADDITIVE else tokens)

    def add_entropy(self, entropy: Tensor, mb: MicroBatch, device) -> None:
        self._add("policy/entropy", (entropy * mb.loss_mask.to(device)).sum() * mb.weight,
                  float(mb.loss_mask.sum()) * mb.weight)

    def add_mismatch(self, m: Mismatch, mb: MicroBatch, level: str) -> None:
        """`importance_weights`' mismatch: KL as token means, fractions as means over the level's units."""
        tokens = float(mb.loss_mask.sum()) * mb.weight
        units = tokens if level == "token" else mb.loss_mask.shape[0] * mb.weight
        self._add("rollout/mismatch_kl_k1", m.kl_k1 * tokens, tokens)
        self._add("rollout/mismatch_kl_k3", m.kl_k3 * tokens, tokens)
        for key, frac in (("rollout/truncated_frac", m.truncated_frac), ("rollout/masked_frac", m.masked_frac)):
            if frac is not None:
                self._add(key, frac * units, units)
        # A dummy micro-batch (weight 0) adds the neutral element: every rank must hold the same keys.
        high = m.ratio_max if mb.weight else torch.full_like(m.ratio_max, -math.inf)
        low = m.ratio_min if mb.weight else torch.full_like(m.ratio_min, math.inf)
        self.maxima["rollout/is_ratio_max"] = torch.maximum(self.maxima.get("rollout/is_ratio_max", high), high)
        self.minima["rollout/is_ratio_min"] = torch.minimum(self.minima.get("rollout/is_ratio_min", low), low)

    def _add(self, key: str, value: Tensor, tokens: float | None) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value
        if tokens is not None:
            self.tokens[key] = self.tokens.get(key, 0.0) + tokens

    def reduce(self, device, world_size: int, optimizer_steps: int) -> dict[str, float]:
        """Means over all ranks: token means, and the loss per optimiser step."""
        keys = sorted(self.sums)
        if not keys:  # no optimiser step this time (every completion masked): nothing was added, on any rank
            return self._reduce_extremes(device, world_size)
        values = torch.stack([torch.as_tensor(self.sums[k], dtype=torch.float32, device=device) for k in keys]
                             + [torch.tensor(self.tokens.get(k, 0.0), dtype=torch.float32, device=device) for k in keys])
        if world_size > 1:
            torch_dist.all_reduce(values)
        sums, tokens = values[: len(keys)].tolist(), values[len(keys):].tolist()
        # DeepSpeed averages gradients over ranks, so each rank's loss part is scaled by world_size: undo it. A mean
        # over no tokens (a step whose every group scored alike runs only dummy micro-batches) is left out, not 0:
        # a p or an entropy of 0 would be plotted as if measured.
        out = {k: s / (max(optimizer_steps, 1) * world_size) if k in ADDITIVE else s / t
               for k, s, t in zip(keys, sums, tokens) if k in ADDITIVE or t > 0}
        return {**out, **self._reduce_extremes(device, world_size)}

    def _reduce_extremes(self, device, world_size: int) -> dict[str, float]:
        high, low = sorted(self.maxima), sorted(self.minima)
        if not high + low:
            return {}
        values = torch.stack([self.maxima[k].float().to(device) for k in high]
                             + [-self.minima[k].float().to(device) for k in low])
        if world_size > 1:
            torch_dist.all_reduce(values, op=torch_dist.ReduceOp.MAX)
        values = values.tolist()
        out = {**dict(zip(high, values[: len(high)])), **{k: -v for k, v in zip(low, values[len(high):])}}
        return {k: v for k, v in out.items() if math.isfinite(v)}  # +-inf: only dummy micro-batches, nothing seen
