"""Policy losses of APMPO and its baselines (GRPO, DAPO, GMPO, Dr. GRPO, GSPO), as pure functions.

    from apmpo.loss import LossConfig, adaptive_params, advantages_for, policy_loss

    cfg = LossConfig(name="apmpo")                     # or any name in POLICY_LOSSES; paper defaults built in
    advantages = advantages_for(rewards, cfg)          # rewards [B, G] -> [B, G], the loss's advantage rule
    params = adaptive_params(rewards, cfg)             # p, FSS, eps_ada from the step's reward statistics
    loss, metrics = policy_loss(logp, old_logp, advantages.flatten(), mask, cfg, params)

The formulas are those of docs/SPEC.md (APMPO paper, contradictions resolved), and of the Dr. GRPO
(Liu et al. 2025) and GSPO (Zheng et al. 2025) papers. Three concerns are kept apart, each one small function:

1. the per-token objective: the sign-aware clip of the log-ratio (`clip_bounds`, applied in `_clip`);
2. how tokens become a sequence value: the power mean in log space (`power_mean`);
3. how values are reduced over sequences and tokens, with global normalisers (`_reduce`).

`POLICY_LOSSES` is the one place that knows a loss: one `PolicyLoss` entry holds its function, its rules
for p and eps_ada, its advantage rule and its clip defaults. Adding a loss is a function and an entry.

Rollout correction (decoupled PPO, as AReaL). Three policies meet in a step: the engine's, which sampled the
tokens (behaviour, log-probs `engine_logp`); the learner's weights before this update, recomputed (the proximal
"old" policy of the ratio r and its clip); and the one being trained. The gap between the first two (the engine's
bf16 numerics, or a stale weight version) is corrected by importance weights w = pi_old / pi_engine, truncated
(`tis`) or masked (`mis`) by the learner (apmpo/learner/update.py), detached, and applied here:

- per sequence: the weight multiplies the sequence's advantage, the same for every loss;
- per token (`policy_loss(token_weights=w)`): w_t multiplies token t's clipped ratio rho'_t before tokens become
  the sequence value. GRPO, DAPO and Dr. GRPO take w_t * min(r A, clip(r) A), the decoupled-PPO token term.
  APMPO and GMPO take the power mean of x_t = w_t rho'_t, in log space log x_t = log rho'_t + log w_t: the
  weight corrects each token's own ratio, which is the sampled quantity, and the power mean then aggregates
  corrected ratios as it aggregates uncorrected ones. p = 1 is then exactly the token-level decoupled form of
  GRPO, and p = 0 the geometric one, M_0(w rho') = M_0(w) M_0(rho'): the sequence-level weight (geometric mean
  of the token weights) times the sequence ratio. A weight applied to M_p after the mean would instead give
  every token the same weight whatever p, and p = 1 would not reduce to the token-level form. GSPO's sequence
  ratio is geometric too: the mean of log w_t is added to its log-ratio after the sequence clip.
- w = 0 (masked) drops a token: in a sum (GRPO, DAPO, Dr. GRPO) its term is 0 and the sequence's 1/|o_i| stays;
  in a power mean (APMPO, GMPO, GSPO) it leaves the mean, taken over the sequence's kept tokens, since x_t = 0
  would make M_p zero for p <= 0 and so mask the whole sequence; a sequence with no kept token contributes 0.
  The global normalisers (num_seqs, num_tokens, token_budget) stay those of the plan, masked or not.

Everything runs in fp32 whatever the input dtype, with no Python loop over tokens or sequences, and no
host synchronisation except where documented (`power_mean` inspects `p` on the host when it is a CPU
tensor, which `adaptive_params` returns because rewards live on the CPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Callable, Literal

import torch
from torch import Tensor

__all__ = [
    "LossConfig",
    "AdaptiveParams",
    "adaptive_params",
    "group_advantages",
    "advantages_for",
    "power_mean",
    "policy_loss",
    "kl_penalty",
    "PolicyLoss",
    "POLICY_LOSSES",
]

# Below this |p| the power mean uses its cumulant series (exact to O(p^3)) instead of dividing by p.
SMALL_P = 1e-3


def _upcast(x: Tensor) -> Tensor:
    """At least fp32: bf16/fp16 inputs are computed in fp32, fp64 stays fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


@dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of the policy loss. Defaults are the papers' (SPEC.md §2-4; per loss: `POLICY_LOSSES`)."""

    # Each number declares its range as apmpo.config reads it, {"range": "[lo, hi]"} in the field's metadata.
    name: str = "apmpo"  # a key of POLICY_LOSSES
    # fixed lower clip: ratio >= 1 - eps_low (all but gmpo); None: the loss's default
    eps_low: float | None = field(default=None, metadata={"range": "[0, 1)"})
    # fixed upper clip (dapo 0.28, gspo 4e-4); apmpo uses it when fac=False
    eps_high: float | None = field(default=None, metadata={"range": "[0, 100]"})
    # FAC: eps_ada = eps_min + (eps_max - eps_min) * tanh(FSS)
    eps_min: float = field(default=0.2, metadata={"range": "[0, 100]"})
    eps_max: float = field(default=0.4, metadata={"range": "[0, 100]"})
    # PMPO: p = exp(-gamma * mu_R)  (or 1 - gamma * mu_R for p_schedule="linear")
    gamma: float = field(default=0.8, metadata={"range": "[0, 100]"})
    # added to standard deviations (advantages and FSS)
    delta: float = field(default=1e-6, metadata={"range": "(0, 1]"})
    p_schedule: Literal["exp", "linear"] = "exp"
    fss: Literal["full", "mu_only", "sigma_only"] = "full"  # FSS = mu/(sigma+delta) | mu | 1/(sigma+delta)
    clip_mode: Literal["asymmetric", "symmetric"] = "asymmetric"  # symmetric: clip(r, 1-eps_ada, 1+eps_ada)
    stats_scope: Literal["batch", "group"] = "batch"  # mu_R, sigma_R over the step's batch, or per prompt
    fac: bool = True  # adaptive upper clip; False: eps_high (name="apmpo", fac=False is PMPO alone)
    pmpo: bool = True  # adaptive power mean; False: p = 1 (name="apmpo", pmpo=False is GRPO+FAC)
    # GMPO clips the log-ratio to [-gmpo_clip, gmpo_clip], sign-aware
    gmpo_clip: float = field(default=0.4, metadata={"range": "(0, 100]"})
    # weight of KL(pi_theta || pi_ref); 0 means no reference model at all
    kl_beta: float = field(default=0.001, metadata={"range": "[0, 100]"})
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    # Dr. GRPO's constant: its loss is the sum of all token terms / (num_seqs * token_budget). Set it to the
    # generation budget (rollout.max_tokens), as TRL divides by max_completion_length.
    token_budget: int | None = field(default=None, metadata={"range": "[1, 2**24]"})

    def __post_init__(self):
        if self.name not in POLICY_LOSSES:
            raise ValueError(f"loss.name must be one of {list(POLICY_LOSSES)}, got {self.name!r}")
        entry = POLICY_LOSSES[self.name]
        for f in fields(self):  # NaN passes every comparison below: kl_beta=nan would turn the KL term off
            if isinstance(getattr(self, f.name), float) and not math.isfinite(getattr(self, f.name)):
                raise ValueError(f"loss.{f.name} must be finite, got {getattr(self, f.name)}")
        for key in ("eps_low", "eps_high"):  # the loss's own defaults
            if getattr(self, key) is None:
                object.__setattr__(self, key, getattr(entry, key))
        if entry.needs_token_budget and (self.token_budget is None or self.token_budget <= 0):
            raise ValueError(f"loss.name={self.name!r} needs loss.token_budget > 0 (the generation budget per "
                             f"sequence, e.g. rollout.max_tokens), got {self.token_budget}")
        choices = {
            "p_schedule": ("exp", "linear"),
            "fss": ("full", "mu_only", "sigma_only"),
            "clip_mode": ("asymmetric", "symmetric"),
            "stats_scope": ("batch", "group"),
            "kl_estimator": ("k1", "k2", "k3"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"LossConfig.{key}={getattr(self, key)!r}; expected one of {sorted(allowed)}")
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"LossConfig.eps_low={self.eps_low} must be in [0, 1)")
        if not 0 <= self.eps_min <= self.eps_max:
            raise ValueError(f"LossConfig needs 0 <= eps_min <= eps_max, got {self.eps_min}, {self.eps_max}")
        if self.clip_mode == "symmetric" and self.eps_max >= 1:
            raise ValueError(f"clip_mode='symmetric' needs eps_max < 1, got {self.eps_max}")
        if self.delta <= 0 or self.kl_beta < 0:
            raise ValueError("LossConfig needs delta > 0 and kl_beta >= 0")


@dataclass(frozen=True)
class AdaptiveParams:
    """The step's reward statistics and what APMPO derives from them.

    Each field is a 0-d fp32 tensor (stats_scope="batch") or shape [B] (stats_scope="group", one per prompt).
    `policy_loss` takes 0-d fields or fields of shape [N], one per sequence: see `per_sequence`.
    """

    p: Tensor  # power of the mean: 1 arithmetic (GRPO), 0 geometric (GMPO)
    eps_ada: Tensor  # upper clip: ratio <= 1 + eps_ada
    fss: Tensor  # feedback stability score
    mu: Tensor  # mean reward
    sigma: Tensor  # population standard deviation of the rewards

    def per_sequence(self, group_index: Tensor) -> "AdaptiveParams":
        """Per-prompt fields indexed to per-sequence ones: `group_index[i]` is the prompt of sequence i."""
        if self.p.dim() == 0:
            return self
        return AdaptiveParams(*(getattr(self, f.name)[group_index] for f in fields(self)))


def group_advantages(rewards: Tensor, delta: float = 1e-6, std: bool = True) -> Tensor:
    """A_i = (R_i - mean_g R) / (std_g R + delta) within each group; all-equal groups get exactly 0.

    rewards: [B, G] (B prompts x G samples). Population std. Returns fp32 [B, G].
    std=False: A_i = R_i - mean_g R, Dr. GRPO's advantage (no division by the group's std).
    """
    _check_rewards(rewards)
    r = rewards.float()
    centred = r - r.mean(dim=1, keepdim=True)
    if std:
        centred = centred / (r.std(dim=1, unbiased=False, keepdim=True) + delta)
    # An all-equal group can round to a tiny non-zero R - mean, which delta would blow up: force 0.
    all_equal = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(r), centred)


def advantages_for(rewards: Tensor, cfg: LossConfig) -> Tensor:
    """The group advantages [B, G] that cfg's loss trains on (std-normalised or not, see `PolicyLoss`)."""
    return group_advantages(rewards, cfg.delta, POLICY_LOSSES[cfg.name].std_advantages)


def adaptive_params(rewards: Tensor, cfg: LossConfig) -> AdaptiveParams:
    """p, FSS and eps_ada (SPEC §2) from the step's rewards [B, G], by the rules of cfg's `PolicyLoss`.

    Batch scope reduces over all B*G rewards: pass the rewards of every data-parallel rank, so all ranks
    derive the same numbers. For the fixed-rule losses, p and eps_ada report what those losses use (p=1 for
    the arithmetic mean, p=0 for the geometric one of GMPO and GSPO; their fixed upper clip).
    """
    _check_rewards(rewards)
    r = rewards.float().detach()
    dims = (0, 1) if cfg.stats_scope == "batch" else (1,)
    mu = r.mean(dim=dims)
    sigma = r.std(dim=dims, unbiased=False)

    if cfg.fss == "full":
        fss = mu / (sigma + cfg.delta)
    elif cfg.fss == "mu_only":
        fss = mu
    else:
        fss = 1.0 / (sigma + cfg.delta)

    entry = POLICY_LOSSES[cfg.name]
    p, eps_ada = entry.p(mu, cfg), entry.eps(fss, cfg)
    return AdaptiveParams(p=_like(p, mu), eps_ada=_like(eps_ada, mu), fss=fss, mu=mu, sigma=sigma)


def _like(value: Tensor | float, mu: Tensor) -> Tensor:
    """A rule's value as a tensor of mu's shape: fixed rules return a float."""
    return value if isinstance(value, Tensor) else torch.full_like(mu, value)


# The rules for p (from mu_R) and eps_ada (from FSS): APMPO's adaptive ones, which its ablation switches turn
# into fixed ones, and the fixed ones of the baselines.


def _pmpo_p(mu: Tensor, cfg: LossConfig) -> Tensor | float:
    if not cfg.pmpo:
        return 1.0
    return torch.exp(-cfg.gamma * mu) if cfg.p_schedule == "exp" else 1.0 - cfg.gamma * mu


def _fac_eps(fss: Tensor, cfg: LossConfig) -> Tensor | float:
    return cfg.eps_min + (cfg.eps_max - cfg.eps_min) * torch.tanh(fss) if cfg.fac else cfg.eps_high


def _arithmetic(mu: Tensor, cfg: LossConfig) -> float:
    return 1.0


def _geometric(mu: Tensor, cfg: LossConfig) -> float:
    return 0.0


def _fixed_eps(fss: Tensor, cfg: LossConfig) -> float:
    return cfg.eps_high


def _gmpo_eps(fss: Tensor, cfg: LossConfig) -> float:
    return math.expm1(cfg.gmpo_clip)  # the ratio bound of GMPO's log-space clip


# --------------------------------------------------------------------------- per-token objective


def clip_bounds(advantages: Tensor, log_lo: Tensor | float, log_hi: Tensor | float) -> tuple[Tensor, Tensor]:
    """Per-row bounds [N, 1] that turn one clamp into PPO's pessimistic, sign-aware clip.

    min(r A, clip(r, lo, hi) A) = A * rho' with log rho' = min(l, log_hi) for A > 0 and max(l, log_lo) for A < 0.
    A = 0 rows are pinned to 0 (they contribute nothing and no gradient). log_lo/log_hi: float, 0-d or [N, 1].
    """
    a = advantages.unsqueeze(-1)
    lo = torch.where(a > 0, -math.inf, torch.where(a < 0, _filled(log_lo, a), 0.0))
    hi = torch.where(a < 0, math.inf, torch.where(a > 0, _filled(log_hi, a), 0.0))
    return lo, hi


def _filled(value: Tensor | float, like: Tensor) -> Tensor:
    """A float as a 0-d tensor like `like`, filled where it lives: copying it there from the host would make
    the host wait, on a GPU, for every kernel queued before the copy."""
    return value if isinstance(value, Tensor) else torch.full((), value, dtype=like.dtype, device=like.device)


def _per_row(value: Tensor, like: Tensor) -> Tensor | float:
    """A step parameter (0-d or [N]) to combine with the [N, T] `like`: a 0-d one on the host as a float, which
    kernels take as an argument; otherwise [N, 1] (or [1, 1]) on like's device, copied without waiting for the
    kernels queued before it (a blocking copy to a GPU would)."""
    if value.dim() == 0 and value.device.type == "cpu":
        return value.item()
    return value.to(like.device, like.dtype, non_blocking=True).reshape(-1, 1)


# --------------------------------------------------------------------------- tokens -> sequence value


def masked_row_sum(x: Tensor, maskf: Tensor) -> Tensor:
    """sum_t x[n, t] * mask[n, t] as one fused reduction, without materialising the product."""
    return torch.einsum("nt,nt->n", x, maskf)


class _LogPowerMeanExact(torch.autograd.Function):
    """log M_p for |p| >= SMALL_P: (s + log1p(mean_t expm1(p l_t - s))) / p, s = max_t p l_t.

    The shift s prevents overflow for any sign and size of p; expm1/log1p keep the relative precision of
    the small deviations, so the division by p does not amplify rounding. The backward is the closed form
    d log M_p / d l_t = softmax_t(p l_t) over the masked tokens (Appendix H's weights), reusing the forward's
    exponentials in place instead of storing autograd's intermediates.
    """

    @staticmethod
    def forward(ctx, log_x, maskf, p):
        u = log_x * p  # p: a float or [N, 1]
        u.masked_fill_(maskf == 0, -math.inf)
        s = u.amax(dim=-1, keepdim=True)
        e = u.sub_(s).expm1_()  # -1 exactly on padding
        n = maskf.sum(-1, keepdim=True)
        mean_expm1 = masked_row_sum(e, maskf).unsqueeze(-1) / n
        log_m = (s + torch.log1p(mean_expm1)) / p
        ctx.save_for_backward(e, n * (1 + mean_expm1))  # e + 1 = exp(p l - s), 0 on padding
        return log_m.squeeze(-1)

    @staticmethod
    def backward(ctx, grad_log_m):
        e, denominator = ctx.saved_tensors
        weights = (e + 1).mul_(grad_log_m.unsqueeze(-1) / denominator)
        return weights, None, None


def power_mean(log_x: Tensor, mask: Tensor, p: Tensor | float) -> Tensor:
    """log M_p(x) per row, with M_p(x) = ((1/n) sum_t x_t^p)^(1/p) over the masked entries, from log x.

    log_x, mask: [N, T]; p: float, 0-d or [N]. Returns [N] in fp32 (fp64 for fp64 input).
    Any real p works, negative ones included. For |p| < SMALL_P the cumulant series
    m + p var/2 + p^2 k3/6 (m, var, k3: mean, variance, third central moment of log x) is used instead; it is
    exact as p -> 0 (the geometric mean), and value and gradient are continuous across the threshold.
    """
    log_x = _upcast(log_x)
    maskf = mask.to(log_x.dtype)
    if not isinstance(p, Tensor) or (p.dim() == 0 and p.device.type == "cpu"):
        p = float(p)  # one p for every row, passed to the kernels as an argument: one branch
        return _log_power_mean_series(log_x, maskf, p) if abs(p) < SMALL_P else _LogPowerMeanExact.apply(
            log_x, maskf, p)
    # One p per row. Evaluate only the branches some row needs: p comes from rewards on the CPU, so this check
    # costs no device sync; a p already on an accelerator takes both branches rather than syncing.
    small = p.abs() < SMALL_P
    on_host = p.device.type == "cpu"
    need_series = bool(small.any()) if on_host else True
    need_exact = bool((~small).any()) if on_host else True
    p = _per_row(p, log_x)  # [N, 1] in log_x's dtype, on its device
    if not need_series:
        return _LogPowerMeanExact.apply(log_x, maskf, p)
    series = _log_power_mean_series(log_x, maskf, p)
    if not need_exact:
        return series
    small = p.abs() < SMALL_P
    exact = _LogPowerMeanExact.apply(log_x, maskf, torch.where(small, SMALL_P, p))
    return torch.where(small.squeeze(-1), series, exact)


def _log_power_mean_series(log_x: Tensor, maskf: Tensor, p: Tensor | float) -> Tensor:
    """log M_p for |p| < SMALL_P: the cumulant series m + p var/2 + p^2 k3/6 (see power_mean)."""
    n = maskf.sum(-1, keepdim=True)
    m = masked_row_sum(log_x, maskf).unsqueeze(-1) / n
    d = (log_x - m) * maskf
    d2 = d * d
    var = d2.sum(-1, keepdim=True) / n
    k3 = (d2 * d).sum(-1, keepdim=True) / n
    return (m + p * var / 2 + p * p * k3 / 6).squeeze(-1)


# --------------------------------------------------------------------------- reductions


def _reduce(values: Tensor, normalizer: Tensor | float | None, default: Tensor | float) -> Tensor:
    """sum(values) / normalizer. The normaliser is the global count over micro-batches and ranks, so that
    how a batch is split never changes the loss or its gradient; it defaults to this call's own count."""
    return values.sum() / (default if normalizer is None else normalizer)


# --------------------------------------------------------------------------- the losses

LossFn = Callable[..., "tuple[Tensor, dict[str, Tensor]]"]
# Every loss function: (logp, old_logp, advantages, mask, cfg, params, *, num_seqs, num_tokens, token_weights).


def _log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """l = log pi_theta - log pi_old (at least fp32) and the mask as floats of the same dtype."""
    log_ratio = _upcast(logp) - _upcast(old_logp)
    return log_ratio, mask.to(log_ratio.dtype)


def _clip(log_ratio, advantages, maskf, log_lo, log_hi):
    """log rho' = the log-ratio after the sign-aware clip (clipped entries get no gradient, as PPO's clip),
    and the clip metrics."""
    lo, hi = clip_bounds(advantages, log_lo, log_hi)
    return log_ratio.clamp(lo, hi), _clip_metrics(log_ratio, advantages, maskf, lo, hi)


def _fixed_log_bounds(cfg: LossConfig) -> tuple[float, float]:
    return math.log1p(-cfg.eps_low), math.log1p(cfg.eps_high)


def _kept_tokens(maskf: Tensor, token_weights: Tensor | None) -> tuple[Tensor | None, Tensor, Tensor | None]:
    """For a mean over tokens with rollout correction: log w_t (0 where w_t = 0 or off the mask, so it stays
    finite), the mask of the kept tokens (w_t > 0) and, per row, whether any is kept. A row with none keeps its
    full mask as a finite stand-in; `_drop_empty` zeroes its value (and gradient). Without weights: no change."""
    if token_weights is None:
        return None, maskf, None
    w = token_weights.detach().to(maskf.dtype)
    keep = (w > 0) & (maskf > 0)
    kept = keep.any(-1)
    log_w = torch.log(torch.where(keep, w, 1.0))
    return log_w, torch.where(kept.unsqueeze(-1), keep, maskf > 0).to(maskf.dtype), kept


def _drop_empty(per_seq: Tensor, kept: Tensor | None) -> Tensor:
    return per_seq if kept is None else torch.where(kept, per_seq, 0.0)


def _ppo_token_sums(logp, old_logp, advantages, mask, cfg, token_weights):
    """sum_t w_t min(r A, clip(r, 1-eps_low, 1+eps_high) A) per sequence [N] (w_t = 1 without correction), the
    float mask and the clip metrics: the token objective of GRPO, DAPO and Dr. GRPO, which differ only in how
    they reduce it."""
    log_ratio, maskf = _log_ratio(logp, old_logp, mask)
    log_rho, metrics = _clip(log_ratio, advantages, maskf, *_fixed_log_bounds(cfg))
    weights = maskf if token_weights is None else maskf * token_weights.detach().to(maskf.dtype)
    return advantages * masked_row_sum(torch.exp(log_rho), weights), maskf, metrics


def grpo_loss(logp, old_logp, advantages, mask, cfg, params, *, num_seqs=None, num_tokens=None, token_weights=None):
    """GRPO: min(r A, clip(r, 1-eps_low, 1+eps_high) A), mean over each sequence's tokens, then over sequences."""
    token_sums, maskf, metrics = _ppo_token_sums(logp, old_logp, advantages, mask, cfg, token_weights)
    per_seq = token_sums / maskf.sum(-1)
    return -_reduce(per_seq, num_seqs, per_seq.numel()), metrics


def dapo_loss(logp, old_logp, advantages, mask, cfg, params, *, num_seqs=None, num_tokens=None, token_weights=None):
    """DAPO: the same clipped token objective (clip-higher 0.28), averaged over all tokens of the batch."""
    token_sums, maskf, metrics = _ppo_token_sums(logp, old_logp, advantages, mask, cfg, token_weights)
    return -_reduce(token_sums, num_tokens, maskf.sum()), metrics


def dr_grpo_loss(logp, old_logp, advantages, mask, cfg, params, *, num_seqs=None, num_tokens=None,
                 token_weights=None):
    """Dr. GRPO: the same clipped token objective summed over all tokens of the batch and divided by a constant,
    num_seqs * cfg.token_budget (no length normalisation); its advantages are not divided by the group's std."""
    token_sums, _, metrics = _ppo_token_sums(logp, old_logp, advantages, mask, cfg, token_weights)
    return -_reduce(token_sums, num_seqs, token_sums.numel()) / cfg.token_budget, metrics


def gmpo_loss(logp, old_logp, advantages, mask, cfg, params, *, num_seqs=None, num_tokens=None, token_weights=None):
    """GMPO: log-ratio clipped sign-aware to [-c, c], sequence ratio exp(mean_t), objective A * ratio."""
    log_ratio, maskf = _log_ratio(logp, old_logp, mask)
    log_rho, metrics = _clip(log_ratio, advantages, maskf, -cfg.gmpo_clip, cfg.gmpo_clip)
    log_w, kept_mask, kept = _kept_tokens(maskf, token_weights)
    if kept is not None:
        log_rho = log_rho + log_w
    per_seq = advantages * torch.exp(masked_row_sum(log_rho, kept_mask) / kept_mask.sum(-1))
    return -_reduce(_drop_empty(per_seq, kept), num_seqs, per_seq.numel()), metrics


def gspo_loss(logp, old_logp, advantages, mask, cfg, params, *, num_seqs=None, num_tokens=None, token_weights=None):
    """GSPO: sequence ratio s = exp(mean_t l), min(s A, clip(s, 1-eps_low, 1+eps_high) A), mean over sequences.

    The clip acts on the whole sequence (GSPO's eps: 3e-4, 4e-4). Its metrics are those of s, counted on
    every token of the sequence: clip fractions are the share of tokens in clipped sequences. Token weights:
    mean_t log w_t is added to log s after the clip (module docstring), both means over the kept tokens.
    """
    log_ratio, maskf = _log_ratio(logp, old_logp, mask)
    log_w, kept_mask, kept = _kept_tokens(maskf, token_weights)
    log_s = (masked_row_sum(log_ratio, kept_mask) / kept_mask.sum(-1)).unsqueeze(-1).expand_as(log_ratio)
    log_s, metrics = _clip(log_s, advantages, maskf, *_fixed_log_bounds(cfg))
    log_s = log_s[:, 0]
    if kept is not None:
        log_s = log_s + masked_row_sum(log_w, kept_mask) / kept_mask.sum(-1)
    per_seq = advantages * torch.exp(log_s)
    return -_reduce(_drop_empty(per_seq, kept), num_seqs, per_seq.numel()), metrics


def apmpo_loss(logp, old_logp, advantages, mask, cfg, params, *, num_seqs=None, num_tokens=None, token_weights=None):
    """APMPO: J_i = A_i * M_p(rho'_i) with rho' clipped to [1-eps_low, 1+eps_ada]; mean over sequences.

    M_p is 1-homogeneous, so sgn(A) M_p(|A| rho') = A M_p(rho') and the power mean runs on log rho' alone.
    Token weights: M_p(w rho') over the kept tokens, log x = log rho' + log w (module docstring).
    """
    log_ratio, maskf = _log_ratio(logp, old_logp, mask)
    eps_ada = _per_row(params.eps_ada, log_ratio)
    log1p = math.log1p if isinstance(eps_ada, float) else torch.log1p
    log_lo = log1p(-eps_ada) if cfg.clip_mode == "symmetric" else math.log1p(-cfg.eps_low)
    log_rho, metrics = _clip(log_ratio, advantages, maskf, log_lo, log1p(eps_ada))
    log_w, kept_mask, kept = _kept_tokens(maskf, token_weights)
    if kept is not None:
        log_rho = log_rho + log_w
    per_seq = advantages * torch.exp(power_mean(log_rho, kept_mask, params.p))
    return -_reduce(_drop_empty(per_seq, kept), num_seqs, per_seq.numel()), metrics


# (mu_R or FSS, cfg) -> the value for the step: a tensor like mu_R, or a float for a fixed rule.
Rule = Callable[[Tensor, LossConfig], "Tensor | float"]


@dataclass(frozen=True)
class PolicyLoss:
    """Everything that makes one loss: its function, how it sets p and eps_ada, its advantages, its defaults."""

    fn: LossFn
    p: Rule  # mu_R -> the power of its sequence mean (1 arithmetic, 0 geometric); reported as apmpo/p
    eps: Rule  # FSS -> its upper clip, ratio <= 1 + eps_ada; reported as apmpo/eps_ada
    eps_low: float = 0.2  # default of LossConfig.eps_low
    eps_high: float = 0.2  # default of LossConfig.eps_high
    std_advantages: bool = True  # A = (R - mean_g) / (std_g + delta); False: A = R - mean_g
    needs_token_budget: bool = False  # divides by LossConfig.token_budget, which must then be set


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "apmpo": PolicyLoss(apmpo_loss, p=_pmpo_p, eps=_fac_eps),
    "grpo": PolicyLoss(grpo_loss, p=_arithmetic, eps=_fixed_eps),
    "dapo": PolicyLoss(dapo_loss, p=_arithmetic, eps=_fixed_eps, eps_high=0.28),
    "gmpo": PolicyLoss(gmpo_loss, p=_geometric, eps=_gmpo_eps),
    # Liu et al. 2025, "Understanding R1-Zero-Like Training": GRPO without its length and std normalisations.
    "dr_grpo": PolicyLoss(dr_grpo_loss, p=_arithmetic, eps=_fixed_eps, std_advantages=False, needs_token_budget=True),
    # Zheng et al. 2025, "Group Sequence Policy Optimization": the paper's clip range (3e-4, 4e-4).
    "gspo": PolicyLoss(gspo_loss, p=_geometric, eps=_fixed_eps, eps_low=3e-4, eps_high=4e-4),
}


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    params: AdaptiveParams,
    *,
    ref_logp: Tensor | None = None,
    num_seqs: Tensor | float | None = None,
    num_tokens: Tensor | float | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss to minimise, -J of SPEC.md, and detached metrics.

    logp, old_logp: [N, T] log-probs of the sampled tokens under the current and the rollout policy;
    advantages: [N]; mask: [N, T] bool/float, 1 on completion tokens (every row needs at least one);
    params: from `adaptive_params`, fields 0-d or [N] (see `AdaptiveParams.per_sequence`).
    ref_logp: [N, T] reference log-probs; with cfg.kl_beta > 0 the loss includes kl_beta * KL.
    num_seqs, num_tokens: global counts of the optimisation batch when this call sees one micro-batch of it
    (sequence-mean losses use num_seqs, DAPO's token mean num_tokens); default: this call's own counts.
    token_weights: [N, T] token-level rollout-correction weights w_t >= 0 (detached here; 0 drops a token), which
    enter each loss as the module docstring says; None: no correction (sequence-level weights multiply the
    advantages instead).
    Metrics: loss/total (the returned loss), loss/policy (its policy term), loss/kl (KL, without beta).
    """
    _check_inputs(logp, old_logp, advantages, mask, params, ref_logp, token_weights)
    loss, metrics = POLICY_LOSSES[cfg.name].fn(
        logp, old_logp, _upcast(advantages), mask, cfg, params, num_seqs=num_seqs, num_tokens=num_tokens,
        token_weights=token_weights,
    )
    metrics["loss/policy"] = loss
    if ref_logp is not None and cfg.kl_beta > 0:
        kl = kl_penalty(logp, ref_logp, mask, cfg, num_seqs=num_seqs)
        loss = loss + cfg.kl_beta * kl
        metrics["loss/kl"] = kl
    metrics.update({"loss/total": loss, "apmpo/p": params.p, "apmpo/eps_ada": params.eps_ada, "apmpo/fss": params.fss})
    return loss, {key: value.detach().float().mean() for key, value in metrics.items()}


def kl_penalty(
    logp: Tensor, ref_logp: Tensor, mask: Tensor, cfg: LossConfig, *, num_seqs: Tensor | float | None = None
) -> Tensor:
    """KL(pi_theta || pi_ref) estimated per token (k1, k2 or k3 of cfg.kl_estimator), averaged over each
    sequence's tokens, then over sequences (global `num_seqs` as in `policy_loss`). Not multiplied by beta."""
    if ref_logp.shape != logp.shape:
        raise ValueError(f"ref_logp has shape {tuple(ref_logp.shape)}, expected {tuple(logp.shape)} like logp")
    log_ref_ratio = _upcast(ref_logp) - _upcast(logp)  # log pi_ref / pi_theta
    if cfg.kl_estimator == "k1":
        per_token = -log_ref_ratio
    elif cfg.kl_estimator == "k2":
        per_token = 0.5 * log_ref_ratio.square()
    else:
        per_token = torch.expm1(log_ref_ratio) - log_ref_ratio
    maskf = mask.to(per_token.dtype)
    per_seq = masked_row_sum(per_token, maskf) / maskf.sum(-1)
    return _reduce(per_seq, num_seqs, per_seq.numel())


# --------------------------------------------------------------------------- metrics and checks


@torch.no_grad()
def _clip_metrics(log_ratio, advantages, maskf, lo, hi) -> dict[str, Tensor]:
    """Token means over this call's tokens; no host sync. Zero-advantage rows are never counted as clipped."""
    n_tokens = maskf.sum()
    a = advantages.unsqueeze(-1)
    upper = torch.where(a == 0, math.inf, hi)  # A > 0 rows: gradient cut above hi
    lower = torch.where(a == 0, -math.inf, lo)  # A < 0 rows: gradient cut below lo
    mean_log_ratio = masked_row_sum(log_ratio, maskf).sum() / n_tokens
    mean_ratio = masked_row_sum(torch.exp(log_ratio), maskf).sum() / n_tokens
    return {
        "loss/clip_frac_upper": masked_row_sum((log_ratio > upper).to(maskf.dtype), maskf).sum() / n_tokens,
        "loss/clip_frac_lower": masked_row_sum((log_ratio < lower).to(maskf.dtype), maskf).sum() / n_tokens,
        "policy/ratio_mean": mean_ratio,
        # KL(pi_old || pi_theta) by the k3 estimator on the rollout's tokens: E_old[r - 1 - log r].
        "policy/approx_kl": mean_ratio - 1 - mean_log_ratio,
    }


def _check_rewards(rewards: Tensor) -> None:
    if not isinstance(rewards, Tensor) or rewards.dim() != 2:
        shape = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a tensor [B, G] (prompts x samples), got {shape}")


def _check_inputs(logp, old_logp, advantages, mask, params, ref_logp, token_weights) -> None:
    if logp.dim() != 2:
        raise ValueError(f"logp must be [N, T], got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp), ("token_weights", token_weights)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(logp.shape)} like logp")
    n = logp.shape[0]
    if advantages.shape != (n,):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected ({n},): one per row of logp")
    # Checked on the host only: on an accelerator it would cost a sync per call (the learner builds and
    # checks its masks on the CPU; an empty row there would give NaN).
    empty = (mask.sum(-1) == 0).nonzero().flatten() if mask.device.type == "cpu" else mask.new_zeros(0)
    if empty.numel():
        raise ValueError(f"mask has rows without tokens: {empty[:8].tolist()}; every sequence needs >= 1 token")
    for f in fields(params):
        value = getattr(params, f.name)
        if value.dim() != 0 and tuple(value.shape) != (n,):
            raise ValueError(
                f"params.{f.name} has shape {tuple(value.shape)}; policy_loss needs 0-d or ({n},), one per "
                "sequence: use params.per_sequence(group_index) for stats_scope='group'"
            )
