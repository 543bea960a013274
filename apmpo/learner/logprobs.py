"""Per-token log-probs (and entropy) of completion tokens, without ever materialising the full logits.

Why: Qwen2.5's vocabulary is 151,936, so the `[N, L, vocab]` fp32 logits of 16k tokens take ~10 GB, and the
naive `log_softmax(model(ids).logits.float() / T)` keeps several such tensors alive for the backward. Here the
backbone runs once, only the hidden states that predict scored tokens are kept, and the LM head, the fp32
upcast, the temperature and the log-softmax run over `chunk_tokens` of them at a time. A small autograd
Function keeps nothing of a chunk's logits but its logsumexp and recomputes them in the backward, so peak
memory is about two `[chunk_tokens, vocab]` fp32 buffers, whatever the token count (1024 x 151,936 fp32 is
0.6 GB). Under `torch.no_grad()` (old and reference log-probs) the same code is just a loop over chunks.

Numerics match `log_softmax(model(ids).logits.float() / T)`: the head runs in the model's dtype (bf16 on
GPU), the softmax in fp32.

Models: any HF causal LM whose backbone is `model.model` and whose head is `model.get_output_embeddings()`,
tied or untied (Qwen2, Qwen2.5, Llama). Qwen2.5-VL plugs in unchanged: `Qwen2_5_VLForConditionalGeneration
.model` is the full multimodal backbone, so pass `pixel_values=..., image_grid_thw=...` as keyword arguments
and they reach it (it builds its own M-RoPE positions). Under DeepSpeed ZeRO-2 pass `engine.module`: the
parameters are whole on every rank and `engine.backward` still reduces their gradients. (ZeRO-3 is not
supported: the head's weight is read directly.)

Positions: rows are right-padded (prompt, completion, padding), so the backbone's default position ids
(0, 1, 2, ...) are right. For left padding pass `position_ids=` yourself. Padding is never scored, so it
cannot put NaN into the result.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    logits_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    with_entropy: bool = False,
    **model_inputs,
) -> tuple[Tensor, Tensor | None]:
    """Log pi(input_ids[n, t] | input_ids[n, :t]) / entropy at the positions `logits_mask` selects.

    input_ids, attention_mask: [N, L], right-padded prompt + completion rows.
    logits_mask: [N, L] bool, True where the token input_ids[n, t] is scored (completion tokens; t >= 1).
    model_inputs: passed on to the backbone (`pixel_values`, `image_grid_thw`, `position_ids`, ...).
    Returns logp [N, L] fp32 (0 where not scored; differentiable when grad is enabled) and, with
    `with_entropy`, the entropy [N, L] fp32 of the temperature-scaled next-token distribution at the same
    positions (0 elsewhere; detached), else None.
    """
    if logits_mask[:, 0].any():
        raise ValueError("logits_mask[:, 0] must be False: the first token has no context to be scored from")
    hidden = model.model(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **model_inputs
    ).last_hidden_state
    # Position t-1 predicts token t. Selecting first keeps only scored tokens' states ([M, H], small).
    scored = logits_mask[:, 1:]
    states = hidden[:, :-1][scored]
    targets = input_ids[:, 1:][scored]
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("the LM head has a bias; chunked log-probs support bias-free heads (Qwen, Llama)")

    logps, entropies = [], []
    for start in range(0, targets.numel(), chunk_tokens):
        h, y = states[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        logp, entropy = _ChunkLogprobs.apply(h, head.weight, y, temperature, with_entropy)
        logps.append(logp)
        entropies.append(entropy)

    zeros = torch.zeros(logits_mask.shape, dtype=torch.float32, device=hidden.device)
    logp = zeros.masked_scatter(logits_mask, torch.cat(logps)) if logps else zeros
    if not with_entropy:
        return logp, None
    entropy = zeros.masked_scatter(logits_mask, torch.cat(entropies)) if entropies else zeros
    return logp, entropy


class _ChunkLogprobs(torch.autograd.Function):
    """log pi(y | h) and entropy of one chunk; saves only (h, weight, y, logsumexp) and recomputes the logits in the
    backward, where d logp / d logits = onehot(y) - softmax is built in place in one [chunk, vocab] fp32 buffer.
    (Autograd through log_softmax + gather would hold three or four such buffers at once.)"""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, y: Tensor, temperature: float, with_entropy: bool):
        logits = _scaled_logits(h, weight, temperature)  # [chunk, vocab] fp32
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, y[:, None]).squeeze(-1) - lse
        entropy = logp.new_empty(0)
        if with_entropy:
            log_probs = logits.sub_(lse[:, None])
            entropy = -log_probs.exp().mul_(log_probs).sum(-1)
        ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(h, weight, y, lse)
        ctx.temperature = temperature
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_entropy: Tensor):
        h, weight, y, lse = ctx.saved_tensors
        scale = grad_logp[:, None] / ctx.temperature  # the 1/T of logits = head(h) / T
        grad = _scaled_logits(h, weight, ctx.temperature).sub_(lse[:, None]).exp_().mul_(-scale)  # -g softmax / T
        grad.scatter_add_(-1, y[:, None], scale)  # + g onehot(y) / T
        grad = grad.to(h.dtype)  # the matmuls run in the model's dtype, as autograd through head(h).float() would
        grad_h = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.T @ h if ctx.needs_input_grad[1] else None
        return grad_h, grad_weight, None, None, None


def _scaled_logits(h: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """head(h) in the model's dtype, then fp32 / T; a fresh tensor, so callers may work on it in place."""
    return (h @ weight.T).float().div_(temperature)
