"""Prompts in, scored trajectories out: the one path by which training (apmpo.learner.collect) and evaluation
(apmpo.eval.run, and so validation) draw n samples of each prompt and score them, single-turn or as episodes of an
environment (apmpo.envs.episodes), and the one type they come back as, which the learner trains on as it is.

    rollouts, summary, times = play(client, prompt_ids, records, n, first_seed, sampling, score=score)

Seeds: turn t of sample j of prompt k of a call draws with `first_seed + (k * n + j) * T + t`, T the episodes'
max_turns (1 single-turn). That is the server's rule for one single-turn request (`seed + k * n + j`) and
apmpo.seeding.turn_seed for episodes, so a sample's draw depends on its place in the call and nothing else: a call
that plays only some samples (`keep`) draws each as the whole call would. `first_seed` is the first of the range
the call owns, prompts x n x T seeds (apmpo.seeding.train_request_seed / eval_request_seed).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from apmpo.seeding import turn_seed

if TYPE_CHECKING:  # not at run time: the environments' side imports this module and stays free of torch
    from torch import Tensor

    from apmpo.data.vision import VisionInputs
    from apmpo.envs.episodes import EpisodeRunner
    from apmpo.rewards import RewardSummary
    from apmpo.sampling import Sampling

# texts, records -> (rewards, summary): apmpo.rewards.RewardPool.score with the caller's reward, bound and deadline.
ScoreFn = Callable[[list[str], list[dict]], "tuple[list[float], RewardSummary]"]


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


def seeds_per_sample(episodes: EpisodeRunner | None) -> int:
    """Engine seeds one sample of `play` draws: one per turn an episode may take, else one. Callers size the seed
    range of a call (apmpo.seeding) by it."""
    return episodes.limits.max_turns if episodes else 1


def play(client, prompt_ids: list[list[int]], records: list[dict], n: int, first_seed: int, sampling: Sampling, *,
         score: ScoreFn | None = None, episodes: EpisodeRunner | None = None, vision: VisionInputs | None = None,
         keep: Callable[[int, int], bool] | None = None) -> tuple[list[Rollout], RewardSummary, dict[str, float]]:
    """n samples of each prompt (prompt_ids[k] encodes records[k]), scored: (rollouts prompt-major with group -1,
    the failures of their scoring, seconds spent: "generate" and "reward", or "env" for episodes). Single-turn
    samples are scored by `score`; with `episodes` each sample is an episode of its environment, which scores it.
    With `vision`, prompts' images go to the engine and each rollout carries its prompt with expanded image pads and
    its images' model inputs (Rollout.mm). keep(k, j): whether sample j of prompt k is wanted (default: all);
    single-turn requests still draw every sample of a prompt, as one request does."""
    keep = keep or (lambda k, j: True)
    if episodes is not None:
        if vision is not None:
            raise ValueError("multi-turn episodes (data.env) do not take images yet")
        T = seeds_per_sample(episodes)
        wanted = [(k, j) for k in range(len(records)) for j in range(n) if keep(k, j)]
        played, summary = episodes.run(client, [records[k] for k, _ in wanted],
                                       lambda e, t: turn_seed(first_seed, wanted[e][0] * n + wanted[e][1], T, t),
                                       sampling)
        return played, summary, {"generate": summary.generate_seconds, "env": summary.env_seconds}
    tick = time.perf_counter()
    images = [vision.image_bytes(record) for record in records] if vision else None
    outputs = client.generate(prompt_ids, sampling, n=n, seed=first_seed, images=images)
    times = {"generate": time.perf_counter() - tick}
    tick = time.perf_counter()
    wanted = [(k, out) for k, outs in enumerate(outputs) for j, out in enumerate(outs) if keep(k, j)]
    rewards, summary = score([out.text for _, out in wanted], [records[k] for k, _ in wanted])
    times["reward"] = time.perf_counter() - tick
    prompts = [vision.model_inputs(record, ids) if vision else (ids, {}) for record, ids in zip(records, prompt_ids)]
    return [Rollout(prompts[k][0], list(out.token_ids), list(out.logprobs), out.finish_reason, reward=reward,
                    mm=prompts[k][1] or None, weight_versions=[out.weight_version], text=out.text)
            for (k, out), reward in zip(wanted, rewards)], summary, times
