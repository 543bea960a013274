"""Multiple-choice answers: an option letter, or the option's text, against the gold option.

`sample["choices"]` lists the option texts (option i is letter "ABCD..."[i]); `sample["answer"]` is
the gold letter, the gold option text, or its index. The prediction is read from the final answer
(the last `\\boxed{}`, `<answer>` tag or "answer is ...") when there is one, else from the whole
completion: its last standalone option letter ("(B)", "B.", "**B**"; not the B of "Bob").
An answer that is no letter but equals an option's text (up to case, spaces and `$`) picks that
option, which is how Geometry3K answers are often written ("10\\sqrt{3}").
"""
from __future__ import annotations

import re

from apmpo.data.answers import CHOICE_LETTERS as LETTERS, extract_math_answer


def _normalise(text: str) -> str:
    return re.sub(r"[\s$]|\\[,;!]|\\text\{|\\left|\\right", "", str(text)).strip(".").lower()


def _last_letter(text: str, num_choices: int) -> str | None:
    letters = LETTERS[:num_choices]
    found = re.findall(rf"(?<![A-Za-z0-9_\\])([{letters}])(?![A-Za-z0-9_])", text)
    return found[-1] if found else None


def gold_letter(sample: dict) -> str:
    """The gold option as a letter, whether given as a letter, an index or the option text."""
    answer, choices = sample["answer"], sample["choices"]
    if isinstance(answer, int) and not isinstance(answer, bool):
        return LETTERS[answer]
    answer = str(answer).strip()
    if len(answer) == 1 and answer.upper() in LETTERS[: len(choices)]:
        return answer.upper()
    stripped = answer.strip("()").strip()
    if len(stripped) == 1 and stripped.upper() in LETTERS[: len(choices)]:
        return stripped.upper()
    for letter, choice in zip(LETTERS, choices):
        if _normalise(choice) == _normalise(answer):
            return letter
    raise ValueError(f"gold answer {answer!r} is neither an option letter nor one of the choices {choices}")


def predicted_letter(completion: str, choices: list[str]) -> str | None:
    """The option the completion picks, by the rules in the module docstring; None if none."""
    final = extract_math_answer(completion)
    if final is not None:
        for letter, choice in zip(LETTERS, choices):
            if _normalise(choice) == _normalise(final):
                return letter
        return _last_letter(final, len(choices))
    return _last_letter(completion, len(choices))


def choice_reward(completion: str, sample: dict) -> float:
    """1.0 if the completion picks the gold option of `sample["choices"]`, else 0.0."""
    return 1.0 if predicted_letter(completion, sample["choices"]) == gold_letter(sample) else 0.0
