"""YAML into nested typed dataclasses, the mechanism under apmpo.config (which declares what a run's configuration
holds): fields that declare their range or that hold a path, YAML files with their `base:` files deep-merged on top,
and a dataclass built from a mapping, each unknown key refused with the nearest valid one and each value checked
against its field's type (ints accepted for floats, numbers in strings for numeric fields, since YAML reads `1e-6`
as a string), its range and a path's length. It knows nothing of apmpo's keys; every error is a ConfigError naming
the file and key at fault."""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A configuration that cannot be used, with the file and key at fault."""


# Every numeric field declares its range in its metadata, {"range": "[lo, hi]"} (brackets closed, parentheses
# open; bounds are numbers or powers such as 2**20): values outside, and floats that are not finite, are refused
# at load naming the key. Fields of other modules (LossConfig) declare theirs the same way, with no import from
# here; tests/test_config.py checks that every numeric leaf has one.


def ranged(default: Any, interval: str) -> Any:
    """A field with a declared range: `lr: float = ranged(1e-6, "(0, 1]")`. None (for `int | None`) is allowed."""
    _parse_range(interval)  # a malformed range fails at import
    return field(default=default, metadata={"range": interval})


def _bound(text: str) -> float:
    text = text.strip()
    power = re.fullmatch(r"(\d+)\*\*(\d+)(?:\s*-\s*(\d+))?", text.replace(" ", ""))
    if power:
        return int(power[1]) ** int(power[2]) - int(power[3] or 0)
    return float(text)


def _parse_range(interval: str) -> tuple[bool, float, float, bool]:
    match = re.fullmatch(r"\s*([\[(])(.+),(.+)([\])])\s*", interval)
    if not match:
        raise ValueError(f"range {interval!r}: expected e.g. '[0, 1)'")
    lo, hi = _bound(match[2]), _bound(match[3])
    if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
        raise ValueError(f"range {interval!r}: bounds must be finite and ordered")
    return match[1] == "[", lo, hi, match[4] == "]"


def check_range(key: str, value: float, interval: str) -> None:
    """Raises ConfigError unless `value` lies in `interval` (NaN and infinities never do)."""
    closed_lo, lo, hi, closed_hi = _parse_range(interval)
    above = value >= lo if closed_lo else value > lo
    below = value <= hi if closed_hi else value < hi
    if not (above and below):  # NaN fails both
        raise ConfigError(f"{key} must lie in {interval}, got {value}")


# Paths longer than the file system takes: refused at load rather than by an OSError after the servers started.
NAME_MAX, PATH_MAX = 255, 4095


def path_field(default: str | None) -> Any:
    """A field holding a file system path (or a name that becomes part of one): checked against NAME_MAX, PATH_MAX."""
    return field(default=default, metadata={"path": True})


def check_path(key: str, value: str) -> None:
    if len(value.encode()) > PATH_MAX or any(len(part.encode()) > NAME_MAX for part in value.split("/")):
        raise ConfigError(f"{key} is longer than a path may be ({len(value)} characters; at most {PATH_MAX} bytes, "
                          f"{NAME_MAX} per name): {value[:60]!r}...")


# --------------------------------------------------------------------------- reading and building


def read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in seen:
        raise ConfigError(f"{path}: circular base: {' -> '.join(map(str, seen))}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    bases = data.pop("base", [])
    merged: dict[str, Any] = {}
    for base in [bases] if isinstance(bases, str) else bases:
        merged = _deep_merge(merged, read_yaml(path.parent / base, seen + (path.resolve(),)))
    return _deep_merge(merged, data)


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def build(cls, data: Any, prefix: str, source: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    metadata = {f.name: f.metadata for f in dataclasses.fields(cls)}
    names = list(metadata)
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"{source}: unknown key '{prefix}{key}'{hint}")
        hint = hints[key]
        optional = _optional_section(hint)
        if optional is not None and value is None:
            kwargs[key] = None  # an optional section left out (model.lora: null)
        elif dataclasses.is_dataclass(optional or hint):
            kwargs[key] = build(optional or hint, value if value is not None else {}, f"{prefix}{key}.", source)
        else:
            kwargs[key] = value = _check_type(value, hint, f"{prefix}{key}", source)
            if "range" in metadata[key] and value is not None:
                check_range(f"{source}: {prefix}{key}", value, metadata[key]["range"])
            if metadata[key].get("path") and value is not None:
                check_path(f"{source}: {prefix}{key}", value)
    try:
        return cls(**kwargs)
    except ValueError as exc:  # e.g. LossConfig's own checks
        raise ConfigError(f"{source}: {exc}") from None


def _optional_section(hint: Any) -> type | None:
    """The dataclass of a `Section | None` field, else None."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else ()
    sections = [a for a in args if dataclasses.is_dataclass(a)]
    return sections[0] if sections and type(None) in args else None


def _check_type(value: Any, hint: Any, key: str, source: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_type(value, arg, key, source)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]
    if origin is Literal:
        if isinstance(value, bool) and ("on" if value else "off") in args:
            value = "on" if value else "off"  # YAML 1.1 reads an unquoted off/on (and no/yes) as a boolean
        if value not in args:
            raise ConfigError(f"{source}: {key} must be one of {list(args)}, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {key} expects bool (true/false), got {type(value).__name__} {value!r}")
        return value
    if hint in (int, float):
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 as a string
            try:
                value = hint(value) if hint is float else int(value, 0)
            except ValueError:
                pass
        ok = isinstance(value, int) if hint is int else isinstance(value, (int, float))
        if not ok or isinstance(value, bool):
            raise ConfigError(f"{source}: {key} expects {hint.__name__}, got {type(value).__name__} {value!r}")
        return hint(value)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {key} expects a list, got {type(value).__name__} {value!r}")
        return [_check_type(item, args[0], f"{key}[{i}]", source) for i, item in enumerate(value)]
    if hint is str:
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)  # YAML reads `devices: 3` as a number
        if not isinstance(value, str):
            raise ConfigError(f"{source}: {key} expects str, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{source}: {key}: unsupported field type {hint}")  # a bug in a dataclass above
