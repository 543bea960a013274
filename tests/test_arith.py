"""The built-in arithmetic word problems: seeded, disjoint splits, answers that are what the story says."""
import collections

from apmpo.data import load_records
from apmpo.data.arith import TEMPLATES, TEST_SIZE, TRAIN_SIZE, is_held_out, make_rows
from apmpo.eval.run import resolve_benchmarks
from apmpo.rewards import math_reward


def _key(row):
    return row["template"], tuple(sorted(row["numbers"].items()))


def test_splits_are_seeded_sized_and_disjoint():
    train, test = make_rows("train"), make_rows("test")
    assert (len(train), len(test)) == (TRAIN_SIZE, TEST_SIZE)
    assert make_rows("train") == train and make_rows("test") == test  # the same rows every time
    assert not {_key(r) for r in train} & {_key(r) for r in test}
    assert len({_key(r) for r in test}) == TEST_SIZE  # held-out problems are distinct
    assert all(is_held_out(r["template"], r["numbers"]) for r in test)
    assert not any(is_held_out(r["template"], r["numbers"]) for r in train)
    # Every template in both splits, one and two operations alike.
    assert set(collections.Counter(r["template"] for r in test)) == set(range(len(TEMPLATES)))


def test_first_held_out_problems_and_their_answers_by_hand():
    test = make_rows("test")
    # (9 + 8) x 3 = 51; 26 + 29 = 55; (9 + 5) x 4 = 56
    assert [(r["question"], r["answer"]) for r in test[:3]] == [
        ("Liam fills 9 shelves on Monday and 8 shelves on Tuesday, with 3 books in each. How many books is that in "
         "all?", "51"),
        ("Priya has 26 marbles. She gets 29 more marbles. How many marbles does Priya have now?", "55"),
        ("Noah fills 9 boxes on Monday and 5 boxes on Tuesday, with 4 pencils in each. How many pencils is that in "
         "all?", "56"),
    ]


def test_answers_are_positive_integers_and_every_number_is_in_the_question():
    for row in make_rows("train", 2000):
        assert int(row["answer"]) > 0
        assert all(str(v) in row["question"] for v in row["numbers"].values())


def test_records_use_the_math_prompt_and_reward_and_the_eval_knows_the_benchmark():
    [record] = load_records("arith_test", limit=1)
    assert record["task"] == "math" and "\\boxed{}" in record["messages"][0]["content"]
    assert math_reward("3 x 17 = 51, so the answer is \\boxed{51}.", record) == 1.0
    assert math_reward("The final answer is 51.", record) == 1.0
    assert math_reward("\\boxed{50}", record) == 0.0
    [benchmark] = resolve_benchmarks("arith_test", limit=8)
    assert benchmark.reward == "math" and len(benchmark.records) == 8
