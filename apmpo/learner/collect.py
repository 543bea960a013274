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
from apmpo.learner.batching import Rollout, StepRollouts
from apmpo.loss import LossConfig, adaptive_params, advantages_for

# completions, samples, deadline= -> (rewards, summary): apmpo.rewards.RewardPool.score with the reward bound;
# crashes and time-outs are scored 0 and counted in the summary ("errors", "timeouts", "crashes", their total
# "failures", and the "first_error").
ScoreFn = Callable[..., "tuple[list[float], dict]"]
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
                     score: ScoreFn, cfg: RolloutConfig, loss: LossConfig, *, run_seed: int, step: int,
                     stop_token_ids: list[int], vision: VisionInputs | None = None) -> StepRollouts:
    """Generates and scores until the batch is full; the seconds spent go to .times ("generate", "reward").
    Engine seeds come from apmpo.seeding (run seed, step, round): no two requests of a run share one, and
    evaluation draws from another range. Generation stops at `stop_token_ids`, as in evaluation.
    Scoring takes at most `cfg.reward_step_timeout_s` over all rounds; raises RuntimeError when more than
    MAX_FAILED_FRAC of the step's rewards failed. With `vision`, prompts' images go to the engine, and each
    rollout carries its prompt with expanded image pads and its images' model inputs (Rollout.mm)."""
    B, G = cfg.prompts_per_step, cfg.group_size
    times = {"generate": 0.0, "reward": 0.0}
    sampler_before, weight_version = sampler.state_dict(), None
    kept: list[list[Rollout]] = []
    raw_rewards, lengths, truncated, rounds, failures, first_error = [], [], 0, 0, 0, None
    last_round: list[list[Rollout]] = []
    while len(kept) < B and rounds < (cfg.max_sampling_rounds if cfg.dynamic_sampling else 1):
        chosen = sampler.take(B)
        tick = time.perf_counter()
        images = [vision.image_bytes(samples[i]) for i in chosen] if vision else None
        outputs = client.generate([prompt_ids[i] for i in chosen], n=G, temperature=cfg.temperature,
                                  top_p=cfg.top_p, top_k=cfg.top_k, max_tokens=cfg.max_tokens,
                                  seed=seeding.train_request_seed(run_seed, step, rounds, len(chosen) * G),
                                  stop_token_ids=stop_token_ids, images=images)
        flat = [(i, out) for i, outs in zip(chosen, outputs) for out in outs]
        weight_version = min([out.weight_version for _, out in flat] + ([] if weight_version is None else [weight_version]))
        times["generate"] += time.perf_counter() - tick
        tick = time.perf_counter()
        rewards, summary = score([out.text for _, out in flat], [samples[i] for i, _ in flat],
                                 deadline=time.monotonic() + cfg.reward_step_timeout_s - times["reward"],
                                 # past this many, the check below stops the run whatever the other items score
                                 max_failures=math.floor(MAX_FAILED_FRAC * (len(raw_rewards) + len(flat))) - failures)
        times["reward"] += time.perf_counter() - tick
        raw_rewards += rewards
        failures += summary["failures"]
        first_error = first_error or summary["first_error"]
        if failures > MAX_FAILED_FRAC * len(raw_rewards):
            raise RuntimeError(
                f"reward scoring failed for {failures} of {len(raw_rewards)} completions this step (errors, "
                f"crashes, time-outs past rollout.reward_timeout_s or rollout.reward_step_timeout_s); the first: "
                f"{first_error}. The reward function looks broken: stopping rather than training on zeros")
        last_round = []
        for g, i in enumerate(chosen):
            group = []
            prompt, mm = vision.model_inputs(samples[i], prompt_ids[i]) if vision else (prompt_ids[i], {})
            for j in range(G):
                out, reward = flat[g * G + j][1], rewards[g * G + j]
                lengths.append(len(out.token_ids))
                truncated += out.finish_reason == "length"
                group.append(Rollout(prompt, list(out.token_ids), list(out.logprobs), out.finish_reason,
                                     group=-1, reward=reward + overlong_penalty(len(out.token_ids), cfg),
                                     mm=mm or None))
            last_round.append(group)
            if not cfg.dynamic_sampling or len({r.reward for r in group}) > 1:
                kept.append(group)
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
            if not (cfg.mask_truncated and rollout.finish_reason == "length") and rollout.completion_ids:
                rollouts.append(rollout)
    raw = torch.tensor(raw_rewards)
    metrics = {
        "reward/mean": raw.mean().item(),
        "reward/std": raw.std(unbiased=False).item(),
        "reward/trained_mean": rewards.mean().item(),
        "response/length_mean": sum(lengths) / len(lengths),
        "response/truncated_frac": truncated / len(lengths),
        "reward/failures": failures,
        "rollout/rounds": rounds,
        "rollout/groups": len(kept),
        "rollout/trained_sequences": len(rollouts),
        "rollout/informative_groups_frac": (advantages.abs().sum(1) > 0).float().mean().item(),
    }
    return StepRollouts(rollouts, rewards, params, metrics, times, weight_version, sampler_before)


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
