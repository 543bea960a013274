"""python -m apmpo.plot on small synthetic run directories: it writes a PNG, labels runs apart, smooths right."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from apmpo.plot import band, ema, read_metrics, run_labels, smoothed

ROOT = Path(__file__).resolve().parents[1]


def write_run(run_dir: Path, loss: str, steps: int = 30, apmpo: bool = True) -> Path:
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"loss:\n  name: {loss}\n")
    lines = []
    for step in range(1, steps + 1):
        row = {"step": step, "reward/mean": 0.2 + 0.6 * step / steps + 0.05 * math.sin(step),
               "policy/entropy": 3.0 * math.exp(-step / 10), "time/step": 0.5 + 0.01 * step}
        if apmpo:
            row |= {"apmpo/p": math.exp(-0.8 * row["reward/mean"]), "apmpo/eps_ada": 0.3, "apmpo/fss": 1.0 + step}
        if step == 7:
            row["policy/entropy"] = None  # a NaN logged as null
        lines.append(json.dumps(row))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 31, "rew')  # a line cut by a kill
    return run_dir


def test_plot_cli_writes_a_png_for_two_runs(tmp_path):
    a = write_run(tmp_path / "a" / "quickstart", "apmpo")
    b = write_run(tmp_path / "b" / "quickstart", "grpo", steps=20, apmpo=False)
    out = tmp_path / "fig" / "dynamics.png"
    done = subprocess.run([sys.executable, "-m", "apmpo.plot", str(a), str(b), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_missing_run_is_one_clear_line(tmp_path):
    from apmpo.plot import main

    assert main([str(tmp_path / "nope"), "--out", str(tmp_path / "x.png")]) == 1
    assert not (tmp_path / "x.png").exists()


def test_labels_are_made_distinct(tmp_path):
    a = write_run(tmp_path / "a" / "quickstart", "apmpo")
    b = write_run(tmp_path / "b" / "quickstart", "grpo")
    c = write_run(tmp_path / "c" / "quickstart", "grpo")
    assert run_labels([a, tmp_path]) == ["quickstart", tmp_path.name]
    assert run_labels([a, b]) == ["quickstart (apmpo)", "quickstart (grpo)"]
    assert run_labels([b, c]) == ["b/quickstart", "c/quickstart"]


def test_read_metrics_skips_cut_lines_and_ema_is_debiased(tmp_path):
    run = write_run(tmp_path / "r", "apmpo", steps=5)
    assert list(read_metrics(run)) == [1, 2, 3, 4, 5]
    assert ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # a constant stays itself from step 1
    # weight 0.5: avg 0.5, 1.25 -> debiased 0.5/0.5 = 1, 1.25/0.75 = 5/3
    assert ema([1.0, 2.0], 0.5) == pytest.approx([1.0, 5 / 3])
    assert max(smoothed([1.0] * 10 + [1e6] + [1.0] * 10, 0.9, log_like=True)) < 1e3  # one FSS spike stays a bump


def test_band_holds_a_skipped_step_and_stops_where_a_run_stopped():
    # Run a skipped step 3 (every group alike: no p logged) and ends at 5; run b logs 2-4 only (it began late).
    a = ([1, 2, 4, 5], [1.0, 2.0, 4.0, 5.0])
    b = ([2, 3, 4], [20.0, 30.0, 40.0])
    steps, mean, low, high = band([a, b], end=4)
    assert steps == [2, 3, 4]  # from b's first step to the last every run reached; a holds 2.0 at step 3
    assert mean == [11.0, 16.0, 22.0] and low == [2.0, 2.0, 4.0] and high == [20.0, 30.0, 40.0]
    # `end`: the last step every run reached, though a's last value of the key came earlier (steps 4-5 unlogged).
    steps, mean, _, _ = band([([1, 2, 3], [1.0, 2.0, 3.0]), ([1, 2, 3, 4, 5], [0.0, 0.0, 0.0, 1.0, 1.0])], end=5)
    assert steps == [1, 2, 3, 4, 5] and mean == [0.5, 1.0, 1.5, 2.0, 2.0]
    # `scale` divides every value (seconds to minutes for the time panel).
    assert band([a], end=5, scale=2.0)[1] == [0.5, 1.0, 2.0, 2.5]
