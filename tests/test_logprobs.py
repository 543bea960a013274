"""apmpo.learner.logprobs against the naive full-logits computation, and proof that it never builds them.

The reference is `log_softmax(model(ids).logits.float() / T)` gathered at the next token: it shares no code
with the chunked path (it goes through the model's own forward and its full `[N, L, vocab]` logits).
"""
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import apmpo.learner.logprobs as logprobs_module
from apmpo.learner.logprobs import attention_kernel, token_logprobs
from apmpo.tiny import build_model, build_tokenizer

# --------------------------------------------------------------------------- fixtures and the reference


@functools.lru_cache(maxsize=None)
def tokenizer():
    return build_tokenizer()


def make_model(tied: bool, vocab: int | None = None, **kwargs):
    model = build_model(tokenizer(), tie_word_embeddings=tied, **kwargs)
    if vocab is not None:
        model.resize_token_embeddings(vocab, mean_resizing=False)
    return model


def make_batch(vocab: int, n: int = 5, length: int = 24, seed: int = 0):
    """Right-padded rows (prompt, completion, padding) of random lengths; the last row fills the width."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (n, length), generator=g)
    attention_mask = torch.zeros(n, length, dtype=torch.long)
    logits_mask = torch.zeros(n, length, dtype=torch.bool)
    for i in range(n):
        prompt = int(torch.randint(1, 8, (), generator=g))
        total = length if i == n - 1 else int(torch.randint(prompt + 1, length + 1, (), generator=g))
        attention_mask[i, :total] = 1
        logits_mask[i, prompt:total] = True
        input_ids[i, total:] = tokenizer().pad_token_id
    return input_ids, attention_mask, logits_mask


def reference(model, input_ids, attention_mask, logits_mask, temperature):
    """Naive: full fp32 logits -> log_softmax -> gather the next token; entropy from the same tensor."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float() / temperature
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    logp = torch.zeros(logits_mask.shape)
    logp[:, 1:] = logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = torch.zeros(logits_mask.shape)
    entropy[:, 1:] = -(logprobs.exp() * logprobs).sum(-1).detach()
    return logp * logits_mask, entropy * logits_mask


def grads_of(model, logp, weights):
    model.zero_grad(set_to_none=True)
    (logp * weights).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_grads_close(grads, ref_grads):
    """fp32 sums in another order: errors ~1e-7 of a tensor's largest entry, so the tolerance scales with it."""
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------- values, entropy, gradients


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 10_000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_matches_naive_values_entropy_and_gradients(tied, chunk_tokens, temperature):
    model = make_model(tied)
    batch = make_batch(len(tokenizer()), seed=chunk_tokens)
    weights = torch.randn(batch[0].shape, generator=torch.Generator().manual_seed(1))

    logp, entropy = token_logprobs(model, *batch, temperature=temperature, chunk_tokens=chunk_tokens, with_entropy=True)
    ref_logp, ref_entropy = reference(model, *batch, temperature)

    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    assert not entropy.requires_grad
    assert (logp[~batch[2]] == 0).all() and (entropy[~batch[2]] == 0).all()

    assert_grads_close(grads_of(model, logp, weights), grads_of(model, ref_logp, weights))


def test_no_grad_loops_chunks_with_the_same_values():
    model = make_model(tied=True)
    batch = make_batch(len(tokenizer()))
    with torch.no_grad():
        old_logp, none = token_logprobs(model, *batch, chunk_tokens=5)
    logp, _ = token_logprobs(model, *batch, chunk_tokens=5)
    assert none is None and old_logp.grad_fn is None
    torch.testing.assert_close(old_logp, logp.detach(), rtol=0, atol=0)


# --------------------------------------------------------------------------- rows sharing a prompt (a group's samples)


def make_group_batch(vocab: int, groups: int = 3, per_group: int = 4, length: int = 30, seed: int = 0):
    """As make_batch, but `per_group` rows share each prompt (prompts of different lengths), rows shuffled."""
    g = torch.Generator().manual_seed(seed)
    n = groups * per_group
    input_ids = torch.full((n, length), tokenizer().pad_token_id)
    attention_mask = torch.zeros(n, length, dtype=torch.long)
    logits_mask = torch.zeros(n, length, dtype=torch.bool)
    for group in range(groups):
        prompt = torch.randint(0, vocab, (int(torch.randint(2, 12, (), generator=g)),), generator=g)
        for i in range(group * per_group, (group + 1) * per_group):
            total = length if i == n - 1 else int(torch.randint(len(prompt) + 1, length + 1, (), generator=g))
            input_ids[i, : len(prompt)] = prompt
            input_ids[i, len(prompt) : total] = torch.randint(0, vocab, (total - len(prompt),), generator=g)
            attention_mask[i, :total] = 1
            logits_mask[i, len(prompt) : total] = True
    order = torch.randperm(n, generator=g)
    return input_ids[order], attention_mask[order], logits_mask[order]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_rows_sharing_a_prompt_match_naive_values_entropy_and_gradients(tied, temperature):
    model = make_model(tied)
    batch = make_group_batch(len(tokenizer()), seed=int(tied))
    weights = torch.randn(batch[0].shape, generator=torch.Generator().manual_seed(1))

    logp, entropy = token_logprobs(model, *batch, temperature=temperature, chunk_tokens=7, with_entropy=True)
    ref_logp, ref_entropy = reference(model, *batch, temperature)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads_of(model, logp, weights), grads_of(model, ref_logp, weights))


def test_a_shared_prompt_runs_once(monkeypatch):
    model = make_model(tied=True)
    input_ids, attention_mask, logits_mask = make_group_batch(len(tokenizer()), groups=3, per_group=4)
    seen = []
    backbone = model.model.forward
    monkeypatch.setattr(model.model, "forward", lambda **kw: seen.append(kw["input_ids"].shape) or backbone(**kw))
    token_logprobs(model, input_ids, attention_mask, logits_mask)
    prompt_lengths = logits_mask.int().argmax(1)
    inputs = attention_mask.sum(1) - prompt_lengths - 1  # each completion less its last token (it predicts none)
    # The 3 distinct prompts once, then the completions packed into rows as wide as the longest, fewer than 12.
    assert seen[0] == (3, int(prompt_lengths.max()))
    packed, width = seen[1]
    assert width == int(inputs.max()) and packed < 12 and packed * width >= int(inputs.sum())


def test_packing_puts_each_segment_whole_in_a_row_of_its_prompt():
    lengths, prompt_of, width = [5, 1, 3, 0, 2, 4, 5, 1, 2], [0, 0, 0, 0, 1, 1, 1, 0, 1], 5
    packed_prompt, row, column = logprobs_module.pack(lengths, prompt_of, width)
    used = set()
    for i, length in enumerate(lengths):
        if length:
            assert packed_prompt[row[i]] == prompt_of[i] and column[i] + length <= width
            cells = {(row[i], column[i] + k) for k in range(length)}
            assert not cells & used
            used |= cells
    assert sorted(packed_prompt) == [0, 0, 1, 1, 1]  # prompt 0: [5], [3, 1, 1]; prompt 1: [5], [4], [2, 2]


@pytest.mark.parametrize("shape", ["one-token completions", "some one-token completions"])
def test_rows_sharing_a_prompt_with_one_token_completions(shape):
    model = make_model(tied=False)
    input_ids, attention_mask, logits_mask = make_group_batch(len(tokenizer()), seed=3)
    starts = logits_mask.int().argmax(1)
    cut = range(len(starts)) if shape == "one-token completions" else range(0, len(starts), 3)
    for i in cut:  # completion of one token: only the prompt's last state scores it
        attention_mask[i, starts[i] + 1 :] = 0
        logits_mask[i, starts[i] + 1 :] = False
        input_ids[i, starts[i] + 1 :] = tokenizer().pad_token_id
    weights = torch.randn(input_ids.shape, generator=torch.Generator().manual_seed(1))
    logp, _ = token_logprobs(model, input_ids, attention_mask, logits_mask)
    ref_logp, _ = reference(model, input_ids, attention_mask, logits_mask, 1.0)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    assert_grads_close(grads_of(model, logp, weights), grads_of(model, ref_logp, weights))


def test_gradient_checkpointing_forwards_whole_rows():
    # It drops the KV cache in training, so rows sharing a prompt take the plain path there, still exact.
    model = make_model(tied=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = make_group_batch(len(tokenizer()))
    logp, _ = token_logprobs(model, *batch)
    torch.testing.assert_close(logp, reference(model, *batch, 1.0)[0], rtol=1e-5, atol=1e-5)


def test_nothing_scored_and_first_position_rejected():
    model = make_model(tied=True)
    input_ids, attention_mask, logits_mask = make_batch(len(tokenizer()))
    logp, entropy = token_logprobs(model, input_ids, attention_mask, torch.zeros_like(logits_mask), with_entropy=True)
    assert (logp == 0).all() and (entropy == 0).all()
    logits_mask[:, 0] = True
    with pytest.raises(ValueError, match="logits_mask"):
        token_logprobs(model, input_ids, attention_mask, logits_mask)


def test_bf16_model_is_finite_and_close_to_fp32():
    """bf16 head + fp32 softmax: equal to the naive bf16 computation up to GEMM blocking (measured 5e-7), and
    within 0.02 nats of the fp32 model (measured 6e-3: bf16 keeps 8 bits of mantissa, ~4e-3 relative)."""
    model = make_model(tied=False)
    batch = make_batch(len(tokenizer()))
    fp32_logp, fp32_entropy = reference(model, *batch, 0.6)
    model = model.to(torch.bfloat16)

    logp, entropy = token_logprobs(model, *batch, temperature=0.6, chunk_tokens=16, with_entropy=True)
    with attention_kernel(model, batch[0]):  # SDPA's math kernel for a bf16 forward with grad on CPU, as it took
        bf16_logp, _ = reference(model, *batch, 0.6)
    assert logp.dtype == entropy.dtype == torch.float32
    assert torch.isfinite(logp).all() and torch.isfinite(entropy).all()
    torch.testing.assert_close(logp, bf16_logp, rtol=0, atol=1e-4)
    torch.testing.assert_close(logp, fp32_logp, rtol=0, atol=2e-2)
    torch.testing.assert_close(entropy, fp32_entropy, rtol=0, atol=2e-2)
    logp.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def fp64_head_reference(hidden, weight, targets, temperature):
    """Naive: log_softmax(hidden.double() @ W.double().T / T) gathered at the targets, in fp64."""
    logits = hidden.double() @ weight.double().T / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


@pytest.mark.parametrize("chunk_tokens", [3, 10_000])  # recomputed in the backward / kept
def test_an_fp32_head_on_bf16_weights_gives_fp64s_values_and_gradients(chunk_tokens):
    """model.head_dtype fp32: the head's matmuls run in fp32 on the bf16 operands (exact casts), so values lie
    within fp32 rounding of fp64's and the gradients, back in bf16, within a bf16 rounding."""
    g = torch.Generator().manual_seed(0)
    states = (3 * torch.randn(20, 32, generator=g)).bfloat16().requires_grad_()
    weight = torch.randn(300, 32, generator=g).bfloat16().requires_grad_()
    targets = torch.randint(300, (20,), generator=g)
    upstream = torch.randn(20, generator=g)

    logp, _ = logprobs_module.chunked_head_logprobs(states, targets, weight, 0.6, chunk_tokens, False, None,
                                                    torch.float32)
    ref = fp64_head_reference(states, weight, targets, 0.6)
    assert logp.dtype == torch.float32
    # fp32 rounds logits of up to ~100 by up to 2^-24 x 128 = 7.6e-6 each (measured: 1.2e-5 at most)
    torch.testing.assert_close(logp.double(), ref, rtol=0, atol=3e-5)
    bf16_head, _ = logprobs_module.chunked_head_logprobs(states, targets, weight, 0.6, chunk_tokens, False, None)
    assert (bf16_head.double() - ref).abs().mean() > 100 * (logp.double() - ref).abs().mean()  # it does something

    grads = torch.autograd.grad((logp * upstream).sum(), (states, weight))
    ref_grads = torch.autograd.grad((ref * upstream.double()).sum(), (states, weight))
    for grad, ref_grad in zip(grads, ref_grads):
        assert grad.dtype == torch.bfloat16  # the parameter's dtype, as the embedding's gradient of a tied head
        # one bf16 rounding (2^-8), and near 0 what fp32 sums of 300 terms cancel to
        torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=2**-7, atol=1e-5 * ref_grad.abs().max())


@pytest.mark.parametrize("tied", [True, False])
def test_an_fp32_head_in_a_bf16_model_matches_the_naive_fp64_head(tied):
    """token_logprobs(head_dtype=fp32) on a bf16 model, tied embeddings included (TRL's cast_lm_head_to_fp32
    refuses those): the naive fp64 head on the same hidden states, values and every parameter's gradient."""
    model = make_model(tied).to(torch.bfloat16)
    input_ids, attention_mask, logits_mask = make_batch(len(tokenizer()))
    weights = torch.randn(input_ids.shape, generator=torch.Generator().manual_seed(1))

    logp, _ = token_logprobs(model, input_ids, attention_mask, logits_mask, temperature=0.6, chunk_tokens=16,
                             share_prompts=False, head_dtype=torch.float32)
    with attention_kernel(model, input_ids):  # the kernel token_logprobs took
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    scored = logits_mask[:, 1:]
    ref = torch.zeros(logits_mask.shape, dtype=torch.float64).masked_scatter(logits_mask, fp64_head_reference(
        hidden[:, :-1][scored], model.get_output_embeddings().weight, input_ids[:, 1:][scored], 0.6))
    torch.testing.assert_close(logp.double(), ref, rtol=0, atol=1e-5)

    grads = grads_of(model, logp, weights)
    ref_grads = grads_of(model, ref, weights.double())
    for name, grad in grads.items():
        # the same bf16 backward from gradients that differ by fp32's rounding, then bf16's
        scale = ref_grads[name].abs().max().item()
        torch.testing.assert_close(grad.float(), ref_grads[name].float(), rtol=2e-2, atol=2e-2 * scale,
                                   msg=lambda m: f"{name}: {m}")


def test_a_bf16_cpu_forward_takes_sdpas_math_kernel_where_its_weights_fit(monkeypatch):
    """attention_kernel: PyTorch's flash kernel for CPU is slow in its bf16 backward (docstring), so a bf16 forward
    takes the math kernel, with or without grad (old log-probs must equal the update forward's), unless its
    attention weights would exceed the budget; fp32 keeps PyTorch's choice. Which kernel ran is seen in the
    profiler's op names."""
    model = make_model(tied=True).to(torch.bfloat16)
    ids = make_batch(len(tokenizer()))[0]

    def kernels(grad=True):
        with torch.profiler.profile() as prof, torch.set_grad_enabled(grad), attention_kernel(model, ids):
            model(input_ids=ids)
        names = {e.name for e in prof.events()}
        return {k for k, op in (("math", "aten::_scaled_dot_product_attention_math"),
                                ("flash", "aten::_scaled_dot_product_flash_attention_for_cpu")) if op in names}

    assert kernels() == kernels(grad=False) == {"math"}
    monkeypatch.setattr(logprobs_module, "MATH_ATTENTION_BYTES", 1000)
    assert kernels() == {"flash"}
    model.float()
    monkeypatch.undo()
    assert kernels() == {"flash"}


# --------------------------------------------------------------------------- memory: no full logits


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def memory_footprint(fn):
    """(elements of the largest tensor created, elements in the distinct storages saved for the backward) of
    fn()'s forward + backward."""
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes() // t.element_size()
        return t

    with LargestTensor() as mode:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        out.sum().backward()
    return mode.largest, sum(saved.values())


VOCAB, CHUNK = 50_000, 100


@pytest.fixture(scope="module")
def big_vocab():
    model = make_model(tied=True, vocab=VOCAB, hidden_size=64, num_heads=1, num_kv_heads=1, intermediate_size=128)
    batch = make_batch(VOCAB, n=4, length=160)
    return model, batch, int(batch[2].sum()) * VOCAB  # elements of the scored tokens' full logits


def test_chunked_never_materialises_full_logits(big_vocab, monkeypatch):
    """Past KEEP_LOGPROBS_BYTES (paper-scale micro-batches), the backward recomputes each chunk's logits."""
    monkeypatch.setattr(logprobs_module, "KEEP_LOGPROBS_BYTES", 0)
    model, batch, full = big_vocab
    largest, saved = memory_footprint(lambda: token_logprobs(model, *batch, chunk_tokens=CHUNK, with_entropy=True)[0])
    assert largest <= CHUNK * VOCAB  # no op, forward or backward, makes more than one chunk's logits
    # The backward keeps no chunk's logits: it saves the backbone's activations and the weights, a small
    # fraction of the full logits, where keeping every chunk's logits would save more than all of them.
    assert saved < full / 4


def test_memory_detectors_catch_full_and_kept_logits(big_vocab, monkeypatch):
    """The two checks above fail on the naive way, and on chunks that autograd keeps for the backward."""
    model, batch, full = big_vocab
    largest, saved = memory_footprint(lambda: reference(model, *batch, 1.0)[0])
    assert largest >= full and saved >= full

    def chunk_without_recompute(h, weight, y, temperature, with_entropy, bias, keep):  # a text model: no bias
        logprobs = torch.log_softmax((h @ weight.T).float() / temperature, dim=-1)
        return logprobs.gather(-1, y[:, None]).squeeze(-1), None

    monkeypatch.setattr(logprobs_module._ChunkLogprobs, "apply", chunk_without_recompute)
    largest, saved = memory_footprint(lambda: token_logprobs(model, *batch, chunk_tokens=CHUNK)[0])
    assert largest <= CHUNK * VOCAB and saved >= full


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_a_kept_log_softmax_gives_the_recomputed_values_and_gradients_bit_for_bit(big_vocab, monkeypatch,
                                                                                   with_entropy, temperature):
    """Within KEEP_LOGPROBS_BYTES the backward reuses the forward's log-softmax instead of running the head again:
    the same numbers, the logits kept (every scored token's), and one matmul fewer in the backward."""
    model, batch, full = big_vocab

    def run():
        model.zero_grad(set_to_none=True)
        with MatmulCount() as count:
            logp, entropy = token_logprobs(model, *batch, temperature=temperature, chunk_tokens=CHUNK,
                                           with_entropy=with_entropy)
            (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        return logp, entropy, {n: p.grad.clone() for n, p in model.named_parameters()}, count.calls

    monkeypatch.setattr(logprobs_module, "KEEP_LOGPROBS_BYTES", 0)
    recomputed = run()
    monkeypatch.setattr(logprobs_module, "KEEP_LOGPROBS_BYTES", 4 * full)
    kept = run()
    assert torch.equal(kept[0], recomputed[0])
    assert (kept[1] is None and recomputed[1] is None) or torch.equal(kept[1], recomputed[1])
    assert kept[2].keys() == recomputed[2].keys() and all(torch.equal(kept[2][n], recomputed[2][n]) for n in kept[2])
    chunks = -(-int(batch[2].sum()) // CHUNK)
    assert recomputed[3] - kept[3] == chunks  # the head's matmul, once per chunk
    _, saved = memory_footprint(lambda: token_logprobs(model, *batch, chunk_tokens=CHUNK)[0])
    assert saved >= full


class MatmulCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return func(*args, **(kwargs or {}))
