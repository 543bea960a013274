"""Rank 0's half of a step: sample prompts, generate G completions each, score them, compute advantages.

DAPO's three additions are switches of `RolloutConfig`: overlong reward shaping, dynamic sampling (drop
groups whose rewards are all equal and sample more prompts until the batch is full, at most
`max_sampling_rounds` times) and the masking of truncated completions (they get no loss).
"""
from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterator

import torch

from apmpo.config import RolloutConfig
from apmpo.data.vision import VisionInputs
from apmpo import seeding
from apmpo.envs.episodes import EpisodeRunner
from apmpo.learner.batching import StepRollouts
from apmpo.loss import LossConfig, adaptive_params, advantages_for
from apmpo.play import play, seeds_per_sample
from apmpo.rewards import RewardSummary
from apmpo.sampling import Sampling
from apmpo.trajectory import Rollout

# completions, samples, deadline=, max_failures= -> (rewards, summary): apmpo.rewards.RewardPool.score with the
# reward bound; crashes and time-outs are scored 0 and counted in the RewardSummary. collect_rollouts binds the
# step's deadline and failure budget, which makes it the ScoreFn that apmpo.play.play calls.
PoolScore = Callable[..., "tuple[list[float], RewardSummary]"]
# More failed rewards than this in a step is a broken reward function, not hard completions: stop, rather than
# train on zeros.
MAX_FAILED_FRAC = 0.5


class PromptSampler:
    """A seeded, resumable order over a dataset: a fresh permutation every epoch."""

    def __init__(self, size: int, seed: int, epoch: int = 0, position: int = 0):
        if size == 0:
            raise ValueError("the training dataset is empty")
        self.size, self.seed, self.epoch, self.position = size, seed, epoch, position
        self._order = self._permutation()

    def _permutation(self) -> list[int]:
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            step = min(k - len(out), self.size - self.position)
            out += self._order[self.position : self.position + step]
            self.position += step
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}




def overlong_penalty(length: int, cfg: RolloutConfig) -> float:
    """DAPO's soft overlong punishment: 0 up to max_tokens - buffer, then linear down to -penalty."""
    if cfg.overlong_buffer <= 0:
        return 0.0
    excess = length - (cfg.max_tokens - cfg.overlong_buffer)
    return -cfg.overlong_penalty * min(1.0, excess / cfg.overlong_buffer) if excess > 0 else 0.0


def collect_rollouts(client, sampler: PromptSampler, prompt_ids: list[list[int]], samples: list[dict],
                     score: PoolScore, cfg: RolloutConfig, loss: LossConfig, *, run_seed: int, step: int,
                     sampling: Sampling, vision: VisionInputs | None = None,
                     episodes: EpisodeRunner | None = None) -> StepRollouts:
    """Generates and scores until the batch is full; the seconds spent go to .times ("generate", "reward", and
    "env" for episodes). Engine seeds come from apmpo.seeding (run seed, step, round): no two requests of a run
    share one, and evaluation draws from another range. `sampling` is cfg.sampling(the model's stop tokens).
    Scoring takes at most `cfg.reward_step_timeout_s` over all rounds; raises RuntimeError when more than
    MAX_FAILED_FRAC of the step's rewards failed. With `vision`, prompts' images go to the engine, and each
    rollout carries its prompt with expanded image pads and its images' model inputs (Rollout.mm). With `episodes`,
    each of the G samples of a prompt is a multi-turn episode of its environment (apmpo.envs), which also gives its
    reward (`score` is not used): failed environment calls count as failed rewards. Each environment call is bounded
    by the runner's timeout (max_turns + 1 calls per episode, an episode's calls in turn, all at once; and, for an
    episode rebuilt on another worker after a neighbour's failure, its calls so far, replayed, each bounded alike)."""
    B, G = cfg.prompts_per_step, cfg.group_size
    times = {"generate": 0.0, "reward": 0.0, **({"env": 0.0} if episodes else {})}
    sampler_before = sampler.state_dict()
    kept: list[list[Rollout]] = []
    raw_rewards, rounds, failures, first_error = [], 0, 0, None
    lengths, truncated, turns, episode_tokens = [], 0, 0, []
    last_round: list[list[Rollout]] = []
    while len(kept) < B and rounds < (cfg.max_sampling_rounds if cfg.dynamic_sampling else 1):
        chosen = sampler.take(B)
        # Past this many failures, the check below stops the run whatever the other items score.
        tolerable = math.floor(MAX_FAILED_FRAC * (len(raw_rewards) + len(chosen) * G)) - failures
        flat, summary, spent = play(
            client, [prompt_ids[i] for i in chosen], [samples[i] for i in chosen], G,
            seeding.train_request_seed(run_seed, step, rounds, len(chosen) * G * seeds_per_sample(episodes)),
            sampling,
            score=lambda texts, records, tolerable=tolerable: score(
                texts, records, deadline=time.monotonic() + cfg.reward_step_timeout_s - times["reward"],
                max_failures=tolerable),
            episodes=episodes, vision=vision)
        for phase, seconds in spent.items():
            times[phase] += seconds
        turns += summary.turns if episodes else 0
        raw_rewards += [r.reward for r in flat]
        failures += summary.failures
        first_error = first_error or summary.first_error
        if failures > MAX_FAILED_FRAC * len(raw_rewards):
            raise RuntimeError(
                f"reward scoring failed for {failures} of {len(raw_rewards)} completions this step (errors, "
                f"crashes, time-outs past rollout.reward_timeout_s or rollout.reward_step_timeout_s"
                f"{', or data.env_timeout_s' if episodes else ''}); the first: {first_error}. The "
                f"{'environment' if episodes else 'reward function'} looks broken: stopping rather than training "
                "on zeros")
        for r in flat:
            lengths.append(r.num_sampled)
            episode_tokens.append(len(r.completion_ids))
            truncated += r.finish_reason == "length"
            r.reward += overlong_penalty(r.num_sampled, cfg)
        last_round = [flat[g * G:(g + 1) * G] for g in range(len(chosen))]
        kept += [group for group in last_round if not cfg.dynamic_sampling or len({r.reward for r in group}) > 1]
        rounds += 1
    kept = kept[:B] if kept else last_round  # nothing informative after the cap: train on the last round
    rewards = torch.tensor([[r.reward for r in group] for group in kept])
    # The batch's statistics, together: advantages by the loss's rule (std-normalised or not, Dr. GRPO), and
    # APMPO's p, FSS and eps_ada from the same rewards.
    advantages, params = advantages_for(rewards, loss), adaptive_params(rewards, loss)
    rollouts = []
    for g, group in enumerate(kept):
        for j, rollout in enumerate(group):
            rollout.group, rollout.advantage = g, float(advantages[g, j])
            if not (cfg.mask_truncated and rollout.finish_reason == "length") and rollout.num_sampled:
                rollouts.append(rollout)
    # The oldest weights that sampled any turn of the batch: its staleness in asynchronous training.
    versions = [v for group in kept for r in group for v in r.weight_versions]
    raw = torch.tensor(raw_rewards)
    metrics = {
        "reward/mean": raw.mean().item(),
        "reward/std": raw.std(unbiased=False).item(),
        "reward/trained_mean": rewards.mean().item(),
        "response/length_mean": sum(lengths) / len(lengths),
        "response/length_max": max(lengths),
        "response/truncated_frac": truncated / len(lengths),
        "reward/failures": failures,
        "rollout/rounds": rounds,
        "rollout/groups": len(kept),
        "rollout/trained_sequences": len(rollouts),
        "rollout/informative_groups_frac": (advantages.abs().sum(1) > 0).float().mean().item(),
    }
    if episodes is not None:  # response/length_mean counts the sampled tokens; these, the whole episode
        metrics |= {"episode/turns_mean": turns / len(lengths),
                    "episode/tokens_mean": sum(episode_tokens) / len(episode_tokens)}
    return StepRollouts(rollouts, rewards, params, metrics, times, min(versions, default=-1), sampler_before)


class RolloutStream:
    """Rank 0's batches for the steps, generated up to `max_staleness` steps ahead of the update.

    max_staleness 0: `get(step)` collects the batch then and there, in this thread (the synchronous loop). N >= 1:
    one background thread collects the next N steps' batches in order while the learner updates, so generation
    and training overlap. A batch's staleness is how many weight pushes happened between the weights that
    generated it (its oldest request's) and the policy being trained; one staler than N is never trained on: it
    is dropped (counted in `discarded`) and the step's batch collected again, fresh. The server applies a push
    only between requests (its engine lock), so no request ever runs on half-updated weights.
    `paused()` holds the background thread off (validation shares the server and the reward pool).
    """

    def __init__(self, collect: Callable[[int], StepRollouts], max_staleness: int, last_step: int):
        self.collect, self.max_staleness, self.last_step = collect, max_staleness, last_step
        self.discarded = 0
        self._lock = threading.Lock()  # held while a batch is collected
        self._pending: dict[int, Future] = {}
        self._todo: queue.SimpleQueue = queue.SimpleQueue()
        if max_staleness > 0:
            threading.Thread(target=self._work, name="rollouts", daemon=True).start()

    def _work(self) -> None:
        while (item := self._todo.get()) is not None:
            step, future = item
            try:
                with self._lock:
                    future.set_result(self.collect(step))
            except BaseException as error:  # noqa: BLE001  (raised in the training thread by get())
                future.set_exception(error)

    def get(self, step: int, policy_version: int) -> StepRollouts:
        """The batch of `step`, generated at most max_staleness pushes before `policy_version`."""
        if self.max_staleness == 0:
            return self.collect(step)
        for ahead in range(step, min(step + self.max_staleness, self.last_step) + 1):
            if ahead not in self._pending:
                self._pending[ahead] = Future()
                self._todo.put((ahead, self._pending[ahead]))
        batch = self._pending.pop(step).result()
        if batch.staleness(policy_version) > self.max_staleness:
            self.discarded += 1
            with self._lock:
                batch = self.collect(step)
        return batch

    def sampler_state(self, next_step: int, sampler: PromptSampler) -> dict:
        """Where a resume at `next_step` starts sampling: before that step's batch (in flight or done, it is
        collected again on resume), else where the sampler is."""
        if next_step in self._pending:
            return self._pending[next_step].result().sampler_before
        with self._lock:
            return sampler.state_dict()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        with self._lock:
            yield

    def close(self) -> None:
        self._todo.put(None)
