"""Running `launch/train.py` the way a user does, for the end-to-end tests (a helper module, not a test)."""
import json
import subprocess
import sys
from pathlib import Path

import cpu_time
from apmpo import warm

ROOT = Path(__file__).resolve().parents[1]

# One short quickstart run, shared by the tests that read what a run leaves behind (metrics, checkpoints,
# validation, the rollout-correction log) and by the kill test as its uninterrupted reference: every one of them
# used to start its own servers and DeepSpeed. Save, validation, keep_best and token-level TIS are all on.
QUICKSTART_RUN = ("train.steps=4", "checkpoint.save_every=2", "checkpoint.keep_last=3", "eval.every=2",
                  "eval.limit=40", "checkpoint.keep_best=val/quickstart_val/pass@1", "correction.mode=tis",
                  "correction.level=token")


def train_command(config: str, *overrides: str) -> list[str]:
    """`python launch/train.py --config ROOT/config --set o ...`."""
    sets = [arg for override in overrides for arg in ("--set", override)]
    return [sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(ROOT / config), *sets]


def run(command: list[str], timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """Runs from the repository root, forked by the worker's warm process where it can be (apmpo/warm.py,
    tests/conftest.py); fails the test with the end of the output unless it exits 0."""
    done = warm_run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kwargs)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def warm_run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """apmpo.warm.run, with a forked program's CPU seconds charged to the running test (tests/cpu_time.py)."""
    done = warm.run(command, **kwargs)
    cpu_time.charge_forked(getattr(done, "cpu_s", 0.0))
    return done


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
