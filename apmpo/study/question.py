"""The question a study answers: planned from a pilot's pairs (--plan), fixed in study.json before its first run
(--halfwidth), and extended only by the rule written with it (stats.more_seeds).
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from apmpo.study import records, stats
from apmpo.study import report as study_report
from apmpo.study.methods import StudyError


def saved_plan(out: Path) -> records.Plan | None:
    path = out / "study.json"
    return records.read(path, records.Study).plan if path.is_file() else None


def preregister(out: Path, args: argparse.Namespace) -> records.Plan | None:
    """The plan this call asks for (--halfwidth: the two --methods, the reference, --score, --seeds), checked
    against study.json's: fixed once a run of the study has finished or started, so that no one picks the
    question, or the number of seeds, after seeing results."""
    old = saved_plan(out)
    if args.halfwidth is None:
        return old
    others = [m for m in args.methods if m != args.reference]
    if len(args.methods) != 2 or len(others) != 1:
        raise StudyError(f"--halfwidth fixes one question, a method against --reference {args.reference}: give "
                         f"--methods METHOD,{args.reference} (got {','.join(args.methods)})")
    rule = {} if args.max_seeds is None else {"max_seeds": args.max_seeds, "first": len(args.seeds)}
    if rule and args.max_seeds < len(args.seeds):
        raise StudyError(f"--max-seeds {args.max_seeds} is fewer than the {len(args.seeds)} --seeds planned")
    plan = records.Plan(method=others[0], reference=args.reference, score=args.score, seeds=tuple(args.seeds),
                        halfwidth=args.halfwidth, **rule)
    started = any((out / "runs").glob("*/seed_*/config.yaml"))
    if old is not None and plan != as_fixed(old) and started:
        raise StudyError(f"{out / 'study.json'} fixed its question before its first run ({_describe(old)}); it "
                         f"cannot become {_describe(plan)}: ask a new question in another --out")
    if old is None and started:
        raise StudyError(f"{out} has runs already: a question fixed now could be chosen after seeing them; ask it "
                         "in a new --out")
    return old if old is not None and started else plan


def as_fixed(plan: records.Plan) -> records.Plan:
    """The plan as it was fixed before the first run: the seeds its rule added since left out."""
    return plan if plan.first is None else plan.model_copy(update={"seeds": plan.seeds[:plan.first]})


def with_more_seeds(plan: records.Plan, more: int) -> records.Plan:
    """The plan with the rule's next `more` seeds: the integers after its last seed, in order (never chosen)."""
    last = max(plan.seeds)
    return plan.model_copy(update={"seeds": (*plan.seeds, *range(last + 1, last + 1 + more))})


def _describe(plan: records.Plan) -> str:
    rule = "" if plan.first is None else (f"; more seeds while wider than that, up to {plan.max_seeds} "
                                          f"({len(plan.seeds) - plan.first} added so far)")
    return (f"{plan.method} - {plan.reference} on {plan.score}, seeds {','.join(map(str, plan.seeds[:plan.first]))}, "
            f"+-{plan.halfwidth:g} points{rule}")


def print_status(out: Path) -> None:
    """--plan on a study with a question: where it stands, by its rule: "done", "N more" or the pairs it waits for."""
    plan = saved_plan(out)
    a = study_report.answer(records.load_results(out), plan)
    print(f"{out}: {_describe(plan)}")
    d = a.get("difference")
    if d is not None and d["low"] is not None:
        print(f"  {len(a['finished'])} pairs finished: {100 * d['diff']:+.1f} points [{100 * d['low']:+.1f}, "
              f"{100 * d['high']:+.1f}], half-width {100 * (d['high'] - d['low']) / 2:.2f}")
    if a["split"]:
        print(f"  seeds {', '.join(map(str, a['split']))}: their runs ran on different machine kinds; left out")
    left = [s for s in plan.seeds if s not in a["finished"] and s not in a["split"]]
    if a["verdict"] != "interim":
        print(f"  done: {a['verdict']}")
    elif a.get("more"):
        print(f"  {a['more']} more (the rule: the interval is wider than +-{plan.halfwidth:g}): the study's next "
              f"start adds seeds {max(plan.seeds) + 1}-{max(plan.seeds) + a['more']} and runs them")
    else:
        print(f"  waiting for {len(left)} planned pair(s): seeds {', '.join(map(str, left))}")


def print_plan(out: Path, args: argparse.Namespace) -> None:
    """--plan: how many seeds --halfwidth needs, from the study's finished pairs (the pilot), and the command."""
    results = records.load_results(out)
    method = args.methods[0] if args.methods else next((m for m in results if m != args.reference), None)
    ours, theirs = results.get(method, {}), results.get(args.reference, {})
    seeds = sorted(set(ours) & set(theirs))
    if len(seeds) < 2:
        raise StudyError(f"--plan needs at least 2 finished pairs of {method} and {args.reference} in {out}; it has "
                         f"{len(seeds)}: run a pilot first (e.g. --methods {method},{args.reference} --seeds 0,1,2)")
    per_pair = statistics.fmean(ours[s]["seconds"] + theirs[s]["seconds"] for s in seeds)

    def planned(score: str) -> stats.Plan:
        d = study_report.paired_difference(study_report.scores(ours, seeds, score),
                                           study_report.scores(theirs, seeds, score))
        return stats.plan([100 * x for x in d["per_seed"]], args.halfwidth, per_pair)

    plan = planned(args.score)
    pilot = plan.pilot
    print(f"pilot: {pilot.n} pairs of {method} - {args.reference} on {args.score}: {pilot.mean:+.1f} points "
          f"[{pilot.low:+.1f}, {pilot.high:+.1f}] (95% paired t), sd of the paired difference {pilot.sd:.1f}; "
          f"{per_pair / 60:.0f} minutes a pair")
    # Pairs that all differ by the same amount (scores are counts of problems: it happens on few pairs) measure no
    # spread, and a plan at sd 0 would ask for the fewest seeds: none is given.
    no_spread = "every pair differs by the same amount: no spread to plan from yet; finish more pairs"

    def spread(pilot: stats.Interval) -> bool:  # sd above rounding: the scores' differences are sums of fractions
        return pilot.sd > 1e-9

    if not spread(pilot):
        print(f"  {no_spread}")
    else:
        for what, n in [(f"at the pilot's sd {pilot.sd:.1f}", plan.seeds),
                        (f"at its 80% upper bound {plan.sd_bound:.1f}", plan.seeds_at_bound)]:
            print(f"  +-{args.halfwidth:g} points {what}: {n} seeds, about {plan.hours(n):.0f} hours of runs")
    # The score is part of the question, so it is chosen here, before the study: by what the pilot says it costs.
    for other in (s for s in records.SCORES if s != args.score):
        try:
            alt = planned(other)
        except records.RecordError:  # no validation curve: no curve score
            continue
        print(f"  --score {other} instead: sd {alt.pilot.sd:.1f}, " + (
            f"{alt.seeds} seeds (about {alt.hours(alt.seeds):.0f} hours), {alt.seeds_at_bound} at its 80% upper "
            f"bound{' (it scores learning speed)' * (other == 'auc')}" if spread(alt.pilot) else no_spread))
    if not spread(pilot):
        return
    config = records.read(out / "study.json", records.Study).settings.config
    print(f"to ask it (the plan is fixed in study.json before the first run; the answer is read on these seeds):\n"
          f"  python -m apmpo.study --config {config} --out NEW_FOLDER --methods {method},{args.reference} "
          f"--reference {args.reference} --seeds 0-{plan.seeds - 1} --score {args.score} "
          f"--halfwidth {args.halfwidth:g}")
