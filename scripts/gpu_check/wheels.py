"""What the GPU machine lacks and how to carry it there: it cannot fetch a package, so a check that needs one says which
wheels to build or download where pip has the internet (bash scripts/gpu_wheels.sh fetches them all at once)."""
from __future__ import annotations

import platform
import sys

from scripts.gpu_check.measure import CheckFailed

# DeepSpeed's install requirements (its wheel's Requires-Dist, extras left out); a test keeps this in step with
# the DeepSpeed of .venv. The GPU box is told which of them it lacks.
DEEPSPEED_REQUIRES = ("einops", "hjson", "msgpack", "ninja", "numpy", "packaging", "psutil", "py-cpuinfo",
                      "pydantic", "torch", "tqdm")

DEEPSPEED_MISSING = """DeepSpeed is not importable here ({error}). It has no wheel on PyPI, so build one where pip
has the internet and this repo's .venv, and carry it here with the requirements this machine lacks:
  there: .venv/bin/python -m pip wheel --no-deps --no-build-isolation -w wheels/ \\
             "deepspeed==$(.venv/bin/python -c 'import deepspeed; print(deepspeed.__version__)')"
{download}  here:  {python} -m pip install --no-index --find-links wheels/ deepspeed
The checks that need no DeepSpeed ran all the same."""


def require_deepspeed() -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError as error:
        missing = [name for name in DEEPSPEED_REQUIRES if not _installed(name)]
        download = f"         {download_command(missing)}\n" if missing else ""
        raise CheckFailed(DEEPSPEED_MISSING.format(error=error, download=download, python=sys.executable)) from None


# Modules whose distribution has another name (pip download yaml finds nothing).
DISTRIBUTION_OF = {"yaml": "pyyaml", "math_verify": "math-verify", "PIL": "pillow"}


def download_command(modules: list[str]) -> str:
    """pip, on a machine with the internet, fetching wheels of these modules for this machine's Python and platform
    (bash scripts/gpu_wheels.sh fetches all that the checks need at once)."""
    return (f".venv/bin/python -m pip download -d wheels/ --only-binary=:all: --python-version "
            f"{sys.version_info.major}.{sys.version_info.minor} --platform manylinux2014_{platform.machine()} "
            f"{' '.join(DISTRIBUTION_OF.get(module, module) for module in modules)}")


def _installed(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
        return True
    except PackageNotFoundError:
        return False
