"""SQL answers: execution accuracy against a sqlite database that generated SQL can never change.

The predicted SQL is the last fenced ```sql block of the completion (else the last ``` block, else
the whole completion). Both queries run on `sample["db_path"]`, and the results are compared by
`sample["metric"]`:

- "spider" (default), the official rule of Spider's test-suite evaluation (exec_eval.py):
  both queries get its normalisation first (`spider_normalize`), DISTINCT is removed from both;
  rows are a multiset, or a list when the gold query has ORDER BY; columns may be permuted; values
  compare with Python `==`; two empty results are equal.
- "bird", BIRD's rule: `set(pred_rows) == set(gold_rows)`, queries run as written.

Safety: the database is opened read-only (apmpo.data.sqlite: a `mode=ro` URI with `PRAGMA query_only`, an
authorizer that allows reading only, no ATTACH, PRAGMA, writes or schema changes), one statement per call, and
a progress handler that aborts any query running past QUERY_TIMEOUT_S, runaway joins included.
SQL that does not parse or run scores 0.
"""
from __future__ import annotations

import functools
import re
import sqlite3
import time
from collections import Counter
from itertools import product
from pathlib import Path

from apmpo.data.sqlite import open_readonly

QUERY_TIMEOUT_S = 10.0
MAX_ROWS = 1_000_000  # more rows than any gold result; bounds memory for a runaway predicted query
_PROGRESS_EVERY_N_OPS = 1_000

_SQL_FENCE = re.compile(r"```sql\s*\n?(.*?)```", re.DOTALL | re.IGNORECASE)
_ANY_FENCE = re.compile(r"```[a-zA-Z]*\s*\n?(.*?)```", re.DOTALL)
# Quoted strings and identifiers, so that DISTINCT inside them is left alone.
_QUOTED_OR_DISTINCT = re.compile(r"('(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|`[^`]*`|\[[^\]]*\])|\bdistinct\b", re.I)


class QueryError(Exception):
    """A query failed to run: bad SQL, a forbidden action, the time limit or the row limit."""


def extract_sql(completion: str) -> str:
    """The last ```sql block of `completion`, else its last ``` block, else the completion itself."""
    blocks = _SQL_FENCE.findall(completion) or _ANY_FENCE.findall(completion)
    return (blocks[-1] if blocks else completion).strip()


# github.com/taoyds/test-suite-sql-eval: exec_eval.postprocess ("> =" -> ">=" and the like, "to avoid execution
# errors") and exec_eval.replace_cur_year (YEAR(CURDATE()) -> 2020, inside exec_on_db_) run on both queries;
# evaluation.evaluate first turns a predicted " value " placeholder into " 1 " (the prediction only).
_SPLIT_OPERATORS = (("> =", ">="), ("< =", "<="), ("! =", "!="))
_CUR_YEAR = re.compile(r"YEAR\s*\(\s*CURDATE\s*\(\s*\)\s*\)\s*", re.IGNORECASE)


def spider_normalize(sql: str, predicted: bool) -> str:
    """`sql` as Spider's official execution evaluation runs it (see above); `predicted`: the model's query."""
    if predicted:
        sql = sql.replace(" value ", " 1 ")
    for split, joined in _SPLIT_OPERATORS:
        sql = sql.replace(split, joined)
    return _CUR_YEAR.sub("2020", sql)


def remove_distinct(sql: str) -> str:
    """`sql` with every DISTINCT keyword removed (the Spider default), quoted text untouched."""
    return _QUOTED_OR_DISTINCT.sub(lambda m: m.group(1) or "", sql)


def execute_readonly(db_path: str | Path, sql: str, timeout_s: float = QUERY_TIMEOUT_S) -> list[tuple]:
    """Rows of one read-only statement on `db_path`; raises QueryError on any failure or timeout."""
    conn = open_readonly(db_path)
    deadline = time.monotonic() + timeout_s
    # sqlite calls this every N virtual-machine steps; a nonzero return aborts the statement.
    conn.set_progress_handler(lambda: time.monotonic() > deadline, _PROGRESS_EVERY_N_OPS)
    try:
        cursor = conn.execute(sql.strip().rstrip(";"))
        rows = cursor.fetchmany(MAX_ROWS + 1)
        if len(rows) > MAX_ROWS:
            raise QueryError(f"more than {MAX_ROWS} rows")
        return rows
    except (sqlite3.Error, ValueError, OverflowError) as e:  # ValueError: e.g. a NUL character
        timed_out = time.monotonic() > deadline
        raise QueryError(f"timed out after {timeout_s}s" if timed_out else str(e)) from e
    finally:
        conn.close()


@functools.lru_cache(maxsize=4096)
def _gold_rows(db_path: str, sql: str, timeout_s: float) -> tuple[tuple, ...]:
    # Training scores G completions per prompt against one gold query; run it once per process.
    return tuple(execute_readonly(db_path, sql, timeout_s))


def _unordered_row(row: tuple) -> tuple:
    return tuple(sorted(row, key=lambda x: str(x) + str(type(x))))


def _column_permutations(gold: list[tuple], pred: list[tuple]):
    """Column orders of `pred` that could match `gold`: each pred column's values all occur in the
    gold column it is mapped to (exec_eval samples 20 rows for this; checking every row is exact)."""
    num_cols = len(gold[0])
    gold_column_values = [{row[i] for row in gold} for i in range(num_cols)]
    candidates = [
        [p for p in range(num_cols) if all(row[p] in gold_column_values[g] for row in pred)] for g in range(num_cols)
    ]
    return (perm for perm in product(*candidates) if len(set(perm)) == num_cols)


def spider_results_equal(gold: list[tuple], pred: list[tuple], order_matters: bool) -> bool:
    """Spider test-suite `result_eq`: equal up to a column permutation (and row order unless ordered)."""
    if not gold and not pred:
        return True
    if len(gold) != len(pred) or len(gold[0]) != len(pred[0]):
        return False
    # Cheap rejection: compare rows with their values sorted, ignoring column order.
    gold_unordered, pred_unordered = map(lambda rows: [_unordered_row(r) for r in rows], (gold, pred))
    if (gold_unordered != pred_unordered) if order_matters else (set(gold_unordered) != set(pred_unordered)):
        return False
    for perm in _column_permutations(gold, pred):
        permuted = [tuple(row[i] for i in perm) for row in pred]
        if (gold == permuted) if order_matters else (Counter(gold) == Counter(permuted)):
            return True
    return False


def execution_match(
    pred_sql: str, gold_sql: str, db_path: str | Path, metric: str = "spider", timeout_s: float = QUERY_TIMEOUT_S
) -> bool:
    """Whether `pred_sql` returns the same result as `gold_sql` on `db_path` under `metric`."""
    if metric not in ("spider", "bird"):
        raise ValueError(f"unknown SQL metric {metric!r}; expected 'spider' or 'bird'")
    if metric == "spider":
        pred_sql = remove_distinct(spider_normalize(pred_sql, predicted=True))
        gold_sql = remove_distinct(spider_normalize(gold_sql, predicted=False))
    gold = list(_gold_rows(str(Path(db_path).resolve()), gold_sql, timeout_s))
    try:
        pred = execute_readonly(db_path, pred_sql, timeout_s)
    except QueryError:
        return False
    if metric == "bird":
        return set(pred) == set(gold)
    return spider_results_equal(gold, pred, order_matters="order by" in gold_sql.lower())


def sql_reward(completion: str, sample: dict) -> float:
    """1.0 if the SQL in `completion` gives the result of `sample["answer"]` on `sample["db_path"]`."""
    metric = sample.get("metric") or "spider"
    return 1.0 if execution_match(extract_sql(completion), sample["answer"], sample["db_path"], metric) else 0.0
