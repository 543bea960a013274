"""The CPU quickstart task: "say one of these digits", learned by a tiny model the package builds itself.

Each prompt is a user message of three distinct digits, e.g. "385"; any of them is a correct answer:

    <|im_start|>user\\n385<|im_end|>\\n<|im_start|>assistant\\n   ->   "8"<|im_end|>   reward 1.0
                                                                  "2"...          reward 0.0

The reward looks at the first non-whitespace character of the completion text (what follows is ignored):
1.0 when it is one of the prompt's digits, else 0.0. The model is a random 2-layer Qwen2 (head_dim 64, as
vLLM's CPU attention needs) over a character vocabulary of 22 tokens, so a fresh model, whose next-token
distribution is near uniform, scores about 0.16. Answering with *some* digit is worth 0.3 on average;
going above that needs the model to read the prompt and copy one of its digits.

What a user should see with configs/quickstart.yaml (16 prompts x 8 samples a step): reward/mean goes from
~0.16 to ~0.3 after about ten steps (it answers with digits), past 0.8 within about 30-45 steps (it copies a digit
of the prompt), and settles at 0.9-1.0; the same with loss.name apmpo, grpo, dapo or gmpo.

    from apmpo.quickstart import build_tokenizer, make_samples, make_val_samples, reward, save_quickstart_model
    save_quickstart_model("/tmp/quickstart-model")  # or in memory: apmpo.tiny.build_model(build_tokenizer())
    samples = make_samples(512, seed=0)  # [{"task": "quickstart", "messages": [{"role": "user", "content": "690"}], "answer": "690", ...}, ...]
    val = make_val_samples()  # 90 held-out prompts, never in training (python -m apmpo.eval --benchmarks quickstart_val)
    reward("9", samples[0]), reward("5", samples[0])  # 1.0, 0.0
"""
from __future__ import annotations

import itertools
import random
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from apmpo import tiny
from apmpo.rewards.quickstart import quickstart_reward as reward  # noqa: F401 (part of this module's API)

DIGITS = "0123456789"
NUM_DIGITS = 3  # per prompt, distinct
# Every character the chat template and the prompts use: "user", "assistant", newline, digits.
ALPHABET = "\n" + DIGITS + "aeinrstu"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer (one token per character of ALPHABET, no merges) with ChatML specials.

    Ids are fixed: the three special tokens first (<|endoftext|> pad, <|im_start|>, <|im_end|> EOS), then
    ALPHABET in order. Characters outside ALPHABET are dropped when encoding.
    """
    # Byte-level symbols ("\n" is "Ċ") and no merges: the checkpoint then reloads identically as the
    # Qwen2Tokenizer that AutoTokenizer (and so vLLM) builds from vocab + merges for a qwen2 model.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    symbols = [byte_level.pre_tokenize_str(ch)[0][0] for ch in ALPHABET]
    vocab = {token: i for i, token in enumerate(tiny.SPECIAL_TOKENS + symbols)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = byte_level
    tok.add_special_tokens(tiny.SPECIAL_TOKENS)
    return tiny.chatml_tokenizer(tok)


def save_quickstart_model(out_dir: str | Path, **kwargs) -> Path:
    """Write the quickstart checkpoint (a random `apmpo.tiny` model sized to this tokenizer, and the
    tokenizer) to `out_dir`; keyword arguments go to `apmpo.tiny.save_tiny_model`. Returns the path."""
    return tiny.save_tiny_model(out_dir, tokenizer=build_tokenizer(), **kwargs)


# Held out for validation: every 8th of the 120 sets of three digits (15 sets, 90 prompts with their orders).
# Training never shows a prompt made of one of these sets, in any order, so a validation score is on unseen
# prompts (the 720 possible prompts are too few to hold out by seed: 4096 training draws cover them all).
VAL_DIGIT_SETS = frozenset(frozenset(c) for c in list(itertools.combinations(DIGITS, NUM_DIGITS))[7::8])


def _record(digits: str, index: int, split: str) -> dict:
    return {"id": f"quickstart_{split}/{index}", "task": "quickstart", "question": digits,
            "messages": [{"role": "user", "content": digits}], "answer": digits}


def make_samples(n: int, seed: int = 0) -> list[dict]:
    """`n` training records, the same for the same seed: chat messages to render with the chat template
    (add_generation_prompt=True) and the answer, the string of digits that are each a correct reply. Prompts whose
    digits form a VAL_DIGIT_SETS set are drawn again: they belong to `make_val_samples`."""
    rng = random.Random(seed)
    samples = []
    while len(samples) < n:
        digits = "".join(rng.sample(DIGITS, NUM_DIGITS))
        if frozenset(digits) not in VAL_DIGIT_SETS:
            samples.append(_record(digits, len(samples), "train"))
    return samples


def make_val_samples() -> list[dict]:
    """The held-out validation records (the built-in benchmark `quickstart_val` of `python -m apmpo.eval`): the 90
    prompts made of a VAL_DIGIT_SETS set, each once, in a fixed order."""
    prompts = sorted("".join(p) for s in VAL_DIGIT_SETS for p in itertools.permutations(sorted(s)))
    return [_record(digits, i, "val") for i, digits in enumerate(prompts)]
