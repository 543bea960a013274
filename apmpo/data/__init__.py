"""Datasets as lists of normalised records, and their prompts through the tokenizer's chat template.

    from apmpo.data import load_records, encode_prompt
    records = load_records("math500")                 # a built-in name, a local file or a hub id
    ids = encode_prompt(records[0], tokenizer)        # chat template + generation prompt, token ids

A record is a plain dict, and it is also the `sample` that `apmpo.rewards` scores against:
    id, task ("math" | "sql" | "choice"), question, answer (gold, a string), messages (system + user),
    and per task: db_path, db_id, metric ("spider" | "bird") for SQL; choices for multiple choice;
    images for Geometry3K (kept from any row that has them; vision prompts: apmpo.data.vision).

Sources, tried in this order:
- a built-in name (BUILTIN below): files shipped in apmpo/data/builtin (see its ATTRIBUTION.md);
- a local .jsonl, .json (a list of objects) or .parquet file (parquet needs pyarrow);
- anything else is passed to `datasets.load_dataset(source, split=split)` (a hub id or a local
  dataset folder); `datasets` is imported only then (pip install apmpo[hub]).

Field mapping (`fields=`, default: the built-in's, else detected from the first row): see FIELD_MAPS.
SQL sources need `db_root`, the folder holding `<db_id>/<db_id>.sqlite` (built-in Spider has its own).

Prompts: a system prompt per task (SYSTEM_PROMPTS; `system_prompt=` overrides it) and the question
as the user turn. A tokenizer without a chat template gets the plain format
    "{system}\\n\\n{user}\\n\\nResponse:"
encoded with the tokenizer's special tokens (BOS where it has one); with a template the rendered
text already holds them, so it is encoded without adding more.
"""
from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from apmpo.data.answers import CHOICE_LETTERS, gold_to_text, last_boxed

logger = logging.getLogger(__name__)

BUILTIN_ROOT = Path(__file__).resolve().parent / "builtin"
SPIDER_DB_ROOT = BUILTIN_ROOT / "spider" / "database"

SYSTEM_PROMPTS = {
    # Qwen2.5-Math's CoT prompt, the one the paper's math models were tuned and evaluated with.
    "math": "Please reason step by step, and put your final answer within \\boxed{}.",
    "sql": (
        "You are an expert in SQLite. Given a database schema and a question, think step by step, then "
        "write one SQLite query that answers the question, in a ```sql code block at the end."
    ),
    "choice": (
        "Please reason step by step, and put the letter of your final choice within \\boxed{}."
    ),
}
PLAIN_FORMAT = "{system}\n\n{user}\n\nResponse:"


@dataclass(frozen=True)
class Builtin:
    path: str  # relative to BUILTIN_ROOT
    fields: str  # a key of FIELD_MAPS
    count: int  # records in the file, checked by the tests
    db_root: Path | None = None


BUILTIN: dict[str, Builtin] = {
    "math500": Builtin("math/math500_test.jsonl", "math", 500),
    "aime24": Builtin("math/aime24_test.jsonl", "math", 30),
    "aime25": Builtin("math/aime25_test.jsonl", "math", 30),
    "amc23": Builtin("math/amc23_test.jsonl", "math", 40),
    "minerva": Builtin("math/minerva_math_test.jsonl", "minerva", 272),
    "olympiadbench": Builtin("math/olympiadbench_test.jsonl", "olympiadbench", 675),
    # 12,000 rows, of which 2 have an empty answer in the source and are skipped.
    "math12k": Builtin("train/math12k_train.jsonl", "math", 11998),
    "spider": Builtin("spider/dev_subset.json", "spider", 741, SPIDER_DB_ROOT),
    # BIRD mini-dev questions only: its databases are not shipped, pass db_root.
    "bird": Builtin("bird/mini_dev_sqlite.json", "bird", 500),
    "geometry3k": Builtin("geometry3k/test_freeform.jsonl", "geometry3k", 601),
}


# --- field maps: one raw row -> the task-specific part of a record ---------------------------------

def _math(row: dict) -> dict:
    return {"task": "math", "question": row.get("problem") or row["question"], "answer": gold_to_text(row["answer"])}


def _minerva(row: dict) -> dict:
    # No answer field: the gold answer is the last \boxed{} of the solution, units kept.
    return {"task": "math", "question": row["problem"], "answer": last_boxed(row["solution"]) or ""}


def _olympiadbench(row: dict) -> dict:
    question = row["question"] if not row.get("context") else f"{row['context']}\n\n{row['question']}"
    # Every `$`, not only the outer ones (Qwen2.5-Math's .strip("$")): multi-answer golds read "$69$,$84$".
    return {"task": "math", "question": question, "answer": row["final_answer"][0].replace("$", "").strip()}


def _geometry3k(row: dict) -> dict:
    # The free-form copy keeps its R1-style instruction in the user turn; the task's system prompt
    # replaces it (the math reward reads both \boxed{} and <answer> tags). Its images are not shipped.
    content = row["messages"][-1]["content"].replace("<image>", "").strip()
    question = content.split("\n\nFirst output the thinking process")[0].strip()
    return {"task": "math", "question": question, "answer": str(row["solution"]).strip(), "images": row["images"]}


def _spider(row: dict) -> dict:
    return {"task": "sql", "question": row["question"], "answer": row["query"], "db_id": row["db_id"], "metric": "spider"}


def _bird(row: dict) -> dict:
    evidence = row.get("evidence") or ""
    return {
        "task": "sql", "question": row["question"], "answer": row["SQL"], "db_id": row["db_id"], "metric": "bird",
        "evidence": evidence,
    }


def _choice(row: dict) -> dict:
    return {"task": "choice", "question": row.get("question") or row["problem"], "answer": row["answer"],
            "choices": [str(c) for c in row["choices"]]}


FIELD_MAPS: dict[str, Callable[[dict], dict]] = {
    "math": _math, "minerva": _minerva, "olympiadbench": _olympiadbench, "geometry3k": _geometry3k,
    "spider": _spider, "bird": _bird, "choice": _choice,
}


def detect_fields(row: dict) -> str:
    """The FIELD_MAPS key that fits a raw row, judged by its columns."""
    if "db_id" in row:
        return "bird" if "SQL" in row else "spider"
    if "choices" in row:
        return "choice"
    if "final_answer" in row:
        return "olympiadbench"
    if "answer" in row:
        return "math"
    if "solution" in row and "problem" in row:
        return "minerva"
    if "messages" in row and "solution" in row:
        return "geometry3k"
    raise ValueError(f"cannot tell the field mapping from columns {sorted(row)}; pass fields=")


# --- prompts -------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def read_schema(db_path: str) -> str:
    """The database's CREATE TABLE statements, as stored by sqlite."""
    from apmpo.rewards.sql import open_readonly  # noqa: PLC0415

    conn = open_readonly(db_path)
    try:
        rows = conn.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL AND name NOT LIKE 'sqlite_%'"
        ).fetchall()
    finally:
        conn.close()
    return "\n\n".join(sql.strip() + ";" for (sql,) in rows)


def user_content(record: dict) -> str:
    """The user turn of a record: the question, with the schema (SQL) or lettered choices."""
    if record["task"] == "sql":
        parts = [f"Database schema:\n{read_schema(record['db_path'])}"]
        if record.get("evidence"):
            parts.append(f"External knowledge: {record['evidence']}")
        parts.append(f"Question: {record['question']}")
        return "\n\n".join(parts)
    if record["task"] == "choice":
        options = "\n".join(f"{letter}. {text}" for letter, text in zip(CHOICE_LETTERS, record["choices"]))
        return f"{record['question']}\n\nChoices:\n{options}"
    return record["question"]


def build_messages(record: dict, system_prompt: str | None = None) -> list[dict[str, str]]:
    """Chat messages for a record: the task's system prompt (or `system_prompt`) and the user turn."""
    system = SYSTEM_PROMPTS[record["task"]] if system_prompt is None else system_prompt
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": user_content(record)}]


def render_prompt(record: dict, tokenizer: Any) -> str:
    """The prompt text: the chat template with the generation prompt, or PLAIN_FORMAT without one."""
    messages = record["messages"]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    user = "\n\n".join(m["content"] for m in messages if m["role"] != "system")
    return PLAIN_FORMAT.format(system=system, user=user).lstrip()


def encode_prompt(record: dict, tokenizer: Any) -> list[int]:
    """Prompt token ids of a record (a plain list of ints, whatever the transformers version)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    # The rendered chat template already holds the special tokens; the plain format needs them added.
    return list(tokenizer(render_prompt(record, tokenizer), add_special_tokens=not has_template)["input_ids"])


def stop_token_ids(model_path: str, tokenizer: Any) -> tuple[int, ...]:
    """Where sampling stops, for training and evaluation alike: the tokenizer's EOS and every `eos_token_id` of the
    model's generation_config.json (Qwen2.5's instruct models end turns with <|im_end|> and <|endoftext|>)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    from transformers import GenerationConfig  # noqa: PLC0415  (light; keeps `import apmpo.data` fast)

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):
        eos = None  # no generation_config.json: the tokenizer's EOS only
    ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return tuple(sorted(ids))


# --- loading -------------------------------------------------------------------------------------

def _read_rows(source: str, split: str) -> list[dict]:
    path = Path(source)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
        if suffix == ".json":
            rows = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(rows, list):
                raise ValueError(f"{path}: expected a JSON list of objects")
            return rows
        if suffix == ".parquet":
            import pyarrow.parquet as pq  # noqa: PLC0415  (only parquet needs it)

            return pq.read_table(path).to_pylist()
        raise ValueError(f"{path}: unsupported file type {suffix!r}; use .jsonl, .json or .parquet")
    try:
        import datasets  # noqa: PLC0415  (only hub ids need it)
    except ImportError as e:
        raise ImportError(f"{source!r} is not a built-in name or a local file; loading it from the hub "
                          "needs `datasets` (pip install apmpo[hub])") from e
    return [dict(row) for row in datasets.load_dataset(source, split=split)]


def load_records(
    source: str,
    *,
    split: str = "test",
    fields: str | None = None,
    db_root: str | os.PathLike | None = None,
    system_prompt: str | None = None,
    limit: int | None = None,
    image_root: str | os.PathLike | None = None,
) -> list[dict]:
    """Normalised records (see the module docstring) of a built-in name, a local file or a hub id.

    A row's `images` (any field map) are kept; relative image paths are made absolute against `image_root`,
    default the local dataset file's folder (apmpo.data.vision reads them)."""
    builtin = BUILTIN.get(source)
    if builtin is not None:
        rows = _read_rows(str(BUILTIN_ROOT / builtin.path), split)
        fields = fields or builtin.fields
        db_root = db_root or builtin.db_root
    else:
        rows = _read_rows(source, split)
    rows = rows[:limit] if limit is not None else rows
    if not rows:
        return []
    fields = fields or detect_fields(rows[0])
    if fields not in FIELD_MAPS:
        raise KeyError(f"unknown field mapping {fields!r}; use one of {sorted(FIELD_MAPS)}")
    records, skipped = [], 0
    for index, row in enumerate(rows):
        # The row's position, not its own id field: BIRD mini-dev repeats some question_ids.
        record = {"id": f"{source}/{index}"}
        record.update(FIELD_MAPS[fields](row))
        if record["answer"] in ("", None):
            skipped += 1  # no gold answer: such a record could only ever score 0
            continue
        if row.get("images") and "images" not in record:
            record["images"] = row["images"]
        if record.get("images") and (image_root or (builtin is None and Path(source).is_file())):
            root = Path(image_root or Path(source).parent).resolve()
            record["images"] = [str(root / ref) if isinstance(ref, str) and not Path(ref).is_absolute() else ref
                                for ref in record["images"]]
        if record["task"] == "sql":
            record["db_path"] = str(_db_path(record["db_id"], db_root, source))
        record["messages"] = build_messages(record, system_prompt)
        records.append(record)
    if skipped:
        logger.warning("%s: skipped %d of %d rows with an empty gold answer", source, skipped, len(rows))
    return records


def _db_path(db_id: str, db_root: str | os.PathLike | None, source: str) -> Path:
    if db_root is None:
        raise ValueError(f"{source!r} is a SQL dataset: pass db_root, the folder with <db_id>/<db_id>.sqlite")
    path = Path(db_root).resolve() / db_id / f"{db_id}.sqlite"
    if not path.is_file():
        raise FileNotFoundError(f"database {db_id!r} not found at {path}" + (
            " (BIRD's databases are not shipped: download BIRD dev and pass db_root)" if source == "bird" else ""))
    return path


def db_ids(source: str) -> list[str]:
    """The database ids a SQL source refers to (for preparing a db_root)."""
    builtin = BUILTIN.get(source)
    rows = _read_rows(str(BUILTIN_ROOT / builtin.path) if builtin else source, "test")
    return sorted({row["db_id"] for row in rows})


__all__ = [
    "BUILTIN", "FIELD_MAPS", "SYSTEM_PROMPTS", "PLAIN_FORMAT", "build_messages", "db_ids", "detect_fields",
    "encode_prompt", "load_records", "read_schema", "render_prompt", "stop_token_ids",
]
