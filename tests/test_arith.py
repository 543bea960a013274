"""The built-in word problems (arith: one step, twostep: two): seeded, disjoint splits, answers that are what the
story says."""
import collections
import hashlib
import json
import re

import pytest

from apmpo.data import load_records
from apmpo.data.arith import ARITH
from apmpo.data.twostep import TWOSTEP
from apmpo.eval.run import resolve_benchmarks
from apmpo.rewards import math_reward


def _key(row):
    return row["template"], tuple(sorted(row["numbers"].items()))


@pytest.mark.parametrize("task", [ARITH, TWOSTEP], ids=lambda task: task.name)
def test_splits_are_seeded_sized_and_disjoint(task):
    train, test = task.make_rows("train"), task.make_rows("test")
    assert (len(train), len(test)) == (task.train_size, task.test_size)
    assert task.make_rows("train") == train and task.make_rows("test") == test  # the same rows every time
    assert not {_key(r) for r in train} & {_key(r) for r in test}
    assert len({_key(r) for r in test}) == task.test_size  # held-out problems are distinct
    assert all(task.is_held_out(r["template"], r["numbers"]) for r in test)
    assert not any(task.is_held_out(r["template"], r["numbers"]) for r in train)
    # Every template in both splits.
    assert set(collections.Counter(r["template"] for r in test)) == set(range(len(task.templates)))
    assert set(collections.Counter(r["template"] for r in train)) == set(range(len(task.templates)))


def test_the_two_sides_are_every_problem_once():
    # arith: 3 x 8 x 8 sums (2..9 each), 3 x 65 differences (a in 3..12, b in 1..a-1), 4 x 4 products (2..5 each)
    assert len(ARITH.problems(True)) + len(ARITH.problems(False)) == 3 * 64 + 3 * 65 + 16 == 403
    # twostep, digits 2..9 unless said. a + b - c with c < a + b: 512 less the (a, b, c) with a + b <= c, which are
    # 1 x 6 + 2 x 5 + 3 x 4 + 4 x 3 + 5 x 2 + 6 x 1 = 56 (a + b = 4..9: that many pairs, c from a + b to 9).
    # a - b + c with a in 3..12, b in 1..a-1: 65 x 8. a + b + c: 512. a - b - c with a in 4..15, b and c in 1..9,
    # b + c < a: the pairs (b, c) with b + c <= a - 1, by a: 3+6+10+15+21+28+36+45+53+60+66+71 = 414.
    # a x b + c with a and b in 2..5: 16 x 8. a x b - c with c in 1..9 below a x b, min(a x b - 1, 9) of them, by a:
    # (3 + 5 + 7 + 9) + (5 + 8 + 9 + 9) + (7 + 9 + 9 + 9) + 4 x 9 = 125.
    sizes = [456, 520, 512, 414, 128, 125]
    for index, size in enumerate(sizes):
        assert sum(1 for held_out in (True, False) for i, _ in TWOSTEP.problems(held_out) if i == index) == size
    assert len(TWOSTEP.problems(True)) + len(TWOSTEP.problems(False)) == sum(sizes) == 2155
    # The held-out side is large enough for its split, with room (a quarter of 2155 is about 539).
    assert len(TWOSTEP.problems(True)) == 556 > TWOSTEP.test_size == 384


@pytest.mark.parametrize("task", [ARITH, TWOSTEP], ids=lambda task: task.name)
def test_asking_for_more_held_out_problems_than_there_are_fails(task):
    held_out = len(task.problems(True))
    with pytest.raises(ValueError, match=f"{task.name}_test has {held_out} distinct problems, not {held_out + 1}"):
        task.make_rows("test", held_out + 1)


def test_arith_rows_are_those_the_committed_study_used():
    # sha256 of the rows as JSON, taken before the machinery was shared with twostep (studies/smollm2_arith).
    digests = {split: hashlib.sha256(json.dumps(ARITH.make_rows(split), sort_keys=True).encode()).hexdigest()
               for split in ("train", "test")}
    assert digests == {"train": "3770f7204da437d0e13d426ed14ed4ef4ee63ec54391b0391968860ac6459379",
                       "test": "7554e34071e7ccd23f542aa916aa19871709f3894c023ddd614b3d89923346fb"}


def test_first_held_out_problems_and_their_answers_by_hand():
    # 3 + 6 = 9; 10 - 2 = 8; 7 + 2 = 9
    assert [(r["question"], r["answer"]) for r in ARITH.make_rows("test")[:3]] == [
        ("Ava had 3 stickers and found 6 more. How many stickers does Ava have now?", "9"),
        ("Chen had 10 pencils and lost 2 of them. How many pencils does Chen have left?", "8"),
        ("Mia has 7 pencils and buys 2 more. How many pencils does Mia have now?", "9"),
    ]


@pytest.mark.parametrize("task", [ARITH, TWOSTEP], ids=lambda task: task.name)
def test_answers_are_positive_integers_and_every_number_is_in_the_question(task):
    for row in task.make_rows("train", 2000) + task.make_rows("test"):
        assert int(row["answer"]) > 0
        assert all(f" {v} " in row["question"] for v in row["numbers"].values())


# Each verb's operation on the running count, read from the story: "buys 5 more" adds, "gives 3 of them" takes.
VERBS = {"buys": 1, "found": 1, "gets": 1, "and": 1, "lost": -1, "took": -1, "gives": -1}


def _solve(question):
    """A twostep story's answer from its text alone: "3 bags with 4 marbles in each" is 3 x 4, the first other
    number starts the count, and each later one is added or taken by the word before it."""
    product = re.search(r"(\d+) \w+ with (\d+) \w+ in each", question)
    count = int(product[1]) * int(product[2]) if product else None
    for verb, number in re.findall(r"(\w+) (\d+)", question[product.end():] if product else question):
        count = int(number) if count is None else count + VERBS[verb] * int(number)
    return count


def test_every_twostep_answer_is_what_its_story_says():
    rows = TWOSTEP.make_rows("train", 3000) + TWOSTEP.make_rows("test")
    assert set(collections.Counter(r["template"] for r in rows)) == set(range(len(TWOSTEP.templates)))
    for row in rows:
        assert row["answer"] == str(_solve(row["question"])), row["question"]
    # Every problem of every template, in its own words (names and objects do not change the arithmetic).
    for index, numbers in TWOSTEP.problems(True) + TWOSTEP.problems(False):
        question = TWOSTEP.templates[index].text.format(name="Mia", items="marbles", box="bags", **numbers)
        assert TWOSTEP.templates[index].answer(numbers) == _solve(question) > 0, question
    # By hand: 7 + 5 - 3 = 9; 3 x 4 + 2 = 14; 12 - 4 - 5 = 3
    assert _solve("Mia has 7 marbles and buys 5 more, then gives 3 of them to a friend. How many?") == 9
    assert _solve("Mia has 3 bags with 4 marbles in each, and 2 more marbles on the table. How many?") == 14
    assert _solve("There were 12 eggs in a box. Tom took 4 of them and then a friend took 5 of them.") == 3


def test_records_use_the_datasets_prompt_and_the_math_reward_and_the_eval_knows_the_benchmark():
    [record] = load_records("arith_test", limit=1)
    assert record["task"] == "math" and record["messages"][0] == {"role": "system", "content": ARITH.system_prompt}
    assert "\\boxed{7}" in ARITH.system_prompt
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


def test_twostep_records_and_the_prompts_worked_example():
    [record] = load_records("twostep_test", limit=1)
    assert record["messages"][0] == {"role": "system", "content": TWOSTEP.system_prompt}
    assert record["question"] == TWOSTEP.make_rows("test")[0]["question"]
    # The example's own story and answer agree: 4 + 3 = 7, 7 - 2 = 5.
    example = re.search(r"Question: (.*)\nAnswer: (.*)", TWOSTEP.system_prompt)
    assert _solve(example[1]) == 5 and math_reward(example[2], {"answer": "5"}) == 1.0
    [benchmark] = resolve_benchmarks("twostep_test", limit=64)
    assert benchmark.reward == "math" and len(benchmark.records) == 64


def test_the_one_and_two_step_training_set_holds_each_tasks_training_problems_alternately():
    rows = load_records("arith_twostep_train")
    arith, twostep = ARITH.make_rows("train", 4096), TWOSTEP.make_rows("train", 4096)
    assert len(rows) == 8192
    assert [r["question"] for r in rows[0::2]] == [r["question"] for r in twostep]
    assert [r["question"] for r in rows[1::2]] == [r["question"] for r in arith]
    assert all(r["messages"][0] == {"role": "system", "content": TWOSTEP.system_prompt} for r in rows)
    # Neither held-out split is trained on: every problem comes from its own task's training side.
    for task, half in ((ARITH, arith), (TWOSTEP, twostep)):
        assert not any(task.is_held_out(r["template"], r["numbers"]) for r in half)
