"""The CPU quickstart's reward (the task is in apmpo/quickstart.py): say one of the prompt's digits."""


def quickstart_reward(completion: str, sample: dict) -> float:
    """1.0 if the completion's first non-whitespace character is one of the sample's answer digits, else 0.0."""
    first = completion.lstrip()[:1]
    return float(first != "" and first in sample["answer"])
