"""Two-step arithmetic word problems: the built-in `twostep_train` and `twostep_test`, harder than arith's one step.

    from apmpo.data import load_records
    train = load_records("twostep_train")   # 8192 problems (data.train: twostep_train)
    test = load_records("twostep_test")     # 384 held-out problems (eval.benchmarks / --benchmarks twostep_test)
    mixed = load_records("arith_twostep_train")  # arith's and twostep's training problems, alternately

A problem is a short story with two operations on small integers (+, -, x) and an integer answer, e.g.

    Mia has 7 marbles and buys 5 more, then gives 3 of them to a friend. How many marbles does Mia have now?  -> 9

asked with a system prompt that works one such problem in two steps, and scored by `data.reward: math`. The
machinery (templates, disjoint splits by a hash of template and numbers, seeded rows) is arith's: WordProblems in
apmpo/data/arith.py.

Why a second task: SmolLM2-135M-Instruct learns arith to 80-90% pass@1 within 30 steps, where methods that explore
differently end alike. Here a fresh model starts lower and has further to go.

Difficulty, measured with SmolLM2-135M-Instruct as fetched, through `python -m apmpo.eval --benchmarks twostep_test
--n 4 --limit 128 --seeds 0 --temperature 0.7 --max-tokens 128 --max-model-len 256 --enforce-eager` (top-p 0.95, the
eval's default): pass@1 0.025 (13 of 512 samples; 0.031 on the first 64 problems, the ones training validates on),
41% cut at 128 tokens, 98 tokens on average. By template: a + b - c 6/100, a - b + c 4/104, a - b - c 3/92, and
none right of 136 a + b + c, 32 a x b + c, 48 a x b - c. 13 of the 128 problems had a right answer among their 4
samples: at 8 prompts x 4 samples a step, about one group a step has a reward to learn from (none in about 4 steps
of 10). The model's answers lose track of which number goes where ("he lost 2 * 5 = 10 stamps") or run past 128
tokens; 18% of them box a number, 48% say "the answer is".
"""
from __future__ import annotations

import itertools

from apmpo.data.arith import ARITH, Template, WordProblems

SYSTEM_PROMPT = ("Solve the problem briefly, one step at a time. Example:\n"
                 "Question: Ann has 4 pens and buys 3 more, then gives 2 of them to a friend. "
                 "How many pens does Ann have now?\n"
                 "Answer: 4 + 3 = 7. 7 - 2 = 5. The final answer is \\boxed{5}.")

DIGITS = range(2, 10)


def _add_then_subtract():
    return [{"a": a, "b": b, "c": c} for a, b, c in itertools.product(DIGITS, repeat=3) if c < a + b]


def _subtract_then_add():
    return [{"a": a, "b": b, "c": c} for a in range(3, 13) for b in range(1, a) for c in DIGITS]


def _add_twice():
    return [{"a": a, "b": b, "c": c} for a, b, c in itertools.product(DIGITS, repeat=3)]


def _subtract_twice():
    return [{"a": a, "b": b, "c": c} for a in range(4, 16) for b in range(1, 10) for c in range(1, 10) if b + c < a]


def _multiply_then_add():
    return [{"a": a, "b": b, "c": c} for a, b in itertools.product(range(2, 6), repeat=2) for c in DIGITS]


def _multiply_then_subtract():
    return [{"a": a, "b": b, "c": c} for a, b in itertools.product(range(2, 6), repeat=2) for c in range(1, 10)
            if c < a * b]


TEMPLATES = (
    Template("{name} has {a} {items} and buys {b} more, then gives {c} of them to a friend. "
             "How many {items} does {name} have now?", _add_then_subtract, lambda n: n["a"] + n["b"] - n["c"]),
    Template("{name} had {a} {items} and lost {b} of them, then found {c} more. How many {items} does {name} have now?",
             _subtract_then_add, lambda n: n["a"] - n["b"] + n["c"]),
    Template("{name} has {a} {items}, buys {b} more and then gets {c} more as a gift. "
             "How many {items} does {name} have now?", _add_twice, lambda n: n["a"] + n["b"] + n["c"]),
    Template("There were {a} {items} in a box. {name} took {b} of them and then a friend took {c} of them. "
             "How many {items} are in the box now?", _subtract_twice, lambda n: n["a"] - n["b"] - n["c"]),
    Template("{name} has {a} {box} with {b} {items} in each, and {c} more {items} on the table. "
             "How many {items} does {name} have in all?", _multiply_then_add, lambda n: n["a"] * n["b"] + n["c"]),
    Template("{name} has {a} {box} with {b} {items} in each and gives {c} {items} to a friend. "
             "How many {items} does {name} have left?", _multiply_then_subtract, lambda n: n["a"] * n["b"] - n["c"]),
)

TWOSTEP = WordProblems("twostep", TEMPLATES, SYSTEM_PROMPT, train_size=8192, test_size=384)


def one_and_two_step_rows(size: int = 8192) -> list[dict]:
    """The built-in `arith_twostep_train`: arith's training problems and twostep's, alternating, `size` in all.
    Trained on twostep's own problems for 30 steps (8 prompts x 4 samples), SmolLM2-135M-Instruct did not learn:
    reward 0-0.09 a step, validation 0.02-0.05 (APMPO, seed 0, 2026-11-29), because about one group a step had a
    reward in it. Half one-step problems, which it learns within 30 steps, give every step a signal, and twostep's
    held-out split (never trained on: each half comes from its task's training side) measures how far that goes
    on two steps. Asked with twostep's system prompt (a worked two-step example) throughout."""
    one, two = ARITH.make_rows("train", size // 2), TWOSTEP.make_rows("train", size - size // 2)
    return [row for pair in zip(two, one) for row in pair] + two[len(one):]

