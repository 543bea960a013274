"""Math answers: check the model's final answer (apmpo.data.answers) against the gold with math-verify.

Equivalence is math-verify's (`verify(gold, pred)`, gold first: the check is not symmetric for
assignments such as `x=5` and for equations turned into intervals). Its own timeouts use SIGALRM,
which raises off the main thread, so they are disabled here; the bound is ours: answers longer
than MAX_ANSWER_CHARS score 0, and `apmpo.rewards.batch` kills any item that runs past its timeout.
"""
from __future__ import annotations

import logging
import re

from math_verify import parse, verify

from apmpo.data.answers import MAX_ANSWER_CHARS, extract_math_answer, gold_to_text

# math-verify warns once per process that its timeout is off; that is deliberate here (see above).
logging.getLogger("math_verify").setLevel(logging.ERROR)

# "1.5e3" is not LaTeX, so math-verify would read it as 1.5*e*3; rewrite plain e-notation first.
_E_NOTATION = re.compile(r"^\s*([-+]?\d+(?:\.\d*)?|[-+]?\.\d+)[eE]([-+]?\d+)\s*$")


def _parse_answer(answer: str) -> list:
    e_notation = _E_NOTATION.match(answer)
    if e_notation:
        answer = f"{e_notation.group(1)} \\times 10^{{{int(e_notation.group(2))}}}"
    # Wrapped in \boxed so math-verify's LaTeX extractor takes the whole answer (units, \text, %).
    return parse(f"\\boxed{{{answer}}}", parsing_timeout=None)


def math_equal(gold: str, pred: str) -> bool:
    """Whether `pred` is mathematically equal to `gold` (math-verify, gold first, no SIGALRM)."""
    if len(pred) > MAX_ANSWER_CHARS:
        return False
    if pred.strip() == gold.strip():
        return True
    return bool(verify(_parse_answer(gold), _parse_answer(pred), timeout_seconds=None))


def math_reward(completion: str, sample: dict) -> float:
    """1.0 if the final answer of `completion` equals `sample["answer"]`, else 0.0."""
    pred = extract_math_answer(completion)
    if pred is None:
        return 0.0
    return 1.0 if math_equal(gold_to_text(sample["answer"]), pred) else 0.0
