"""Multi-turn and tool-use episodes: an environment answers the policy between its turns.

A user's environment is a class with two methods; one instance plays one episode:

    class Env:
        def reset(self, sample: dict) -> str | list[dict]:
            return "start"            # the first user message (or a list of chat messages)

        def step(self, action: str) -> tuple[str | dict, float | None, bool]:
            ...                       # action: the policy's turn, as text (without its end-of-turn token)
            return "the next user message", None, False    # or: (anything, reward, True) to end the episode

named in the config as `data.env: my_pkg.envs:Env` (or a built-in: `reveal`, `calculator`), with
`data.max_turns` and `data.max_episode_tokens` as the episode's limits. A sample is a training or benchmark record
(apmpo.data), the same dict a reward function gets.

What the learner trains on (apmpo.envs.episodes.EpisodeRunner): the first prompt's ids, then each turn's sampled ids
(their end-of-turn token included) and the environment message's ids as the chat template renders it, never
re-tokenised; a loss mask that is 1 on sampled tokens only; the engine's log-probs of the sampled tokens; one
reward (the last one `step` returned, 0 if none) and the weight version of each turn. The environments run in
worker processes (apmpo.envs.workers: `rollout.env_workers` of them, each capped at `rollout.env_memory_mb` of
address space), one call at a time in each: a call that raises, runs past `data.env_timeout_s`, kills its worker,
allocates past the cap, or returns something malformed or longer than the episode could hold ends its episode with
reward 0, and is counted. The episodes that shared its worker are rebuilt on another (their reset and steps
replayed) and go on; every process an environment starts ends with its batch.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

Message = dict  # {"role": "user" | ..., "content": str}


@runtime_checkable
class Environment(Protocol):
    """The interface; any class with these two methods is an environment (no need to subclass)."""

    def reset(self, sample: dict) -> str | list[Message]:
        """The episode's first prompt: a user message's text, or a list of chat messages."""

    def step(self, action: str) -> tuple[str | Message, float | None, bool]:
        """The environment's reply to one policy turn: (observation, reward or None, done). The observation is the
        next user message's text, or a chat message with its own role; it is ignored when done is True."""


# Built-in environments by name; anything else is "pkg.module:Class".
BUILTIN_ENVS = {"reveal": "apmpo.envs.reveal:RevealEnv", "calculator": "apmpo.envs.calculator:CalculatorEnv"}


def get_env(name: str) -> type:
    """The environment class named `name`: a built-in (BUILTIN_ENVS) or "pkg.module:Class" that can be
    instantiated (not a Protocol such as Environment, nor a class with abstract methods)."""
    from apmpo.rewards import import_user_module

    spec = BUILTIN_ENVS.get(name, name)
    if ":" not in spec:
        raise ValueError(f"unknown environment {name!r}; use one of {sorted(BUILTIN_ENVS)} or 'pkg.module:Class'")
    module_name, _, attr = spec.partition(":")
    cls = getattr(import_user_module(module_name), attr, None)
    if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise TypeError(f"{name!r} does not name a class with reset(sample) and step(action) methods")
    if getattr(cls, "_is_protocol", False) or getattr(cls, "__abstractmethods__", None):
        raise TypeError(f"{name!r} is an interface (a Protocol or a class with abstract methods "
                        f"{sorted(getattr(cls, '__abstractmethods__', ()))}), not an environment that can play")
    return cls


__all__ = ["BUILTIN_ENVS", "Environment", "Message", "get_env"]
