"""Tiny random Qwen2 models and tokenizers built in code.

Tests and the CPU quickstart use these so that nothing is downloaded. The shapes are the smallest that
vLLM's CPU attention accepts (head_dim 64), with grouped-query attention like Qwen2.5, and the
embeddings either tied (Qwen2.5-1.5B/3B) or untied (Qwen2.5-7B).

    python -m apmpo.tiny /tmp/tiny --tied      # writes a loadable HF checkpoint + tokenizer

Also a tiny Qwen2.5-VL (`save_tiny_vl_model`: text as above, a 2-block vision tower, an image processor built in
code, no torchvision) and synthetic labelled diagrams with verifiable answers (`save_synthetic_diagrams`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
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
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return chatml_tokenizer(tok)


def chatml_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """`tok` (byte-level, SPECIAL_TOKENS in its vocabulary) as Qwen2.5's tokenizer behaves: <|im_end|> ends a turn
    (EOS), <|endoftext|> pads, CHAT_TEMPLATE renders chats. This one and the quickstart's character-level one."""
    tok.decoder = decoders.ByteLevel()
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
    """Write a tiny checkpoint (safetensors) with its tokenizer to `out_dir`, atomically (see `_write_atomically`);
    returns the path.

    The tokenizer defaults to `build_tokenizer(corpus)`."""
    tokenizer = build_tokenizer(corpus) if tokenizer is None else tokenizer
    model = build_model(tokenizer, tie_word_embeddings=tie_word_embeddings, seed=seed, **model_kwargs)
    model.generation_config.do_sample = False  # the server never reads it; sampling is explicit

    def write(folder: Path) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)

    return _write_atomically(Path(out_dir), write)


def _write_atomically(out_dir: Path, write) -> Path:
    """`write(folder)` into a fresh sibling folder, renamed to `out_dir` (replacing it) once complete: a process
    killed while writing leaves `out_dir` absent or whole, never a half-written model that every later run would
    fail to read. Partial folders that a killed writer left are removed here."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{out_dir.name}.partial-"
    for stale in out_dir.parent.glob(f"{prefix}*"):
        shutil.rmtree(stale, ignore_errors=True)
    partial = Path(tempfile.mkdtemp(prefix=prefix, dir=out_dir.parent))
    try:
        write(partial)
        if out_dir.is_dir() and any(out_dir.iterdir()):
            shutil.rmtree(out_dir)  # rename(2) replaces an empty folder only
        os.replace(partial, out_dir)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out_dir


# Qwen2.5-VL's template, reduced: ChatML, where a content list renders its image items as the vision tokens.
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def save_tiny_vl_model(out_dir: str | Path, *, seed: int = 0, max_pixels: int = 112 * 112) -> Path:
    """A random Qwen2.5-VL (tied embeddings like the 3B; text: 2 layers, hidden 128, head_dim 64; vision: 2 blocks,
    hidden 128) with its tokenizer (+ the vision tokens) and a PIL image processor; images are resized to at most
    `max_pixels` (112 x 112: 64 patches, 16 image tokens)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         # M-RoPE splits head_dim / 2 = 32 rotary frequencies into (time, height, width).
                         rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
                         bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=128,
                           fullatt_block_indexes=[1], window_size=112, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
        vision_start_token_id=start, vision_end_token_id=end, image_token_id=image, video_token_id=video,
        tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_pixels).save_pretrained(out_dir)
    return out_dir


def save_synthetic_diagrams(out_dir: str | Path, n: int = 8, seed: int = 0) -> Path:
    """`n` diagrams of three shapes (circle, square, triangle) at random places, each labelled with a letter, and
    `data.jsonl` asking which shape a letter labels: rows {problem, choices (the three shapes), answer (A-C),
    images: [file name]}, Geometry3K's multiple-choice form (`fields: choice`; images relative to the file)."""
    import json
    import random

    from PIL import Image, ImageDraw

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for k in range(n):
        image = Image.new("RGB", (112, 112), "white")
        draw = ImageDraw.Draw(image)
        shapes = ["circle", "square", "triangle"]
        rng.shuffle(shapes)
        letters = rng.sample("ABCD", 3)
        for (x, y), shape, letter in zip([(8, 10), (60, 10), (34, 62)], shapes, letters):
            box = (x, y, x + 36, y + 36)
            if shape == "circle":
                draw.ellipse(box, outline="black", width=2)
            elif shape == "square":
                draw.rectangle(box, outline="black", width=2)
            else:
                draw.polygon([(x + 18, y), (x, y + 36), (x + 36, y + 36)], outline="black")
            draw.text((x + 14, y + 14), letter, fill="black")
        target = rng.randrange(3)
        image.save(out_dir / f"diagram_{k}.png")
        choices = ["circle", "square", "triangle"]
        rows.append({"problem": f"<image>Which shape is labelled {letters[target]}?", "choices": choices,
                     "answer": "ABC"[choices.index(shapes[target])], "images": [f"diagram_{k}.png"]})
    path = out_dir / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def save_perturbed_copy(model_dir: str | Path, out_dir: str | Path, seed: int):
    """The text model at `model_dir` with N(0, 0.5^2) noise added to every weight, saved with its tokenizer:
    weights that generate visibly differently, for weight-sync tests. Returns the model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5 * torch.randn(param.shape, generator=g))
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return model


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
