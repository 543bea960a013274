"""A calculator tool for arithmetic word problems: any dataset whose samples carry an `answer`.

The policy calls the tool by writing `<calc>EXPRESSION</calc>` in its turn; the environment's next message gives
each call's result, `<result>14</result>` (one line per call, in order; `<result>error: ...</result>` for an
expression it cannot compute). A turn without a call ends the episode; its reward is the math reward
(apmpo.rewards.math_reward: the final answer in \\boxed{}, ...) against the sample's `answer`.

The first prompt is the system prompt (SYSTEM_PROMPT, which replaces the sample's own), one worked episode as chat
turns (EXAMPLE: a question, a turn with a call, the result, the boxed answer) and the sample's question. The example
is what makes a small model use the tool at all: SmolLM2-135M-Instruct at temperature 0.7 on arith_test made no
call in 128 episodes with SYSTEM_PROMPT alone, nor in 64 each with a worked example written into the system prompt
(two wordings, as apmpo/data/arith.py does for its own prompt); with EXAMPLE as chat turns 26% of 128 episodes
called the tool (docs/multiturn.md, 2026-11-26). A subclass may set `example = []` or its own turns.

    user:      Tom has 3 bags of 4 apples and buys 2 more. How many apples?
    policy:    <calc>3*4+2</calc>
    user:      <result>14</result>
    policy:    He has \\boxed{14} apples.                                         -> reward 1.0

Expressions are numbers (integers and decimals), + - * / and parentheses, computed exactly (fractions) by a
small parser over Python's `ast`: nothing is evaluated as code. A result that is not an integer is written with
up to 10 significant digits.
"""
from __future__ import annotations

import ast
import re
from fractions import Fraction

SYSTEM_PROMPT = (
    "Solve the problem. You may use a calculator: write <calc>expression</calc> with numbers, + - * / and "
    "parentheses, and the next message gives <result>value</result> for each call. Put your final answer "
    "within \\boxed{}.")
# One worked episode, in the calculator's own format, shown as earlier chat turns before the question.
EXAMPLE = (
    {"role": "user", "content": "Ann has 4 pens and gets 3 more. How many pens does Ann have now?"},
    {"role": "assistant", "content": "Ann has 4 + 3 pens. <calc>4 + 3</calc>"},
    {"role": "user", "content": "<result>7</result>"},
    {"role": "assistant", "content": "The final answer is \\boxed{7}."},
)
CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
MAX_EXPRESSION_CHARS = 200  # bounds the time and the size of any result (no powers: at most ~10^200)
_OPERATORS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__,
              ast.Div: Fraction.__truediv__}


def calculate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; ValueError for anything else (or a division by zero)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError):
        raise ValueError("not an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(repr(node.value))  # 0.1 as written, not its binary approximation
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError("only numbers, + - * / and parentheses")


def format_value(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.10g}"


def tool_reply(action: str) -> str | None:
    """The environment's message for the calls in `action`, or None when it makes none."""
    calls = CALL.findall(action)
    if not calls:
        return None
    results = []
    for expression in calls:
        try:
            results.append(format_value(calculate(expression)))
        except (ValueError, OverflowError) as error:  # OverflowError: a fraction too large for a float
            results.append(f"error: {error}")
    return "\n".join(f"<result>{r}</result>" for r in results)


class CalculatorEnv:
    system_prompt = SYSTEM_PROMPT
    example: tuple[dict, ...] | list[dict] = EXAMPLE

    def reset(self, sample: dict) -> list[dict]:
        self.sample = sample
        question = [m for m in sample.get("messages", []) if m["role"] != "system"] or \
            [{"role": "user", "content": sample["question"]}]
        return [{"role": "system", "content": self.system_prompt}, *(dict(m) for m in self.example), *question]

    def step(self, action: str) -> tuple[str, float | None, bool]:
        reply = tool_reply(action)
        if reply is not None:
            return reply, None, False
        from apmpo.rewards.maths import math_reward  # noqa: PLC0415  (math-verify and sympy: only when scoring)

        return "", math_reward(action, self.sample), True
