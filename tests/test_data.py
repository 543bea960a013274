"""Built-in benchmarks, local and hub-style loading, field maps and prompts through a real chat template."""
import json
import sqlite3

import pytest

from apmpo.data import (
    BUILTIN, BUILTIN_ROOT, PLAIN_FORMAT, SYSTEM_PROMPTS, db_ids, encode_prompt, load_records, render_prompt,
)
from apmpo.rewards import get_reward
from apmpo.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def bird_db_root(tmp_path_factory):
    """Stand-in BIRD databases (one empty table each): BIRD's own are not shipped."""
    root = tmp_path_factory.mktemp("bird_dbs")
    for db_id in db_ids("bird"):
        (root / db_id).mkdir()
        with sqlite3.connect(root / db_id / f"{db_id}.sqlite") as conn:
            conn.execute("CREATE TABLE t (x int)")
    return root


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_every_builtin_loads_with_its_count_and_gold_answers(name, bird_db_root):
    records = load_records(name, db_root=bird_db_root if name == "bird" else None)
    assert len(records) == BUILTIN[name].count
    assert len({r["id"] for r in records}) == len(records)
    for record in records:
        assert isinstance(record["answer"], str) and record["answer"].strip(), record
        assert record["question"].strip() and record["messages"][-1]["role"] == "user"
        get_reward(record["task"])  # every task names a registered reward


def test_builtin_data_is_inside_the_package():
    assert BUILTIN_ROOT.parent.name == "data" and BUILTIN_ROOT.parent.parent.name == "apmpo"
    assert (BUILTIN_ROOT / "ATTRIBUTION.md").is_file() and (BUILTIN_ROOT / "spider" / "SPIDER_README.txt").is_file()
    assert len(list((BUILTIN_ROOT / "spider" / "database").glob("*/*.sqlite"))) == 10


def test_field_maps_per_benchmark():
    assert load_records("amc23")[0]["answer"] == "27"                      # float 27.0
    assert load_records("aime25")[0]["answer"] == "70"                     # int
    assert load_records("minerva")[0]["answer"] == "1.6"                   # last \boxed of the solution
    olympiad = load_records("olympiadbench")
    assert olympiad[1]["answer"] == "\\frac{1}{2 n+2}"                     # final_answer[0], $ stripped
    assert all("$" not in r["answer"] for r in olympiad)
    assert "69,84" in {r["answer"] for r in olympiad}                      # "$69$,$84$": every $ goes
    spider = load_records("spider")[0]
    assert spider["task"] == "sql" and spider["metric"] == "spider"
    assert spider["db_path"].endswith("concert_singer/concert_singer.sqlite")
    geometry = load_records("geometry3k")[0]
    assert geometry["answer"] == "60" and "<image>" not in geometry["question"] and "<think>" not in geometry["question"]


def test_gold_answers_score_one_against_themselves():
    math_reward, sql_reward = get_reward("math"), get_reward("sql")
    for name in ("math500", "aime24", "aime25", "amc23", "minerva"):
        for record in load_records(name, limit=20):
            assert math_reward(f"\\boxed{{{record['answer']}}}", record) == 1.0, (name, record["answer"])
    record = load_records("spider", limit=1)[0]
    assert sql_reward(f"```sql\n{record['answer']}\n```", record) == 1.0


def test_bird_needs_its_databases():
    with pytest.raises(ValueError, match="db_root"):
        load_records("bird")


def test_prompts_through_the_chat_template(tokenizer):
    record = load_records("math500", limit=1)[0]
    assert record["messages"] == [
        {"role": "system", "content": "Please reason step by step, and put your final answer within \\boxed{}."},
        {"role": "user", "content": record["question"]},
    ]
    text = render_prompt(record, tokenizer)
    assert text.startswith("<|im_start|>system\nPlease reason step by step")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = encode_prompt(record, tokenizer)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == text
    # The same ids as the template's own tokenisation (a BatchEncoding in transformers 5).
    templated = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=True, tokenize=True)
    templated = templated["input_ids"] if hasattr(templated, "keys") else templated
    assert ids == list(templated)


def test_sql_prompt_carries_the_schema(tokenizer):
    record = load_records("spider", limit=1)[0]
    user = record["messages"][-1]["content"]
    assert 'CREATE TABLE "singer"' in user and user.endswith("Question: How many singers do we have?")
    assert record["messages"][0]["content"] == SYSTEM_PROMPTS["sql"]


def test_choice_prompt_lists_lettered_choices(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text(json.dumps({"question": "2+2?", "choices": ["3", "4", "5", "6"], "answer": "B"}) + "\n")
    record = load_records(str(path))[0]
    assert record["task"] == "choice"
    assert record["messages"][-1]["content"] == "2+2?\n\nChoices:\nA. 3\nB. 4\nC. 5\nD. 6"
    assert get_reward("choice")("\\boxed{B}", record) == 1.0


def test_plain_format_without_a_chat_template(tokenizer):
    plain = build_tokenizer()
    plain.chat_template = None
    record = load_records("aime24", limit=1)[0]
    text = render_prompt(record, plain)
    assert text == PLAIN_FORMAT.format(system=SYSTEM_PROMPTS["math"], user=record["question"])
    assert plain.decode(encode_prompt(record, plain)) == text


def test_system_prompt_override():
    record = load_records("aime24", limit=1, system_prompt="Be brief.")[0]
    assert record["messages"][0] == {"role": "system", "content": "Be brief."}
    assert load_records("aime24", limit=1, system_prompt="")[0]["messages"][0]["role"] == "user"


@pytest.fixture()
def math_rows():
    return [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": 4}]


def test_local_jsonl_json_parquet(tmp_path, math_rows):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in math_rows))
    (tmp_path / "a.json").write_text(json.dumps(math_rows))
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist([{"problem": r["problem"], "answer": str(r["answer"])} for r in math_rows]),
                   tmp_path / "a.parquet")
    for suffix in ("jsonl", "json", "parquet"):
        records = load_records(str(tmp_path / f"a.{suffix}"))
        assert [(r["question"], r["answer"], r["task"]) for r in records] == [("1+1?", "2", "math"), ("2+2?", "4", "math")]


def test_local_minerva_style_file_is_detected(tmp_path):
    (tmp_path / "m.jsonl").write_text(json.dumps({"problem": "p", "solution": "so \\boxed{5 \\mathrm{~m}}"}) + "\n")
    assert load_records(str(tmp_path / "m.jsonl"))[0]["answer"] == "5 \\mathrm{~m}"


def test_local_spider_style_file_with_db_root(tmp_path):
    rows = [{"db_id": "pets_1", "question": "How many pets?", "query": "SELECT count(*) FROM pets"}]
    (tmp_path / "s.json").write_text(json.dumps(rows))
    with pytest.raises(ValueError, match="db_root"):
        load_records(str(tmp_path / "s.json"))
    record = load_records(str(tmp_path / "s.json"), db_root=BUILTIN_ROOT / "spider" / "database")[0]
    assert get_reward("sql")("SELECT count(*) FROM pets", record) == 1.0


def test_hub_path_through_datasets_on_a_local_folder(tmp_path, math_rows):
    # No hub access in CI: a local dataset folder goes through the same `datasets.load_dataset` call.
    pytest.importorskip("datasets")
    folder = tmp_path / "my_dataset"
    folder.mkdir()
    (folder / "test.jsonl").write_text("".join(json.dumps({**r, "answer": str(r["answer"])}) + "\n" for r in math_rows))
    records = load_records(str(folder), split="test")
    assert [r["answer"] for r in records] == ["2", "4"]


def test_unknown_sources_fail_clearly(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_records(str(tmp_path / "x.csv"))
    with pytest.raises(KeyError, match="field mapping"):
        load_records("aime24", fields="nope")
