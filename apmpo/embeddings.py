"""Sentence embeddings from a sentence-transformers model folder, computed with transformers alone.

sentence-transformers is not a dependency, on purpose. It requires scikit-learn and scipy, and once scikit-learn is
installed transformers imports it in every process that loads a model (for assisted generation's `roc_curve`);
vLLM imports scipy.signal too. On 2 cores that added 1.5-2.5 s to the start of every server, learner and eval
process, for one metric of one eval flag. What ACS needs from the library is small and is read from the folder
itself:

- modules.json names the pipeline: Transformer, Pooling, Normalize are read; any other module (a Dense layer, a
  router) is refused by name rather than silently skipped. A folder without modules.json is a plain transformers
  model, mean-pooled, as sentence-transformers treats it.
- sentence_bert_config.json: max_seq_length (inputs are truncated to it) and do_lower_case.
- the Pooling folder's config.json: cls, max, mean, mean_sqrt_len_tokens and lasttoken (weightedmean is refused),
  concatenated in sentence-transformers' order when several are on.

Embeddings are always L2-normalised: ACS is a cosine similarity. With all-MiniLM-L6-v2 they equal
sentence-transformers 6.2's `encode(..., normalize_embeddings=True)` to within 1.5e-8 (docs/evaluation.md).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "lasttoken")
# The `pooling_mode_*` flags of sentence-transformers before version 6, in its concatenation order.
LEGACY_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                        "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
READ_MODULES = ("Transformer", "Pooling", "Normalize")


class EmbeddingModelError(ValueError):
    """A folder this module cannot embed with exactly as sentence-transformers would; the message says why."""


def pool(hidden, attention_mask, modes: tuple[str, ...]):
    """Sentence vectors [batch, len(modes) * dim] from token states [batch, seq, dim] and their 0/1 mask, left or
    right padded."""
    import torch  # noqa: PLC0415

    rows = torch.arange(hidden.shape[0])
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    parts = []
    for mode in modes:
        if mode == "cls":  # the first real token
            parts.append(hidden[rows, attention_mask.int().argmax(dim=1)])
        elif mode == "max":
            parts.append(hidden.masked_fill(mask == 0, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            count = mask.sum(dim=1).clamp(min=1e-9)
            parts.append((hidden * mask).sum(dim=1) / (count if mode == "mean" else count.sqrt()))
        elif mode == "lasttoken":  # the last real token
            last = attention_mask.shape[1] - 1 - attention_mask.flip(1).int().argmax(dim=1)
            parts.append(hidden[rows, last])
        else:
            raise EmbeddingModelError(f"pooling mode {mode!r} is not one of {', '.join(POOLING_MODES)}")
    return torch.cat(parts, dim=-1)


def pooling_modes(config: dict) -> tuple[str, ...]:
    """The modes of a Pooling config.json, in concatenation order: version 6's `pooling_mode` (a name or a list),
    else the earlier flags; mean when none is on, as sentence-transformers reads them."""
    named = config.get("pooling_mode")
    if named is None:
        modes = tuple(mode for flag, mode in LEGACY_POOLING_FLAGS.items() if config.get(flag)) or ("mean",)
    else:
        modes = (named,) if isinstance(named, str) else tuple(named)
    unknown = [mode for mode in modes if mode not in POOLING_MODES]
    if unknown:
        raise EmbeddingModelError(f"pooling {', '.join(unknown)}: supported are {', '.join(POOLING_MODES)}")
    return modes


class SentenceEncoder:
    """texts -> unit-norm embeddings [len(texts), dim] (numpy float32), from a local folder or a hub id."""

    def __init__(self, model: str, batch_size: int = 32):
        import torch  # noqa: PLC0415
        from transformers import AutoModel, AutoTokenizer  # noqa: PLC0415

        folder = _local_folder(model)
        self.modes, self.max_seq_length, self.lower_case = _read_pipeline(folder)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
        self.batch_size = batch_size

    def __call__(self, texts: list[str]) -> np.ndarray:
        import torch  # noqa: PLC0415

        texts = [text.lower() for text in texts] if self.lower_case else list(texts)
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # similar lengths share a batch
        out = np.empty((len(texts), self.model.config.hidden_size * len(self.modes)), dtype=np.float32)
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            batch = self.tokenizer([texts[i] for i in rows], padding=True, truncation=True,
                                   max_length=self.max_seq_length, return_tensors="pt")
            with torch.inference_mode():
                hidden = self.model(**batch).last_hidden_state
            vectors = torch.nn.functional.normalize(pool(hidden, batch["attention_mask"], self.modes), dim=-1)
            out[rows] = vectors.numpy()
        return out


def _local_folder(model: str) -> Path:
    if Path(model).expanduser().is_dir():
        return Path(model).expanduser()
    from huggingface_hub import snapshot_download  # noqa: PLC0415  (a hub id: transformers' own downloader)

    return Path(snapshot_download(model))


def _read_pipeline(folder: Path) -> tuple[tuple[str, ...], int | None, bool]:
    """(pooling modes, max_seq_length, do_lower_case) of a sentence-transformers folder."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return ("mean",), None, False
    modules = json.loads(modules_file.read_text())
    kinds = [module["type"].rsplit(".", 1)[-1] for module in modules]
    if any(kind not in READ_MODULES for kind in kinds) or kinds[:2] != ["Transformer", "Pooling"]:
        raise EmbeddingModelError(f"{folder}: modules {kinds}; supported is Transformer, Pooling and optionally "
                                  "Normalize, in that order")
    pooling = json.loads((folder / modules[1]["path"] / "config.json").read_text())
    settings_file = folder / modules[0]["path"] / "sentence_bert_config.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    return pooling_modes(pooling), settings.get("max_seq_length"), bool(settings.get("do_lower_case", False))
