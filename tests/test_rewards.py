"""Verifiers (math, SQL, choice), the registry and the batch scorer, on real math-verify and sqlite."""
import concurrent.futures
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest

from apmpo.data import SPIDER_DB_ROOT, load_records
from apmpo.rewards import RewardPool, choice_reward, get_reward, math_reward, score_batch, sql_reward
from apmpo.data.answers import extract_math_answer, last_boxed
from apmpo.rewards.sql import QueryError, execute_readonly, execution_match, remove_distinct, spider_results_equal

CONCERT = str(SPIDER_DB_ROOT / "concert_singer" / "concert_singer.sqlite")


def test_rewards_do_not_import_torch():
    code = "import sys, apmpo.rewards; assert 'torch' not in sys.modules"
    assert os.system(f'{sys.executable} -c "{code}"') == 0


# --- math ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("gold, pred", [
    ("\\frac{7}{20}", "\\dfrac{7}{20}"),
    ("\\frac{7}{20}", "0.35"),
    (27.0, "27"),                              # amc23 gold is a float
    ("27", "27.0"),
    (70, "70"),                                # aime25 gold is an int
    ("10\\%", "10"),                           # math-verify accepts the percentage with or without %
    ("10\\%", "0.1"),
    ("1.6 \\mathrm{~cm}", "1.6"),              # minerva keeps units in the gold; they are ignored
    ("1.6", "1.6 \\text{ cm}"),
    ("[-2,7]", "[-2, 7]"),                     # interval
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\frac{\\pi}{2})"),  # tuple
    ("1,2", "2,1"),                            # a list of solutions is a set
    ("1.5 \\times 10^{3}", "1500"),            # scientific notation
    ("1500", "1.5e3"),                         # plain e-notation, rewritten before parsing
    ("3\\sqrt{2}", "\\sqrt{18}"),
    ("\\frac{1}{2n+2}", "\\frac{1}{2(n+1)}"),
    ("5", "x=5"),
    ("\\text{(C)}", "C"),
])
def test_math_equivalent_answers_score_one(gold, pred):
    assert math_reward(f"Work... so the answer is \\boxed{{{pred}}}.", {"answer": gold}) == 1.0


@pytest.mark.parametrize("gold, pred", [
    ("27", "28"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(\\frac{\\pi}{2}, 3)"),  # an ordered pair, swapped
    ("(-\\infty,3)", "(-\\infty, 3]"),        # open vs closed end
    ("2^{1009}", "2^{1008}"),
    ("6", "6.0000001"),
    ("\\frac{7}{20}", ""),
])
def test_math_wrong_answers_score_zero(gold, pred):
    assert math_reward(f"\\boxed{{{pred}}}", {"answer": gold}) == 0.0


def test_math_extraction_rules():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{a}{b^{2}}} c") == "\\frac{a}{b^{2}}"  # last, nested
    assert last_boxed("\\fbox{42}") == "42"
    assert last_boxed("so \\boxed 7 done") == "7"
    assert last_boxed("cut off \\boxed{\\frac{1}{2") is None
    assert extract_math_answer("I think <answer>60</answer>") == "60"
    assert extract_math_answer("Thus, the final answer is $3.5$. Done") == "3.5"
    assert extract_math_answer("no answer here, 42") is None  # no last-number fall-back
    assert math_reward("The answer is 42", {"answer": "42"}) == 1.0
    assert math_reward("The result is 42", {"answer": "42"}) == 0.0


def test_math_gold_comes_first():
    # The boxed prediction wins over an earlier "answer is"; the gold is never read from the completion.
    assert math_reward("the answer is 3, no wait: \\boxed{4}", {"answer": "4"}) == 1.0
    assert math_reward("\\boxed{3}", {"answer": "4"}) == 0.0


def test_math_huge_inputs_are_bounded():
    huge = "x" * 1_000_000 + "\\boxed{5}"
    start = time.monotonic()
    assert math_reward(huge, {"answer": "5"}) == 1.0
    assert math_reward("\\boxed{" + "1+" * 500_000 + "1}", {"answer": "5"}) == 0.0  # over MAX_ANSWER_CHARS
    assert math_reward("<answer>" * 100_000, {"answer": "5"}) == 0.0
    assert math_reward("\\boxed{" * 100_000, {"answer": "5"}) == 0.0
    assert time.monotonic() - start < 5.0


def test_math_works_off_the_main_thread():
    # math-verify's own SIGALRM timeouts would raise here; ours are disabled.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lambda p: math_reward(p, {"answer": "\\frac12"}), ["\\boxed{0.5}"] * 4)) == [1.0] * 4


# --- choice --------------------------------------------------------------------------------------

CHOICES = ["3", "10\\sqrt{3}", "12", "15"]


@pytest.mark.parametrize("completion, gold, expected", [
    ("So the answer is (B).", "B", 1.0),
    ("\\boxed{B}", "B", 1.0),
    ("**C**", "B", 0.0),
    ("A quick check shows B", "B", 1.0),         # "A" the article is not the last letter
    ("Bob says 12, so \\boxed{C}", "C", 1.0),
    ("\\boxed{10 \\sqrt{3}}", "B", 1.0),           # the option's text
    ("\\boxed{12}", "10\\sqrt{3}", 0.0),           # gold given as text
    ("\\boxed{10\\sqrt{3}}", "10\\sqrt{3}", 1.0),
    ("\\boxed{E}", "B", 0.0),                      # not an option
    ("no idea", "B", 0.0),
])
def test_choice_reward(completion, gold, expected):
    assert choice_reward(completion, {"answer": gold, "choices": CHOICES}) == expected


def test_choice_gold_as_index():
    assert choice_reward("\\boxed{D}", {"answer": 3, "choices": CHOICES}) == 1.0


# --- SQL -----------------------------------------------------------------------------------------

def test_sql_extraction_and_errors():
    gold = {"answer": "SELECT count(*) FROM singer", "db_path": CONCERT}
    assert sql_reward("Here:\n```sql\nSELECT 1\n```\nbetter:\n```sql\nSELECT count(*) FROM singer;\n```", gold) == 1.0
    assert sql_reward("SELECT count(*) FROM singer", gold) == 1.0  # no fence: the whole completion
    assert sql_reward("```sql\nSELEC count(*) FROM singer\n```", gold) == 0.0  # does not parse
    assert sql_reward("```sql\nSELECT count(*) FROM no_such_table\n```", gold) == 0.0
    assert sql_reward("```sql\nSELECT count(*) FROM singer; SELECT 1\n```", gold) == 0.0  # one statement only


def test_spider_rules():
    # Columns may be permuted; rows are a multiset unless the gold query orders them.
    assert execution_match("SELECT age, name FROM singer", "SELECT name, age FROM singer", CONCERT)
    assert execution_match("SELECT name FROM singer ORDER BY name DESC", "SELECT name FROM singer", CONCERT)
    assert not execution_match("SELECT name FROM singer ORDER BY age ASC", "SELECT name FROM singer ORDER BY age DESC",
                               CONCERT)
    # DISTINCT is removed from both queries (the official default), so duplicates count as rows.
    assert execution_match("SELECT country FROM singer", "SELECT DISTINCT country FROM singer", CONCERT)
    assert remove_distinct("SELECT DISTINCT name FROM t WHERE x = 'distinct'") == "SELECT  name FROM t WHERE x = 'distinct'"
    # Two empty results are equal, whatever their columns; an empty and a non-empty one are not.
    assert execution_match("SELECT name FROM singer WHERE age > 1000", "SELECT age, country FROM singer WHERE 0", CONCERT)
    assert not execution_match("SELECT name FROM singer WHERE 0", "SELECT name FROM singer", CONCERT)
    # Values compare with Python ==: 1 == 1.0.
    assert spider_results_equal([(1, "a")], [("a", 1.0)], order_matters=False)
    assert not spider_results_equal([(1, 1), (2, 2)], [(1, 1), (1, 1)], order_matters=False)  # multiset
    assert not spider_results_equal([(1,), (2,)], [(2,), (1,)], order_matters=True)


def test_bird_rule_compares_row_sets():
    sample = {"answer": "SELECT DISTINCT country FROM singer", "db_path": CONCERT, "metric": "bird"}
    assert sql_reward("SELECT country FROM singer", sample) == 1.0  # sets: duplicates vanish
    assert sql_reward("SELECT country, 1 FROM singer", sample) == 0.0  # no column permutation or projection
    assert sql_reward("SELECT 1", {**sample, "metric": "bird"}) == 0.0


@pytest.fixture()
def db_copy(tmp_path):
    path = tmp_path / "concert_singer.sqlite"
    shutil.copy(CONCERT, path)
    return str(path)


def _digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.mark.parametrize("hostile", [
    "DROP TABLE singer",
    "DELETE FROM singer",
    "UPDATE singer SET age = 0",
    "INSERT INTO singer (Singer_ID) VALUES (999)",
    "CREATE TABLE evil (x int)",
    "ATTACH DATABASE '{tmp}/evil.db' AS evil",
    "PRAGMA query_only = OFF",
    "PRAGMA journal_mode = DELETE",
    "VACUUM",
    "SELECT 1; DROP TABLE singer",
    "WITH x AS (SELECT 1) DELETE FROM singer",
])
def test_hostile_sql_cannot_change_the_database(db_copy, tmp_path, hostile):
    before = _digest(db_copy)
    sql = hostile.format(tmp=tmp_path)
    with pytest.raises(QueryError):
        execute_readonly(db_copy, sql)
    assert sql_reward(f"```sql\n{sql}\n```", {"answer": "SELECT count(*) FROM singer", "db_path": db_copy}) == 0.0
    assert _digest(db_copy) == before
    assert not (tmp_path / "evil.db").exists()
    assert execute_readonly(db_copy, "SELECT count(*) FROM singer") == [(6,)]


def test_runaway_query_is_interrupted():
    runaway = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT count(*) FROM r"
    start = time.monotonic()
    with pytest.raises(QueryError, match="timed out"):
        execute_readonly(CONCERT, runaway, timeout_s=0.5)
    assert time.monotonic() - start < 3.0


def _shuffled_columns(sql: str, rng: random.Random) -> str | None:
    """`SELECT a, b FROM` -> `SELECT b, a FROM` for a plain top-level select list, else None."""
    match = re.match(r"(?is)^\s*SELECT\s+(DISTINCT\s+)?(.*?)\s+FROM\s", sql)
    if not match or "(" in match.group(2) or " select " in sql.lower()[match.end():]:
        return None
    columns = [c.strip() for c in match.group(2).split(",")]
    if len(columns) < 2:
        return None
    shuffled = columns[:]
    while shuffled == columns:
        rng.shuffle(shuffled)
    return sql[: match.start(2)] + ", ".join(shuffled) + sql[match.end(2):]


def test_every_spider_gold_query_matches_itself_and_a_column_shuffle():
    records = load_records("spider")
    rng = random.Random(0)
    shuffled_checked = 0
    for record in records:
        assert sql_reward(f"```sql\n{record['answer']}\n```", record) == 1.0, record["answer"]
        shuffled = _shuffled_columns(record["answer"], rng)
        if shuffled is not None:
            assert sql_reward(shuffled, record) == 1.0, shuffled
            shuffled_checked += 1
    assert shuffled_checked > 150


# --- registry and batch scorer -------------------------------------------------------------------

def raising_reward(completion: str, sample: dict) -> float:
    raise RuntimeError("broken verifier")


def sleeping_reward(completion: str, sample: dict) -> float:
    if completion == "hang":
        time.sleep(3600)
    if completion.startswith("sleep "):
        time.sleep(float(completion.split()[1]))
    return 1.0


def dying_reward(completion: str, sample: dict) -> float:
    if completion == "die":
        os._exit(3)
    return 1.0


def odd_value_reward(completion: str, sample: dict):
    """Returns what the completion names: a NaN about 1 time in 20 is what made training silently stop."""
    # 1e300 and -1e39 are finite Python floats, and inf as the float32 that rewards are stored in; 3e38 is not.
    return {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "text": "1.0", "none": None,
            "int": 1, "bool": True, "1e300": 1e300, "-1e39": -1e39, "3e38": 3e38}.get(completion, 0.5)


def test_registry():
    assert get_reward("math") is math_reward and get_reward("sql") is sql_reward and get_reward("choice") is choice_reward
    assert get_reward("apmpo.rewards.maths:math_reward") is math_reward
    with pytest.raises(KeyError, match="unknown reward"):
        get_reward("maths")
    with pytest.raises(TypeError):
        get_reward("apmpo.rewards.maths:MAX_ANSWER_CHARS")


def test_batch_scores_match_serial_scores():
    records = load_records("math500", limit=12)
    completions = [f"\\boxed{{{r['answer']}}}" for r in records[:6]] + ["\\boxed{-12345}"] * 6
    scores, summary = score_batch("math", completions, records, timeout_s=30, num_workers=2)
    assert scores == [math_reward(c, r) for c, r in zip(completions, records)] == [1.0] * 6 + [0.0] * 6
    assert summary.errors == summary.timeouts == summary.crashes == summary.failures == 0


def test_batch_errors_are_scored_zero_counted_and_logged_once(caplog):
    scores, summary = score_batch(raising_reward, ["a"] * 5, [{}] * 5, timeout_s=10, num_workers=2)
    assert scores == [0.0] * 5
    assert summary.errors == summary.failures == 5 and summary.first_error == "RuntimeError: broken verifier"
    assert len([r for r in caplog.records if "broken verifier" in r.getMessage()]) == 1


def test_batch_hung_and_dead_workers_are_replaced():
    completions = ["ok", "hang", "ok", "die", "ok", "hang", "ok", "ok"]
    with RewardPool(num_workers=2, timeout_s=1.0) as pool:
        start = time.monotonic()
        scores, summary = pool.score(sleeping_reward, completions, [{}] * 8)
        assert time.monotonic() - start < 10
        assert scores == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0]
        assert summary.timeouts == summary.failures == 2
        scores, summary = pool.score(dying_reward, completions, [{}] * 8)
        assert scores == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0] and summary.crashes == summary.failures == 1
        # The pool still works after its workers were killed and replaced.
        assert pool.score("math", ["\\boxed{2}"], [{"answer": "2"}])[0] == [1.0]


def test_batch_each_item_gets_the_whole_timeout_though_items_wait_in_the_pipe():
    # One worker, an item queued behind each running one: 3 items of 0.6 s take 1.8 s, past the 1 s timeout,
    # yet each ran within it; and the items queued behind a hang are scored by its replacement.
    with RewardPool(num_workers=1, timeout_s=1.0) as pool:
        pool.score(sleeping_reward, ["ok"], [{}])  # the worker is up
        scores, summary = pool.score(sleeping_reward, ["sleep 0.6"] * 3, [{}] * 3)
        assert scores == [1.0] * 3 and summary.failures == 0
        scores, summary = pool.score(sleeping_reward, ["ok", "hang", "ok", "ok"], [{}] * 4)
        assert scores == [1.0, 0.0, 1.0, 1.0]
        assert summary.timeouts == summary.failures == 1 and summary.first_error == "item 1 ran past 1.0s"


def test_batch_a_large_item_never_waits_in_the_pipe_of_a_hung_worker():
    # Queued behind the hang, 1 MB would fill the pipe and block the pool in send() past every timeout.
    big = "ok" + " " * 1_000_000
    with RewardPool(num_workers=1, timeout_s=1.0) as pool:
        result = concurrent.futures.Future()
        threading.Thread(target=lambda: result.set_result(pool.score(sleeping_reward, ["hang", big, big], [{}] * 3)),
                         daemon=True).start()
        scores, summary = result.result(timeout=30)
        assert scores == [0.0, 1.0, 1.0] and summary.timeouts == 1


def test_batch_non_finite_and_non_numeric_rewards_are_failures(caplog):
    completions = ["ok", "nan", "ok", "inf", "-inf", "text", "none", "int", "bool", "ok", "1e300", "-1e39", "3e38"]
    scores, summary = score_batch(odd_value_reward, completions, [{}] * 13, timeout_s=10, num_workers=1)
    assert scores == [0.5, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0, 0.0, 3e38]
    assert summary.errors == summary.failures == 7
    assert summary.first_error == "ValueError: the reward returned nan, not a finite float32 number"
    assert len([r for r in caplog.records if "reward scoring failed" in r.getMessage()]) == 1


def test_batch_crash_reports_the_exit_code():
    scores, summary = score_batch(dying_reward, ["ok", "die"], [{}] * 2, timeout_s=10, num_workers=1)
    assert scores == [1.0, 0.0] and summary.crashes == 1
    assert summary.first_error == "worker exited with code 3"


def test_batch_deadline_bounds_a_call():
    completions = ["ok", "hang", "hang", "ok", "ok"]
    with RewardPool(num_workers=2, timeout_s=60.0) as pool:
        pool.score(sleeping_reward, ["ok"] * 2, [{}] * 2)  # the workers are up
        start = time.monotonic()
        scores, summary = pool.score(sleeping_reward, completions, [{}] * 5, deadline=start + 2.0)
        assert 2.0 <= time.monotonic() - start < 5.0
        # Two workers: "ok" is scored, both "hang"s run into the deadline, the last two never start.
        assert scores == [1.0, 0.0, 0.0, 0.0, 0.0]
        assert summary.timeouts == summary.failures == 4
        assert summary.first_error == "item 1 ran past the call's deadline"


def test_batch_worker_killed_while_idle_is_replaced_without_a_failure():
    with RewardPool(num_workers=1, timeout_s=10.0) as pool:
        pool.score(sleeping_reward, ["ok"], [{}])
        pool._workers[0].process.kill()  # as the OOM killer would, between two calls
        pool._workers[0].process.join()
        scores, summary = pool.score(sleeping_reward, ["ok", "ok"], [{}] * 2)
        assert scores == [1.0, 1.0] and summary.failures == 0


def test_batch_refuses_a_reward_defined_in_main():
    def reward(completion: str, sample: dict) -> float:
        return 1.0

    reward.__module__ = "__main__"  # as if defined in the script being run: workers cannot import it
    with pytest.raises(ValueError, match="defined in the script being run"):
        score_batch(reward, ["a"], [{}], num_workers=1)


def test_reward_workers_do_not_rerun_the_callers_main():
    """In training, the caller's __main__ is launch/train.py (torch, DeepSpeed). A forkserver child re-runs it
    unless told not to: every replaced worker then spent seconds importing, so a crash cost most of an item's
    timeout (4.2 s of 5 s), and every worker held torch."""
    done = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "reward_pool_main.py")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["loaded"] == [0.0, 1.0]  # torch is not in the workers, the preloaded verifiers are
    assert result["scores"] == [0.0, 1.0] * 4
    summary = result["summary"]
    assert summary["crashes"] == summary["failures"] == 4 and summary["first_error"] == "worker exited with code 3"
    assert result["seconds"] < 2.0  # 4 crashes, each a fork from the preloaded server


def test_batch_pathological_latex_times_out():
    completions = ["\\boxed{9^{9^{9^{9^{9}}}}}", "\\boxed{2}"]
    scores, summary = score_batch("math", completions, [{"answer": "1"}, {"answer": "2"}], timeout_s=2, num_workers=2)
    assert scores == [0.0, 1.0]
    assert summary.timeouts + summary.errors <= 1


def test_hung_items_time_out_side_by_side():
    """One worker, four hung items among four good ones: one after another they would cost four 2 s timeouts (8 s);
    a stalled worker's next items go to an extra worker, so the hangs overlap."""
    from failing_rewards import hang_on_hang

    completions = ["hang", "ok", "hang", "ok", "hang", "ok", "hang", "ok"]
    with RewardPool(num_workers=1, timeout_s=2.0) as pool:
        pool.score(hang_on_hang, ["ok"], [{}])  # started up, the reward's module imported
        start = time.monotonic()
        scores, summary = pool.score(hang_on_hang, completions, [{}] * 8)
        elapsed = time.monotonic() - start
        assert scores == [0.0, 1.0] * 4 and summary.timeouts == summary.failures == 4
        assert elapsed < 6.0, elapsed  # about 4 x 0.5 s to see each stall, and one 2 s timeout
        assert len(pool._workers) == 1  # the extra workers went with the call


def test_a_call_stops_once_the_failures_pass_max_failures():
    from failing_rewards import hang_on_hang

    with RewardPool(num_workers=1, timeout_s=1.0) as pool:
        pool.score(hang_on_hang, ["ok"], [{}])
        start = time.monotonic()
        scores, summary = pool.score(hang_on_hang, ["hang"] * 20, [{}] * 20, max_failures=2)
        elapsed = time.monotonic() - start
    # Three failures decide it; hangs that timed out in the same instant count too, the rest are never scored.
    assert scores == [0.0] * 20 and summary.timeouts >= 3
    assert summary.timeouts + summary.unscored == summary.failures == 20
    assert elapsed < 5.0, elapsed  # 20 hangs one after another: 20 s


def test_a_reward_that_allocates_too_much_fails_at_once():
    from failing_rewards import allocate

    with RewardPool(num_workers=1, timeout_s=30.0, memory_mb=1024) as pool:
        start = time.monotonic()
        scores, summary = pool.score(allocate, ["2048", "16"], [{}] * 2)
        assert time.monotonic() - start < 10.0
    assert scores == [0.0, 1.0] and summary.errors == summary.failures == 1
    assert summary.first_error.startswith("MemoryError")
