"""Arithmetic word problems, GSM8K-like, generated in code: the built-in `arith_train` and `arith_test`.

    from apmpo.data import load_records
    train = load_records("arith_train")   # 8192 problems (data.train: arith_train)
    test = load_records("arith_test")     # 96 held-out problems (eval.benchmarks / --benchmarks arith_test)

A problem is a short story with one operation on small integers (+, -, x) and an integer answer, e.g.

    Mia had 12 marbles and gave 5 of them to a friend. How many marbles does Mia have left?   -> 7

It is asked with its own system prompt (SYSTEM_PROMPT: brief, one worked example, the \\boxed{} answer) and scored
by `data.reward: math`, which also reads "The answer is 7".

The machinery is shared with apmpo/data/twostep.py (two operations a story): a task is a WordProblems, templates
and sizes, and its two splits are disjoint by construction (WordProblems says how).

Difficulty, measured with SmolLM2-135M-Instruct (apmpo.models) through the server (64 to 256 samples a setting: the
figures move by about 0.04 between samples of that size):
- the first version, GSM8K-like, one or two operations on numbers up to 60, default math prompt: held-out pass@1
  0.002 at temperature 1 (256 tokens, 48% cut), 0.000 at 1 (128 tokens, 77% cut), 0.012 at 0.6 (160 tokens);
- one operation on one-digit numbers, default math prompt, temperature 0.7, 128 tokens: 0.00-0.14 by template
  (0.07 on average; 33-56% cut: the model states its sum, then loops or never says which number is the answer);
  0.46 greedy;
- the same with SYSTEM_PROMPT: 0.05-0.13 by template (0.09 on average; 22-38% cut);
- this dataset, through python -m apmpo.eval (64 held-out problems x 4, 128 tokens): pass@1 0.090 at temperature
  0.7 (30% cut, 82 tokens on average), 0.082 at 0.6, 0.109 at 0.5 (23% cut). Temperature is no lever here: the
  model's greedy answers are often right, its sampled ones lose the thread at any temperature.
"""
from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass
from typing import Callable

# --- the machinery: templates, a task, its splits ---------------------------------------------------------------

SEEDS = {"train": 0, "test": 1}  # of the random.Random that draws each split's rows

NAMES = ["Mia", "Liam", "Ava", "Noah", "Emma", "Lucas", "Sofia", "Omar", "Chen", "Priya", "Tom", "Zoe"]
# (plural, container) pairs: "3 bags with 6 marbles in each"
ITEMS = [("marbles", "bags"), ("apples", "baskets"), ("stickers", "sheets"), ("pencils", "boxes"),
         ("cookies", "trays"), ("stamps", "albums"), ("eggs", "cartons"), ("books", "shelves")]


@dataclass(frozen=True)
class Template:
    """A story with slots {name} {items} {box} and the number slots of every dict `numbers` lists; `answer`
    solves it."""
    text: str
    numbers: Callable[[], list[dict[str, int]]]
    answer: Callable[[dict[str, int]], int]


@dataclass(frozen=True)
class WordProblems:
    """A task of word problems from `templates`, the built-in datasets NAME_train and NAME_test.

    The splits are disjoint by construction: every problem (a template and its numbers, not its names or objects)
    is enumerated once and hashed, and one hash value in `held_out_every` belongs to the held-out side. The held-out
    split is `test_size` distinct problems of that side; training draws `train_size` from the other side, names and
    objects varied (rows from a seeded random.Random, the same on every machine and Python version)."""
    name: str
    templates: tuple[Template, ...]
    system_prompt: str
    train_size: int
    test_size: int
    held_out_every: int = 4  # one problem in 4 is held out

    def is_held_out(self, template: int, numbers: dict[str, int]) -> bool:
        """The split of a problem, by its template's index and its numbers only."""
        key = f"{template}:" + ",".join(f"{k}={v}" for k, v in sorted(numbers.items()))
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % self.held_out_every == 0

    def problems(self, held_out: bool) -> list[tuple[int, dict[str, int]]]:
        """Every (template index, numbers) of one side of the split, in a fixed order."""
        return [(index, numbers) for index, template in enumerate(self.templates) for numbers in template.numbers()
                if self.is_held_out(index, numbers) == held_out]

    def make_rows(self, split: str, size: int | None = None) -> list[dict]:
        """`size` rows {question, answer, template, numbers} of `split` ("train" or "test"), the same on every
        call. Held-out problems are distinct, so each counts once in pass@k; training draws its problems with
        replacement."""
        held_out = split == "test"
        size = size if size is not None else (self.test_size if held_out else self.train_size)
        rng = random.Random(SEEDS[split])
        side = self.problems(held_out)
        if held_out and size > len(side):
            raise ValueError(f"{self.name}_test has {len(side)} distinct problems, not {size}")
        chosen = rng.sample(side, size) if held_out else [rng.choice(side) for _ in range(size)]
        rows = []
        for index, numbers in chosen:
            name, (items, box) = rng.choice(NAMES), rng.choice(ITEMS)
            template = self.templates[index]
            question = template.text.format(name=name, items=items, box=box, **numbers)
            rows.append({"question": question, "answer": str(template.answer(numbers)), "template": index,
                         "numbers": numbers})
        return rows


# --- arith: one operation a story --------------------------------------------------------------------------------

# Asked as the system turn of every problem: short answers and a final answer the math reward finds. A worked
# example helps this model more than an instruction alone (above).
SYSTEM_PROMPT = ("Solve the problem briefly. Example:\n"
                 "Question: Ann has 4 pens and gets 3 more. How many pens does Ann have now?\n"
                 "Answer: 4 + 3 = 7. The final answer is \\boxed{7}.")


def _sums():
    return [{"a": a, "b": b} for a, b in itertools.product(range(2, 10), repeat=2)]


def _differences():
    return [{"a": a, "b": b} for a in range(3, 13) for b in range(1, a)]


def _products():
    return [{"a": a, "b": b} for a, b in itertools.product(range(2, 6), repeat=2)]


def _plus(n):
    return n["a"] + n["b"]


def _minus(n):
    return n["a"] - n["b"]


TEMPLATES = (
    Template("{name} has {a} {items} and buys {b} more. How many {items} does {name} have now?", _sums, _plus),
    Template("{name} had {a} {items} and found {b} more. How many {items} does {name} have now?", _sums, _plus),
    Template("There are {a} {items} on the table. {name} puts {b} more there. How many {items} are on the table now?",
             _sums, _plus),
    Template("{name} had {a} {items} and gave {b} of them to a friend. How many {items} does {name} have left?",
             _differences, _minus),
    Template("{name} had {a} {items} and lost {b} of them. How many {items} does {name} have left?",
             _differences, _minus),
    Template("There were {a} {items} in a box. {name} took {b} of them. How many {items} are in the box now?",
             _differences, _minus),
    Template("{name} has {a} {box} with {b} {items} in each. How many {items} does {name} have in all?",
             _products, lambda n: n["a"] * n["b"]),
)


# 8192 training problems (drawn from 3 x 64 sums, 3 x 65 differences and 16 products, less the held-out quarter),
# 96 held out.
ARITH = WordProblems("arith", TEMPLATES, SYSTEM_PROMPT, train_size=8192, test_size=96)
