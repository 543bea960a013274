"""Compare methods over seeds: train every (method, seed), evaluate each run, report differences with intervals.

    python -m apmpo.study --config configs/smollm2_arith.yaml --out studies/smollm2_arith \
        --methods apmpo,grpo,dapo,gmpo --seeds 0,1,2
    python -m apmpo.study --out studies/smollm2_arith --methods pmpo_only,fac_only --seeds 0,1   # same folder: more
    python -m apmpo.study --out studies/smollm2_arith --methods apmpo_bf16 --variant "apmpo_bf16: model.dtype=bf16"
    python -m apmpo.study --out studies/smollm2_arith --methods apmpo_bf16 --seeds 2   # a variant it knows
    python -m apmpo.study --out studies/smollm2_arith --report [--reference grpo]   # the report alone
    python -m apmpo.study --out studies/smollm2_arith --plan --halfwidth 2 --methods apmpo   # seeds for +-2 points
    python -m apmpo.study --config configs/smollm2_arith.yaml --out studies/answer --methods apmpo,grpo \
        --seeds 0-85 --score last --halfwidth 2     # the question fixed in study.json before the first run

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
import ctypes
import datetime
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from apmpo import dirlock, warm
from apmpo.study import records
from apmpo.study import report as study_report, stats
from apmpo.study.records import BUILTIN_VARIANTS, RecordError, Settings, builtin_methods, write_atomic

ROOT = Path(__file__).resolve().parents[2]  # the repository: launch/train.py
# Keys that place and checkpoint a run and never change what it learns: two configs that differ in them alone train
# the same.
BOOKKEEPING = ("logging", "checkpoint", "train.resume", "derived")
# Keys the study sets for every run, over whatever a --set or a variant gives: a value there would be replaced, yet
# recorded as what the method trained with. checkpoint whole: the study owns a run's checkpoints (hf/ is what it
# evaluates, --save-every when they are written, keep_best what "best" means); logging.tensorboard and logging.wandb
# are the user's to choose.
PER_RUN = ("train.seed", "data.seed", "train.resume", "logging.output_dir", "logging.run_name", "checkpoint")


class StudyError(Exception):
    """A study that cannot run as asked; the message names the option at fault."""


class Stopped(Exception):
    """SIGINT or SIGTERM: the study stops its runs as on Ctrl-C, and the same command goes on later."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, frame) -> None:
    raise Stopped(signum)


def log(message: str) -> None:
    print(f"[apmpo.study] {message}", flush=True)


# ---------------------------------------------------------------------------- what to run


@dataclass
class Run:
    method: str
    seed: int
    method_overrides: tuple[str, ...]
    overrides: tuple[str, ...]  # the method's, then the study's --set, then the run's own
    dir: Path
    cfg: object = None  # apmpo.config.Config, resolved at start: a bad config fails before anything runs
    started: float = field(default_factory=time.monotonic)  # this attempt's start
    before: float = 0.0  # seconds of the earlier attempts (elapsed.json when the study started)
    machines: tuple[str, ...] = ()  # where its attempts ran, this one's included (elapsed.json's, then this one)
    failures: tuple[records.Failure, ...] = ()  # its attempts that failed (elapsed.json's, then this study's)

    @property
    def name(self) -> str:
        return f"{self.method} seed {self.seed}"

    @property
    def result_path(self) -> Path:
        return self.dir / "result.json"


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
    """ "pmpo_only: loss.fac=false loss.x=y" -> ("pmpo_only", ("loss.fac=false", "loss.x=y"))."""
    name, sep, rest = text.partition(":")
    name = name.strip()
    overrides = tuple(shlex.split(rest))
    if not sep or not name.isidentifier() or not overrides or not all("=" in o for o in overrides):
        raise StudyError(f"--variant {text!r}: expected 'NAME: key=value [key=value ...]', e.g. "
                         "'pmpo_only: loss.fac=false'")
    return name, overrides


def parse_variants(texts: list[str]) -> dict[str, tuple[str, ...]]:
    """Every --variant, by name: a name given twice, or a built-in method's name, is refused (a variant named grpo
    would train something else under grpo's name)."""
    variants: dict[str, tuple[str, ...]] = {}
    builtin = builtin_methods()
    for text in texts:
        name, overrides = parse_variant(text)
        if name in variants:
            raise StudyError(f"--variant {name!r} is given twice: one name, one set of overrides")
        if name in builtin:
            raise StudyError(f"--variant {text!r}: {name!r} is a built-in method ({' '.join(builtin[name])}); "
                             f"give your variant a name of its own, e.g. {name}_mine")
        variants[name] = overrides
    return variants


def method_overrides(name: str, variants: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    from apmpo.loss import POLICY_LOSSES

    if (builtin := builtin_methods().get(name)) is not None:
        return builtin
    if name in variants:
        return variants[name]
    raise StudyError(f"--methods: {name!r} is neither a loss ({', '.join(POLICY_LOSSES)}), a built-in variant "
                     f"({', '.join(BUILTIN_VARIANTS)}) nor defined with --variant \"{name}: key=value ...\"")


def check_overrides(methods: dict[str, tuple[str, ...]], shared: tuple[str, ...]) -> None:
    """Refuses an override that would be silently replaced: one of a key the study sets per run (PER_RUN), and a
    --set of a key that a method sets (the --set comes after, so grpo's loss.name=grpo would give way to
    --set loss.name=apmpo). A key and a section holding it count as the same key."""
    def key(override: str) -> tuple[str, ...]:
        return tuple(override.partition("=")[0].strip().split("."))

    def overlap(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
        return a[:len(b)] == b[:len(a)]

    where = {f"--set {o!r}": o for o in shared} | {f"method {m}'s {o!r}": o
                                                       for m, overrides in methods.items() for o in overrides}
    for what, override in where.items():
        if hit := next((k for k in PER_RUN if overlap(key(override), tuple(k.split(".")))), None):
            raise StudyError(f"{what}: the study sets {hit} for every run itself (the seed from --seeds, "
                             "checkpoints from --save-every, where the run is written); leave it out")
    for override in shared:
        for method, overrides in methods.items():
            if hit := next((o for o in overrides if overlap(key(override), key(o))), None):
                raise StudyError(f"--set {override!r} would replace {method}'s own {hit!r}: a key is set by the "
                                 "methods or by --set, not both")


def saved_methods(out: Path) -> dict[str, tuple[str, ...]]:
    """The methods OUT/study.json records ({} for a new study): a variant trained there needs no --variant again."""
    path = out / "study.json"
    return records.read(path, records.Study).methods if path.is_file() else {}


def load_study(out: Path, settings: Settings | None, methods: dict[str, tuple[str, ...]]) -> tuple[Settings, dict]:
    """Merges this call with OUT/study.json: the shared settings must be those of earlier calls, a method already
    there keeps its overrides. Returns the settings and every method of the study."""
    path = out / "study.json"
    if path.is_file():
        saved = records.read(path, records.Study)
        old = saved.settings
        if settings is not None and settings != old:
            changed = [k for k in Settings.__dataclass_fields__ if getattr(settings, k) != getattr(old, k)]
            raise StudyError(f"{out} was run with other settings ({', '.join(changed)}: "
                             f"{[getattr(old, k) for k in changed]}); run them in another --out")
        known = saved.methods
        for name, overrides in methods.items():
            if name in known and known[name] != overrides:
                raise StudyError(f"method {name!r} of {out} was trained with {list(known[name])}, not "
                                 f"{list(overrides)}: give the new variant another name")
        settings = old
        methods = known | methods
    elif settings is None:
        raise StudyError(f"{path} does not exist: a new study needs --config")
    return settings, methods


def lock_study(out: Path) -> TextIO:
    """Holds OUT/.lock while the study runs: a second study in the same folder would train the same runs into the
    same directories at once."""
    try:
        return dirlock.hold(out, "apmpo.study")
    except dirlock.Busy as busy:
        raise StudyError(f"{busy}: wait for it to end, or stop it (the same command then goes on where it "
                         "stopped)") from None
    except OSError as error:  # a file, or a path where nothing can be written
        raise StudyError(f"--out {out}: cannot write there ({error.strerror or error})") from None


def save_study(out: Path, settings: Settings, methods: dict[str, tuple[str, ...]],
               plan: records.Plan | None = None) -> None:
    """Writes OUT/study.json, once every run's config has loaded: a bad config or variant leaves nothing behind
    that a corrected call would have to match."""
    out.mkdir(parents=True, exist_ok=True)
    study = {"settings": settings.__dict__, "methods": methods} | ({"plan": plan.model_dump()} if plan else {})
    write_atomic(out / "study.json", json.dumps(study, indent=1) + "\n")
    ignore = out / ".gitignore"
    if not ignore.exists():  # what a commit of the study folder leaves out: large, and not needed by the report
        write_atomic(ignore, "checkpoints/\ntensorboard/\n*.log\nsamples.jsonl\n*.tmp\n.lock\n")


def plan_runs(out: Path, settings: Settings, methods: dict[str, tuple[str, ...]], asked: list[str],
              seeds: list[int]) -> list[Run]:
    """Every asked (method, seed), its config resolved now (a bad one raises ConfigError naming the key), and
    checked against what an earlier call trained it with (its config.yaml). Seed by seed: a study stopped early
    holds whole pairs for the report."""
    from apmpo import preflight
    from apmpo.config import load_config

    runs = []
    for seed in seeds:
        for method in asked:
            run_dir = out / "runs" / method / f"seed_{seed}"
            overrides = (*methods[method], *settings.set, f"train.seed={seed}", f"data.seed={seed}",
                         f"logging.output_dir={run_dir.parent}", f"logging.run_name={run_dir.name}",
                         "train.resume=auto", f"checkpoint.save_every={settings.save_every}", "checkpoint.keep_last=1")
            cfg = load_config(settings.config, overrides)
            if cfg.eval.every and cfg.checkpoint.keep_best is None:  # the best policy by validation is evaluated
                key = f"val/{cfg.eval.benchmarks.split(',')[0].split('=')[0]}/pass@1"
                overrides += (f"checkpoint.keep_best={key}",)
                cfg = load_config(settings.config, overrides)
            preflight.check(cfg)
            elapsed = run_dir / "elapsed.json"  # read now: a broken one stops the study before anything runs
            earlier = records.read(elapsed, records.Elapsed) if elapsed.is_file() else records.Elapsed(seconds=0.0)
            machines = tuple(dict.fromkeys([*earlier.machines, records.this_machine()]))
            run = Run(method, seed, methods[method], overrides, run_dir, cfg, before=earlier.seconds,
                      machines=machines, failures=tuple(earlier.failures))
            _check_same_config(run)
            runs.append(run)
    return runs


def _check_same_config(run: Run) -> None:
    saved = run.dir / "config.yaml"
    if not saved.is_file():
        return
    import yaml

    def learning(d: dict) -> dict:
        flat = _flatten(d)
        return {k: v for k, v in flat.items() if not k.startswith(BOOKKEEPING)}

    old, new = learning(yaml.safe_load(saved.read_text())), learning(run.cfg.to_dict())
    # Keys of one side only are a newer or older apmpo's (rollout.env_workers came during the first study): a new
    # key's default keeps the old behaviour, so only a value both sides have can differ.
    changed = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    if changed:
        raise StudyError(f"{run.dir} was trained with another config: {', '.join(changed[:6])} "
                         f"(was {[old.get(k) for k in changed[:6]]}, now {[new.get(k) for k in changed[:6]]}); "
                         "delete that run folder to train it again")


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


# ---------------------------------------------------------------------------- one run: train, evaluate, record


def trained(run: Run) -> bool:
    return (run.dir / "checkpoints" / f"step_{run.cfg.train.steps}" / "hf" / "config.json").is_file()


def best_record(run: Run) -> dict | None:
    path = run.dir / "checkpoints" / "best" / "best.json"
    return json.loads(path.read_text()) if path.is_file() else None


def commands(run: Run, settings: Settings, slot: Slot):
    """The run's processes, one after another: (what, argv, env). Generated lazily: each step looks at what the
    previous one left on disk."""
    cfg = run.cfg
    if not trained(run):
        argv = [sys.executable, str(ROOT / "launch" / "train.py")]
        if slot.learner:
            # DeepSpeed's launcher from this interpreter: `deepspeed` is on PATH only in an activated environment
            argv = [sys.executable, "-m", "deepspeed.launcher.runner", "--include", f"localhost:{slot.learner}",
                    "--master_port", str(slot.port), str(ROOT / "launch" / "train.py")]
        overrides = run.overrides + ((f"rollout.devices={slot.servers}",) if slot.servers else ())
        yield "training", argv + ["--config", cfg_path(settings)] + [a for o in overrides for a in ("--set", o)], None
    best = best_record(run)
    last_step = cfg.train.steps
    targets = [("last", run.dir / "checkpoints" / f"step_{last_step}", last_step)]
    if settings.eval_best and best is not None and best["step"] != last_step:
        targets.append(("best", run.dir / "checkpoints" / "best", best["step"]))
    for which, checkpoint, _ in targets:
        if (run.dir / "eval" / which / "results.json").is_file():
            continue
        yield f"eval {which}", eval_argv(run, settings, slot, which, checkpoint), None
    write_result(run, settings, targets, best)


def cfg_path(settings: Settings) -> str:
    return str(Path(settings.config).resolve())


def eval_argv(run: Run, settings: Settings, slot: Slot, which: str, checkpoint: Path) -> list[str]:
    e, r = run.cfg.eval, run.cfg.rollout
    argv = [sys.executable, "-m", "apmpo.eval", "--model", str(checkpoint), "--benchmarks", e.benchmarks,
            "--out", str(run.dir / "eval" / which), "--label", f"{run.method} seed {run.seed} {which}",
            "--n", str(settings.eval_n), "--seeds", ",".join(map(str, settings.eval_seeds)),
            "--temperature", str(e.temperature), "--top-p", str(e.top_p), "--max-tokens", str(e.max_tokens),
            "--max-model-len", str(r.max_model_len), "--reward-workers", str(r.reward_workers),
            "--reward-timeout-s", str(r.reward_timeout_s)]
    if settings.eval_limit is not None:
        argv += ["--limit", str(settings.eval_limit)]
    if e.reward is not None:
        argv += ["--reward", e.reward]
    if run.cfg.data.env is not None:
        d = run.cfg.data
        argv += ["--env", d.env, "--max-turns", str(d.max_turns), "--max-episode-tokens", str(d.max_episode_tokens),
                 "--env-timeout-s", str(d.env_timeout_s), "--env-workers", str(r.env_workers)]
    if r.enforce_eager:
        argv.append("--enforce-eager")
    if slot.learner:
        argv += ["--devices", slot.servers or slot.learner.split(",")[0]]
    return argv


def write_result(run: Run, settings: Settings, targets: list, best: dict | None) -> None:
    """result.json, the run's record for the report (per-problem correct counts, the validation curve), then the
    checkpoints go unless --keep-checkpoints."""
    evals = {}
    for which, _, step in targets:
        evals[which] = {"step": step, **_correct_counts(run.dir / "eval" / which)}
    # The best policy was the last one: its evaluation stands for both. Not under --no-best: the best table would
    # then hold just the runs whose best came last, a selection.
    if settings.eval_best and best is not None and best["step"] == evals["last"]["step"]:
        evals["best"] = evals["last"]
    metrics = _read_metrics(run.dir / "metrics.jsonl")
    key = run.cfg.checkpoint.keep_best
    result = {
        "method": run.method, "seed": run.seed, "overrides": list(run.method_overrides),
        "steps": run.cfg.train.steps, "validation_key": key,
        "validation": [[s, m[key]] for s, m in metrics.items() if key and isinstance(m.get(key), (int, float))],
        "train_seconds": round(sum(m.get("time/step", 0.0) for m in metrics.values()), 1),
        "seconds": round(_elapsed(run), 1), "eval": evals, "machines": list(run.machines),
        "failures": [f.model_dump() for f in run.failures],
    }
    write_atomic(run.result_path, json.dumps(result, indent=1) + "\n")


def _elapsed(run: Run) -> float:
    """Wall time of the run across attempts: the earlier ones' (elapsed.json), and this one's so far."""
    return run.before + time.monotonic() - run.started


def _save_elapsed(run: Run) -> None:
    """elapsed.json, rewritten at every poll of the run (2 s): an attempt killed outright loses that much."""
    run.dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run.dir / "elapsed.json", json.dumps({"seconds": _elapsed(run), "machines": run.machines,
                                                       "failures": [f.model_dump() for f in run.failures]}) + "\n")


def _record_failure(run: Run, what: str, code: int) -> None:
    """Kept in elapsed.json and then result.json: a report says which runs needed another attempt, and why."""
    steps = _read_metrics(run.dir / "metrics.jsonl")
    failure = records.Failure(what=what, exit=code, after_step=max(steps, default=0),
                              at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    run.failures += (failure,)
    _save_elapsed(run)


def _correct_counts(eval_dir: Path) -> dict:
    """From apmpo.eval's results.json and samples.jsonl: n, the k values, and per benchmark the number of correct
    samples of each problem, summed over the eval seeds (n counts them all)."""
    results = json.loads((eval_dir / "results.json").read_text())
    s = results["settings"]
    counts: dict[str, dict[int, int]] = {b: {} for b in results["benchmarks"]}
    seeds = set(s["seeds"])
    with open(eval_dir / "samples.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["benchmark"] in counts and row["seed"] in seeds and row["sample"] < s["n"]:
                per = counts[row["benchmark"]]
                per[row["index"]] = per.get(row["index"], 0) + bool(row["correct"])
    return {"n": s["n"] * len(s["seeds"]), "k": s["k"],
            "benchmarks": {b: {"correct": [per[i] for i in sorted(per)],
                               "pass@1": results["benchmarks"][b]["pass@1"]["mean"],
                               "mean_tokens": results["benchmarks"][b]["mean_tokens"]}
                           for b, per in counts.items()}}


def _read_metrics(path: Path) -> dict[int, dict]:
    from apmpo.plot import read_metrics

    try:
        return read_metrics(path)
    except (FileNotFoundError, ValueError):
        return {}


# ---------------------------------------------------------------------------- slots and processes


@dataclass
class Slot:
    """Where a run goes: nothing on CPU; on GPUs, the learner's devices and the servers' (None: shared)."""
    learner: str | None = None
    servers: str | None = None
    port: int = 29500


def parse_parallel(text: str | None, gpus: list[str] | None = None) -> list[Slot]:
    """--parallel's groups, checked against the physical ids of the `gpus` this process sees (None: not checked)."""
    if text is None:
        return [Slot()]
    slots = []
    for k, group in enumerate(text.split(";")):
        learner, _, servers = group.partition("+")
        ids = [d.strip() for d in learner.split(",")] + ([d.strip() for d in servers.split(",")] if servers else [])
        if not all(d.isdigit() for d in ids):
            raise StudyError(f"--parallel {text!r}: group {group!r} is not 'GPUS' or 'GPUS+SERVER_GPUS' "
                             "(e.g. '0+1;2+3' or '0,1+2')")
        slots.append(Slot(",".join(ids[:len(learner.split(","))]), servers.replace(" ", "") or None, 29500 + 10 * k))
    named = [d for s in slots for d in (s.learner + "," + (s.servers or "")).split(",") if d]
    if len(set(named)) != len(named):
        raise StudyError(f"--parallel {text!r} names a GPU twice: every group needs GPUs of its own")
    if gpus is not None and (missing := sorted({int(d) for d in named if d not in gpus})):
        raise StudyError(f"--parallel {text!r} names GPU(s) {missing}, but this machine has {len(gpus)} GPU(s)"
                         + (f" ({','.join(gpus)})" if gpus else "; leave --parallel out to run one run at a time"))
    return slots


def _visible_gpus() -> list[str]:
    from apmpo.learner.engine import visible_gpus

    return visible_gpus()


def _die_with_parent() -> None:
    """In the child, before exec: a SIGINT when the study dies, however (SIGKILL too), so that a training run and
    its servers stop as on Ctrl-C and nothing outlives the study. SIGINT back to its default first: a study started
    in the background by a script (`nohup ... &`) ignores it, its children would inherit that, and a training run
    outlived its study."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG


@dataclass
class Active:
    run: Run
    steps: object  # the run's commands() generator
    slot: Slot
    what: str = ""
    process: subprocess.Popen | warm.ForkedProcess | None = None
    log_file: object = None
    seen_validations: int = 0


def start_next(active: Active) -> bool:
    """Starts the run's next process; False when the run has none left (it is finished)."""
    try:
        what, argv, env = next(active.steps)
    except StopIteration:
        return False
    active.what = what
    log_path = active.run.dir / ("train.log" if what == "training" else f"{what.replace(' ', '_')}.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    active.log_file = open(log_path, "ab")
    log(f"  {active.run.name}: {what} (log: {log_path})")
    active.process = _forked(argv, env, active.log_file) or subprocess.Popen(
        argv, stdout=active.log_file, stderr=subprocess.STDOUT, env=env, cwd=ROOT, preexec_fn=_die_with_parent)
    return True


def _forked(argv: list[str], env: dict[str, str] | None, log_file) -> warm.ForkedProcess | None:
    """Forked by the warm process that $APMPO_WARM_PROGRAMS names, where there is one and it can be (apmpo/warm.py:
    the imports of each run's learner and evaluation, once): its program dies with the study, as started ones do."""
    path = os.environ.get(warm.WARM_PROGRAMS_ENV)
    return warm.fork_to_log(argv, path, env, log_file.fileno(), cwd=ROOT) if path else None


def report_progress(active: Active) -> None:
    """A line for each new validation of a training run."""
    if active.what != "training":
        return
    metrics = _read_metrics(active.run.dir / "metrics.jsonl")
    key = active.run.cfg.checkpoint.keep_best
    validations = [(s, m[key]) for s, m in metrics.items() if key and isinstance(m.get(key), (int, float))]
    if len(validations) > active.seen_validations:
        active.seen_validations = len(validations)
        step, value = validations[-1]
        reward = metrics[step].get("reward/mean")
        log(f"  {active.run.name}: step {step}/{active.run.cfg.train.steps}, {key} {value:.3f}"
            + (f", reward/mean {reward:.3f}" if isinstance(reward, (int, float)) else ""))


def eta(runs: list[Run], left: list[Run], active: list[Active]) -> str:
    done = [records.read(r.result_path, records.Result).seconds for r in runs if r.result_path.is_file()]
    if not done:
        return "ETA after the first run"
    per_run = statistics.fmean(done)
    remaining = per_run * len(left)
    for a in active:
        steps = len(_read_metrics(a.run.dir / "metrics.jsonl")) if a.what == "training" else a.run.cfg.train.steps
        remaining += per_run * (1 - 0.85 * steps / a.run.cfg.train.steps)  # about 15% of a run is its evaluation
    return f"ETA {_duration(remaining / max(1, len(active) or 1))} ({per_run / 60:.1f} min a run, from {len(done)})"


def _duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes} min"


def run_all(runs: list[Run], settings: Settings, slots: list[Slot], on_finished) -> list[Run]:
    """Runs every unfinished run, len(slots) at a time; returns the runs that failed."""
    left = [r for r in runs if not r.result_path.is_file()]
    total, failed, active = len(runs), [], []
    log(f"{total} run(s): {total - len(left)} finished, {len(left)} to run; {eta(runs, left, active)}")
    try:
        while left or active:
            for slot in slots:
                if left and not any(a.slot is slot for a in active):
                    run = left.pop(0)
                    run.started = time.monotonic()
                    failures = [records.describe_failure(f.model_dump()) for f in run.failures]
                    log(f"run {total - len(left) - len(active)}/{total}: {run.name}"
                        + (f"; again, after: {'; '.join(failures)}" if failures else ""))
                    a = Active(run, commands(run, settings, slot), slot)
                    if start_next(a):
                        active.append(a)
                    else:
                        on_finished(run)
            time.sleep(2)
            for a in list(active):
                report_progress(a)
                code = a.process.poll()
                _save_elapsed(a.run)
                if code is None:
                    continue
                a.log_file.close()
                if code != 0:
                    _record_failure(a.run, a.what, code)
                    tail = (a.run.dir / ("train.log" if a.what == "training" else f"{a.what.replace(' ', '_')}.log"))
                    log(f"  {a.run.name}: {a.what} FAILED (exit {code}); last lines of {tail}:\n"
                        + "\n".join(tail.read_text(errors="replace").splitlines()[-15:]))
                    failed.append(a.run)
                    active.remove(a)
                elif not start_next(a):
                    active.remove(a)
                    on_finished(a.run)
                    log(f"{a.run.name} finished: {_summary(a.run)}; {eta(runs, left, active)}")
    finally:
        for a in active:  # a signal or an error: each child stops as on Ctrl-C, its servers with it
            if a.process.poll() is None:
                a.process.send_signal(signal.SIGINT)
        for a in active:
            try:
                a.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                a.process.kill()
            _save_elapsed(a.run)
    return failed


def _summary(run: Run) -> str:
    result = records.read(run.result_path, records.Result)
    parts = [f"{which} (step {e.step}) pass@1 " + ", ".join(f"{b} {v.pass_at_1:.3f}" for b, v in e.benchmarks.items())
             for which, e in result.eval.items()]
    return f"{result.seconds / 60:.1f} min; " + "; ".join(parts)


def prune(run: Run) -> None:
    """A finished run's checkpoints (DeepSpeed's state, hf/ and best/): result.json holds what the report needs."""
    root = run.dir / "checkpoints"
    if root.is_dir():
        shutil.rmtree(root)


# ---------------------------------------------------------------------------- report and CLI


# ---------------------------------------------------------------------------- the question, planned and fixed


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
    plan = records.Plan(method=others[0], reference=args.reference, score=args.score, seeds=tuple(args.seeds),
                        halfwidth=args.halfwidth)
    started = any((out / "runs").glob("*/seed_*/config.yaml"))
    if old is not None and plan != old and started:
        raise StudyError(f"{out / 'study.json'} fixed its question before its first run ({_describe(old)}); it "
                         f"cannot become {_describe(plan)}: ask a new question in another --out")
    if old is None and started:
        raise StudyError(f"{out} has runs already: a question fixed now could be chosen after seeing them; ask it "
                         "in a new --out")
    return plan


def _describe(plan: records.Plan) -> str:
    return (f"{plan.method} - {plan.reference} on {plan.score}, seeds {','.join(map(str, plan.seeds))}, "
            f"+-{plan.halfwidth:g} points")


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


def write_report(out: Path, methods: list[str], reference: str) -> Path:
    plan = saved_plan(out)
    study_report.write(out, methods, plan.reference if plan else reference, f"Study: {out.name}", plan)
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
    p.add_argument("--parallel", default=None, metavar="'GPUS[+GPUS];...'",
                   help="GPU groups, one run each at once, e.g. '0+1;2+3' (learner + servers) or '0;1' (shared)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep finished runs' checkpoints")
    p.add_argument("--report", action="store_true", help="only rewrite the report from the finished runs")
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
                        (not args.plan or args.halfwidth is not None, "--plan needs --halfwidth POINTS")]:
        if not ok:
            p.error(message)
    return args


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
            not args.no_best)
        if (args.report or args.plan) and not (out / "study.json").is_file():
            raise StudyError(f"{out / 'study.json'} does not exist: " + (
                f"no study to report on in {out}" if args.report else "--plan reads a study's finished pairs"))
        if args.report:
            log(f"report: {write_report(out, list(saved_methods(out)), args.reference)}")
            return 0
        if args.plan:
            print_plan(out, args)
            return 0
        if not asked:
            raise StudyError("--methods is empty: name the methods to run, e.g. --methods apmpo,grpo")
        slots = parse_parallel(args.parallel, _visible_gpus() if args.parallel else None)
        settings, methods = load_study(out, settings, methods)
        check_overrides(methods, settings.set)
        runs = plan_runs(out, settings, methods, asked, args.seeds)
        records.load_results(out)  # every finished run's record: a broken one stops the study before anything runs
        lock = lock_study(out)
        plan = preregister(out, args)
        save_study(out, settings, methods, plan)
    except ConfigError as error:
        print(f"apmpo.study: bad config: {error}", file=sys.stderr)
        return 2
    except (StudyError, RecordError) as error:
        print(f"apmpo.study: {error}", file=sys.stderr)
        return 2
    with lock:  # until the study ends
        try:
            return run_study(out, runs, settings, slots, methods, args)
        except RecordError as error:  # a record broken meanwhile, read for the report: the runs were stopped
            print(f"apmpo.study: {error}", file=sys.stderr)
            return 2


def run_study(out: Path, runs: list[Run], settings: Settings, slots: list[Slot], methods: dict,
              args: argparse.Namespace) -> int:
    """Runs what is left of the study, rewriting the report after each run; the exit code."""
    def finished(run: Run) -> None:
        if not args.keep_checkpoints:
            prune(run)
        write_report(out, list(methods), args.reference)

    # Both, whatever this process inherited: started in the background by a script, SIGINT is ignored
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        failed = run_all(runs, settings, slots, finished)
    except Stopped as stop:
        log(f"stopped ({stop}); the same command goes on where it stopped (finished runs: "
            f"{out}/runs/*/seed_*/result.json)")
        return 128 + stop.signum
    report_path = write_report(out, list(methods), args.reference)
    if failed:
        log(f"{len(failed)} run(s) failed: {', '.join(r.name for r in failed)} (their logs above); rerun to retry")
        return 1
    log(f"done: {report_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
