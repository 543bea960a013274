"""metrics.jsonl survives what a crash or a full disk leaves: a torn last line is dropped on resume, and a failed
write names the file."""
import errno
import json

import pytest

from apmpo.config import Config
from apmpo.learner.metrics import MetricsLogger


def _config(tmp_path) -> Config:
    cfg = Config()
    cfg.logging.output_dir, cfg.logging.tensorboard = str(tmp_path), False
    return cfg


def test_a_torn_last_line_is_dropped_on_resume(tmp_path):
    cfg = _config(tmp_path)
    path = cfg.run_dir / "metrics.jsonl"
    path.parent.mkdir(parents=True)
    # Steps 1-5 were logged, then the disk filled in the middle of step 6's line.
    path.write_text("".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in range(1, 6))
                    + '{"step": 6, "reward/me')
    logger = MetricsLogger(cfg, start_step=4)  # resumed from the checkpoint of step 4
    logger.log(5, {"reward/mean": 0.55})
    logger.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.2}, {"step": 3, "reward/mean": 0.3},
                    {"step": 4, "reward/mean": 0.4}, {"step": 5, "reward/mean": 0.55}]


def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path):
    cfg = _config(tmp_path)
    path = cfg.run_dir / "metrics.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text('{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a JSON record"):
        MetricsLogger(cfg, start_step=3)
    assert path.read_text() == '{"step": 1}\n{"step": 2, "rew\n{"step": 3}\n'  # nothing lost


def test_a_full_disk_names_the_metrics_file(tmp_path):
    cfg = _config(tmp_path)
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "metrics.jsonl").symlink_to("/dev/full")  # every write to /dev/full fails with ENOSPC
    logger = MetricsLogger(cfg, start_step=0)
    with pytest.raises(OSError, match=r"writing step 1's metrics to .*metrics.jsonl failed: No space left on device") as info:
        logger.log(1, {"reward/mean": 0.5})
    assert info.value.errno == errno.ENOSPC
    logger.bar.close()


def test_the_completions_digests_keep_one_line_per_step_over_a_resume_and_a_restart(tmp_path):
    """rollouts.jsonl follows metrics.jsonl: a run resumed at step 2 keeps steps 1-2, one from scratch none (a
    spread run retrained from scratch once appended its 9 steps after the first attempt's 15)."""
    from apmpo.learner.metrics import drop_steps_after

    path = tmp_path / "rollouts.jsonl"
    lines = [json.dumps({"step": step, "crc32": [step]}) for step in (1, 2, 3)]
    path.write_text("\n".join(lines) + '\n{"step": 4, "cr')
    drop_steps_after(path, 2)
    assert path.read_text() == lines[0] + "\n" + lines[1] + "\n"
    drop_steps_after(path, 0)
    assert path.read_text() == ""
