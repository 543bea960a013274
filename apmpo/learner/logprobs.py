"""Per-token log-probs (and entropy) of completion tokens, without ever materialising the full logits.

Why: Qwen2.5's vocabulary is 151,936, so the `[N, L, vocab]` fp32 logits of 16k tokens take ~10 GB, and the
naive `log_softmax(model(ids).logits.float() / T)` keeps several such tensors alive for the backward. Here the
backbone runs once, only the hidden states that predict scored tokens are kept, and the LM head, the fp32
upcast, the temperature and the log-softmax run over `chunk_tokens` of them at a time. A small autograd
Function keeps nothing of a chunk's logits but its logsumexp and recomputes them in the backward, so peak
memory is about two `[chunk_tokens, vocab]` fp32 buffers, whatever the token count (1024 x 151,936 fp32 is
0.6 GB). Only where all of a call's log-softmax fits in `KEEP_LOGPROBS_BYTES` (1 GiB: SmolLM2's update on CPU,
not a paper-scale micro-batch) is it kept, and the backward skips the head's matmul. Under `torch.no_grad()`
(old and reference log-probs) the same code is just a loop over chunks.

Numerics match `log_softmax(model(ids).logits.float() / T)`: the head runs in the model's dtype (bf16 on
GPU), the softmax in fp32. With `head_dtype=torch.float32` (model.head_dtype: fp32) the head runs in fp32 instead,
`hidden.float() @ weight.float().T`: its operands are cast, not the parameter, so a head tied to the embeddings
(SmolLM2, Qwen2.5-1.5B) gets the fp32 head's gradient in its own dtype, as the embedding's is. TRL's
cast_lm_head_to_fp32 casts the parameter and so refuses tied heads.

A vision-language model's placeholder tokens get the server's logit bias first
(`apmpo.data.vision.NEVER_SAMPLE_BIAS`, before the temperature, as vLLM applies it): the engine's log-probs
are those of the biased distribution, and the learner's must be too, or every ratio pi/pi_old is off by the
placeholders' probability mass.

Models: any HF causal LM whose backbone is `model.model` and whose head is `model.get_output_embeddings()`,
tied or untied (Qwen2, Qwen2.5, Llama). Qwen2.5-VL plugs in unchanged: `Qwen2_5_VLForConditionalGeneration
.model` is the full multimodal backbone, so pass `pixel_values=..., image_grid_thw=...` as keyword arguments
and they reach it (it builds its own M-RoPE positions). Under DeepSpeed pass `engine.module`: under ZeRO-2
the parameters are whole on every rank and `engine.backward` still reduces their gradients; under ZeRO-3 the
head's chunks run in a module of the policy's own, which DeepSpeed's hooks gather the weight for (`LogprobHead`).

Positions: rows are right-padded (prompt, completion, padding), so the backbone's default position ids
(0, 1, 2, ...) are right. For left padding pass `position_ids=` yourself. Padding is never scored, so it
cannot put NaN into the result.

Rows that share a prompt (a group's G samples) run it once: the distinct prompts first, then each row's
completion on its prompt's KV cache, repeated per row. Same values and gradients up to fp32 summation order
(tests/test_logprobs.py); the prompt's share of the forward and backward shrinks G-fold. Vision-language
models, sliding-window attention and gradient checkpointing (which drops the cache) forward whole rows.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from apmpo.learner.zero3 import full_shape, is_partitioned, partitioned

KEEP_LOGPROBS_BYTES = 2**30  # the backward reuses the forward's log-softmax where all of a call's fit in this
MATH_ATTENTION_BYTES = 2**30  # a bf16 CPU forward keeps its attention weights (SDPA's math kernel) within this


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    logits_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    with_entropy: bool = False,
    share_prompts: bool | None = None,
    head_dtype: torch.dtype | None = None,
    **model_inputs,
) -> tuple[Tensor, Tensor | None]:
    """Log pi(input_ids[n, t] | input_ids[n, :t]) / entropy at the positions `logits_mask` selects.

    input_ids, attention_mask: [N, L], right-padded prompt + completion rows.
    logits_mask: [N, L] bool, True where the token input_ids[n, t] is scored (completion tokens; t >= 1).
    model_inputs: passed on to the backbone (`pixel_values`, `image_grid_thw`, `position_ids`, ...).
    share_prompts: rows that share a prompt run it once, their completions packed (values and gradients equal);
    None: wherever the model allows it (`shares_prompts`) and there are no model_inputs. A training step decides
    it once, for its plan and its forwards alike (apmpo/learner/step.py).
    head_dtype: the dtype the LM head's matmul runs in (torch.float32: model.head_dtype fp32); None: the model's.
    Returns logp [N, L] fp32 (0 where not scored; differentiable when grad is enabled) and, with
    `with_entropy`, the entropy [N, L] fp32 of the temperature-scaled next-token distribution at the same
    positions (0 elsewhere; detached), else None.
    """
    if logits_mask[:, 0].any():
        raise ValueError("logits_mask[:, 0] must be False: the first token has no context to be scored from")
    if share_prompts is None:
        share_prompts = shares_prompts(model) and not model_inputs
    shared = _prompt_of_each_row(input_ids, attention_mask, logits_mask) if share_prompts else None
    with attention_kernel(model, input_ids):
        if shared is None:
            hidden = model.model(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **model_inputs
            ).last_hidden_state
            # Position t-1 predicts token t. Selecting first keeps only scored tokens' states ([M, H], small).
            scored = logits_mask[:, 1:]
            states = hidden[:, :-1][scored]
            targets = input_ids[:, 1:][scored]
        else:
            states, targets = _states_sharing_prompts(model, input_ids, attention_mask, logits_mask, *shared)
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("the LM head has a bias; chunked log-probs support bias-free heads (Qwen, Llama)")
    bias = never_sampled_bias(model.config, full_shape(head.weight)[0], states.device)
    if is_partitioned(head.weight):  # ZeRO-3: the head's weight is gathered by a module of the policy's own
        if not hasattr(model, "apmpo_logprob_head"):
            raise ValueError("under ZeRO-3 the model needs attach_logprob_head(model) before deepspeed.initialize")
        logps, entropies = model.apmpo_logprob_head(states, targets, head.weight, temperature, chunk_tokens,
                                                    with_entropy, bias, head_dtype)
    else:
        logps, entropies = chunked_head_logprobs(states, targets, head.weight, temperature, chunk_tokens,
                                                 with_entropy, bias, head_dtype)
    zeros = torch.zeros(logits_mask.shape, dtype=torch.float32, device=states.device)
    logp = zeros.masked_scatter(logits_mask, logps)
    return logp, zeros.masked_scatter(logits_mask, entropies) if with_entropy else None


def attention_kernel(model: nn.Module, input_ids: Tensor):
    """SDPA's math kernel for a bf16 forward on CPU where every layer's attention weights of the [N, L] rows fit
    MATH_ATTENTION_BYTES (the math kernel keeps them for the backward); else PyTorch's choice. Why: PyTorch's
    flash-attention kernel for CPU is 16x slower in its bf16 backward than in its forward (SmolLM2's update, 2
    cores: 3.0 s of 10.0 s in the backward, 0.19 s in the forward; in fp32 0.46 s), while the math kernel's batched
    matmuls run at the bf16 matmul rate (0.41 s, and the update 6.5 s). No-grad forwards take the same kernel, so
    that old log-probs equal the update forward's bit for bit: every ratio starts at 1."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if input_ids.device.type != "cpu" or model.dtype != torch.bfloat16:
        return contextlib.nullcontext()
    config = model.config.get_text_config()
    rows, width = input_ids.shape
    weights_bytes = rows * width * width * config.num_attention_heads * config.num_hidden_layers * 2
    return sdpa_kernel(SDPBackend.MATH) if weights_bytes <= MATH_ATTENTION_BYTES else contextlib.nullcontext()


def chunked_head_logprobs(states: Tensor, targets: Tensor, weight: Tensor, temperature: float, chunk_tokens: int,
                          with_entropy: bool, bias: Tensor | None, head_dtype: torch.dtype | None = None
                          ) -> tuple[Tensor, Tensor]:
    """log pi(targets | states) [M] through the head's `weight`, `chunk_tokens` at a time, and the entropies [M]
    (empty without `with_entropy`). `head_dtype`: the head's matmuls (forward and backward) run in it; None: in
    the weight's."""
    if head_dtype is not None:
        # Cast once for all chunks (differentiable: the gradients come back in the weight's and states' dtypes,
        # the chunks' weight gradients summed in head_dtype first). One head_dtype copy of the weight lives through
        # the backward: 0.9 GB for Qwen2.5's 151,936 x 1536 in fp32.
        states, weight = states.to(head_dtype), weight.to(head_dtype)
    # Where every chunk's log-softmax fits KEEP_LOGPROBS_BYTES together, the backward reuses them rather than run
    # the head again: one [tokens, vocab] matmul less (about 6% of SmolLM2's update on CPU, 0.9 s; paper-scale
    # micro-batches, 10 GB of them, recompute).
    keep = torch.is_grad_enabled() and targets.numel() * weight.shape[0] * 4 <= KEEP_LOGPROBS_BYTES
    logps, entropies = [], []
    for start in range(0, targets.numel(), chunk_tokens):
        h, y = states[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        logp, entropy = _ChunkLogprobs.apply(h, weight, y, temperature, with_entropy, bias, keep)
        logps.append(logp)
        entropies.append(entropy)
    empty = states.new_zeros(0, dtype=torch.float32)
    if not logps:
        return empty, empty
    return torch.cat(logps), torch.cat(entropies) if with_entropy else empty


class LogprobHead(nn.Module):
    """chunked_head_logprobs as a module of the policy, for ZeRO-3 (attach_logprob_head). The head's weight is
    this module's external parameter, so DeepSpeed gathers it once for all of a call's chunks, and once more for
    their backward, while the module runs. Gathers are collectives: every rank gathers as often, whatever its
    number of chunks, where calling the head module chunk by chunk would not."""

    def forward(self, states: Tensor, targets: Tensor, weight: Tensor, temperature: float, chunk_tokens: int,
                with_entropy: bool, bias: Tensor | None, head_dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
        return chunked_head_logprobs(states, targets, weight, temperature, chunk_tokens, with_entropy, bias,
                                     head_dtype)


def attach_logprob_head(model: nn.Module) -> None:
    """Before deepspeed.initialize with ZeRO-3 (so that its hooks cover it): the policy's LogprobHead, the head's
    weight registered as its external parameter. It holds no parameters, so state dicts are unchanged."""
    import deepspeed

    model.apmpo_logprob_head = LogprobHead()
    deepspeed.zero.register_external_parameter(model.apmpo_logprob_head, model.get_output_embeddings().weight)


def never_sampled_bias(config, vocab: int, device: torch.device) -> Tensor | None:
    """[vocab] fp32: the server's logit bias on the placeholder tokens (0 elsewhere); None for a text model."""
    from apmpo.data.vision import NEVER_SAMPLE_BIAS, placeholder_token_ids

    tokens = [t for t in placeholder_token_ids(config) if t < vocab]
    if not tokens:
        return None
    bias = torch.zeros(vocab, dtype=torch.float32, device=device)
    bias[tokens] = NEVER_SAMPLE_BIAS
    return bias


# --- rows that share a prompt (the G samples of a group) run it once ----------------------------------------------


def shares_prompts(model: nn.Module) -> bool:
    """Text models with a full-attention KV cache. Not vision-language models (their M-RoPE positions come from
    the whole row), not under gradient checkpointing (it drops the cache in training), and not under ZeRO-3: every
    rank must run the backbone as often, since each run gathers its weights, and whether a micro-batch's rows share
    a prompt (two passes) or not (one) differs between ranks."""
    config = model.config
    return (getattr(config, "vision_config", None) is None and not getattr(config, "use_sliding_window", False)
            and not (model.training and getattr(model, "is_gradient_checkpointing", False))
            and not partitioned(model))


def _prompt_of_each_row(input_ids: Tensor, attention_mask: Tensor, logits_mask: Tensor
                        ) -> tuple[Tensor, list[list[int]], Tensor] | None:
    """(row -> index into the distinct prompts, the distinct prompts, each row's prompt length), a row's prompt
    being its tokens before its first scored one; None when no two rows share one (or a row has nothing scored, or
    is not right-padded, or has padding in its prompt or scored)."""
    starts = logits_mask.int().argmax(dim=1)
    real = attention_mask.bool()
    position = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    right_padded = (real == (position < real.sum(dim=1, keepdim=True))).all()
    if not (logits_mask.any(dim=1).all() and right_padded and (real | ~logits_mask).all()):
        return None  # (a right-padded row's prompt, before its first scored token, is all real tokens)
    distinct: dict[tuple[int, ...], int] = {}
    index = [distinct.setdefault(tuple(ids[:start]), len(distinct))
             for ids, start in zip(input_ids.tolist(), starts.tolist())]
    if len(distinct) == len(index):
        return None
    return torch.tensor(index, device=input_ids.device), [list(prompt) for prompt in distinct], starts


def _states_sharing_prompts(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, logits_mask: Tensor,
                            index: Tensor, prompts: list[list[int]], starts: Tensor) -> tuple[Tensor, Tensor]:
    """The scored tokens' hidden states and targets, as the plain forward gives them, with each distinct prompt run
    once: its KV cache is repeated for the rows of pass 2, and the completions run on top of it, packed.
    Gradients flow back through the repeated cache into the one prompt pass (the rows' sum, as before).

    The G samples of a group share their prompt, so the prompt's forward and backward shrink G-fold: the quickstart
    (22-token prompts, 8 samples) took 0.049 s for the forward and backward of 128 rows with 8 completion tokens,
    against 0.103 s for whole rows; 0.14 against 0.22 s with 32. Packing the completions of a prompt into shared rows
    (pass 2) drops most of the padding that completions of unequal lengths leave: on the quickstart's 64-token
    completions (geometric lengths, mean 27) the padded tokens of pass 2 went from 1.4x the real ones to 1.2x."""
    device, rows = input_ids.device, input_ids.shape[0]
    # Pass 1: the distinct prompts, right-padded (a pad attends to the real tokens before it, so its cached keys
    # and values are finite; pass 2 masks them out).
    longest = max(len(p) for p in prompts)
    prompt_ids = torch.zeros((len(prompts), longest), dtype=input_ids.dtype, device=device)
    prompt_mask = torch.zeros((len(prompts), longest), dtype=torch.bool, device=device)
    for k, prompt in enumerate(prompts):
        prompt_ids[k, : len(prompt)] = torch.tensor(prompt, dtype=input_ids.dtype)
        prompt_mask[k, : len(prompt)] = True
    first = model.model(input_ids=prompt_ids, attention_mask=prompt_mask.long(), use_cache=True)
    last_prompt_state = first.last_hidden_state[index, starts - 1]  # predicts the row's first completion token

    # Pass 2: row i's completion but its last token (which predicts nothing), tokens starts[i] .. ends[i] - 2, as a
    # segment of a packed row that holds only segments of the same prompt, on that prompt's cache. A segment
    # attends to its prompt and causally to itself; its positions go on from its prompt's end.
    ends = attention_mask.sum(dim=1)
    lengths = ends - starts - 1
    width = int(lengths.max())
    scored_row, scored_at = logits_mask.nonzero(as_tuple=True)  # the plain forward's order: row by row
    offset = scored_at - starts[scored_row]  # 0: predicted by the prompt's last state; k: by the segment's k-th
    if width == 0:
        return last_prompt_state[scored_row], input_ids[scored_row, scored_at]
    packed_prompt, packed_row, column = pack(lengths.tolist(), index.tolist(), width)
    packed_row, column = torch.tensor(packed_row, device=device), torch.tensor(column, device=device)
    # Every token of every segment: its row, its index k in the segment, where it goes in the packed rows.
    segment_row = torch.repeat_interleave(torch.arange(rows, device=device), lengths)
    k = torch.arange(len(segment_row), device=device) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    slot = packed_row[segment_row] * width + column[segment_row] + k
    packed = len(packed_prompt)
    packed_ids = torch.zeros(packed * width, dtype=input_ids.dtype, device=device)
    positions = torch.zeros(packed * width, dtype=torch.long, device=device)
    segment = torch.full((packed * width,), -1, dtype=torch.long, device=device)
    packed_ids[slot] = input_ids[segment_row, starts[segment_row] + k]
    positions[slot] = starts[segment_row] + k
    segment[slot] = segment_row
    packed_ids, positions, segment = (t.view(packed, width) for t in (packed_ids, positions, segment))
    own = ((segment[:, :, None] == segment[:, None, :]) & (segment[:, None, :] >= 0)
           & torch.ones(width, width, dtype=torch.bool, device=device).tril())
    packed_prompt = torch.tensor(packed_prompt, device=device)
    # A padding query sees the whole prompt: finite, and never scored.
    sees_prompt = prompt_mask[packed_prompt][:, None, :].expand(packed, width, longest)
    mask = torch.cat([sees_prompt, own], dim=2)[:, None]  # [packed, 1, width, longest + width], True: attends
    cache = first.past_key_values
    cache.reorder_cache(packed_prompt)  # index_select per layer: one copy per packed row, differentiable
    rest = model.model(input_ids=packed_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                       use_cache=True).last_hidden_state
    states = torch.cat([last_prompt_state, rest.reshape(packed * width, -1)])
    source = torch.where(offset == 0, scored_row,
                         rows + packed_row[scored_row] * width + column[scored_row] + offset - 1)
    return states[source], input_ids[scored_row, scored_at]


def pack(lengths: list[int], prompt_of: list[int], width: int) -> tuple[list[int], list[int], list[int]]:
    """Segments of `lengths` into rows of `width` tokens, a row holding segments of one prompt only (first fit,
    longest first). Returns each packed row's prompt and each segment's packed row and column (empty segments:
    row 0, column 0, never read)."""
    packed_prompt: list[int] = []
    packed_row, column = [0] * len(lengths), [0] * len(lengths)
    free: dict[int, list[tuple[int, int]]] = {}  # prompt -> its rows: (packed row, tokens used)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] == 0:
            continue
        rows = free.setdefault(prompt_of[i], [])
        fit = next((r for r, (_, used) in enumerate(rows) if used + lengths[i] <= width), None)
        if fit is None:
            rows.append((len(packed_prompt), 0))
            packed_prompt.append(prompt_of[i])
            fit = len(rows) - 1
        row, used = rows[fit]
        packed_row[i], column[i] = row, used
        rows[fit] = (row, used + lengths[i])
    return packed_prompt, packed_row, column


class _ChunkLogprobs(torch.autograd.Function):
    """log pi(y | h) and entropy of one chunk. Saves (h, weight, y) and either the chunk's [chunk, vocab] fp32
    log-softmax (`keep`) or only its logsumexp, recomputing the logits in the backward; there
    d logp / d logits = onehot(y) - softmax is built in place in one such buffer. (Autograd through log_softmax +
    gather would hold three or four of them at once.)"""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, y: Tensor, temperature: float, with_entropy: bool,
                bias: Tensor | None, keep: bool):
        logits = _scaled_logits(h, weight, temperature, bias)  # [chunk, vocab] fp32
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.gather(-1, y[:, None]).squeeze(-1) - lse
        entropy = logp.new_empty(0)
        log_probs = logits.sub_(lse[:, None]) if with_entropy or keep else None
        if with_entropy:
            entropy = -log_probs.exp().mul_(log_probs).sum(-1)
        ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(h, weight, y, log_probs if keep else lse)
        ctx.temperature, ctx.bias, ctx.keep = temperature, bias, keep
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_entropy: Tensor):
        h, weight, y, saved = ctx.saved_tensors
        scale = grad_logp[:, None] / ctx.temperature  # the 1/T of logits = head(h) / T
        if ctx.keep:
            grad = saved.exp()  # softmax, from the forward's log-softmax
        else:  # saved: the logsumexp
            grad = _scaled_logits(h, weight, ctx.temperature, ctx.bias).sub_(saved[:, None]).exp_()
        grad.mul_(-scale).scatter_add_(-1, y[:, None], scale)  # -g p / T + g onehot(y) / T
        grad = grad.to(h.dtype)  # the matmuls run in the model's dtype, as autograd through head(h).float() would
        grad_h = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.T @ h if ctx.needs_input_grad[1] else None
        return grad_h, grad_weight, None, None, None, None, None


def _scaled_logits(h: Tensor, weight: Tensor, temperature: float, bias: Tensor | None = None) -> Tensor:
    """head(h) in the model's dtype, then fp32, + bias, / T; a fresh tensor, so callers may work on it in place."""
    logits = (h @ weight.T).float()
    if bias is not None:
        logits.add_(bias)
    return logits.div_(temperature) if temperature != 1.0 else logits  # / 1.0 is exact: a pass saved
