"""Every benchmark script runs to the end at a tiny size and prints its side-by-side ratio.

Speed is never asserted here (the figures depend on the machine); this only keeps the scripts from rotting,
so that the README's figures can be re-measured from any clean clone. The sizes are the smallest that still run
every path. The engines serve the session's tiny model (TINY): its compiled graph is then built once, and cached.
The scripts run two at a time: much of each is one process importing or starting an engine on one core.
"""
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import netns
from train_runs import warm_run, with_warm_programs

ROOT = Path(__file__).resolve().parents[1]
PERCENT, TIMES = r"\d+%", r"\d+\.\d+x"
TINY = "{tiny_tied}"  # replaced by the path of conftest's tiny_tied model
SMALL_SERVE = ["--model", TINY, "--prompts", "4", "--prompt-len", "8", "--n", "2", "--max-tokens", "8",
               "--repeats", "1"]


BENCHMARKS = {  # script: (tiny arguments, the ratio line it must print)
    "loss_overhead": (["--n", "16", "--t", "64", "--repeats", "2"], rf"apmpo .*\({TIMES}\)"),
    "logprob_memory": (["--batch", "1", "--seq", "64", "--vocab", "1000", "--hidden", "64"],
                       r"chunked / naive: peak \d+\.\d+, extra \d+\.\d+"),
    "reward_throughput": ([], rf"gold-vs-wrong .* {TIMES}"),
    "omp_wait": (["--steps", "2"], rf"ratio whole/split time, two at once: {TIMES} \(passive/split {TIMES}\); "
                                    rf"alone, passive/whole {TIMES}"),
    "bf16_updates": (["--model", TINY, "--problems", "2", "--steps", "1,4", "--learner-prompts", "2",
                      "--learner-batches", "2", "--max-new-tokens", "8", "--reward", "parity"],
                     r"\n +4 \| .* \( *-?\d+\.\d+x\) \| .* \( *-?\d+\.\d+x\) \| \d+\.\d%[\s\S]*"
                     r"surrogate raised by the bf16 learner's update \(fp32 forward\): [+-]\d+\.\d+[\s\S]*"
                     r"bf16, dithered masters +2: [+-]\d\.\d+ / [+-]\d\.\d+ / [+-]\d\.\d+ \(\d+\.\d% moved\)"),
    "bf16_mismatch": (["--model", TINY, "--problems", "2", "--max-new-tokens", "8"],
                      rf"ratio fp32 head/bf16 head: KL {TIMES}"),
    "precision_error": (["--model", TINY, "--prompts", "2", "--max-new-tokens", "8"],
                        rf"ratio bf16/fp16 error: learner {TIMES}, engine {TIMES}"),
    "engine_logprobs": (["--model", TINY, "--prompts", "4", "--reward", "parity", "--set", "rollout.max_tokens=8",
                         "--set", "data.max_prompt_tokens=320", "--set", "rollout.max_model_len=336"],
                        rf"ratio engine/recompute: train_on_batch {TIMES}, time/logprob"),
    "generation": (SMALL_SERVE, rf"ratio server/in-process: {PERCENT}"),
    "weight_sync": (["--layers", "1", "--vocab", "512", "--repeats", "1"], rf"ratio push/raw: {PERCENT}"),
    "step_time": (["--tiny"], rf"ratio apmpo/baseline speed: {TIMES}"),
    "study_run": (["--tiny"], rf"ratio after/before: the run {TIMES}"),
    "compile": (["--model", TINY, "--prompts", "2", "--n", "2", "--tokens", "8", "--repeats", "1"],
                rf"ratio compiled/eager speed: {TIMES}"),
    "learner_compile": (["--model", TINY, "--prompts", "2", "--n", "2", "--prompt-tokens", "4", "--tokens", "8",
                         "--repeats", "1"], rf"ratio compiled/eager speed: {TIMES}"),
    "servers": (SMALL_SERVE, rf"ratio 2 servers/1 server: tokens/s {TIMES}, push {TIMES}"),
    "lora": (["--config", "configs/quickstart.yaml", "--steps", "2", "--rank", "8", "--runs", "full,lora",
              "--set", "rollout.num_servers=1", "--set", "rollout.prompts_per_step=4", "--set", "train.mini_batch_size=2",
              "--out", "/tmp/apmpo_bench_lora"],
             rf"ratio lora/full: push bytes \d+\.\d+x, .* s/step {TIMES}"),
    "multinode": (["--steps", "2", "--repeats", "2"], rf"ratio two nodes/one host: step {TIMES}, all-reduce {TIMES}"),
    "zero_memory": (["--model", TINY, "--runs", "zero2,zero3"],
                    rf"ratio zero3/zero2: weights {TIMES}, peak RSS {TIMES}"),
}


# Scripts whose learner ranks, started by DeepSpeed's launcher, fork from the tests' warm process (apmpo/warm.py,
# relay): their figures are medians over steps after the first. The others' ranks start afresh, as a user's do:
# step_time, lora and zero_memory report a learner's memory or start-up, which a relay's would misstate.
RANKS_FORKED = {"multinode"}


def test_every_benchmark_is_run_here():
    assert set(BENCHMARKS) == {path.stem for path in (ROOT / "benchmarks").glob("*.py")}


def _run(script: str, tiny_tied: Path) -> tuple[list[str], subprocess.CompletedProcess]:
    args = [str(tiny_tied) if arg == TINY else arg for arg in BENCHMARKS[script][0]]
    # A CPU engine built in the script's process gets the server's 1 GiB KV cache, not half the machine's memory.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE") or "1"}
    if script in RANKS_FORKED:
        env = with_warm_programs(env)
    return args, warm_run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def benchmark_runs(tiny_tied):
    """Every script's arguments and finished process, two scripts running at any time."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        # the quick ones (listed first) last, so that no long run is left running alone at the end
        futures = {script: pool.submit(_run, script, tiny_tied) for script in reversed(BENCHMARKS)}
        return {script: future.result() for script, future in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("script", BENCHMARKS)
def test_benchmark_prints_its_ratio(script, benchmark_runs, capsys):
    if script == "multinode" and (why := netns.unusable()):
        pytest.skip(why)
    args, result = benchmark_runs[script]
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(BENCHMARKS[script][1], result.stdout), result.stdout[-3000:]
    with capsys.disabled():  # into CI's log: the figures of this machine, at a tiny size
        print(f"\n--- benchmarks/{script}.py {' '.join(args)}\n{result.stdout.strip()}")
