"""What a caller may ask of a warm process (apmpo/warm_server.py), checked whole before any of it is used, and why a
request is refused. A request is one message on the warm process's socket, as apmpo/warm.py's `fork` makes it: JSON
{command, env, cwd, fds, context} and, as its descriptors, those that `fds` numbers for the program, then the caller's
JOINED namespaces. The warm process serves its own user only (the caller's uid, from the kernel, is checked before
a request is read); this is what keeps a request of that user's from stopping it or taking its descriptors."""
from __future__ import annotations

import contextlib
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NamedTuple

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue, ValidationError, field_validator

from apmpo.warm import JOINED, startup_settings

MAX_REQUEST_BYTES = 1 << 17  # a request's JSON (a caller's environment is some kB); a longer one is refused
MAX_FDS = 64  # the descriptors that one request may carry, its namespaces' included


class Refused(Exception):
    """A request refused, with the reason that its caller is told and the warm process's log says."""


def _no_nul(text: str) -> str:
    if "\0" in text:
        raise ValueError("a NUL character")
    return text


Text = Annotated[str, AfterValidator(_no_nul)]  # what an argument, a path or an environment variable can hold
Descriptor = Annotated[int, Field(ge=0, lt=1 << 20)]


class Request(BaseModel):
    """`command` (`python [-u] SCRIPT | -m MODULE, ARGS...`, the warm process's python) to run with the environment
    `env` in `cwd`, given the request's descriptors as the numbers `fds`, for a caller whose process_context() is
    `context`. Strict: no value is converted, and no other field is taken."""
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    command: list[Text] = Field(min_length=2, max_length=4096)
    env: dict[Text, Text]
    cwd: Text
    fds: list[Descriptor] = Field(max_length=MAX_FDS - len(JOINED))
    context: dict[str, JsonValue]

    @field_validator("env")
    @classmethod
    def _names(cls, env: dict[str, str]) -> dict[str, str]:
        if any(not name or "=" in name for name in env):
            raise ValueError("an environment variable's name is empty or holds '='")
        return env

    @field_validator("cwd")
    @classmethod
    def _absolute(cls, cwd: str) -> str:
        if not os.path.isabs(cwd):
            raise ValueError("not an absolute path")
        return cwd

    @field_validator("fds")
    @classmethod
    def _distinct(cls, fds: list[int]) -> list[int]:
        if len(set(fds)) != len(fds):
            raise ValueError("a number given twice")
        return fds


class Program(NamedTuple):
    unbuffered: bool
    module: str | None
    script: str | None
    args: list[str]


def program(command: list[str]) -> Program | None:
    """`python [-u] (-m MODULE | SCRIPT) ARGS` as a Program; None for anything else."""
    if not command or command[0] != sys.executable:
        return None
    rest = command[1:]
    unbuffered = rest[:1] == ["-u"]
    rest = rest[unbuffered:]
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return Program(unbuffered, rest[1], None, rest[2:])
    if rest and not rest[0].startswith("-"):
        return Program(unbuffered, None, rest[0], rest[1:])
    return None


def read(message: bytes, flags: int, fds: list[int]) -> Request:
    """The request in `message`, received with `flags` (recvmsg's) and the descriptors `fds`; Refused where it is
    not one that the warm process can serve. The descriptors stay the caller's to close."""
    if flags & socket.MSG_TRUNC:
        raise Refused(f"a message over {MAX_REQUEST_BYTES} bytes")
    if flags & socket.MSG_CTRUNC:
        raise Refused(f"over {MAX_FDS} descriptors")
    try:
        request = Request.model_validate_json(message)
    except ValidationError as error:  # where and what, never the value (an environment's secrets)
        raise Refused("malformed: " + "; ".join(f"{'.'.join(map(str, e['loc'])) or 'the message'}: {e['msg']}"
                                                for e in error.errors(include_url=False)[:3])) from None
    if len(fds) != len(request.fds) + len(JOINED):
        raise Refused(f"{len(fds)} descriptors sent for {len(request.fds)} and {len(JOINED)} namespaces")
    if program(request.command) is None:
        raise Refused(f"not a Python program it can run: {request.command[:3]}")
    return request


@dataclass(frozen=True)
class View:
    """What the warm process started with, and a program forked from it keeps: the startup settings of its
    environment (`startup`; `imports_set`: those that its imports made), its process_context() (`context`, as a
    request carries it), and the namespaces that it joins for a caller instead of keeping its own (`joins`)."""
    startup: dict[str, str]
    imports_set: dict[str, str]
    context: dict
    joins: frozenset[str]

    def refusal(self, request: Request) -> str | None:
        """Why a program forked for `request` would not be what `python` would have started; None: it would."""
        env = request.env
        differ = sorted(key for key in {*self.startup, *startup_settings(env)}
                        if self.startup.get(key) != env.get(key) and key != "PYTHONPATH"
                        and not (key in self.imports_set and env.get(key) in (None, self.imports_set[key])))
        differ += [key for key in self.context if self.context[key] != request.context.get(key)
                   and key not in self.joins]
        differ += [f"PYTHONPATH ({shadowing} would have been imported from there)"
                   for shadowing in _shadowed(entries(env.get("PYTHONPATH")))]
        return f"the warm process started with other {', '.join(differ)}" if differ else None


def entries(pythonpath: str | None) -> list[str]:
    return [os.path.abspath(entry) for entry in (pythonpath or "").split(os.pathsep) if entry]


def _shadowed(entries: list[str]) -> list[str]:
    """The modules imported here that a program with `entries` on PYTHONPATH would have found elsewhere: in one of
    the entries, where the module's own file is in none (a folder read once each, however many modules)."""
    loaded = {name: file for name, module in list(sys.modules.items())
              if "." not in name and (file := getattr(module, "__file__", None)) is not None}
    found = set()
    for entry in dict.fromkeys(entries):
        with contextlib.suppress(OSError):  # not there, or not a folder
            found |= {name.removesuffix(".py") for name in os.listdir(entry) if name.removesuffix(".py") in loaded
                      and (name.endswith(".py") or os.path.exists(os.path.join(entry, name, "__init__.py")))}
    on_path = set(entries)
    return sorted(name for name in found if on_path.isdisjoint(map(str, Path(loaded[name]).parents)))
