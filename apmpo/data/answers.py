"""Answers as text, with no verifier imported: data loading needs them, and sympy and math-verify stay out of it.

Extraction (ours, linear time, so a 1 MB completion costs milliseconds):
  1. the last `\\boxed{...}` or `\\fbox{...}` (nested braces; also `\\boxed 5`), together with the boxes just
     before it that are joined to it by ",", "and" or "or", LaTeX spacing (`\\quad`, `\\,`, `~`), a `\\text{...}`
     of only a joining phrase ("and", "for part (a) and") or math delimiters (`$`, `\\(`, `\\]`): "\\boxed{2} and
     \\boxed{3}", "$\\boxed{(1,2)}$, $\\boxed{(2,1)}$", "\\boxed{2} \\quad \\text{or} \\quad \\boxed{3}". Several
     answers stated as the final one, read as the list "2, 3" and so compared as a set with the gold, as
     math-verify's own extraction does (at most MAX_FINAL_BOXES). A box followed by more text is not part of it;
  2. else the last `<answer>...</answer>` (Geometry3K's R1-style format);
  3. else the text after the last "answer is" / "final answer:" up to the end of its sentence.
There is no "last number in the text" fall-back: in RL it would pay for unformatted guesses.
"""
from __future__ import annotations

import re
from numbers import Number

CHOICE_LETTERS = "ABCDEFGHIJ"  # option i of a multiple-choice question is CHOICE_LETTERS[i]

# A final answer longer than this is not an answer; parsing it would only cost time.
MAX_ANSWER_CHARS = 1000
# Boxes in one final answer list: math-verify's extraction reads a first box and at most five more; the cap also
# keeps the backward search linear on a completion made of thousands of boxes.
MAX_FINAL_BOXES = 6

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_BARE_ARGUMENT = re.compile(r"[^\s$]*")
# What may stand between two boxes of one final answer: math-verify's ",", "and", "or", LaTeX spacing, or a \text{}
# holding only a joining phrase, among whitespace and math delimiters. Whitespace or delimiters alone join nothing
# (math-verify too reads "$\boxed{2}$ $\boxed{3}$" as 3).
_JOIN = r"(?:,|and(?![A-Za-z])|or(?![A-Za-z]))"
_PART = r"(?:for\s+)?part\s*\(?\w\)?"  # "for part (a) and": the boxes answer the parts in turn
_FILLER = r"(?:\s|\$|\\[()\[\]])*"
_BOX_SEPARATOR = re.compile(
    rf"{_FILLER}(?:(?:{_JOIN}|\\q?quad(?![A-Za-z])|\\[,;:! ]|~"
    rf"|\\text\s*\{{\s*(?:{_PART}\s*)?,?\s*{_JOIN}\s*(?:{_PART}\s*)?:?\s*\}}){_FILLER})+")
_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*", re.IGNORECASE)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` in `text`, braces balanced; None if absent."""
    start, command = max((text.rfind(cmd), cmd) for cmd in _BOX_COMMANDS)
    return _box_at(text, start, command)[0] if start >= 0 else None


def final_boxes(text: str) -> list[str]:
    """The last box of `text` and the boxes joined to it by ",", "and" or "or", in order; [] if the last box is
    absent or cut off."""
    boxes: list[str] = []
    before = len(text)  # where the box found last starts
    while len(boxes) < MAX_FINAL_BOXES:
        start, command = max((text.rfind(cmd, 0, before), cmd) for cmd in _BOX_COMMANDS)
        if start < 0:
            return boxes[::-1]
        content, end = _box_at(text, start, command)
        if content is None or (boxes and not _BOX_SEPARATOR.fullmatch(text[end:before])):
            return boxes[::-1]
        boxes.append(content)
        before = start
    return boxes[::-1]


def _box_at(text: str, start: int, command: str) -> tuple[str | None, int]:
    """The content of the box whose command starts at `start`, and the index just past the box; the content is
    None when the box is unbalanced (the completion was cut off inside it)."""
    i = start + len(command)
    while i < len(text) and text[i].isspace():
        i += 1
    if text[i : i + 1] != "{":  # `\boxed 5`: the argument runs to the next space or `$`
        word = _BARE_ARGUMENT.match(text, i)
        return word.group() or None, word.end()
    depth = 0
    # Scan no further than an answer can be long, so a huge unclosed box costs bounded time.
    stop = min(len(text), i + MAX_ANSWER_CHARS + 2)
    for j in range(i, stop):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j], j + 1
    if len(text) - i > MAX_ANSWER_CHARS + 2:
        return text[i + 1 : stop], stop  # too long to be an answer; math_equal rejects it
    return None, len(text)


def extract_math_answer(completion: str) -> str | None:
    """The final answer written in `completion`, by the rules in the module docstring."""
    boxed = final_boxes(completion)
    if boxed:
        return ", ".join(boxed)  # several boxes: an answer list, which math_equal compares as a set
    # rfind, not a lazy regex: that would be quadratic on a long run of unclosed tags.
    tag_start = completion.rfind("<answer>")
    tag_end = completion.find("</answer>", tag_start)
    if tag_start >= 0 and tag_end >= 0:
        inner = completion[tag_start + len("<answer>") : tag_end]
        return ", ".join(final_boxes(inner)) or inner.strip()
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
