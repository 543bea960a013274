"""Per-step metrics: runs/<name>/metrics.jsonl (one JSON object per step), TensorBoard events, optional
Weights & Biases, and a progress bar. Rank 0 only; one `log` call per step."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from tqdm import tqdm

from apmpo.config import Config


class MetricsLogger:
    def __init__(self, cfg: Config, start_step: int):
        self.path = cfg.run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        drop_steps_after(self.path, start_step)
        self.file = open(self.path, "a", encoding="utf-8")
        self.tensorboard = None
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(cfg.run_dir / "tensorboard"), purge_step=start_step + 1)
        self.wandb = None
        if cfg.logging.wandb:
            import wandb  # only when asked for

            self.wandb = wandb.init(project=cfg.logging.wandb_project, name=cfg.logging.run_name,
                                    config=cfg.to_dict(), resume="allow")
        self.bar = tqdm(total=cfg.train.steps, initial=start_step, desc=cfg.logging.run_name, unit="step",
                        dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: _finite(v) for k, v in metrics.items()}}
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as error:
            raise OSError(error.errno, f"writing step {step}'s metrics to {self.path} failed: "
                          f"{os.strerror(error.errno) if error.errno else error}") from error
        if self.tensorboard is not None:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        self.bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                             s_per_step=f"{metrics.get('time/step', float('nan')):.2f}")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def drop_steps_after(path: Path, step: int) -> None:
    """Keep the records of a per-step JSON-lines file (metrics.jsonl, rollouts.jsonl) up to `step`: a resumed run
    redoes the steps after its checkpoint, a run from scratch all of them. A last line that does not parse was torn
    by a crash or a full disk while it was written: it belongs to a step after the checkpoint, so it goes too."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number} is not a JSON record ({error}); only the last line may be torn") from None
        if record.get("step", 0) <= step:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept))


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no NaN
