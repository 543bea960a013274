"""A study's definition: its methods (losses, built-in variants, the user's --variant), the settings every run
shares, and OUT/study.json, which holds both and refuses a later call that would change what earlier runs trained.
"""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TextIO

from apmpo import dirlock
from apmpo.study import records
from apmpo.study.records import (
    BUILTIN_VARIANTS,
    Settings,
    builtin_methods,
    write_atomic,
)

# Keys the study sets for every run, over whatever a --set or a variant gives: a value there would be replaced, yet
# recorded as what the method trained with. checkpoint whole: the study owns a run's checkpoints (hf/ is what it
# evaluates, --save-every when they are written, keep_best what "best" means); logging.tensorboard and logging.wandb
# are the user's to choose.
PER_RUN = ("train.seed", "data.seed", "train.resume", "logging.output_dir", "logging.run_name", "checkpoint")


class StudyError(Exception):
    """A study that cannot run as asked; the message names the option at fault."""


def log(message: str) -> None:
    print(f"[apmpo.study] {message}", flush=True)


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
