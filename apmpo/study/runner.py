"""Running a study's runs: each (method, seed) trained by launch/train.py, evaluated by apmpo.eval, recorded in its
result.json; one after another on CPU, or --parallel groups of GPUs. A killed study goes on where it stopped.
"""
from __future__ import annotations

import ctypes
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from apmpo import warm
from apmpo.study import records
from apmpo.study.methods import StudyError, log
from apmpo.study.records import Settings, write_atomic
from apmpo.study.report import validation_auc

ROOT = Path(__file__).resolve().parents[2]  # the repository: launch/train.py


# Keys that place and checkpoint a run and never change what it learns: two configs that differ in them alone train
# the same.
BOOKKEEPING = ("logging", "checkpoint", "train.resume", "derived")


class Stopped(Exception):
    """SIGINT or SIGTERM: the study stops its runs as on Ctrl-C, and the same command goes on later."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop(signum: int, frame) -> None:
    raise Stopped(signum)


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
            # A run that starts again from step 0 (no checkpoint: a new machine has none of the last one's files)
            # computes nothing of its earlier attempts: it ran where this attempt runs.
            resumed = any((run_dir / "checkpoints").glob("step_*/hf/config.json"))
            machines = tuple(dict.fromkeys([*(earlier.machines if resumed else ()), records.this_machine()]))
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
    # none where the study's question reads the validation curve alone (Settings.final_eval)
    targets = [("last", run.dir / "checkpoints" / f"step_{last_step}", last_step)] if settings.final_eval else []
    if targets and settings.eval_best and best is not None and best["step"] != last_step:
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
    if evals and settings.eval_best and best is not None and best["step"] == evals["last"]["step"]:
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


def _finished_seed(run: Run) -> list[records.Result]:
    """The finished runs of the study that share `run`'s seed: its pairs."""
    return [records.read(path, records.Result)
            for path in sorted(run.dir.parent.parent.glob(f"*/seed_{run.seed}/result.json"))]


def why_wait(run: Run, left: list[Run], until: float | None) -> str | None:
    """Why `run` should not start here and now, or None.

    - Its pair ran on another machine kind: the runs of a pair compute alike only on one kind (AVX2 and AVX-512
      round differently), so it waits for a machine of its pair's kind; the study runs the next pair meanwhile.
    - It would not end by `until` (epoch seconds, --until): a run cut off at a session's end starts again from step
      0 on the next machine, which has none of its checkpoints. The time a run takes is the longest finished run
      of the study on this machine, and the first run of a pair waits unless the whole pair fits."""
    here = records.this_machine()
    if elsewhere := sorted({m for r in _finished_seed(run) for m in r.machines if m != here}):
        return f"its pair ran on {'; '.join(elsewhere)}, not here ({here})"
    if until is None:
        return None
    done = [r.seconds for path in run.dir.parent.parent.glob("*/seed_*/result.json")
            if (r := records.read(path, records.Result)).machines == [here]]
    if not done:
        return None  # no measure yet: the caller chose the deadline knowing as much
    pair_left = sum(r.seed == run.seed for r in left) + 1
    need = pair_left * max(done)
    if time.time() + need > until:
        return (f"{pair_left} run(s) of seed {run.seed} take about {_duration(need)} here, past --until "
                f"{datetime.datetime.fromtimestamp(until).strftime('%Y-%m-%d %H:%M')}")
    return None


def run_all(runs: list[Run], settings: Settings, slots: list[Slot], on_finished,
            until: float | None = None) -> tuple[list[Run], list[Run]]:
    """Runs every unfinished run, len(slots) at a time, except those that must wait (why_wait); returns the runs
    that failed and those that wait."""
    left = [r for r in runs if not r.result_path.is_file()]
    total, failed, active, waiting = len(runs), [], [], []
    log(f"{total} run(s): {total - len(left)} finished, {len(left)} to run; {eta(runs, left, active)}")
    try:
        while left or active:
            for slot in slots:
                while left and not any(a.slot is slot for a in active):
                    run = left.pop(0)
                    if reason := why_wait(run, left, until):
                        log(f"{run.name} waits: {reason}")
                        waiting.append(run)
                        continue
                    run.started = time.monotonic()
                    failures = [records.describe_failure(f.model_dump()) for f in run.failures]
                    log(f"run {total - len(left) - len(active)}/{total}: {run.name}"
                        + (f"; again, after: {'; '.join(failures)}" if failures else ""))
                    a = Active(run, commands(run, settings, slot), slot)
                    if start_next(a):
                        active.append(a)
                    else:
                        on_finished(run)
                    break
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
    return failed, waiting


def _summary(run: Run) -> str:
    result = records.read(run.result_path, records.Result)
    parts = [f"{which} (step {e.step}) pass@1 " + ", ".join(f"{b} {v.pass_at_1:.3f}" for b, v in e.benchmarks.items())
             for which, e in result.eval.items()]
    if result.validation:
        step, value = result.validation[-1]
        parts.append(f"validation at step {step} {value:.3f}, its curve's mean {validation_auc(result.validation):.3f}")
    return f"{result.seconds / 60:.1f} min; " + "; ".join(parts)


def prune(run: Run) -> None:
    """A finished run's checkpoints (DeepSpeed's state, hf/ and best/): result.json holds what the report needs."""
    root = run.dir / "checkpoints"
    if root.is_dir():
        shutil.rmtree(root)
