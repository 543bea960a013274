"""The built-in arithmetic word problems: seeded, disjoint splits, answers that are what the story says."""
import collections

import pytest

from apmpo.data import load_records
from apmpo.data.arith import SYSTEM_PROMPT, TEMPLATES, TEST_SIZE, TRAIN_SIZE, is_held_out, make_rows, problems
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
    # Every template in both splits; the two sides together are every problem, once.
    assert set(collections.Counter(r["template"] for r in test)) == set(range(len(TEMPLATES)))
    assert set(collections.Counter(r["template"] for r in train)) == set(range(len(TEMPLATES)))
    # 3 x 8 x 8 sums (2..9 each), 3 x 65 differences (a in 3..12, b in 1..a-1), 4 x 4 products (2..5 each)
    assert len(problems(True)) + len(problems(False)) == 3 * 64 + 3 * 65 + 16 == 403


def test_asking_for_more_held_out_problems_than_there_are_fails():
    with pytest.raises(ValueError, match=f"arith_test has {len(problems(True))} distinct problems, not 200"):
        make_rows("test", 200)


def test_first_held_out_problems_and_their_answers_by_hand():
    # 3 + 6 = 9; 10 - 2 = 8; 7 + 2 = 9
    assert [(r["question"], r["answer"]) for r in make_rows("test")[:3]] == [
        ("Ava had 3 stickers and found 6 more. How many stickers does Ava have now?", "9"),
        ("Chen had 10 pencils and lost 2 of them. How many pencils does Chen have left?", "8"),
        ("Mia has 7 pencils and buys 2 more. How many pencils does Mia have now?", "9"),
    ]


def test_answers_are_positive_integers_and_every_number_is_in_the_question():
    for row in make_rows("train", 2000) + make_rows("test"):
        assert int(row["answer"]) > 0
        assert all(f" {v} " in row["question"] for v in row["numbers"].values())


def test_records_use_the_datasets_prompt_and_the_math_reward_and_the_eval_knows_the_benchmark():
    [record] = load_records("arith_test", limit=1)
    assert record["task"] == "math" and record["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert "\\boxed{7}" in SYSTEM_PROMPT
    # A caller's system prompt still wins (data.system_prompt, eval --system-prompt); "" means none.
    [own] = load_records("arith_test", limit=1, system_prompt="Be brief.")
    assert own["messages"][0] == {"role": "system", "content": "Be brief."}
    assert load_records("arith_test", limit=1, system_prompt="")[0]["messages"][0]["role"] == "user"
    # The answer formats this model writes: the example's, and MetaMath's "The answer is: 9".
    assert math_reward("3 + 6 = 9. The final answer is \\boxed{9}.", record) == 1.0
    assert math_reward("#### 9\nThe answer is: 9", record) == 1.0
    assert math_reward("3 + 6 = 9 stickers.", record) == 0.0  # no final answer stated
    assert math_reward("\\boxed{8}", record) == 0.0
    [benchmark] = resolve_benchmarks("arith_test", limit=8)
    assert benchmark.reward == "math" and len(benchmark.records) == 8
    assert benchmark.records[0]["messages"] == record["messages"]
