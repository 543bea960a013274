"""The parts of `python -m apmpo.eval`: benchmarks, the resumable sample file, generation and scoring.

samples.jsonl holds one line per sample, keyed by (benchmark, index, seed, sample). A sample already there is
never generated again, so an interrupted or extended evaluation (more seeds, a larger --limit, another
benchmark) continues where it stopped. Lines are appended per request and flushed; a line cut short by a kill
is dropped on the next start.

Seeding (apmpo.seeding): sample j of problem i under eval seed s is drawn with the engine seed
2**62 + s * 2**32 + i * n + j, so a sample does not depend on which other problems share its request, no two
(seed, problem, sample) share a stream, and none meets a training seed. Requests hold contiguous runs of problems
because the server seeds prompt p of a request with `seed + p * n`.

Validation during training (`validate`) runs these same functions on the weights the server holds.
"""
from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from apmpo import seeding
from apmpo.data import BUILTIN, build_messages, encode_prompt, load_records
from apmpo.play import play, seeds_per_sample

if TYPE_CHECKING:  # light at run time: the config imports this module to check eval.benchmarks
    from apmpo.sampling import Sampling

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
QUICKSTART_VAL = "quickstart_val"  # the CPU quickstart's held-out prompts (apmpo.quickstart.make_val_samples)
KNOWN = [*BUILTIN, QUICKSTART_VAL]
BATCH_PROMPTS = 128  # problems per generation request
# The settings that decide what a sample is; a rerun into the same --out must not change them.
GENERATION_KEYS = ("model", "temperature", "top_p", "top_k", "max_tokens", "system_prompt", "seeding", "reward", "env",
                   "max_turns", "max_episode_tokens")


class EvalError(Exception):
    """Bad input or state, reported as one line and a non-zero exit (no traceback)."""


@dataclass(eq=False)  # compared and hashed by identity
class Benchmark:
    name: str  # the key in samples.jsonl and results.json
    records: list[dict]  # apmpo.data records; each is its reward's `sample`
    reward: str  # a reward of apmpo.rewards.get_reward: a registry name ("math", "sql", ...) or "pkg.module:function"


def _items(spec: str) -> list[tuple[str, str]]:
    """(name, source) of each comma-separated item; an unnamed local file is named by its stem."""
    items = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, source = item.partition("=") if "=" in item else ("", "", item)
        items.append((name or (Path(source).stem if source.lower().endswith(FILE_SUFFIXES) else source), source))
    return items


def benchmark_names(spec: str) -> list[str]:
    """The names a `--benchmarks` / `eval.benchmarks` spec gives its benchmarks (the keys of results and metrics)."""
    names = [name for name, _ in _items(spec)]
    if not names:
        raise EvalError("no benchmarks given")
    if len(set(names)) != len(names):
        raise EvalError("a benchmark is named twice; name local files with NAME=PATH")
    return names


def check_benchmark_sources(spec: str) -> None:
    """Every source of `spec` is a built-in name, an existing file or a hub id (owner/name)."""
    for _, source in _items(spec):
        if source in KNOWN:
            continue
        if source.lower().endswith(FILE_SUFFIXES) and not Path(source).is_file():
            raise EvalError(f"benchmark file not found: {source}")
        if not Path(source).is_file() and "/" not in source:
            close = difflib.get_close_matches(source, KNOWN, n=3, cutoff=0.5)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise EvalError(f"unknown benchmark {source!r}; {hint}built-in: {', '.join(KNOWN)}; "
                            "or a local .jsonl/.json/.parquet file, or a hub id (owner/name)")


def resolve_benchmarks(spec: str, *, limit: int | None = None, task: str | None = None, fields: str | None = None,
                       db_root: str | None = None, split: str = "test", system_prompt: str | None = None,
                       reward: str | None = None) -> list[Benchmark]:
    """`spec` is comma-separated: built-in names, local files (`NAME=PATH` names them) or hub ids (owner/name).

    `task` (math | sql | choice) applies to local files and hub ids: their reward and system prompt. `reward` (a
    registry name or "pkg.module:function") scores every benchmark instead of its task's reward."""
    check_benchmark_sources(spec)
    benchmark_names(spec)  # no name twice
    benchmarks = []
    for name, source in _items(spec):
        is_builtin = source in KNOWN
        if source == QUICKSTART_VAL:
            from apmpo.quickstart import make_val_samples  # noqa: PLC0415  (tokenizers, transformers)

            records = make_val_samples()[:limit]
        else:
            own_db = is_builtin and BUILTIN[source].db_root is not None  # built-in Spider ships its databases
            try:
                records = load_records(source, split=split, fields=None if is_builtin else fields,
                                       db_root=None if own_db else db_root, system_prompt=system_prompt, limit=limit)
            except (ValueError, KeyError, FileNotFoundError, ImportError) as error:
                message = str(error).replace("pass db_root", "pass --db-root")
                raise EvalError(f"benchmark {name}: {message}") from None
        if not records:
            raise EvalError(f"benchmark {name}: no records with a gold answer in {source}")
        if task is not None and not is_builtin:
            records = [_with_task(record, task, system_prompt, name) for record in records]
        rewards = {record["task"] for record in records}
        if len(rewards) != 1 and reward is None:
            raise EvalError(f"benchmark {name}: records of several tasks {sorted(rewards)}; pass --task")
        benchmarks.append(Benchmark(name, records, reward or rewards.pop()))
    return benchmarks


def _with_task(record: dict, task: str, system_prompt: str | None, name: str) -> dict:
    record = {**record, "task": task}
    try:
        record["messages"] = build_messages(record, system_prompt)
    except KeyError as error:
        raise EvalError(f"benchmark {name}: --task {task} needs the field {error} in every record "
                        "(for SQL, a db_id and --db-root)") from None
    return record


def encode_benchmark(benchmark: Benchmark, tokenizer, max_model_len: int) -> list[list[int]]:
    """Prompt ids of every problem (apmpo.data.encode_prompt, as training encodes); EvalError if one cannot fit."""
    ids = [encode_prompt(record, tokenizer) for record in benchmark.records]
    too_long = [i for i, prompt in enumerate(ids) if len(prompt) >= max_model_len]
    if too_long:
        raise EvalError(f"benchmark {benchmark.name}: {len(too_long)} prompt(s) have >= max_model_len="
                        f"{max_model_len} tokens (first: problem {too_long[0]}, {len(ids[too_long[0]])} tokens); "
                        "raise --max-model-len (rollout.max_model_len) or use --limit")
    return ids


# --- the sample file -----------------------------------------------------------------------------------------


Key = tuple[str, int, int, int]  # benchmark, index, seed, sample


class SampleStore:
    """samples.jsonl, appended per request. Keeps only what the results need in memory, not the completions."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: dict[Key, dict] = {}
        if path.exists():
            _drop_cut_tail(path)
            for row in self._read():
                self.rows[_key(row)] = {k: row.get(k) for k in ("correct", "num_tokens", "finish_reason")}
        self._file = open(path, "a", encoding="utf-8")

    def __contains__(self, key: Key) -> bool:
        return key in self.rows

    def add(self, rows: list[dict]) -> None:
        self._file.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        self._file.flush()
        os.fsync(self._file.fileno())
        for row in rows:
            self.rows[_key(row)] = {k: row.get(k) for k in ("correct", "num_tokens", "finish_reason")}

    def select(self, benchmark: str, num_problems: int, seeds: list[int], n: int) -> list[dict]:
        """The slim rows of one benchmark's requested samples (all must be present)."""
        return [{"index": i, "seed": s, **self.rows[(benchmark, i, s, j)]}
                for s in seeds for i in range(num_problems) for j in range(n)]

    def completions(self, keys: set[Key]) -> dict[Key, dict]:
        """Full rows (with the completion) for `keys`, read back from the file."""
        self._file.flush()
        return {key: row for row in self._read() if (key := _key(row)) in keys}

    def _read(self) -> Iterator[dict]:
        with open(self.path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError:
                        raise EvalError(f"{self.path}:{number} is not a JSON line; fix or remove it") from None

    def close(self) -> None:
        self._file.close()


def _key(row: dict) -> Key:
    return row["benchmark"], row["index"], row["seed"], row["sample"]


def _drop_cut_tail(path: Path) -> None:
    """A kill during a write can leave a last line without its newline: drop that partial line."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def check_settings(out: Path, settings: dict) -> None:
    """Writes out/config.json on the first run; a later run must use the same generation settings."""
    path = out / "config.json"
    if path.exists():
        saved = json.loads(path.read_text())
        changed = [f"{k}: {saved.get(k)!r} -> {settings[k]!r}" for k in GENERATION_KEYS if saved.get(k) != settings[k]]
        if changed:
            raise EvalError(f"{out} holds samples generated with other settings ({'; '.join(changed)}); "
                            "use another --out, or delete its samples.jsonl and config.json")
    path.write_text(json.dumps(settings, indent=2) + "\n")


# --- generation and scoring ----------------------------------------------------------------------------------


def missing_problems(store: SampleStore, name: str, num_problems: int, seed: int, n: int) -> list[int]:
    return [i for i in range(num_problems) if any((name, i, seed, j) not in store for j in range(n))]


def contiguous_chunks(indices: list[int], size: int) -> Iterator[list[int]]:
    """Runs of consecutive indices, at most `size` long (the server seeds prompt p of a request as seed + p*n)."""
    chunk: list[int] = []
    for index in indices:
        if chunk and (index != chunk[-1] + 1 or len(chunk) == size):
            yield chunk
            chunk = []
        chunk.append(index)
    if chunk:
        yield chunk


def generate_benchmark(client, benchmark: Benchmark, prompt_ids: list[list[int]], seed: int, n: int,
                       sampling: Sampling, store: SampleStore, score: Callable, batch_prompts: int,
                       on_done: Callable[[int], None] = lambda count: None, episodes=None) -> dict:
    """Generates and scores the samples of `benchmark` under `seed` that `store` lacks; returns counts. With
    `episodes` (apmpo.envs.episodes.EpisodeRunner) each sample is an episode of its environment, which scores it:
    its row's completion is the episode's text after the first prompt, num_tokens its sampled tokens."""
    todo = missing_problems(store, benchmark.name, len(benchmark.records), seed, n)
    counts = {"prompts": 0, "samples": 0, "reward_failures": 0}
    for chunk in contiguous_chunks(todo, batch_prompts):
        wanted = [(i, j) for i in chunk for j in range(n) if (benchmark.name, i, seed, j) not in store]
        played, summary, _ = play(
            client, [prompt_ids[i] for i in chunk], [benchmark.records[i] for i in chunk], n,
            seeding.eval_request_seed(seed, chunk[0], n * seeds_per_sample(episodes), len(chunk)), sampling,
            score=lambda texts, records: score(benchmark.reward, texts, records), episodes=episodes,
            keep=lambda k, j, chunk=chunk, wanted=set(wanted): (chunk[k], j) in wanted)
        store.add([{
            "benchmark": benchmark.name, "index": i, "seed": seed, "sample": j, "id": benchmark.records[i]["id"],
            "completion": r.text, "answer": benchmark.records[i]["answer"], "correct": r.reward >= 1.0,
            "reward": r.reward, "num_tokens": r.num_sampled, "finish_reason": r.finish_reason,
        } for (i, j), r in zip(wanted, played)])
        counts["prompts"] += len(chunk)
        counts["samples"] += len(played)
        counts["reward_failures"] += summary.failures
        on_done(len(chunk))
    return counts
