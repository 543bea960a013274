"""Verifiable rewards: pure functions `fn(completion: str, sample: dict) -> float` (1.0 or 0.0).

    from apmpo.rewards import math_reward, sql_reward, choice_reward, get_reward, score_batch

| name     | reads from `sample`                               | rule                                      |
|----------|---------------------------------------------------|-------------------------------------------|
| "math"   | `answer` (str or number)                          | final \\boxed{} answer(s) vs gold, math-verify |
| "sql"    | `answer` (gold SQL), `db_path`, `metric`          | execution accuracy, Spider or BIRD rule   |
| "choice" | `answer` (letter, index or text), `choices`       | picked option vs gold option              |
| "quickstart" | `answer` (a few digits)                       | first character is one of them (CPU quickstart) |

A custom reward is named `"pkg.module:function"`. Training and evaluation both score through
`score_batch` / `RewardPool` (apmpo/rewards/batch.py): worker processes, a timeout per item, and
failures scored 0 and counted. This package does not import torch.
"""
from __future__ import annotations

import importlib
from typing import Callable

from apmpo.rewards.batch import RewardPool, RewardSummary, score_batch
from apmpo.rewards.choice import choice_reward
from apmpo.rewards.maths import math_reward
from apmpo.rewards.quickstart import quickstart_reward
from apmpo.rewards.sql import sql_reward

RewardFn = Callable[[str, dict], float]

REWARDS: dict[str, RewardFn] = {"math": math_reward, "sql": sql_reward, "choice": choice_reward,
                                "quickstart": quickstart_reward}


def import_user_module(name: str):
    """A user's module (a reward's, an environment's), imported. A module that calls sys.exit() or raises
    KeyboardInterrupt while it is imported would end the caller with that code and no message (neither is an
    Exception): both become an ImportError naming the module."""
    try:
        return importlib.import_module(name)
    except SystemExit as stop:
        raise ImportError(f"importing {name!r} called sys.exit({stop.code!r})") from None
    except KeyboardInterrupt:
        raise ImportError(f"importing {name!r} raised KeyboardInterrupt") from None


def get_reward(name: str) -> RewardFn:
    """The reward registered as `name`, or the function at `"pkg.module:function"`."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in name:
        raise KeyError(f"unknown reward {name!r}; use one of {sorted(REWARDS)} or 'pkg.module:function'")
    module_name, _, attr = name.partition(":")
    fn = getattr(import_user_module(module_name), attr, None)
    if not callable(fn):
        raise TypeError(f"{name!r} does not name a function")
    return fn


__all__ = ["REWARDS", "RewardPool", "RewardSummary", "choice_reward", "get_reward", "import_user_module",
           "math_reward", "score_batch", "sql_reward"]
