"""How the engine draws each sample: one `Sampling`, from the config (or the eval CLI) through the client to the
server's request check, and `check_sampling`, the one place of the rules the engine imposes on it.

    sampling = cfg.rollout.sampling(stop_token_ids)                     # or Sampling(max_tokens=64, temperature=0.6)
    outs = client.generate(prompt_ids, sampling, n=8, seed=seed)        # outs[prompt][sample]

How many samples (`n`) and which (`seed`) belong to each request, not here. No torch, no HTTP: the config imports it.
"""
from __future__ import annotations

from dataclasses import dataclass

MIN_TEMPERATURE = 0.01  # vLLM raises a temperature in (0, 0.01) to 0.01: its log-probs would not be the asked ones
MAX_TEMPERATURE = 2.0  # vLLM refuses above
MAX_TOP_K = 2**31 - 1  # the engine's int32


@dataclass(frozen=True)
class Sampling:
    """The defaults sample the model's own distribution, untruncated. The field names are the server's JSON fields."""

    max_tokens: int  # new tokens per sample, at most
    temperature: float = 1.0  # 0: greedy (one sample per prompt), else in [MIN_TEMPERATURE, MAX_TEMPERATURE]
    top_p: float = 1.0  # in (0, 1]
    top_k: int = -1  # -1: off (as is any k >= the vocabulary)
    stop_token_ids: tuple[int, ...] = ()  # a sample ends at the first of these it draws, kept in its ids


def check_sampling(sampling: Sampling, n: int, where: str = "") -> None:
    """Raises ValueError naming the first field the engine would refuse, or silently change, for `n` samples per
    prompt. `where` prefixes the names in the message: "rollout." (a config key), "--" (an option of the eval CLI,
    spelt with hyphens) or "" (the server's request fields)."""
    def name(field: str) -> str:
        return where + (field.replace("_", "-") if where == "--" else field)

    s = sampling
    if not (s.temperature == 0.0 or MIN_TEMPERATURE <= s.temperature <= MAX_TEMPERATURE):  # NaN fails too
        raise ValueError(f"{name('temperature')} must be 0 (greedy) or lie in [{MIN_TEMPERATURE}, "
                         f"{MAX_TEMPERATURE:g}], got {s.temperature}")
    if s.temperature == 0.0 and n > 1:  # vLLM refuses it while building the request: once a bare 500
        raise ValueError(f"{name('temperature')} is 0 (greedy), which gives {n} identical samples per prompt (n must "
                         f"be 1 with temperature 0): use >= {MIN_TEMPERATURE}")
    if not 0.0 < s.top_p <= 1.0:
        raise ValueError(f"{name('top_p')} must lie in (0, 1], got {s.top_p}")
    if not -1 <= s.top_k <= MAX_TOP_K:
        raise ValueError(f"{name('top_k')} must lie in [-1, 2**31 - 1], got {s.top_k}")
    if s.max_tokens < 1:
        raise ValueError(f"{name('max_tokens')} must be >= 1, got {s.max_tokens}")
