"""Running `launch/train.py` the way a user does, for the end-to-end tests (a helper module, not a test)."""
import contextlib
import json
import os
import subprocess
import sys
import threading
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


class WarmPrograms:
    """Warm processes for what the tests run (apmpo/warm.py), one for each startup environment met: the tests' own
    imports add settings that every program started afterwards inherits (vLLM's LD_LIBRARY_PATH,
    TORCHINDUCTOR_COMPILE_THREADS, ...), and a fork must start under the same ones. tests/conftest.py makes one
    per pytest worker."""

    # What a learner imports (warm.LEARNER_IMPORTS: launch/train.py's modules), DeepSpeed, and what a learner imports
    # only once it runs: DeepSpeed's optimiser check imports its Muon optimiser, which calls torch.compile as it loads
    # (Inductor); the metrics' TensorBoard writer; the model's class. A forked 1-step quickstart learner used 1.1-1.3
    # CPU s with them, 3.8-4.1 without.
    IMPORTS = ("learner", "deepspeed", "deepspeed.runtime.zero.muon.original_muon", "torch.utils.tensorboard",
               "transformers.models.qwen2.modeling_qwen2")

    def __init__(self, folder: Path, stack: contextlib.ExitStack):
        self.folder, self.stack, self.paths, self.lock = folder, stack, {}, threading.Lock()

    def path_for(self, env: dict[str, str]) -> Path:
        env = {key: value for key, value in env.items() if key != "PYTHONPATH"}  # the warm process copes with it
        key = json.dumps(sorted(warm.startup_settings(env).items()))
        with self.lock:  # the benchmark scripts start two at a time, from threads
            if key not in self.paths:
                name = f"programs{len(self.paths)}"
                self.paths[key] = self.stack.enter_context(warm.warm_process(
                    self.folder / f"{name}.sock", self.folder / f"{name}.log", env, imports=self.IMPORTS))
            return self.paths[key]


WARM: WarmPrograms | None = None  # set by tests/conftest.py where slow tests run


def with_warm_programs(env: dict[str, str]) -> dict[str, str]:
    """`env` naming, as APMPO_WARM_PROGRAMS, the warm process for programs started under it (the study's runs)."""
    return {**env, warm.WARM_PROGRAMS_ENV: str(WARM.path_for(env))} if WARM is not None else env


def warm_run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """apmpo.warm.run through the warm process for the program's environment, with a forked program's CPU
    seconds charged to the running test (tests/cpu_time.py)."""
    path = WARM.path_for(kwargs.get("env") or dict(os.environ)) if WARM is not None else None
    done = warm.run(command, path=path, **kwargs)
    cpu_time.charge_forked(getattr(done, "cpu_s", 0.0))
    return done


class Ranks:
    """`command` (`python SCRIPT ...`) as `world_size` ranks on this host, with the variables DeepSpeed's launcher
    gives each (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each forked by the warm process for its
    environment where it can be (tests/conftest.py), else started; rank r's output in `logs`/rank{r}.log. For
    tests of what ranks compute together: the launcher itself (its runner, its launch process, the ranks' imports:
    about 25 CPU s a launch) has its own tests (test_train_cli, test_zero3, test_multinode, ...)."""

    def __init__(self, command: list[str], world_size: int, logs: Path, env: dict[str, str] | None = None):
        from apmpo.rollout.net import free_port  # noqa: PLC0415

        env = {**(os.environ if env is None else env), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port())}
        logs.mkdir(parents=True, exist_ok=True)
        self.logs, self.processes = [logs / f"rank{r}.log" for r in range(world_size)], []
        for r, log_path in enumerate(self.logs):
            rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
            with open(log_path, "wb") as log:
                self.processes.append(
                    WARM is not None and warm.fork_to_log(command, WARM.path_for(rank_env), rank_env, log.fileno(),
                                                          cwd=ROOT)
                    or subprocess.Popen(command, env=rank_env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, cwd=ROOT, start_new_session=True))

    def finish(self, timeout: float = 300) -> tuple[list[int], list[str]]:
        """Every rank's exit code and output, once all have ended (killed, and the test failed, past `timeout`)."""
        try:
            codes = [process.wait(timeout=timeout) for process in self.processes]
        finally:
            for process in self.processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
                cpu_time.charge_forked(getattr(process, "cpu_s", 0.0))
        return codes, [log.read_text(errors="replace") for log in self.logs]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
