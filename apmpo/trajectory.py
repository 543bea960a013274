"""The one type a trajectory comes back as: `Rollout`, one sampled completion of one prompt or one multi-turn episode,
which the learner trains on as it is. apmpo.play.play makes them (single-turn from the server's samples, episodes
through apmpo.envs.episodes); training (apmpo.learner) and evaluation read them. On the ground floor, below both the
environments that build episodes and the path that plays them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not at run time: the environments' side imports this module and stays free of torch
    from torch import Tensor


@dataclass
class Rollout:
    """One sampled completion of one prompt, or one multi-turn episode (apmpo.envs): then the completion holds each
    turn's sampled ids and the environment's ids between them, and `sampled` tells them apart."""

    prompt_ids: list[int]
    completion_ids: list[int]
    engine_logprobs: list[float]  # the generation engine's log-prob of each completion token (0.0 where not sampled)
    # "stop" (a stop token; an episode: the environment ended it) | "length" (a token limit; an episode: out of turns
    # or tokens, or its last turn cut without its stop token, whatever the environment said) | "error" (an episode
    # the environment failed); None while an episode is played
    finish_reason: str | None
    group: int = -1  # index of its prompt in the step's batch (set by the learner's collect)
    reward: float = 0.0  # an episode's: the last one its environment's step returned, 0.0 if none or if it failed
    advantage: float = 0.0
    # Vision-language prompts (apmpo.data.vision.VisionInputs.model_inputs), else None: pixel_values [P, D],
    # image_grid_thw [I, 3], mm_token_type_ids [len(prompt_ids)]. prompt_ids then holds the expanded image pads.
    mm: dict[str, Tensor] | None = None
    # Per completion token, True where the policy sampled it: the only tokens the loss sees (an episode's environment
    # tokens are context, never trained on). None: every completion token was sampled.
    sampled: list[bool] | None = None
    weight_versions: list[int] = field(default_factory=list)  # of the server weights that sampled each turn
    text: str = ""  # the completion as text (an episode's: decoded sampled ids and rendered environment messages)
    error: str | None = None  # why the environment failed the episode

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def num_sampled(self) -> int:
        """The completion tokens the loss sees."""
        return len(self.completion_ids) if self.sampled is None else sum(self.sampled)
