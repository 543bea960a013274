"""Checkpoints on the real DeepSpeed engine (tests/checkpoint_worker.py): a full disk fails clearly and keeps the
earlier checkpoints (on a small tmpfs), and rank 0 alone decides what every rank resumes from (two gloo ranks,
rank 1 on a run directory of its own, as a node with a node-local disk)."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from apmpo.config import ConfigError
from apmpo.learner.checkpoint import check_zero_stage, saved_zero_stage
from train_runs import Ranks, warm_run

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "checkpoint_worker.py"


def run_worker(*args) -> subprocess.CompletedProcess:
    return warm_run([sys.executable, str(WORKER), *map(str, args)], capture_output=True, text=True, timeout=600,
                    env={**os.environ, "PYTHONPATH": str(ROOT)})


def run_two_ranks(logs: Path, *args) -> tuple[list[int], str]:
    """The worker as two ranks: their exit codes and their output, together."""
    codes, outputs = Ranks([sys.executable, str(WORKER), *map(str, args)], 2, logs,
                           {**os.environ, "PYTHONPATH": str(ROOT)}).finish(600)
    return codes, "".join(outputs)


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def small_disk(tmp_path):
    """A 12 MiB tmpfs: room for one checkpoint of the tiny model (7.2 MB), not for two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.slow
def test_full_disk_fails_with_the_path_and_keeps_earlier_checkpoints(small_disk):
    ok(run_worker("save", small_disk, "--step", "1"))
    checkpoints = small_disk / "checkpoints"
    before = digests(checkpoints / "step_1")

    done = run_worker("save", small_disk, "--step", "2")
    assert done.returncode != 0
    # Before: "RuntimeError: basic_ios::clear: iostream error" from inside torch.save, and a half-written step_2.tmp.
    assert f"the disk is full: checkpoint {checkpoints / 'step_2.tmp'} needs about 7.8 MiB" in done.stderr
    assert "nothing was written" in done.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1"]
    assert digests(checkpoints / "step_1") == before

    done = run_worker("save", small_disk, "--step", "2", "--no-space-check")  # the check passes, the disk fills
    assert done.returncode != 0
    assert f"the disk is full: writing checkpoint {checkpoints / 'step_2.tmp'} failed" in done.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_1"]  # the partial save was removed
    assert digests(checkpoints / "step_1") == before


@pytest.mark.slow
def test_rank_zero_decides_the_resume_checkpoint(tmp_path):
    shared = tmp_path / "shared"
    codes, output = run_two_ranks(tmp_path / "logs_shared", "save", shared, tmp_path / "out_shared", "--step", "2")
    assert codes == [0, 0], output[-6000:]  # saved, and resumed
    ranks = [json.loads((tmp_path / "out_shared" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["step"] for r in ranks] == [2, 2] and ranks[0]["param_sum"] == ranks[1]["param_sum"]

    # Node-local run directories: rank 1's disk lacks the step_2 that rank 0 resumes from. Each rank choosing
    # for itself started rank 0 at step 2 and rank 1 from scratch, and the ranks hung in their first collective.
    shutil.copytree(shared, tmp_path / "node0")
    (tmp_path / "node1").mkdir()
    codes, output = run_two_ranks(tmp_path / "logs_local", "resume", tmp_path / "node{rank}", tmp_path / "out_local")
    assert codes[0] != 0 and codes[1] != 0, output[-6000:]
    assert ("cannot resume: rank(s) [1] cannot read checkpoint 'step_2', which rank 0 resumes from (rank 1 looked "
            f"in {tmp_path / 'node1' / 'checkpoints' / 'step_2'}); multi-node runs need a run directory shared") in output
    assert not (tmp_path / "out_local").exists()


def test_a_checkpoint_resumes_only_under_a_zero_stage_that_can_load_it(quickstart_run, tmp_path):
    """The quickstart's checkpoints are ZeRO-2's. Stage 1 shares their layout (DeepSpeed loads one into the other);
    stage 3 partitions the module too and stage 0 keeps the optimiser state in the module's file, and DeepSpeed's
    load failed on those with a bare AssertionError or a missing file. tests/test_zero3.py: the CLI, from stage 3."""
    latest = quickstart_run / "checkpoints" / "step_4"
    assert saved_zero_stage(latest) == 2
    for stage in (1, 2):
        check_zero_stage(quickstart_run, "auto", stage)
    for stage in (0, 3):
        with pytest.raises(ConfigError, match=rf"^train.zero_stage={stage} cannot resume checkpoint {latest}: it holds "
                                              r"ZeRO stage 2, .*resume with --set train.zero_stage=2, or start over"):
            check_zero_stage(quickstart_run, "auto", stage)
    check_zero_stage(quickstart_run, "never", 3)  # nothing is loaded
    # Saved before the stage was recorded: the files tell stage 3 apart, not 0, 1 and 2 (bf16 ZeRO-0 partitions
    # its optimiser state too), so only stage 3 is refused.
    legacy = tmp_path / "step_4"
    shutil.copytree(latest, legacy, ignore=shutil.ignore_patterns("hf"))
    state = json.loads((legacy / "trainer_state.json").read_text())
    del state["zero_stage"]
    (legacy / "trainer_state.json").write_text(json.dumps(state))
    assert saved_zero_stage(legacy) is None
    check_zero_stage(quickstart_run, str(legacy), 0)
    with pytest.raises(ConfigError, match=r"it holds ZeRO stage 0, 1 or 2, whose DeepSpeed state stage 3 cannot "
                                          r"load; start over with train.resume=never"):
        check_zero_stage(quickstart_run, str(legacy), 3)
