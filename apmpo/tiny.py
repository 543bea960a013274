"""Tiny random Qwen2 models and tokenizers built in code.

Tests and the CPU quickstart use these so that nothing is downloaded. The shapes are the smallest that
vLLM's CPU attention accepts (head_dim 64), with grouped-query attention like Qwen2.5, and the
embeddings either tied (Qwen2.5-1.5B/3B) or untied (Qwen2.5-7B).

    python -m apmpo.tiny /tmp/tiny --tied      # writes a loadable HF checkpoint + tokenizer
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, the format of Qwen2.5's template, without its tool-calling branches.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

DEFAULT_CORPUS = [
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "The answer is 42. What is 3 + 4? It is 7. Compute 12 * 12 = 144.",
    "system user assistant question answer reply copy repeat letter word number",
    "SELECT name FROM singer WHERE age > 20 ORDER BY name;",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789",
] * 20


def build_tokenizer(corpus: Iterable[str] = DEFAULT_CORPUS, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (so any text encodes) with ChatML special tokens and chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    *,
    tie_word_embeddings: bool = True,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM sized to the tokenizer."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def save_tiny_model(
    out_dir: str | Path,
    *,
    tie_word_embeddings: bool = True,
    corpus: Iterable[str] = DEFAULT_CORPUS,
    tokenizer: PreTrainedTokenizerFast | None = None,
    seed: int = 0,
    **model_kwargs,
) -> Path:
    """Write a tiny checkpoint (safetensors) with its tokenizer to `out_dir`; returns the path.

    The tokenizer defaults to `build_tokenizer(corpus)`."""
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(corpus) if tokenizer is None else tokenizer
    model = build_model(tokenizer, tie_word_embeddings=tie_word_embeddings, seed=seed, **model_kwargs)
    model.generation_config.do_sample = False  # the server never reads it; sampling is explicit
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--tied", dest="tied", action="store_true", default=True)
    group.add_argument("--untied", dest="tied", action="store_false")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = save_tiny_model(args.out_dir, tie_word_embeddings=args.tied, seed=args.seed)
    print(path)


if __name__ == "__main__":
    main()
