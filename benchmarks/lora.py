"""LoRA against full fine-tuning, side by side, on a real model: push time and bytes, the learner's peak memory,
seconds per step, the reward curve over the same steps, and what LoRA's eager engine costs on CPU.

    python -m apmpo.models fetch smollm2-135m-instruct
    python benchmarks/lora.py [--steps 10] [--config configs/smollm2_arith.yaml] [--out runs/bench_lora] [--set k=v]

Three runs of launch/train.py with the same seed, data and prompts (validation and checkpoints off):
- full: full fine-tuning, the config as it is (its server compiles the model on CPU);
- full_eager: the same with rollout.enforce_eager, so that generation runs as an engine with LoRA must on CPU
  (vLLM turns compilation off when LoRA is on): full_eager against full is what losing compilation costs;
- lora: model.lora (rank --rank, alpha 2 x rank, every projection) at optim.lr x --lr-scale.
Reported per run: median seconds per step and of its phases (generate, update, weight sync), the bytes a push
carries, the learner's peak resident memory (VmHWM of its process; the servers are other processes), and the
reward of every step. Timings on a shared machine vary: rerun, and compare runs of one invocation only.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def peak_rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def train(config: str, out: Path, name: str, steps: int, overrides: list[str]) -> dict:
    sets = [f"train.steps={steps}", "eval.every=0", "checkpoint.save_every=0", "checkpoint.keep_best=null",
            f"logging.output_dir={out}", f"logging.run_name={name}", "logging.tensorboard=false", *overrides]
    command = [sys.executable, str(ROOT / "launch" / "train.py"), "--config", config,
               *[arg for s in sets for arg in ("--set", s)]]
    log = open(out / f"{name}.log", "w")
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    peak = 0.0
    while process.poll() is None:  # VmHWM is gone once the process is: read it while it runs
        peak = max(peak, peak_rss_mib(process.pid) or 0.0)
        time.sleep(0.5)
    if process.returncode != 0:
        raise SystemExit(f"{name}: launch/train.py exited {process.returncode}; see {out / f'{name}.log'}")
    records = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    steady = records[1:] or records  # the first step also warms up

    def median(key: str) -> float:
        return statistics.median(r[key] for r in steady)

    return {"s_per_step": median("time/step"), "generate_s": median("time/generate"),
            "update_s": median("time/update"), "logprob_s": median("time/logprob"),
            "weight_sync_s": median("time/weight_sync"), "learner_peak_rss_mib": peak,
            "reward": [round(r["reward/mean"], 4) for r in records]}


def push_bytes(model_path: str, rank: int) -> dict[str, int]:
    """What one push carries: every weight in the engine's dtype (float32 on CPU), or the adapter's tensors."""
    import torch
    from transformers import AutoModelForCausalLM

    from apmpo.config import LoraConfig
    from apmpo.learner import lora

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    full = sum(p.numel() * 4 for p in model.parameters())  # a tied head is not sent twice (weight_sync)
    lora.add_adapter(model, LoraConfig(rank=rank, alpha=2 * rank))
    adapter = sum(t.numel() * t.element_size() for t in model.get_adapter_state_dict().values())
    return {"full": full, "lora": adapter}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "smollm2_arith.yaml"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr-scale", type=float, default=10.0, help="LoRA's learning rate / full fine-tuning's")
    parser.add_argument("--runs", default="full,full_eager,lora")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench_lora"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run, e.g. --set rollout.max_tokens=64 (repeatable)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from apmpo.config import load_config
    from apmpo.learner.prepare import prepare_model

    out = Path(args.out)
    cfg = load_config(args.config, [*args.set, f"logging.output_dir={out}", "logging.run_name=model"])
    out.mkdir(parents=True, exist_ok=True)
    variants = {"full": [], "full_eager": ["rollout.enforce_eager=true"],
                "lora": [f"model.lora.rank={args.rank}", f"model.lora.alpha={2 * args.rank}",
                         f"optim.lr={cfg.optim.lr * args.lr_scale}"]}
    results = {"config": args.config, "steps": args.steps,
               "push_bytes": push_bytes(prepare_model(cfg, is_main=True), args.rank)}
    for name in args.runs.split(","):
        results[name] = train(args.config, out, name, args.steps, args.set + variants[name])
        print(name, json.dumps(results[name]), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    full, lora = results.get("full"), results.get("lora")
    if full and lora:
        bytes_ = results["push_bytes"]
        print(f"ratio lora/full: push bytes {bytes_['lora'] / bytes_['full']:.4f}x, "
              f"push time {lora['weight_sync_s'] / full['weight_sync_s']:.2f}x, "
              f"s/step {lora['s_per_step'] / full['s_per_step']:.2f}x, "
              f"learner peak RSS {lora['learner_peak_rss_mib'] / full['learner_peak_rss_mib']:.2f}x, "
              f"generate {lora['generate_s'] / full['generate_s']:.2f}x")
    if full and results.get("full_eager"):
        print(f"ratio eager/compiled generate (what LoRA's eager CPU engine loses): "
              f"{results['full_eager']['generate_s'] / full['generate_s']:.2f}x")


if __name__ == "__main__":
    main()
