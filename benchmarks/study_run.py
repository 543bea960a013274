"""Seconds of one study run by phase, at two study settings side by side, and each phase against the machine's limit.

    python benchmarks/study_run.py                  # configs/smollm2_twostep.yaml, 8 steps, validation every 4
    python benchmarks/study_run.py --tiny           # CI: the quickstart, 2 steps, validation every step

A study's run is the processes `apmpo.study` starts for it (apmpo/study/runner.py, `commands`): the training run
and, where the study evaluates it, the last policy's evaluation. This script builds both runs with the runner's own
code and times each process, in one process tree, one after the other:

- "before": `studies/twostep_60`'s design, which evaluated the last policy (192 problems x 4 there; --final-limit);
- "after": `studies/twostep_auc`'s, whose question (the validation curve's mean) reads no final evaluation, so the
  study skips it (`--final-eval no`).

Both train the same seed with the same config, so their training computes alike and is run once: "after" is
"before" without the evaluation. `--set-after KEY=VALUE` (repeatable) gives "after" overrides of its own (an opt-in
speed-up), and then a training run of its own. The phases come from each run's metrics.jsonl (time/*); start-up and
shut-down are the training process's wall time less its steps and validations.
Each phase of a step is also given as a multiple of this machine's limit for it in fp32 (benchmarks/step_time.py:
the FLOPs at the matmul rate measured here, decode at that rate or its bytes at the measured bandwidth).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
PHASES = ("generate", "logprob", "update", "weight_sync", "reward")


def time_run(out: Path, config: str, overrides: tuple[str, ...], final_eval: bool, final_limit: int) -> dict:
    """Runs one study run's processes as the runner would, timing each; its phases in seconds."""
    from apmpo.study.records import Settings
    from apmpo.study.runner import Slot, commands, plan_runs

    settings = Settings(config, overrides, eval_n=4, eval_limit=final_limit, save_every=10, eval_best=False,
                        final_eval=final_eval)
    run = plan_runs(out, settings, {"grpo": ("loss.name=grpo",)}, ["grpo"], [0])[0]
    walls = {}
    out.mkdir(parents=True, exist_ok=True)
    for what, argv, env in commands(run, settings, Slot()):
        tick = time.perf_counter()
        with open(out / f"{what.replace(' ', '_')}.log", "wb") as log:
            subprocess.run(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
        walls[what] = time.perf_counter() - tick
    rows = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    phases = {p: sum(r.get(f"time/{p}", 0.0) for r in rows) for p in PHASES}
    steps, validation = sum(r["time/step"] for r in rows), sum(r.get("time/eval", 0.0) for r in rows)
    phases |= {"validation": validation, "start-up and shut-down": walls["training"] - steps - validation,
               "final evaluation": walls.get("eval last", 0.0)}
    return {"phases": phases, "steps": len(rows), "total": sum(walls.values()), "rows": rows,
            "model": run.dir / "checkpoints" / f"step_{run.cfg.train.steps}" / "hf", "cfg": run.cfg}


def limits(result: dict) -> dict[str, float]:
    """Seconds below which a step's generation and update cannot go here in fp32, summed over the run's steps."""
    from step_time import Task, learner_threads, measured_rates, step_limit

    cfg, rows = result["cfg"], result["rows"]
    rates = measured_rates(learner_threads())
    task = Task(cfg.rollout.prompts_per_step, cfg.rollout.group_size, 0.0, "")
    total = {"generate": 0.0, "update": 0.0}
    for r in rows:
        limit = step_limit(result["model"], task, cfg.data.max_prompt_tokens, r["response/length_mean"],
                           int(r["response/length_max"]), rates, "fp32")
        total["generate"] += limit["generate"]
        total["update"] += limit["update"]
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CI: the quickstart, 2 steps, validation every step")
    p.add_argument("--config", default="configs/smollm2_twostep.yaml")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--final-limit", type=int, default=32, help="problems in the 'before' run's final evaluation")
    p.add_argument("--set-after", action="append", default=[], metavar="KEY=VALUE",
                   help="an override of the 'after' run alone (it then trains a run of its own)")
    args = p.parse_args()
    if args.tiny:
        args.config, args.steps, args.eval_every, args.final_limit = "configs/quickstart.yaml", 2, 1, 8
    overrides = (f"train.steps={args.steps}", f"eval.every={args.eval_every}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="apmpo_study_run_") as tmp:
        print(f"[study_run] before: {args.config}, {args.steps} steps, validation every {args.eval_every}, final "
              f"evaluation of {args.final_limit} problems x 4", flush=True)
        results["before"] = time_run(Path(tmp) / "before", args.config, overrides, True, args.final_limit)
        if args.set_after:
            print(f"[study_run] after: the same with {' '.join(args.set_after)}, final evaluation skipped", flush=True)
            results["after"] = time_run(Path(tmp) / "after", args.config, overrides + tuple(args.set_after), False,
                                        args.final_limit)
        else:  # the same training: the run without its evaluation
            print("[study_run] after: the same run, final evaluation skipped", flush=True)
            results["after"] = {**results["before"], "total": results["before"]["total"]
                                - results["before"]["phases"]["final evaluation"],
                                "phases": {**results["before"]["phases"], "final evaluation": 0.0}}
        limit = limits(results["after"])
    before, after = results["before"], results["after"]
    print(f"\n{'phase':<24}{'before s':>10}{'after s':>10}{'x limit':>9}")
    for phase in before["phases"]:
        times = before["phases"][phase], after["phases"][phase]
        multiple = f"{times[1] / limit[phase]:.1f}x" if phase in limit and limit[phase] else "–"
        print(f"{phase:<24}{times[0]:>10.1f}{times[1]:>10.1f}{multiple:>9}")
    print(f"{'the run':<24}{before['total']:>10.1f}{after['total']:>10.1f}")
    print(f"fp32 limit of the steps here: generation {limit['generate']:.1f} s, update {limit['update']:.1f} s")
    print(f"ratio after/before: the run {after['total'] / before['total']:.2f}x")


if __name__ == "__main__":
    main()
