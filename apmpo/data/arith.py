"""Arithmetic word problems, GSM8K-like, generated in code: the built-in `arith_train` and `arith_test`.

    from apmpo.data import load_records
    train = load_records("arith_train")   # 8192 problems (data.train: arith_train)
    test = load_records("arith_test")     # 256 held-out problems (eval.benchmarks / --benchmarks arith_test)

A problem is a short story with one or two operations on small integers (+, -, x, exact division) and an
integer answer, e.g.

    Mia has 14 marbles. She buys 3 bags with 6 marbles in each. How many marbles does Mia have now?   -> 32

It is asked with the math system prompt (\\boxed{} instruction) and scored by `data.reward: math`.

The two splits are disjoint by construction: a problem's template and numbers (not its names or objects) are
hashed, and one hash value in HELD_OUT_EVERY belongs to the held-out side; each split draws only from its side
(rows from a seeded random.Random, the same on every machine and Python version).

Difficulty, measured with SmolLM2-135M-Instruct (apmpo.models) through python -m apmpo.eval: held-out pass@1 0.002
at temperature 1 (128 problems x 4, 256 tokens; 48% of samples cut) and 0.012 at 0.6 / top-p 0.95 (64 x 4, 160
tokens; 41% cut): far too hard as it stands, below the 0.1-0.6 a learning curve needs. Still to do: easier
templates (one operation, smaller numbers) or another system prompt, measured again.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Callable

TRAIN_SIZE = 8192
TEST_SIZE = 256
HELD_OUT_EVERY = 8  # one problem key in 8 is held out
SEEDS = {"train": 0, "test": 1}

NAMES = ["Mia", "Liam", "Ava", "Noah", "Emma", "Lucas", "Sofia", "Omar", "Chen", "Priya", "Tom", "Zoe"]
# (plural, container) pairs: "3 bags with 6 marbles in each"
ITEMS = [("marbles", "bags"), ("apples", "baskets"), ("stickers", "sheets"), ("pencils", "boxes"),
         ("cookies", "trays"), ("stamps", "albums"), ("eggs", "cartons"), ("books", "shelves")]
PRONOUN = {"Mia": "She", "Ava": "She", "Emma": "She", "Sofia": "She", "Priya": "She", "Zoe": "She"}


@dataclass(frozen=True)
class Template:
    """A story with slots {name} {he} {items} {box} and number slots; `numbers` draws them, `answer` solves."""
    text: str
    numbers: Callable[[random.Random], dict[str, int]]
    answer: Callable[[dict[str, int]], int]


def _ab(rng: random.Random, lo: int = 2, hi: int = 40) -> dict[str, int]:
    return {"a": rng.randint(lo, hi), "b": rng.randint(lo, hi)}


def _sub(rng):
    a = rng.randint(10, 60)
    return {"a": a, "b": rng.randint(2, a - 1)}


def _mul(rng):
    return {"a": rng.randint(2, 9), "b": rng.randint(2, 12)}


def _div(rng):
    a, b = rng.randint(2, 12), rng.randint(2, 9)
    return {"a": a * b, "b": b}


def _mul_add(rng):
    return {**_mul(rng), "c": rng.randint(2, 30)}


def _mul_sub(rng):
    n = _mul(rng)
    return {**n, "c": rng.randint(2, n["a"] * n["b"] - 1)}


def _add_sub(rng):
    a, b = rng.randint(5, 40), rng.randint(2, 30)
    return {"a": a, "b": b, "c": rng.randint(2, a + b - 1)}


def _add_mul(rng):
    return {"a": rng.randint(2, 9), "b": rng.randint(2, 9), "c": rng.randint(2, 6)}


def _div_add(rng):
    return {**_div(rng), "c": rng.randint(2, 20)}


TEMPLATES = [
    # one operation
    Template("{name} has {a} {items}. {he} gets {b} more {items}. How many {items} does {name} have now?",
             _ab, lambda n: n["a"] + n["b"]),
    Template("{name} had {a} {items} and gave {b} of them to a friend. How many {items} does {name} have left?",
             _sub, lambda n: n["a"] - n["b"]),
    Template("{name} has {b} {box} with {a} {items} in each. How many {items} does {name} have in all?",
             _mul, lambda n: n["a"] * n["b"]),
    Template("{name} shares {a} {items} equally among {b} friends. How many {items} does each friend get?",
             _div, lambda n: n["a"] // n["b"]),
    # two operations
    Template("{name} has {c} {items}. {he} buys {b} {box} with {a} {items} in each. How many {items} does {name} "
             "have now?", _mul_add, lambda n: n["a"] * n["b"] + n["c"]),
    Template("{name} has {b} {box} with {a} {items} in each, and gives away {c} {items}. How many {items} are left?",
             _mul_sub, lambda n: n["a"] * n["b"] - n["c"]),
    Template("{name} has {a} {items}, finds {b} more, and then loses {c}. How many {items} does {name} have now?",
             _add_sub, lambda n: n["a"] + n["b"] - n["c"]),
    Template("{name} fills {a} {box} on Monday and {b} {box} on Tuesday, with {c} {items} in each. How many "
             "{items} is that in all?", _add_mul, lambda n: (n["a"] + n["b"]) * n["c"]),
    Template("{name} splits {a} {items} equally into {b} {box}, then adds {c} {items} to one of them. How many "
             "{items} are in that one now?", _div_add, lambda n: n["a"] // n["b"] + n["c"]),
]


def is_held_out(template: int, numbers: dict[str, int]) -> bool:
    """The split of a problem, by its template and numbers only."""
    key = f"{template}:" + ",".join(f"{k}={v}" for k, v in sorted(numbers.items()))
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % HELD_OUT_EVERY == 0


def make_rows(split: str, size: int | None = None) -> list[dict]:
    """`size` rows {question, answer} of `split` ("train" or "test"), the same on every call."""
    held_out = split == "test"
    size = size if size is not None else (TEST_SIZE if held_out else TRAIN_SIZE)
    rng = random.Random(SEEDS[split])
    rows, seen = [], set()
    while len(rows) < size:
        index = rng.randrange(len(TEMPLATES))
        template = TEMPLATES[index]
        numbers = template.numbers(rng)
        name, (items, box) = rng.choice(NAMES), rng.choice(ITEMS)
        key = (index, tuple(sorted(numbers.items())))
        # Held-out problems are distinct, so each counts once in pass@k; training may see a problem again.
        if is_held_out(index, numbers) != held_out or (held_out and key in seen):
            continue
        seen.add(key)
        question = template.text.format(name=name, he=PRONOUN.get(name, "He"), items=items, box=box, **numbers)
        rows.append({"question": question, "answer": str(template.answer(numbers)), "template": index,
                     "numbers": numbers})
    return rows
