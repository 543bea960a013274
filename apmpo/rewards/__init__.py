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

from apmpo.rewards.batch import RewardPool, RewardSummary, score_batch
from apmpo.rewards.choice import choice_reward
from apmpo.rewards.maths import math_reward
from apmpo.rewards.registry import REWARDS, get_reward, import_user_module
from apmpo.rewards.sql import sql_reward

__all__ = ["REWARDS", "RewardPool", "RewardSummary", "choice_reward", "get_reward", "import_user_module",
           "math_reward", "score_batch", "sql_reward"]
