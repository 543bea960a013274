"""What the loop needs before its first step: the model path, the prompts, and the scorer.

`model.path: quickstart` and `data.train: quickstart` select the built-in CPU quickstart (apmpo/quickstart.py):
the model is written into the run directory by rank 0, so every process and the server load the same files.
"""
from __future__ import annotations

from pathlib import Path

import torch.distributed as torch_dist

from apmpo.config import Config
from apmpo.learner.rollouts import ScoreFn


def prepare_model(cfg: Config, is_main: bool) -> str:
    if cfg.model.path != "quickstart":
        return cfg.model.path
    from apmpo.quickstart import save_quickstart_model

    path = cfg.run_dir / "model"
    if is_main and not (path / "config.json").is_file():
        save_quickstart_model(path, seed=cfg.train.seed)
    if torch_dist.is_initialized():
        torch_dist.barrier()
    return str(path)


def encode_prompt(messages: list[dict], tokenizer, system_prompt: str | None) -> list[int]:
    if system_prompt:
        messages = [{"role": "system", "content": system_prompt}, *messages]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def load_prompts(cfg: Config, tokenizer) -> tuple[list[dict], list[list[int]]]:
    """The training samples and their prompt token ids; prompts over data.max_prompt_tokens are dropped."""
    if cfg.data.train == "quickstart":
        from apmpo.quickstart import make_samples

        samples = make_samples(4096, seed=cfg.data.seed)
    else:
        raise NotImplementedError("datasets other than the quickstart arrive with apmpo.data")
    encoded = [encode_prompt(s["prompt"], tokenizer, cfg.data.system_prompt) for s in samples]
    kept = [(s, ids) for s, ids in zip(samples, encoded) if len(ids) <= cfg.data.max_prompt_tokens]
    if len(kept) < len(samples):
        print(f"[apmpo] dropped {len(samples) - len(kept)} prompts longer than data.max_prompt_tokens="
              f"{cfg.data.max_prompt_tokens}", flush=True)
    return [s for s, _ in kept], [ids for _, ids in kept]


def make_scorer(cfg: Config) -> ScoreFn:
    if cfg.data.reward == "quickstart":
        from apmpo.quickstart import reward
    else:
        raise NotImplementedError("rewards other than the quickstart arrive with apmpo.rewards")
    return lambda completions, samples: [reward(c, s) for c, s in zip(completions, samples)]
