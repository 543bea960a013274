"""Compare methods over seeds: train every (method, seed), evaluate each run, report differences with intervals.

    python -m apmpo.study --config configs/smollm2_arith.yaml --out studies/smollm2_arith \\
        --methods apmpo,grpo,dapo,gmpo --seeds 0,1,2
    python -m apmpo.study --out studies/smollm2_arith --methods pmpo_only,fac_only --seeds 0,1   # same folder: more
    python -m apmpo.study --out studies/smollm2_arith --methods apmpo_bf16 --variant "apmpo_bf16: model.dtype=bf16"
    python -m apmpo.study --out studies/smollm2_arith --methods apmpo_bf16 --seeds 2   # a variant it knows
    python -m apmpo.study --out studies/smollm2_arith --report [--reference grpo]   # the report alone
    python -m apmpo.study --out studies/smollm2_arith --plan --halfwidth 2 --methods apmpo   # seeds for +-2 points
    python -m apmpo.study --config configs/smollm2_arith.yaml --out studies/answer --methods apmpo,grpo \\
        --seeds 0-85 --score last --halfwidth 2     # the question fixed in study.json before the first run
    python -m apmpo.study --config configs/smollm2_twostep.yaml --out studies/twostep_answer --methods apmpo,grpo \\
        --seeds 100-113 --score auc --halfwidth 2 --max-seeds 40 --until 15:00   # with its rule for more seeds
    python -m apmpo.study --out studies/twostep_answer --plan      # the rule applied: "done", "N more", or waiting

A method is a loss name (apmpo, grpo, dapo, gmpo, gspo, dr_grpo: `loss.name=NAME`), one of the built-in variants
(`dapo` also samples dynamically as the paper's DAPO runs; `pmpo_only` and `fac_only` are the paper's ablations),
or a variant of yours: `--variant "NAME: key=value key=value"`, --set overrides on top of the base config, under a
name of its own (a method's name is what it trains). A key is set by the methods or by the study's --set, not both,
and never one the study sets per run (PER_RUN).

Each (method, seed) is one run in OUT/runs/METHOD/seed_S: `launch/train.py` with `train.seed` and `data.seed` set
to S, so that runs sharing a seed see the same prompts in the same order (the report pairs them); then
`python -m apmpo.eval` on its last policy and on its best by validation (checkpoint.keep_best), on the base
config's validation benchmarks, all problems (--eval-limit), --eval-n samples at the validation's temperature,
one eval sampling seed shared by every run. A run is finished once its result.json is written; a killed study
goes on where it stopped: a finished run is never rerun, a run killed mid-training resumes from its last
checkpoint (every --save-every steps), an evaluation from its samples so far, and its wall time counts every
attempt (elapsed.json). A run whose training or evaluation failed is run again by the study's next start; each
failed attempt is recorded (its process, exit code and last step) and the report lists them. OUT/study.json
records the base config, the shared --set and each method's overrides: a later call may add methods and seeds,
and refuses to change what earlier runs were trained with. A run's checkpoints are deleted once it is evaluated,
unless --keep-checkpoints (a 135M model's take 2.7 GB a run).
OUT/.gitignore leaves out checkpoints, logs and samples, so the folder can be committed as runs finish.

Runs go one after another. On a machine with several GPUs, --parallel "0+1;2+3" runs as many at once as it has
groups: each group is the learner's GPUs, then after "+" its generation servers' (rollout.devices); a group
without "+" shares its first GPU with one server (CUDA IPC). The learner starts under `deepspeed --include`.

Every file is written whole or not at all and read back by one schema, a broken one an error naming it
(apmpo/study/records.py). After every finished run it rewrites OUT/report.md and OUT/report.json
(apmpo/study/report.py) and, if matplotlib is installed, OUT/curves.png (python -m apmpo.plot OUT: each
method's mean over seeds with its min-max band).
"""
from __future__ import annotations

import argparse
import datetime
import signal
import sys
from pathlib import Path

from apmpo.study import records, spread
from apmpo.study import report as study_report
from apmpo.study.methods import (
    StudyError,
    check_overrides,
    load_study,
    lock_study,
    log,
    method_overrides,
    parse_variants,
    save_study,
    saved_methods,
)
from apmpo.study.question import (
    preregister,
    print_plan,
    print_status,
    saved_plan,
    with_more_seeds,
)
from apmpo.study.records import RecordError, Settings
from apmpo.study.runner import (
    Run,
    Slot,
    Stopped,
    _stop,
    _visible_gpus,
    parse_parallel,
    plan_runs,
    prune,
    run_all,
)


def write_report(out: Path, methods: list[str], reference: str) -> Path:
    study = records.read(out / "study.json", records.Study)
    plan = study.plan
    study_report.write(out, methods, plan.reference if plan else reference, f"Study: {out.name}", plan,
                       study.settings.final_eval)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return out / "report.md"
    from apmpo.plot import plot

    if any((out / "runs").glob("*/seed_*/metrics.jsonl")):
        plot([out], out / "curves.png", title=f"{out.name}: mean over seeds, min-max band")
    return out / "report.md"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m apmpo.study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the study folder (created; a rerun resumes in it)")
    p.add_argument("--config", help="base config of every run (a new study; later calls read it from study.json)")
    p.add_argument("--methods", default="", help="comma-separated: losses, built-in variants or --variant names")
    p.add_argument("--variant", action="append", default=[], metavar="'NAME: key=value ...'",
                   help="a named method made of --set overrides (repeatable)")
    p.add_argument("--seeds", default="0,1,2", help="training seeds (train.seed and data.seed), e.g. 0,1,2 or 0-39")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for every run of the study (repeatable)")
    p.add_argument("--reference", default="grpo", help="the method the report compares every other with")
    p.add_argument("--eval-n", type=int, default=16, help="samples per problem in each run's evaluation")
    p.add_argument("--eval-limit", type=int, default=None, help="only the first K problems (default: all)")
    p.add_argument("--eval-seeds", default="0", help="eval sampling seeds, shared by every run")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every K steps, to resume a killed run")
    p.add_argument("--no-best", action="store_true",
                   help="evaluate the last policy only, not also the best by validation: one evaluation a run, not "
                        "two (a question's score never reads the best; the report then has no table of it)")
    p.add_argument("--final-eval", choices=("yes", "no"), default=None,
                   help="evaluate each run's last policy after training (default: yes, except in a study whose "
                        "question's --score reads the validation curve alone: auc, tail)")
    p.add_argument("--max-seeds", type=int, default=None, metavar="N",
                   help="with --halfwidth: the rule for adding seeds, fixed with the question: once every planned "
                        "pair has finished, the next seeds in order while the interval is wider than --halfwidth, "
                        "up to N seeds (apmpo.study.stats.more_seeds)")
    p.add_argument("--until", default=None, metavar="HH:MM|ISO-TIME",
                   help="start no pair that would not finish by then (at the longest finished run's time on this "
                        "machine): a run cut off by a machine's end starts again from step 0 on the next")
    p.add_argument("--parallel", default=None, metavar="'GPUS[+GPUS];...'",
                   help="GPU groups, one run each at once, e.g. '0+1;2+3' (learner + servers) or '0;1' (shared)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep finished runs' checkpoints")
    p.add_argument("--report", action="store_true", help="only rewrite the report from the finished runs")
    p.add_argument("--spread", action="store_true",
                   help="print where the paired differences' spread comes from (apmpo/study/spread.py) and stop")
    p.add_argument("--plan", action="store_true",
                   help="print how many seeds --halfwidth needs, from the finished pairs of --out, and stop")
    p.add_argument("--halfwidth", type=float, default=None, metavar="POINTS",
                   help="with --plan: the target; with a study: fix its question (--methods M,REF, --reference, "
                        "--score, --seeds) in study.json before its first run")
    p.add_argument("--score", choices=records.SCORES, default="last",
                   help="the question's score: the last policy's pass@1, the validation curve's mean (auc), or "
                        "its second half's mean (tail: the plateau's level, docs/study.md)")
    args = p.parse_args(argv)
    try:
        args.seeds = [seed for part in args.seeds.split(",") if part.strip() for seed in _seed_range(part)]
        args.eval_seeds = tuple(int(s) for s in args.eval_seeds.split(",") if s.strip())
    except ValueError:
        p.error("--seeds and --eval-seeds take comma-separated integers, e.g. 0,1,2")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    twice = sorted({m for m in args.methods if args.methods.count(m) > 1} | {
        str(s) for s in args.seeds if args.seeds.count(s) > 1})
    for ok, message in [(not twice, f"--methods and --seeds name each once; refused, not merged: {', '.join(twice)} "
                                    "given twice"),
                        (all(s >= 0 for s in args.seeds), "--seeds must be >= 0"),
                        (args.eval_n >= 1 and (args.eval_limit is None or args.eval_limit >= 1),
                         "--eval-n and --eval-limit must be >= 1"),
                        (bool(args.eval_seeds), "--eval-seeds is empty"), (args.save_every >= 1, "--save-every >= 1"),
                        (args.halfwidth is None or args.halfwidth > 0, "--halfwidth must be > 0"),
                        (args.max_seeds is None or args.halfwidth is not None,
                         "--max-seeds is the rule of a question: it needs --halfwidth")]:
        if not ok:
            p.error(message)
    try:
        args.until = None if args.until is None else _deadline(args.until)
    except ValueError:
        p.error(f"--until {args.until!r}: expected HH:MM (today, local time) or an ISO time, e.g. 2026-12-07T15:00")
    return args


def _deadline(text: str) -> float:
    """ "15:05" -> today at 15:05 local time; "2026-12-07T15:05" as it says. Epoch seconds."""
    if len(text) <= 5 and ":" in text:
        hours, minutes = map(int, text.split(":"))
        return datetime.datetime.now().replace(hour=hours, minute=minutes, second=0, microsecond=0).timestamp()
    return datetime.datetime.fromisoformat(text).timestamp()


def final_eval(out: Path, args: argparse.Namespace) -> bool:
    """--final-eval, else what the study was started with, else whether the question's score reads the last
    policy (auc and tail read the validation curve alone: no CPU for an evaluation nothing reads)."""
    if args.final_eval is not None:
        return args.final_eval == "yes"
    if (out / "study.json").is_file():
        return records.read(out / "study.json", records.Study).settings.final_eval
    return args.halfwidth is None or args.score not in study_report.CURVE_SCORES


def _seed_range(text: str) -> range:
    """ "7" -> 7; "0-39" -> 0..39."""
    first, dash, last = text.strip().partition("-")
    return range(int(first), int(last if dash else first) + 1)


def main(argv: list[str] | None = None) -> int:
    from apmpo.config import ConfigError

    args = parse_args(argv)
    out = args.out
    try:
        variants = saved_methods(out) | parse_variants(args.variant)
        asked = args.methods
        methods = {m: method_overrides(m, variants) for m in asked}
        settings = None if args.config is None else Settings(
            args.config, tuple(args.set), args.eval_n, args.eval_limit, args.eval_seeds, args.save_every,
            not args.no_best, final_eval(out, args))
        if (args.report or args.plan or args.spread) and not (out / "study.json").is_file():
            raise StudyError(f"{out / 'study.json'} does not exist: " + (
                f"no study to report on in {out}" if args.report else "--plan reads a study's finished pairs"))
        if args.report:
            log(f"report: {write_report(out, list(saved_methods(out)), args.reference)}")
            return 0
        if args.spread:
            plan = saved_plan(out)
            method = plan.method if plan else (args.methods[0] if args.methods else "apmpo")
            reference = plan.reference if plan else args.reference
            print(spread.render(spread.spread(out, method, reference), method, reference))
            return 0
        if args.plan:
            if args.halfwidth is not None:
                print_plan(out, args)
            elif saved_plan(out) is not None:
                print_status(out)
            else:
                raise StudyError(f"--plan needs --halfwidth POINTS: {out} asks no question to report on")
            return 0
        if not asked:
            raise StudyError("--methods is empty: name the methods to run, e.g. --methods apmpo,grpo")
        slots = parse_parallel(args.parallel, _visible_gpus() if args.parallel else None)
        settings, methods = load_study(out, settings, methods)
        check_overrides(methods, settings.set)
        plan = preregister(out, args)
        if plan is not None and sorted(asked) != sorted((plan.method, plan.reference)):
            raise StudyError(f"{out} asks {plan.method} - {plan.reference}: run --methods "
                             f"{plan.method},{plan.reference} (its seeds are the plan's)")
        # a question's seeds are its plan's: those fixed before the first run and those its rule added since
        runs = plan_runs(out, settings, methods, asked, list(plan.seeds) if plan else args.seeds)
        records.load_results(out)  # every finished run's record: a broken one stops the study before anything runs
        lock = lock_study(out)
        save_study(out, settings, methods, plan)
    except ConfigError as error:
        print(f"apmpo.study: bad config: {error}", file=sys.stderr)
        return 2
    except (StudyError, RecordError) as error:
        print(f"apmpo.study: {error}", file=sys.stderr)
        return 2
    with lock:  # until the study ends
        try:
            return run_study(out, runs, settings, slots, methods, plan, args)
        except RecordError as error:  # a record broken meanwhile, read for the report: the runs were stopped
            print(f"apmpo.study: {error}", file=sys.stderr)
            return 2


def run_study(out: Path, runs: list[Run], settings: Settings, slots: list[Slot], methods: dict,
              plan: records.Plan | None, args: argparse.Namespace) -> int:
    """Runs what is left of the study, rewriting the report after each run, and the seeds its question's rule adds
    once every planned pair has finished; the exit code."""
    def finished(run: Run) -> None:
        if not args.keep_checkpoints:
            prune(run)
        write_report(out, list(methods), args.reference)

    # Both, whatever this process inherited: started in the background by a script, SIGINT is ignored
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        while True:
            failed, waiting = run_all(runs, settings, slots, finished, args.until)
            more = 0 if failed or waiting or plan is None else study_report.answer(
                records.load_results(out), plan).get("more", 0)
            if not more:
                break
            plan = with_more_seeds(plan, more)
            save_study(out, settings, methods, plan)  # study.json's one change after its first run: seeds added
            log(f"the rule adds {more} seeds ({', '.join(map(str, plan.seeds[-more:]))}): the interval of the "
                f"finished pairs is wider than +-{plan.halfwidth:g}")
            runs = plan_runs(out, settings, methods, [plan.method, plan.reference], list(plan.seeds))
    except Stopped as stop:
        log(f"stopped ({stop}); the same command goes on where it stopped (finished runs: "
            f"{out}/runs/*/seed_*/result.json)")
        return 128 + stop.signum
    report_path = write_report(out, list(methods), args.reference)
    if failed:
        log(f"{len(failed)} run(s) failed: {', '.join(r.name for r in failed)} (their logs above); rerun to retry")
        return 1
    if waiting:
        log(f"{len(waiting)} run(s) wait (above): {', '.join(r.name for r in waiting)}; the same command runs them "
            "later")
        return 3
    log(f"done: {report_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
