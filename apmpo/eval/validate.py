"""Validation during training: `python -m apmpo.eval` on the weights the generation server holds at a step.

    validation = Validation(cfg, tokenizer, model_path)   # rank 0, once, before the loop (bad prompts fail here)
    metrics = validation.run(client, pool.score, step)    # every eval.every steps and after the last
    # {"val/quickstart_val/pass@1": 0.41, "val/quickstart_val/pass@4": 0.83, "val/quickstart_val/length_mean": 2.0,
    #  "val/quickstart_val/truncated_frac": 0.0, "val/reward_failures": 0, "time/eval": 0.6}

It uses the CLI's own functions: benchmarks (resolve_benchmarks), prompts (apmpo.data.encode_prompt), stop tokens
(apmpo.data.stop_token_ids), engine seeds (apmpo.seeding, with eval seed = train.seed at every step, so the curve
moves with the weights, not with the draws), rewards (the same RewardPool.score), Pass@k (summarize_benchmark).
So the values logged at step k are what

    python -m apmpo.eval --model runs/<name>/checkpoints/step_<k> --benchmarks <eval.benchmarks> --n <eval.n> \\
        --temperature <eval.temperature> --top-p <eval.top_p> --max-tokens <eval.max_tokens> [--limit <eval.limit>] \\
        --k 1,<eval.k> --seeds <train.seed> [--reward <eval.reward>] --out DIR

reports for that checkpoint (with data.env, add --env <data.env> --max-turns <data.max_turns> --max-episode-tokens
<data.max_episode_tokens>: every sample is then an episode, eval.max_tokens per turn). Each validation's samples
are kept in runs/<name>/eval/step_<k>/samples.jsonl.
"""
from __future__ import annotations

import shutil
import time
from typing import Callable

from apmpo.data import stop_token_ids
from apmpo.envs.episodes import EpisodeRunner
from apmpo.eval.metrics import summarize_benchmark
from apmpo.eval.run import BATCH_PROMPTS, SampleStore, encode_benchmark, generate_benchmark, resolve_benchmarks


class Validation:
    """The configured benchmarks, resolved and encoded once; `run` evaluates the server's current weights."""

    def __init__(self, cfg, tokenizer, model_path: str):
        e = cfg.eval
        self.n, self.seed, self.out_root = e.n, cfg.train.seed, cfg.run_dir / "eval"
        self.ks = sorted({1, e.k or e.n})
        self.benchmarks = resolve_benchmarks(e.benchmarks, limit=e.limit, reward=e.reward)
        self.prompt_ids = [encode_benchmark(b, tokenizer, cfg.rollout.max_model_len) for b in self.benchmarks]
        self.sampling = e.sampling(stop_token_ids(model_path, tokenizer))
        self.episodes = EpisodeRunner.from_config(cfg, tokenizer)  # data.env: the benchmarks' samples are episodes

    def run(self, client, score: Callable, step: int) -> dict[str, float]:
        """Metrics `val/<benchmark>/{pass@1, pass@k, length_mean, truncated_frac}`, `val/reward_failures` and
        `time/eval` (seconds). `score` is RewardPool.score: (reward name, completions, samples) -> (scores,
        RewardSummary)."""
        tick = time.perf_counter()
        out = self.out_root / f"step_{step}"
        shutil.rmtree(out, ignore_errors=True)  # a resumed run validates this step again, on its own weights
        out.mkdir(parents=True)
        store = SampleStore(out / "samples.jsonl")
        metrics: dict[str, float] = {}
        failures = 0
        try:
            for benchmark, prompt_ids in zip(self.benchmarks, self.prompt_ids):
                counts = generate_benchmark(client, benchmark, prompt_ids, self.seed, self.n, self.sampling, store,
                                            score, BATCH_PROMPTS, episodes=self.episodes)
                failures += counts["reward_failures"]
                rows = store.select(benchmark.name, len(benchmark.records), [self.seed], self.n)
                summary = summarize_benchmark(rows, self.n, [self.seed], self.ks)
                prefix = f"val/{benchmark.name}"
                metrics.update({f"{prefix}/pass@{k}": summary[f"pass@{k}"]["mean"] for k in self.ks})
                metrics[f"{prefix}/length_mean"] = summary["mean_tokens"]
                metrics[f"{prefix}/truncated_frac"] = summary["truncated_frac"]
        finally:
            store.close()
        metrics["val/reward_failures"] = failures
        metrics["time/eval"] = time.perf_counter() - tick
        return metrics
