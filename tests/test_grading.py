"""Grading as the references grade (issue 13): several boxed answers read as a set (math-verify), and SQL predictions
normalised as Spider's official test-suite evaluation does before they run. Real math-verify, real sqlite."""
import pytest
from math_verify import parse, verify

from apmpo.data import SPIDER_DB_ROOT
from apmpo.rewards import math_reward, sql_reward
from apmpo.data.answers import MAX_FINAL_BOXES, extract_math_answer, final_boxes
from apmpo.rewards.sql import spider_normalize

CONCERT = str(SPIDER_DB_ROOT / "concert_singer" / "concert_singer.sqlite")


@pytest.mark.parametrize("completion, gold, reward", [
    ("So x = 2 or x = 3: \\boxed{2} and \\boxed{3}", "2, 3", 1.0),   # two boxes are the answer list "2, 3"
    ("\\boxed{3} and \\boxed{2}", "2, 3", 1.0),                        # ... compared as a set
    ("\\boxed{2} and \\boxed{3}", "\\{2,3\\}", 1.0),
    ("\\boxed{2}, \\boxed{3}", "{2,3}", 1.0),
    ("$\\boxed{2}$ or $\\boxed{3}$.", "3, 2", 1.0),                    # inside inline math
    ("\\boxed{(1,2)}, \\boxed{(2,1)}", "(2,1),(1,2)", 1.0),            # a set of ordered pairs
    ("\\boxed{(1,2)}, \\boxed{(2,1)}", "(1,2)", 0.0),                  # one pair is not the answer
    ("\\boxed{(1,2)}, \\boxed{(1,2)}", "(1,2),(2,1)", 0.0),
    ("\\boxed{2} and \\boxed{3}", "2", 0.0),                           # a superset is wrong
    ("\\boxed{2}", "2, 3", 0.0),                                       # so is a subset
    ("First \\boxed{2}. On reflection that is wrong, so \\boxed{3}", "3", 1.0),  # text between: the last box only
    ("First \\boxed{2}. On reflection that is wrong, so \\boxed{3}", "2, 3", 0.0),
    ("The solutions are 2 and 3", "2, 3", 0.0),                        # still no fall-back to unboxed numbers
    ("\\boxed{2} and \\boxed{3", "2", 0.0),                            # the last box cut off: no answer
])
def test_several_boxes_are_one_answer_set(completion, gold, reward):
    assert math_reward(completion, {"answer": gold}) == reward


# Boxes joined by LaTeX (issue 31, item 17): spacing, \text{} of a joining phrase, math delimiters. math-verify's own
# test cases expect a match for these; ours graded them 0 (only ",", "and", "or" joined boxes).
LATEX_JOINS = [
    "\\boxed{2} \\quad \\text{and} \\quad \\boxed{3}",
    "\\boxed{2} \\text{ for part (a) and } \\boxed{3}",
    "\\( \\boxed{2} \\) and \\( \\boxed{3} \\)",
    "\\[ \\boxed{2} \\] or \\[ \\boxed{3} \\]",
    "\\boxed{2} \\qquad \\boxed{3}",
    "\\boxed{2},\\, \\boxed{3}",
    "\\boxed{2} ~and~ \\boxed{3}",
    "\\boxed{2} \\text{or} \\boxed{3}",
]


@pytest.mark.parametrize("completion", LATEX_JOINS)
def test_boxes_joined_by_latex_are_one_answer_set_as_math_verify_reads_them(completion):
    assert final_boxes(completion) == ["2", "3"]
    for gold, reward in (("2, 3", 1.0), ("3, 2", 1.0), ("3", 0.0), ("2", 0.0)):
        assert math_reward(completion, {"answer": gold}) == reward
        assert verify(parse(f"${gold}$"), parse(completion)) == bool(reward)  # math-verify's own reading agrees


@pytest.mark.parametrize("completion", [
    "\\boxed{2} \\text{, so the other is } \\boxed{3}",  # \text{} of more than a joining phrase
    "\\boxed{2} \\text{andrew} \\boxed{3}",
    "\\boxed{2} \\quadratic \\boxed{3}",             # not \quad
    "\\boxed{2} \\boxed{3}",                           # whitespace alone
    "$\\boxed{2}$ $\\boxed{3}$",                         # or math delimiters alone
    "\\[ \\boxed{2} \\] \\[ \\boxed{3} \\]",
])
def test_other_text_between_boxes_still_keeps_the_last_box_only(completion):
    assert final_boxes(completion) == ["3"]


def test_final_boxes_reads_the_last_run_only_and_at_most_six():
    assert final_boxes("\\boxed{1} text \\boxed{2}, \\boxed{3} and \\fbox{4}") == ["2", "3", "4"]
    assert final_boxes("no box") == [] and extract_math_answer("no box") is None
    many = ", ".join(f"\\boxed{{{i}}}" for i in range(9))
    assert final_boxes(many) == [str(i) for i in range(9 - MAX_FINAL_BOXES, 9)]
    assert extract_math_answer("<answer>\\boxed{1} and \\boxed{5}</answer>") == "1, 5"


def test_spider_normalize_matches_the_official_postprocess():
    # exec_eval.postprocess, replace_cur_year, and evaluation.evaluate's " value " for predictions only
    assert spider_normalize("a > = 1 AND b < = 2 AND c ! = 3", predicted=True) == "a >= 1 AND b <= 2 AND c != 3"
    assert spider_normalize("SELECT YEAR ( CURDATE ( ) ) - age", predicted=False) == "SELECT 2020- age"
    assert spider_normalize("WHERE x = value LIMIT 1", predicted=True) == "WHERE x = 1 LIMIT 1"
    assert spider_normalize("WHERE x = value LIMIT 1", predicted=False) == "WHERE x = value LIMIT 1"


@pytest.mark.parametrize("pred", [
    "SELECT count(*) FROM singer WHERE age > = 32",      # sqlite: near "=": syntax error, without the normalisation
    "SELECT count(*) FROM singer WHERE NOT age < = 31",
    "SELECT count(*) FROM singer WHERE age ! = 25 AND age > 30",
    "SELECT count(*) FROM singer WHERE YEAR(CURDATE()) - age <= 1988",
])
def test_spider_predictions_run_after_the_official_normalisation(pred):
    # Ages 52, 32, 29, 41, 43, 25: four singers are 32 or older (born 1988 or before, counting from 2020).
    sample = {"answer": "SELECT count(*) FROM singer WHERE age >= 32", "db_path": CONCERT, "metric": "spider"}
    assert sql_reward(f"```sql\n{pred}\n```", sample) == 1.0
    # BIRD's evaluation runs the prediction as written.
    assert sql_reward(f"```sql\n{pred}\n```", {**sample, "metric": "bird"}) == 0.0
