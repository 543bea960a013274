"""The pins scripts/gpu_wheels.sh fetches: scripts/gpu_wheels.txt's distributions and everything they require
(extras left out, markers evaluated for the GPU machine: Linux x86_64, CPython --python-version), at the versions
installed in this Python, less torch and what torch requires (the GPU machine has its own, built for its CUDA).

    python scripts/gpu_wheels.py [--python-version 3.12]      # one name==version a line
"""
from __future__ import annotations

import argparse
import re
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

MANIFEST = Path(__file__).with_name("gpu_wheels.txt")
KEPT_FROM_THE_MACHINE = ("torch",)


def manifest() -> list[str]:
    return [line.strip() for line in MANIFEST.read_text().splitlines() if line.strip() and not line.startswith("#")]


def closure(names: list[str], python_version: str = "3.12") -> dict[str, str]:
    """{canonical name: installed version} of `names` and all they require on the target."""
    environment = {**default_environment(), "python_version": python_version, "python_full_version":
                   f"{python_version}.0", "sys_platform": "linux", "platform_machine": "x86_64",
                   "platform_system": "Linux", "implementation_name": "cpython", "extra": ""}
    found: dict[str, str] = {}
    pending = list(names)
    while pending:
        name = canonicalize_name(pending.pop())
        if name in found:
            continue
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            raise SystemExit(f"{name} is not installed in this Python: install apmpo's .venv first") from None
        found[name] = dist.version
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate(environment):
                pending.append(requirement.name)
    return found


def pins(python_version: str = "3.12") -> dict[str, str]:
    machine = closure(list(KEPT_FROM_THE_MACHINE), python_version)
    return {name: version for name, version in sorted(closure(manifest(), python_version).items())
            if name not in machine}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python-version", default="3.12")
    args = parser.parse_args()
    if not re.fullmatch(r"3\.\d+", args.python_version):
        parser.error(f"--python-version: expected 3.N, got {args.python_version!r}")
    for name, version in pins(args.python_version).items():
        print(f"{name}=={version}")


if __name__ == "__main__":
    main()
