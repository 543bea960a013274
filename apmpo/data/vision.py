"""Images for vision-language prompts (Qwen2-VL / Qwen2.5-VL): loading, chat rendering, and the model inputs.

    vision = VisionInputs.from_pretrained(model_path, tokenizer, image_root=None)
    ids = vision.encode(record)                        # chat template, one <|image_pad|> per image: for vLLM
    images = vision.image_bytes(record)                # PNG bytes of each image, sent with `ids`
    full_ids, mm = vision.model_inputs(record, ids)    # image pads expanded + pixel_values etc.: for the HF forward

A record's `images` is a list; each entry is a path (absolute, or relative to `image_root`, default the
dataset file's folder), raw bytes, or a hub-style dict {"bytes": ..., "path": ...}. Its user turn is rendered
as the image(s) then the text, through the tokenizer's chat template (Qwen2.5-VL's template turns an image
item into <|vision_start|><|image_pad|><|vision_end|>).

The generation engine (vLLM) takes the prompt with ONE <|image_pad|> per image and expands it itself; the
learner's forward needs it expanded to the image's token count, `grid_t * grid_h * grid_w / merge_size**2`,
which is what `model_inputs` does with the same image processor (so both sides agree on every position).
Image processing is the PIL one (`Qwen2VLImageProcessorPil`): no torchvision needed.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

IMAGE_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"


def is_vision_language(model: str) -> bool:
    """Whether a checkpoint (local directory or hub id) is a vision-language model (its config has a
    vision_config: Qwen2-VL, Qwen2.5-VL). A local config.json is read directly; a hub id goes through AutoConfig."""
    config = Path(model) / "config.json"
    if config.is_file():
        return "vision_config" in json.loads(config.read_text())
    from transformers import AutoConfig

    return hasattr(AutoConfig.from_pretrained(model), "vision_config")


# Added to the logits of a vision-language model's placeholder tokens (before the temperature), by the server so
# that it never samples them (vLLM's strongest logit bias) and by the learner so that its log-probs are the
# server's (apmpo.learner.logprobs): the ratio pi/pi_old compares the same distribution.
NEVER_SAMPLE_BIAS = -100.0


def placeholder_token_ids(config: Any) -> list[int]:
    """A vision-language model's image and video placeholder tokens, from its (HF) config; none for a text model.
    A policy can sample one (a random one often does; trained ones have: verl#3469, EasyR1#110), and then the
    learner's forward finds one more image pad than the images have features for and fails."""
    names = ("image_token_id", "video_token_id", "image_token_index", "video_token_index")
    return sorted({value for value in (getattr(config, name, None) for name in names) if isinstance(value, int)})


def load_image(ref: Any, root: str | Path | None = None):
    """A PIL RGB image from a path, bytes or {"bytes"/"path"} dict."""
    from PIL import Image

    if isinstance(ref, dict):
        ref = ref.get("bytes") or ref.get("path")
    if isinstance(ref, (bytes, bytearray)):
        return Image.open(io.BytesIO(ref)).convert("RGB")
    path = Path(ref)
    if not path.is_absolute() and root is not None:
        path = Path(root) / path
    return Image.open(path).convert("RGB")


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def vision_messages(record: dict) -> list[dict]:
    """The record's messages with the user turn as content items: its images first, then its text."""
    out = []
    for message in record["messages"]:
        if message["role"] == "user" and record.get("images"):
            items = [{"type": "image"} for _ in record["images"]]
            text = message["content"].replace("<image>", "").strip()
            message = {"role": "user", "content": items + [{"type": "text", "text": text}]}
        out.append(message)
    return out


@dataclass
class VisionInputs:
    tokenizer: Any
    image_processor: Any  # Qwen2VLImageProcessorPil (or any with merge_size and __call__(images=...))
    image_root: str | None = None

    @classmethod
    def from_pretrained(cls, path: str, tokenizer, image_root: str | None = None) -> "VisionInputs":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return cls(tokenizer, Qwen2VLImageProcessorPil.from_pretrained(path), image_root)

    def save_pretrained(self, path) -> None:
        """Tokenizer and image processor, as a checkpoint's hf/ needs them (so the server can load it)."""
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)

    @property
    def image_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)

    def images(self, record: dict) -> list:
        return [load_image(ref, self.image_root) for ref in record.get("images") or []]

    def image_bytes(self, record: dict) -> list[bytes]:
        return [png_bytes(image) for image in self.images(record)]

    def encode(self, record: dict) -> list[int]:
        """Prompt ids with one image pad per image (the engine's form)."""
        text = self.tokenizer.apply_chat_template(vision_messages(record), tokenize=False, add_generation_prompt=True)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if ids.count(self.image_token_id) != len(record.get("images") or []):
            raise ValueError(f"{record.get('id')}: the chat template rendered {ids.count(self.image_token_id)} "
                             f"image pads for {len(record.get('images') or [])} images")
        return ids

    def model_inputs(self, record: dict, ids: list[int]) -> tuple[list[int], dict[str, torch.Tensor]]:
        """(ids with each image pad repeated to its token count, {pixel_values [P, C*t*p*p], image_grid_thw [I, 3],
        mm_token_type_ids [len(full ids)] (1 at image tokens: the HF model needs it for its M-RoPE positions)})."""
        images = self.images(record)
        if not images:
            return list(ids), {}
        out = self.image_processor(images=images, return_tensors="pt")
        merge = self.image_processor.merge_size ** 2
        counts = iter((out["image_grid_thw"].prod(-1) // merge).tolist())
        pad = self.image_token_id
        full = [t for token in ids for t in ([pad] * next(counts) if token == pad else [token])]
        types = (torch.tensor(full) == pad).to(torch.int32)
        return full, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"],
                      "mm_token_type_ids": types}
