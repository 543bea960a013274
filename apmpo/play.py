"""Prompts in, scored trajectories out: the one path by which training (apmpo.learner.collect) and evaluation
(apmpo.eval.run, and so validation) draw n samples of each prompt and score them, single-turn or as episodes of an
environment (apmpo.envs.episodes), as the one type of apmpo.trajectory, `Rollout`, which the learner trains on
as it is.

    rollouts, summary, times = play(client, prompt_ids, records, n, first_seed, sampling, score=score)

Seeds: turn t of sample j of prompt k of a call draws with `first_seed + (k * n + j) * T + t`, T the episodes'
max_turns (1 single-turn). That is the server's rule for one single-turn request (`seed + k * n + j`) and
apmpo.seeding.turn_seed for episodes, so a sample's draw depends on its place in the call and nothing else: a call
that plays only some samples (`keep`) draws each as the whole call would. `first_seed` is the first of the range
the call owns, prompts x n x T seeds (apmpo.seeding.train_request_seed / eval_request_seed).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from apmpo.seeding import turn_seed
from apmpo.trajectory import Rollout

if TYPE_CHECKING:
    from apmpo.data.vision import VisionInputs
    from apmpo.envs.episodes import EpisodeRunner
    from apmpo.rewards import RewardSummary
    from apmpo.sampling import Sampling

# texts, records -> (rewards, summary): apmpo.rewards.RewardPool.score with the caller's reward, bound and deadline.
ScoreFn = Callable[[list[str], list[dict]], "tuple[list[float], RewardSummary]"]


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
