"""Math answers: extract the model's final answer and check it against the gold with math-verify.

Extraction (ours, linear time, so a 1 MB completion costs milliseconds):
  1. the last `\\boxed{...}` or `\\fbox{...}` (nested braces; also `\\boxed 5`);
  2. else the last `<answer>...</answer>` (Geometry3K's R1-style format);
  3. else the text after the last "answer is" / "final answer:" up to the end of its sentence.
There is no "last number in the text" fall-back: in RL it would pay for unformatted guesses.

Equivalence is math-verify's (`verify(gold, pred)`, gold first: the check is not symmetric for
assignments such as `x=5` and for equations turned into intervals). Its own timeouts use SIGALRM,
which raises off the main thread, so they are disabled here; the bound is ours: answers longer
than MAX_ANSWER_CHARS score 0, and `apmpo.rewards.batch` kills any item that runs past its timeout.
"""
from __future__ import annotations

import logging
import re
from numbers import Number

from math_verify import parse, verify

# math-verify warns once per process that its timeout is off; that is deliberate here (see above).
logging.getLogger("math_verify").setLevel(logging.ERROR)

# A final answer longer than this is not an answer; parsing it would only cost time.
MAX_ANSWER_CHARS = 1000

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*", re.IGNORECASE)
# "1.5e3" is not LaTeX, so math-verify would read it as 1.5*e*3; rewrite plain e-notation first.
_E_NOTATION = re.compile(r"^\s*([-+]?\d+(?:\.\d*)?|[-+]?\.\d+)[eE]([-+]?\d+)\s*$")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` in `text`, braces balanced; None if absent."""
    start, command = max((text.rfind(cmd), cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start + len(command) :].lstrip()
    if not rest.startswith("{"):  # `\boxed 5`: the argument runs to the next space or `$`
        return re.split(r"[\s$]", rest, maxsplit=1)[0] or None
    depth = 0
    # Scan no further than an answer can be long, so a huge unclosed box costs bounded time.
    for j, char in enumerate(rest[: MAX_ANSWER_CHARS + 2]):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return rest[1:j]
    if len(rest) > MAX_ANSWER_CHARS + 2:
        return rest[1 : MAX_ANSWER_CHARS + 2]  # too long to be an answer; math_equal rejects it
    return None  # unbalanced: the completion was cut off inside the box


def extract_math_answer(completion: str) -> str | None:
    """The final answer written in `completion`, by the rules in the module docstring."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    # rfind, not a lazy regex: that would be quadratic on a long run of unclosed tags.
    tag_start = completion.rfind("<answer>")
    tag_end = completion.find("</answer>", tag_start)
    if tag_start >= 0 and tag_end >= 0:
        inner = completion[tag_start + len("<answer>") : tag_end]
        return last_boxed(inner) or inner.strip()
    matches = list(_ANSWER_IS.finditer(completion))
    if matches:
        tail = completion[matches[-1].end() :].strip()
        # The sentence ends at a newline or at a period that is not a decimal point.
        tail = re.split(r"\n|\.(?!\d)", tail, maxsplit=1)[0].strip().strip("$").strip()
        return tail or None
    return None


def gold_to_text(answer: object) -> str:
    """Gold answers come as str, int (aime25) or float (amc23: 27.0); write integral floats as ints."""
    if isinstance(answer, bool) or not isinstance(answer, (str, Number)):
        raise TypeError(f"gold answer must be a string or a number, not {type(answer).__name__}")
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))
    return str(answer).strip()


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
