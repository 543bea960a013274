"""The multi-turn CPU quickstart: the digits to answer with are revealed by the environment, one turn late.

    user: start             policy: (anything)       user: 385            policy: 8       -> reward 1.0

The first prompt says only "start"; whatever the policy answers, the environment's reply reveals the sample's three
digits (apmpo/quickstart.py), and the reward of the second turn is the quickstart's: 1.0 when its first
non-whitespace character is one of them. So the policy must read what the environment said (tokens it never
sampled and is never trained on) to score above the ~0.3 of answering with any digit. Every character is in the
quickstart tokenizer's alphabet. configs/quickstart_multiturn.yaml trains it.
"""
from __future__ import annotations

from apmpo.rewards.quickstart import quickstart_reward

FIRST_PROMPT = "start"


class RevealEnv:
    def reset(self, sample: dict) -> str:
        self.sample, self.revealed = sample, False
        return FIRST_PROMPT

    def step(self, action: str) -> tuple[str, float | None, bool]:
        if not self.revealed:
            self.revealed = True
            return self.sample["answer"], None, False
        return "", quickstart_reward(action, self.sample), True
