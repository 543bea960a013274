"""The reward registry: a reward's name in config (data.reward, an eval benchmark's) to its function, a registered name
or a user's `"pkg.module:function"`; apmpo.rewards re-exports it. Apart from the package's __init__ so that the
reward pool's workers (apmpo/rewards/batch.py), which the package imports, resolve names without importing it back."""
from __future__ import annotations

import importlib
from typing import Callable

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
