"""Plays episodes: the generation server samples every running episode's turn in one request, then each
environment answers its own turn, until every episode is done or out of turns or tokens.

    runner = EpisodeRunner(get_env("reveal"), tokenizer, EpisodeLimits(max_turns=2, max_episode_tokens=64,
                           max_prompt_tokens=64, max_model_len=128, timeout_s=10.0))   # or .from_config(cfg, ...)
    episodes, summary = runner.run(client, samples, seed_of=lambda episode, turn: ..., sampling=sampling)

Each episode comes back as an apmpo.trajectory.Rollout, what the learner trains on (module docstring of
apmpo.envs), with its text and, if the environment failed it, its error; `summary` (an EpisodeSummary) counts
the environment's failures as RewardPool.score counts a reward's (errors, timeouts, their total failures,
first_error) and adds the seconds spent generating and in the environment, and the turns played.

The environments live in worker processes (apmpo.envs.workers, `num_workers` of them: rollout.env_workers, each
capped at `memory_mb` of address space: rollout.env_memory_mb), all of a turn's calls at once, each waited for at
most `timeout_s` (or until `deadline`). A call past that ends its episode with reward 0, counted as a timeout; one
that kills its worker is a crash (named with its exit code); one that raises, allocates past the cap, or answers
with more characters than the episode could hold (`max_chars`: the first prompt's or the episode's token limit
times the vocabulary's longest token) is its episode's error. Only that episode fails: the others its worker held
are rebuilt on another. When the batch's episodes are over their environments are dropped, with every process
they started.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from apmpo.envs import get_env
from apmpo.envs.chat import TemplateError, Transcript
from apmpo.envs.workers import EnvWorkers
from apmpo.rewards.batch import RewardSummary
from apmpo.trajectory import Rollout

if TYPE_CHECKING:
    from apmpo.sampling import Sampling  # not at run time: it would import the client, and torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int  # policy turns
    max_episode_tokens: int  # after the first prompt: sampled and environment tokens together
    max_prompt_tokens: int  # of the first prompt; longer: the episode fails (counted)
    max_model_len: int  # of the engine: a turn's prompt plus its sampled tokens fit in it
    timeout_s: float  # each environment call


@dataclass(frozen=True)
class EpisodeSummary(RewardSummary):
    """A RewardSummary of the environment's failures (errors, timeouts), and where a run's time went."""
    turns: int = 0  # policy turns played, over all episodes
    generate_seconds: float = 0.0
    env_seconds: float = 0.0


class EpisodeRunner:
    def __init__(self, env_cls: type, tokenizer: Any, limits: EpisodeLimits, num_workers: int = 2,
                 memory_mb: int | None = None):
        self.tokenizer, self.limits = tokenizer, limits
        # An answer of more characters than this would take more tokens than the episode may hold, even if every
        # token were the vocabulary's longest: it is refused in its worker, before it crosses or is tokenised.
        longest = max(map(len, tokenizer.get_vocab()))
        max_chars = longest * max(limits.max_prompt_tokens, limits.max_episode_tokens)
        self.workers = EnvWorkers(env_cls, num_workers, max_chars, memory_mb)
        self._logged_failure = False

    def close(self) -> None:
        """Stops the environments' worker processes (they also die with this process)."""
        self.workers.close()

    @classmethod
    def from_config(cls, cfg, tokenizer) -> "EpisodeRunner | None":
        """The runner of a training config's data.env (apmpo.config.Config), None without one."""
        d = cfg.data
        if d.env is None:
            return None
        return cls(get_env(d.env), tokenizer, EpisodeLimits(d.max_turns, d.max_episode_tokens, d.max_prompt_tokens,
                                                             cfg.rollout.max_model_len, d.env_timeout_s),
                   cfg.rollout.env_workers, cfg.rollout.env_memory_mb)

    def run(self, client, samples: Sequence[dict], seed_of: Callable[[int, int], int], sampling: Sampling,
            deadline: float | None = None) -> tuple[list[Rollout], EpisodeSummary]:
        """Plays one episode per sample (repeat a sample for several). `seed_of(episode, turn)`: the engine seed of
        that turn (apmpo.seeding.turn_seed); `sampling`: each turn's, its max_tokens lowered to the room left.
        Raises TemplateError when the chat template cannot be extended by appending (apmpo.envs.chat)."""
        start = time.monotonic()
        summary = {"errors": 0, "timeouts": 0, "crashes": 0, "first_error": None, "turns": 0,
                   "generate_seconds": 0.0, "env_seconds": 0.0}  # the EpisodeSummary's, as they come
        episodes = [Rollout([], [], [], None, sampled=[]) for _ in samples]
        self.workers.begin(len(samples))
        try:
            self._play(client, samples, seed_of, sampling, deadline, episodes, summary)
        finally:
            self.workers.end()  # the environments go with their episodes
        for episode in episodes:
            episode.finish_reason = episode.finish_reason or "length"
            if episode.prompt_ids:
                episode.text = self.tokenizer.decode(episode.completion_ids, skip_special_tokens=False,
                                                     clean_up_tokenization_spaces=False)
        return episodes, EpisodeSummary(len(samples), **summary, seconds=time.monotonic() - start)

    def _play(self, client, samples, seed_of, sampling, deadline, episodes, summary) -> None:
        limits = self.limits
        chats: list[Transcript | None] = [None] * len(samples)

        def fail(k: int, kind: str, message: str) -> None:
            episodes[k].finish_reason, episodes[k].reward, episodes[k].error = "error", 0.0, message
            summary[kind] += 1
            summary["first_error"] = summary["first_error"] or message
            if not self._logged_failure:
                self._logged_failure = True
                logger.warning("environment %s failed (%s; later failures are only counted): %s", self.workers.name,
                               kind, message)

        # ------------------------------------------------------------ reset
        tick = time.perf_counter()
        results = self.workers.call_all([(k, "reset", s) for k, s in enumerate(samples)], limits.timeout_s, deadline)
        summary["env_seconds"] += time.perf_counter() - tick
        for k, (status, first) in enumerate(results):
            if status != "ok":
                fail(k, status, f"reset: {first}")
                continue
            try:
                chats[k] = Transcript(self.tokenizer, first)
            except TemplateError:
                raise
            except Exception as error:  # noqa: BLE001  (a malformed first prompt is the environment's failure)
                fail(k, "errors", f"reset: {type(error).__name__}: {error}")
                continue
            episodes[k].prompt_ids = list(chats[k].ids)
            if len(chats[k].ids) > limits.max_prompt_tokens:
                fail(k, "errors", f"reset: a first prompt of {len(chats[k].ids)} tokens > data.max_prompt_tokens="
                                  f"{limits.max_prompt_tokens}")

        # ------------------------------------------------------------ turns
        for turn in range(limits.max_turns):
            for k, episode in enumerate(episodes):
                if episode.finish_reason is None and len(chats[k].ids) >= limits.max_model_len:
                    episode.finish_reason = "length"  # the engine has no room for another token
            active = [k for k, e in enumerate(episodes) if e.finish_reason is None]
            if not active:
                break
            tick = time.perf_counter()
            longest = max(len(chats[k].ids) for k in active)
            turn_sampling = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens,
                                                                         limits.max_model_len - longest))
            outputs = client.generate([chats[k].ids for k in active], turn_sampling, n=1,
                                      seeds=[seed_of(k, turn) for k in active])
            summary["generate_seconds"] += time.perf_counter() - tick
            summary["turns"] += len(active)
            actions, cut = [], {}
            for k, (out,) in zip(active, outputs):
                episode = episodes[k]
                room = limits.max_episode_tokens - len(episode.completion_ids)
                ids = list(out.token_ids[:room])
                # cut by a token limit (the turn's, the engine's or the episode's), not ended by a stop token
                cut[k] = out.finish_reason == "length" or len(out.token_ids) > room
                actions.append(chats[k].add_sampled(ids, sampling.stop_token_ids))
                episode.completion_ids += ids
                episode.sampled += [True] * len(ids)
                episode.engine_logprobs += list(out.logprobs[:room])
                episode.weight_versions.append(out.weight_version)

            tick = time.perf_counter()
            results = self.workers.call_all([(k, "step", a) for k, a in zip(active, actions)], limits.timeout_s,
                                            deadline)
            summary["env_seconds"] += time.perf_counter() - tick
            for k, (status, value) in zip(active, results):
                episode = episodes[k]
                if status != "ok":
                    fail(k, status, f"step: {value}")
                    continue
                message, reward, done = value
                if reward is not None:
                    episode.reward = reward
                if done:  # a last turn that was cut is "length", as a cut single-turn completion is, and scored
                    episode.finish_reason = "length" if cut[k] else "stop"
                    continue
                if turn + 1 == limits.max_turns or len(episode.completion_ids) >= limits.max_episode_tokens:
                    episode.finish_reason = "length"
                    continue
                try:
                    env_ids = chats[k].add_message(message)
                except TemplateError:
                    raise
                except Exception as error:  # noqa: BLE001  (e.g. a role the template refuses)
                    fail(k, "errors", f"step: the observation does not render: {type(error).__name__}: {error}")
                    continue
                if len(episode.completion_ids) + len(env_ids) >= limits.max_episode_tokens:
                    episode.finish_reason = "length"  # no room left for the policy's next turn
                    continue
                episode.completion_ids += env_ids
                episode.sampled += [False] * len(env_ids)
                episode.engine_logprobs += [0.0] * len(env_ids)
