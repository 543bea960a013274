"""Seconds per RL step: apmpo (`launch/train.py`, its vLLM server, DeepSpeed) vs. an in-process baseline, same task.

    python benchmarks/step_time.py                                  # quickstart + 4x512 model; 8, 64, 128 tokens
    PYTHONPATH=/dir/with/trl python benchmarks/step_time.py         # the baseline is TRL's GRPOTrainer
    python benchmarks/step_time.py --tiny                           # CI: quickstart model, 8 tokens, 2 steps, 1 server
    python benchmarks/step_time.py --sizes quickstart --prompt-tokens 128   # longer prompts, same task
    python benchmarks/step_time.py --sizes quickstart --set rollout.num_servers=1   # an apmpo config override
    python benchmarks/step_time.py --sizes smollm2 --tokens 48 64 --steps 4 --warmup 1   # the real model (issue 32)
    PYTHONPATH=<trl> python benchmarks/step_time.py --sizes smollm2 --tokens 64 --baseline-dtypes fp32 bf16 \\
        --set model.dtype=bf16                      # issue 45: TRL's both precisions, and the machine's limit

The task is the quickstart's (16 prompts x 8 samples, apmpo/quickstart.py), one optimiser step per rollout batch,
KL beta 0.001 against a reference model, fp32; apmpo otherwise runs configs/quickstart.yaml (two generation
servers: `--set rollout.num_servers=1` for one). The models: the quickstart's (2 layers, hidden 128, 22 tokens) and
one of realistic shape (4 layers, hidden 512, 8 heads, 2 KV heads, a 32000-token vocabulary whose extra tokens
no prompt uses: a random model of that size rarely stops, so its completions run to the limit on both sides).
`--prompt-tokens N` lengthens every prompt to N tokens (letters before the digits, plus the system prompt of
apmpo's math records: both sides get the same records); the quickstart's own are 22 tokens, real ones longer.
The learning rate is tiny so that the policy, and with it the completion lengths, stay the same on both sides
over the run (the printed mean lengths show it).

The real model, `--sizes smollm2`: SmolLM2-135M-Instruct (30 layers, fetched by apmpo.models) on "What is A + B?"
with A, B in 10-99 under the math system prompt, 8 prompts x 4 samples, no reference model (beta 0), the math
reward plus a graded term that keeps every group's samples apart (GRADED_REWARD: both sides train every row),
one server, compiled (apmpo's default: the quickstart config this script starts from turns compilation off for its
tiny model; on 2 cores a first compile of SmolLM2 adds about 80 s to the start, cached later). After
its runs, a plain torch forward+backward of the same model over the same tokens (apmpo's batch, padded: prompts +
mean completion length) is timed, and its update is reported against it, with tokens/s. Then the machine's limit
for the whole step (`step_limit`): the update's and prefill's FLOPs at the bf16 matmul rate measured here, and
each decode step at that rate or its weight and KV bytes at the measured memory bandwidth, whichever is slower;
apmpo's step and phases, and the fastest baseline, are reported as multiples of it.

The baseline is TRL's GRPOTrainer (HF generate in process) when `trl` is importable, else a plain in-process
GRPO step (HF generate, a log-prob forward of the policy and the reference, one backward, AdamW), written
here. It runs with the threads apmpo's learner takes (apmpo.learner.engine.cpu_threads: every core in the
synchronous loop), or `--baseline-threads`.

Each figure is the median s/step after `--warmup` steps; apmpo's phase split comes from its metrics.jsonl
(time/*), its start-up is the run's wall time less its steps. Runs alternate apmpo / baseline per setting.
Cost on 2 cores: the quickstart model takes seconds a step; the 4x512 one about a minute at 64 tokens (apmpo
49 s, TRL 85 s on an idle machine; the whole default run takes about an hour), so pass `--sizes quickstart` on a
small machine.
"""
from __future__ import annotations

import argparse
import json
import random
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("generate", "reward", "logprob", "update", "weight_sync")
BIG = dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=1536)
BIG_VOCAB = 32000
LR = 1e-7
REAL_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Task:
    """What both sides train on, per model size."""
    prompts: int  # per step
    group: int  # samples per prompt
    beta: float  # KL weight; 0: no reference model
    reward: str  # an apmpo.rewards name; the baseline scores with the same function


TASKS = {"quickstart": Task(16, 8, 0.001, "quickstart"), "big": Task(16, 8, 0.001, "quickstart"),
         "smollm2": Task(8, 4, 0.0, "step_time_reward:graded")}  # write_additions writes it

# SmolLM2 scores about 0 on these sums, and apmpo leaves rows of advantage 0 out of its forwards (docs/training.md):
# a graded term makes every group's samples differ, so that both sides' updates compute every row.
GRADED_REWARD = '''"""benchmarks/step_time.py's reward: the math reward plus a small graded term (distinct words / 1000)."""
from apmpo.rewards import math_reward


def graded(completion: str, sample: dict) -> float:
    return math_reward(completion, sample) + len(set(completion.split())) / 1000
'''


def learner_threads(max_staleness: int = 0) -> int:
    from apmpo.cpu_threads import usable_cores
    from apmpo.learner.engine import cpu_threads

    return cpu_threads(usable_cores(), world_size=1, overlap=max_staleness > 0)


# --- models ----------------------------------------------------------------------------------------------------


def save_models(root: Path, sizes: list[str]) -> dict[str, Path]:
    from apmpo import tiny
    from apmpo.quickstart import build_tokenizer, save_quickstart_model

    paths = {}
    if "quickstart" in sizes:
        paths["quickstart"] = save_quickstart_model(root / "quickstart")
    if "big" in sizes:
        paths["big"] = tiny.save_tiny_model(root / "big", tokenizer=_padded_tokenizer(build_tokenizer()), **BIG)
    if "smollm2" in sizes:
        from apmpo.models import fetch

        paths["smollm2"] = fetch(REAL_MODEL)
    return paths


def _prompt_tokens(model: Path, records_path: str) -> int:
    """The longest prompt of a records file, in tokens of the model's chat format."""
    from transformers import AutoTokenizer

    from apmpo.data import encode_prompt, load_records

    tokenizer = AutoTokenizer.from_pretrained(model)
    return max(len(encode_prompt(record, tokenizer)) for record in load_records(records_path))


def write_additions(root: Path) -> Path:
    """512 "What is A + B?" records, A and B in 10-99 (apmpo's math fields: the math system prompt), and the
    module of their reward (GRADED_REWARD)."""
    rng = random.Random(0)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(512)]
    (root / "step_time_reward.py").write_text(GRADED_REWARD)  # both sides import it: main puts root on PYTHONPATH
    path = root / "additions.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n"
                            for a, b in pairs))
    return path


def _padded_tokenizer(tokenizer):
    """The quickstart's character tokenizer with filler tokens up to BIG_VOCAB: the prompts encode as before, and
    every id the model can sample decodes (to letters, never to a digit: a wrong answer)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    letters = "abcdefghijklmnopqrstuvwxyz"
    k = 0
    while len(vocab) < BIG_VOCAB:
        word = "".join(letters[(k // 26**i) % 26] for i in range(4))
        vocab.setdefault("Q" + word, len(vocab))
        k += 1
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token=tokenizer.eos_token,
                                   pad_token=tokenizer.pad_token, chat_template=tokenizer.chat_template)


# --- apmpo -----------------------------------------------------------------------------------------------------


def write_prompts(root: Path, prompt_tokens: int) -> Path:
    """The quickstart's prompts lengthened to `prompt_tokens` tokens, as a records file (apmpo's math fields)."""
    from apmpo.data import encode_prompt, load_records
    from apmpo.quickstart import build_tokenizer, make_samples

    path = root / f"prompts_{prompt_tokens}.jsonl"

    def write(filler: str) -> int:
        rows = [{"question": filler + s["answer"], "answer": s["answer"]} for s in make_samples(512, seed=0)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return len(encode_prompt(load_records(str(path))[0], build_tokenizer()))

    shortest = write("")
    if prompt_tokens < shortest:
        raise SystemExit(f"--prompt-tokens must be at least {shortest} (the system prompt and the digits)")
    write(("saturnine" * prompt_tokens)[: prompt_tokens - shortest])  # letters the character tokenizer keeps
    return path


def run_apmpo(model: Path, task: Task, tokens: int, steps: int, warmup: int, out: Path, max_staleness: int = 0,
              prompts: str = "quickstart", prompt_tokens: int = 22, extra_sets: tuple[str, ...] = ()) -> dict:
    sets = {"model.path": model, "model.dtype": "fp32", "rollout.prompts_per_step": task.prompts, "data.train": prompts,
            "data.reward": task.reward, "data.max_prompt_tokens": prompt_tokens + 8, "rollout.group_size": task.group,
            "rollout.max_tokens": tokens, "rollout.max_model_len": tokens + prompt_tokens + 48,
            "train.mini_batch_size": task.prompts, "train.steps": steps, "loss.kl_beta": task.beta, "optim.lr": LR,
            "optim.warmup_steps": 0, "checkpoint.save_every": 0, "logging.tensorboard": "false",
            "logging.output_dir": out, "logging.run_name": "apmpo", "train.max_staleness": max_staleness}
    command = [sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(ROOT / "configs/quickstart.yaml"),
               *[arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")],
               *[arg for assignment in extra_sets for arg in ("--set", assignment)]]
    start = time.perf_counter()
    done, peaks = run_watching_memory(command)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"launch/train.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "apmpo" / "metrics.jsonl").read_text().splitlines()]
    kept = rows[warmup:]
    return {"step": statistics.median(r["time/step"] for r in kept),
            **{p: statistics.median(r[f"time/{p}"] for r in kept) for p in PHASES},
            "length": statistics.mean(r["response/length_mean"] for r in kept),
            "length_max": max(r["response/length_max"] for r in kept),
            "reward": statistics.mean(r["reward/mean"] for r in kept),
            "informative": statistics.mean(r["rollout/informative_groups_frac"] for r in kept),
            "startup": wall - sum(r["time/step"] for r in rows), "learner_rss": peaks["learner"],
            "server_rss": peaks["server"]}


def run_watching_memory(command: list[str]) -> tuple[subprocess.CompletedProcess, dict[str, float]]:
    """Runs `command` to the end and samples, twice a second, the resident memory of the generation servers (each
    `apmpo.rollout.server` process of its tree with its engine processes) and of the rest of the tree (the learner
    with its reward workers): their peaks in GB."""
    import threading

    import psutil

    peaks = {"learner": 0.0, "server": 0.0}
    with subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        def sample() -> None:
            while process.poll() is None:
                try:
                    root = psutil.Process(process.pid)
                    tree = [root, *root.children(recursive=True)]
                    servers = [p for p in tree if "apmpo.rollout.server" in " ".join(p.cmdline())]
                    serving = {p.pid for p in servers} | {c.pid for p in servers for c in p.children(recursive=True)}
                    for role, members in (("server", [p for p in tree if p.pid in serving]),
                                          ("learner", [p for p in tree if p.pid not in serving])):
                        peaks[role] = max(peaks[role], sum(p.memory_info().rss for p in members) / 1e9)
                except psutil.Error:  # a process ended between the listing and the reading
                    pass
                time.sleep(0.5)

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        stdout, stderr = process.communicate(timeout=3600)
        watcher.join()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), peaks


# --- baseline (in a process of its own, like apmpo's run) ------------------------------------------------------


def run_baseline(model: Path, size: str, tokens: int, steps: int, warmup: int, out: Path, threads: int,
                 prompts: str = "quickstart", dtype: str = "fp32") -> dict:
    command = [sys.executable, __file__, "--baseline-run", str(model), size, str(tokens), str(steps), str(out),
               str(threads), prompts, dtype]
    start = time.perf_counter()
    done, peaks = run_watching_memory(command)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"baseline failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads((out / "baseline.json").read_text())
    kept = result["steps"][warmup:]
    return {"step": statistics.median(kept), "length": statistics.mean(result["lengths"][warmup:]),
            "startup": wall - sum(result["steps"]), "name": result["name"], "rss": peaks["learner"] + peaks["server"]}


def baseline_main(model: str, task: Task, tokens: int, steps: int, out: Path, threads: int, prompts: str,
                  dtype: str) -> None:
    import torch
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    try:
        import trl  # noqa: F401
    except ImportError:
        if dtype != "fp32":
            raise SystemExit("--baseline-dtypes bf16 needs TRL (its bf16=True); the plain baseline is fp32")
        result = _plain_grpo(model, task, tokens, steps, prompts)
    else:
        result = _trl_grpo(model, task, tokens, steps, out, prompts, dtype)
    out.mkdir(parents=True, exist_ok=True)
    (out / "baseline.json").write_text(json.dumps(result))


def _prompts(n: int, source: str) -> list[dict]:
    """"quickstart": its own samples; else a records file of write_prompts."""
    from apmpo.data import load_records
    from apmpo.quickstart import make_samples

    return make_samples(n, seed=0) if source == "quickstart" else load_records(source)[:n]


def _reward(task: Task, completions: list[str], samples: list[dict]) -> list[float]:
    from apmpo.rewards import get_reward

    reward = get_reward(task.reward)
    return [reward(c, s) for c, s in zip(completions, samples)]


def _trl_grpo(model: str, task: Task, tokens: int, steps: int, out: Path, prompts: str, dtype: str) -> dict:
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    samples = _prompts(task.prompts * steps, prompts)
    data = Dataset.from_list([{"prompt": s["messages"], "answer": s["answer"]} for s in samples])

    def reward(completions, answer, **_) -> list[float]:
        return _reward(task, [c[0]["content"] for c in completions], [{"answer": a} for a in answer])

    class Clock(TrainerCallback):
        def __init__(self):
            self.last, self.steps, self.lengths = None, [], []

        def on_step_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(time.perf_counter() - self.last)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    clock = Clock()
    # Two prompts' completions per forward, all of the step's accumulated: one optimiser step per generation batch
    # (16 x 8: 16 completions per forward, 8 accumulated).
    config = GRPOConfig(output_dir=str(out / "trl"), per_device_train_batch_size=2 * task.group,
                        gradient_accumulation_steps=task.prompts // 2, num_generations=task.group,
                        max_completion_length=tokens, max_steps=steps, learning_rate=LR, beta=task.beta, temperature=1.0, top_k=0, logging_steps=1, save_strategy="no", report_to="none",
                        use_cpu=True, bf16=dtype == "bf16", seed=0, disable_tqdm=True, lr_scheduler_type="constant")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data, callbacks=[clock])
    trainer.train()
    name = f"TRL {trl.__version__} GRPOTrainer" + (" bf16=True" if dtype == "bf16" else "")
    return {"name": name, "steps": clock.steps, "lengths": clock.lengths}


def _plain_grpo(model_path: str, task: Task, tokens: int, steps: int, prompts: str) -> dict:
    """HF generate, then one GRPO step: old/reference log-probs without grad, the clipped-ratio loss with a k3 KL
    term, backward, AdamW. The whole rollout batch in one forward; no chunking."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR)
    samples = _prompts(task.prompts * steps, prompts)
    times, lengths = [], []

    def token_logprobs(model, ids, attention, start):
        logits = model(input_ids=ids, attention_mask=attention).logits[:, start - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, ids[:, start:, None]).squeeze(-1)

    for step in range(steps):
        tick = time.perf_counter()
        batch = samples[step * task.prompts : (step + 1) * task.prompts]
        texts = [tokenizer.apply_chat_template(s["messages"], tokenize=False, add_generation_prompt=True) for s in batch]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        policy.eval()
        with torch.no_grad():
            ids = policy.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=tokens,
                                  num_return_sequences=task.group, pad_token_id=tokenizer.pad_token_id)
        start = enc.input_ids.shape[1]
        completion = ids[:, start:]
        # Tokens up to and including the first EOS count; after it, padding.
        eos = (completion == tokenizer.eos_token_id).int()
        mask = (eos.cumsum(1) - eos) == 0
        lengths.append(mask.sum(1).float().mean().item())
        rewards = torch.tensor(_reward(task, tokenizer.batch_decode(completion * mask + tokenizer.pad_token_id * ~mask,
                                                                    skip_special_tokens=True),
                                       [s for s in batch for _ in range(task.group)])).view(task.prompts, task.group)
        advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
        attention = torch.cat([enc.attention_mask.repeat_interleave(task.group, 0), mask.long()], 1)
        with torch.no_grad():
            old = token_logprobs(policy, ids, attention, start)
            ref = token_logprobs(reference, ids, attention, start)
        policy.train()
        logp = token_logprobs(policy, ids, attention, start)
        ratio = torch.exp(logp - old)
        surrogate = torch.minimum(ratio * advantages[:, None], ratio.clamp(0.8, 1.2) * advantages[:, None])
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token = -(surrogate - task.beta * kl)
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - tick)
    return {"name": "plain PyTorch GRPO (HF generate)", "steps": times, "lengths": lengths}


# --- the learner's limit: a plain torch forward+backward of the same tokens -------------------------------------


def plain_forward_backward(model_path: Path, sequences: int, tokens: int, completion: int, threads: int,
                           dtype: str = "fp32", repeats: int = 3) -> float:
    """Median seconds of one forward+backward of `sequences` rows of `tokens` ids in one batch (training mode, the
    log-probs of the last `completion` positions summed as the loss): what any trainer must spend on them."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32).train()
    ids = torch.randint(0, model.config.vocab_size, (sequences, tokens), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(repeats):
        tick = time.perf_counter()
        logits = model(input_ids=ids).logits[:, -completion - 1 : -1].float()
        torch.log_softmax(logits, -1).gather(-1, ids[:, -completion:, None]).sum().backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - tick)
    return statistics.median(times)


# --- the machine's limit for a step: its FLOPs at the measured matmul rate, its bytes at the measured bandwidth ------


def measured_rates(threads: int) -> dict[str, float]:
    """This machine's matmul rates (FLOP/s of [2048, 576] x [576, 1536], SmolLM2's MLP shape, best of 30) in bf16
    and fp32, and its memory bandwidth (bytes/s read and written by a 512 MiB copy, best of 10)."""
    import torch

    torch.set_num_threads(threads)

    def best(fn, repeats: int) -> float:
        fn()
        times = []
        for _ in range(repeats):
            tick = time.perf_counter()
            fn()
            times.append(time.perf_counter() - tick)
        return min(times)

    rates = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a, b = torch.randn(2048, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
        rates[name] = 2 * 2048 * 576 * 1536 / best(lambda: torch.mm(a, b), 30)
    source = torch.ones(2**27)
    target = torch.empty_like(source)
    rates["bandwidth"] = 2 * source.numel() * 4 / best(lambda: target.copy_(source), 10)
    return rates


def step_limit(model_path: Path, task: Task, prompt_tokens: int, length_mean: float, length_max: int,
               rates: dict[str, float], precision: str = "bf16") -> dict[str, float]:
    """Seconds below which a step cannot go on this machine in `precision` (bf16: the machine's limit; fp32: that
    of a run that keeps fp32): the update's forward and backward (3x the forward's FLOPs; each prompt once per
    group, as the learner runs it; the LM head over completion tokens only) and the prefill (each prompt once: the
    engine's prefix cache) at the precision's matmul rate, and each decode step at that rate or its weight and
    KV-cache bytes at the bandwidth, whichever is slower. Attention's own FLOPs (about 2% here) are left out: the
    limit is, if anything, low."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    backbone = 2 * layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * config["intermediate_size"])
    head = 2 * vocab * hidden  # FLOPs per token
    rate, dtype_bytes = rates[precision], {"bf16": 2, "fp32": 4}[precision]
    rows = task.prompts * task.group
    prompt, completion = task.prompts * prompt_tokens, rows * length_mean
    update = 3 * (backbone * (prompt + completion) + head * completion) / rate
    prefill = (backbone * prompt + head * task.prompts) / rate
    # Decoding: the rows still going at each of the longest completion's steps, on average (completion tokens in all).
    alive = completion / max(length_max, 1)
    weight_bytes = dtype_bytes * (backbone + head) / 2
    kv_bytes = 2 * layers * kv * dtype_bytes  # per cached position
    decode = sum(max((backbone + head) * alive / rate,
                     (weight_bytes + kv_bytes * alive * (prompt_tokens + t)) / rates["bandwidth"])
                 for t in range(length_max))
    return {"update": update, "generate": prefill + decode, "step": update + prefill + decode}


# --- main ------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true",
                        help="CI: quickstart model, 8 tokens, 2 steps, 1 warm-up, one generation server")
    parser.add_argument("--sizes", nargs="+", default=["quickstart", "big"], choices=list(TASKS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[8, 64, 128], help="max new tokens")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=1, help="apmpo / baseline pairs per setting")
    parser.add_argument("--baseline-threads", type=int, default=None, help="default: as apmpo's learner")
    parser.add_argument("--max-staleness", type=int, default=0,
                        help="apmpo's train.max_staleness: 1 generates the next batch while the learner updates "
                             "(one step off-policy, unlike the baseline)")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="lengthen every prompt to this many tokens (default: the quickstart's 22)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of apmpo's config, as train.py's --set (e.g. rollout.num_servers=1)")
    parser.add_argument("--baseline-dtypes", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
                        help="TRL's precisions to run, each beside apmpo (bf16: its bf16=True, CPU autocast); the "
                             "ratio is against the fastest")
    parser.add_argument("--baseline-run", nargs=8, help=argparse.SUPPRESS,
                        metavar=("MODEL", "SIZE", "TOKENS", "STEPS", "OUT", "THREADS", "PROMPTS", "DTYPE"))
    args = parser.parse_args()
    if args.baseline_run:
        model, size, tokens, steps, out, threads, prompts, dtype = args.baseline_run
        return baseline_main(model, TASKS[size], int(tokens), int(steps), Path(out), int(threads), prompts, dtype)
    if args.tiny:
        args.sizes, args.tokens, args.steps, args.warmup = ["quickstart"], [8], 2, 1
        args.sets = [*args.sets, "rollout.num_servers=1"]
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")

    threads = args.baseline_threads or learner_threads()
    root = Path(tempfile.mkdtemp(prefix="apmpo_step_time_"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    models = save_models(root, args.sizes)
    prompts = str(write_prompts(root, args.prompt_tokens)) if args.prompt_tokens else "quickstart"
    load = os.getloadavg()[0]
    tasks = ", ".join(f"{size}: {TASKS[size].prompts} prompts x {TASKS[size].group} samples, beta {TASKS[size].beta}"
                      for size in args.sizes)
    dtype = "bf16" if "model.dtype=bf16" in args.sets else "fp32"
    print(f"{os.cpu_count()} cores, load {load:.1f} at start; {tasks}; apmpo in {dtype}; apmpo learner threads {learner_threads(args.max_staleness)}, baseline threads {threads}, apmpo max_staleness "
          f"{args.max_staleness}; median of steps {args.warmup + 1}-{args.steps}, "
          f"{args.rounds} round(s); prompts {args.prompt_tokens or 22} tokens; apmpo --set {args.sets}", flush=True)
    for size in args.sizes:
        task, size_prompts, prompt_tokens, sets = TASKS[size], prompts, args.prompt_tokens or 22, tuple(args.sets)
        if size == "smollm2":
            size_prompts = str(write_additions(root))
            prompt_tokens = _prompt_tokens(models[size], size_prompts)
            sets = ("rollout.num_servers=1", "rollout.enforce_eager=false", "eval.every=0", *sets)  # apmpo's defaults
        for tokens in args.tokens:
            ours, theirs = [], {baseline_dtype: [] for baseline_dtype in args.baseline_dtypes}
            for r in range(args.rounds):
                ours.append(run_apmpo(models[size], task, tokens, args.steps, args.warmup,
                                      root / f"{size}_{tokens}_{r}", args.max_staleness, size_prompts, prompt_tokens,
                                      sets))
                for baseline_dtype in args.baseline_dtypes:
                    theirs[baseline_dtype].append(run_baseline(
                        models[size], size, tokens, args.steps, args.warmup,
                        root / f"{size}_{tokens}_{r}_{baseline_dtype}", threads, size_prompts, baseline_dtype))
            a = {k: statistics.median(run[k] for run in ours) for k in ours[0]}
            phases = ", ".join(f"{p} {a[p]:.3f}" for p in PHASES)
            print(f"\n{size} model, {tokens} new tokens:", flush=True)
            print(f"  apmpo:    {a['step']:.3f} s/step  (length {a['length']:.1f}; start-up {a['startup']:.0f} s; peak "
                  f"RSS learner {a['learner_rss']:.2f} GB, server {a['server_rss']:.2f} GB)  {phases}")
            fastest = None
            for runs in theirs.values():
                b = {k: statistics.median(run[k] for run in runs) for k in ("step", "length", "startup", "rss")}
                print(f"  baseline: {b['step']:.3f} s/step  (length {b['length']:.1f}; start-up {b['startup']:.0f} s; "
                      f"peak RSS {b['rss']:.2f} GB)  {runs[0]['name']}")
                fastest = b["step"] if fastest is None else min(fastest, b["step"])
            print(f"  ratio apmpo/baseline speed: {fastest / a['step']:.2f}x  (the fastest baseline's s/step over "
                  f"apmpo's)", flush=True)
            if size == "smollm2":  # the learner against a plain forward+backward, the step against the machine
                sequences, width = task.prompts * task.group, prompt_tokens + round(a["length"])
                plain = plain_forward_backward(models[size], sequences, width, round(a["length"]),
                                               learner_threads(args.max_staleness), dtype)
                print(f"  learner: update {a['update']:.2f} s + log-probs {a['logprob']:.2f} s; plain torch forward+"
                      f"backward of {sequences} x {width} tokens in {dtype} {plain:.2f} s ({sequences * width / plain:.0f} "
                      f"tokens/s, the learner's {sequences * width / a['update']:.0f}): "
                      f"{a['update'] / plain:.2f}x it; reward/mean {a['reward']:.2f}, groups with a gradient "
                      f"{a['informative']:.2f} (the others are not run: docs/training.md)", flush=True)
                rates = measured_rates(learner_threads(args.max_staleness))
                limit = step_limit(models[size], task, prompt_tokens, a["length"], int(a["length_max"]), rates)
                print(f"  machine: bf16 matmul {rates['bf16'] / 1e9:.0f} GFLOP/s, fp32 {rates['fp32'] / 1e9:.0f}, "
                      f"memory {rates['bandwidth'] / 1e9:.1f} GB/s; the step's limit {limit['step']:.2f} s (update "
                      f"{limit['update']:.2f}, generate {limit['generate']:.2f}): apmpo at {a['step'] / limit['step']:.2f}x "
                      f"it (update {a['update'] / limit['update']:.2f}x, generate "
                      f"{a['generate'] / limit['generate']:.2f}x); the fastest baseline at "
                      f"{fastest / limit['step']:.2f}x", flush=True)
                if dtype == "fp32":  # how far it is from what fp32 itself allows
                    own = step_limit(models[size], task, prompt_tokens, a["length"], int(a["length_max"]), rates,
                                     "fp32")
                    print(f"  in fp32 (its matmul rate, 4-byte weights) the limit is {own['step']:.2f} s (update "
                          f"{own['update']:.2f}, generate {own['generate']:.2f}): apmpo at "
                          f"{a['step'] / own['step']:.2f}x it", flush=True)
    print(f"load {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
