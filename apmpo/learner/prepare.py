"""What the loop needs before its first step: the model path and the prompts.

`model.path: quickstart` and `data.train: quickstart` select the built-in CPU quickstart (apmpo/quickstart.py):
the model is written into the run directory by rank 0, so every process and the server load the same files.
A name of apmpo.models.MODELS (`model.path: smollm2-135m-instruct`) loads its fetched copy from the cache.
"""
from __future__ import annotations

from apmpo import models
from apmpo.config import Config
from apmpo.data import encode_prompt, load_records
from apmpo.data.vision import VisionInputs, is_vision_language


def prepare_model(cfg: Config, is_main: bool) -> str:
    """The policy's path; for model.path "quickstart", rank 0 writes the model first (before any process group
    exists: the other ranks must wait for it, e.g. in a barrier, before they read it)."""
    if cfg.model.path != "quickstart":
        return models.resolve(cfg.model.path)  # a fetched model's cache entry; anything else as it is
    from apmpo.quickstart import save_quickstart_model

    path = cfg.run_dir / "model"
    if is_main and not (path / "config.json").is_file():
        save_quickstart_model(path, seed=cfg.train.seed)
    return str(path)


def load_vision(model_path: str, tokenizer) -> VisionInputs | None:
    """Image processing for a vision-language model, else None."""
    return VisionInputs.from_pretrained(model_path, tokenizer) if is_vision_language(model_path) else None


def load_prompts(cfg: Config, tokenizer, vision: VisionInputs | None = None) -> tuple[list[dict], list[list[int]]]:
    """The training records (each is also its reward's `sample`) and their prompt token ids; prompts longer
    than data.max_prompt_tokens are dropped, and counted. With `vision`, records with images get the engine's
    form of the prompt (one image pad per image; the count is of that form)."""
    d = cfg.data
    if d.train == "quickstart":
        from apmpo.quickstart import make_samples

        records = make_samples(4096, seed=d.seed)
    else:
        records = load_records(d.train, split=d.split, fields=d.fields, db_root=d.db_root,
                               system_prompt=d.system_prompt, image_root=d.image_root)
    encoded = [vision.encode(r) if vision and r.get("images") else encode_prompt(r, tokenizer) for r in records]
    kept = [(r, ids) for r, ids in zip(records, encoded) if len(ids) <= d.max_prompt_tokens]
    if len(kept) < len(records):
        print(f"[apmpo] dropped {len(records) - len(kept)} of {len(records)} prompts longer than "
              f"data.max_prompt_tokens={d.max_prompt_tokens}", flush=True)
    return [r for r, _ in kept], [ids for _, ids in kept]
