"""Atomic, resumable checkpoints: runs/<name>/checkpoints/step_<k>/.

Each holds the DeepSpeed state (module, ZeRO-partitioned optimiser, scheduler), every rank's RNG states,
`trainer_state.json` (step, data position), and `hf/`: the policy in safetensors with its tokenizer and
config, loadable by `AutoModelForCausalLM.from_pretrained` and by the generation server. With LoRA (`model.lora`)
it also holds `adapter/`, the adapter alone in PEFT's format, and `hf/` is the base model with the adapter merged
in: a plain model.

Everything is written into `step_<k>.tmp/` and renamed to `step_<k>/` only once all ranks have finished.
A run killed at any point (SIGKILL mid-step or mid-save) leaves either a complete checkpoint or a `.tmp`
directory that resume ignores and removes. A save first checks that the disk has room for the checkpoint (all
ranks fail together, before writing, if not); a disk that fills up anyway fails with the path named and the
partial `.tmp` removed. Earlier checkpoints are untouched either way.

Rank 0 picks the checkpoint to resume from and broadcasts it (`resume`): multi-node runs need a run directory
shared by all nodes, and a rank that cannot read the chosen checkpoint stops every rank with the path named. A
checkpoint of another ZeRO stage than train.zero_stage is refused before anything starts (`check_zero_stage`).
"""
from __future__ import annotations

import errno
import json
import math
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist

from apmpo.config import ConfigError
from apmpo.learner.lora import has_adapter, save_merged
from apmpo.learner.zero3 import consolidated_state_dict, full_shape, partitioned

DEEPSPEED_TAG = "deepspeed"
STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    root = checkpoint_dir(run_dir)
    complete = [p for p in root.glob("step_*") if STEP_DIR.match(p.name) and (p / "trainer_state.json").is_file()]
    return max(complete, key=lambda p: int(STEP_DIR.match(p.name).group(1)), default=None)


def checkpoint_bytes(engine, world_size: int, export_hf: bool) -> int:
    """About what one checkpoint takes on disk, all ranks together: the module's weights (DeepSpeed's model
    states, and hf/ once more), ZeRO's fp32 master weights and Adam's two fp32 moments (12 bytes a parameter,
    partitioned over the ranks), and 1 MiB a rank for pickling, RNG states, config and tokenizer files."""
    numels = [(math.prod(full_shape(p)), p) for p in engine.module.parameters()]
    numel = sum(n for n, p in numels if p.requires_grad)  # only these have optimiser state
    weights = sum(n * p.element_size() for n, p in numels)
    return weights * (2 if export_hf else 1) + 12 * numel + world_size * (1 << 20)


def save_checkpoint(engine, run_dir: Path, step: int, trainer_state: dict, tokenizer, rank: int,
                    keep_last: int, export_hf: bool = True) -> Path:
    """Collective: every rank calls it. Returns the final directory. Raises OSError(ENOSPC) naming the path
    when the disk lacks room, before writing anything if it can tell."""
    root = checkpoint_dir(run_dir)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    _check_free_space(tmp, checkpoint_bytes(engine, _world_size(), export_hf))
    if rank == 0:
        tmp.mkdir()
    _barrier()
    try:
        engine.save_checkpoint(str(tmp), tag=DEEPSPEED_TAG, save_latest=False)
        torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
        # ZeRO-3: every rank takes part in gathering the weights for hf/ and adapter/ (rank 0 gets them, on CPU)
        exports = export_hf or has_adapter(engine.module)
        whole = consolidated_state_dict(engine) if exports and partitioned(engine.module) else None
        if rank == 0:
            if has_adapter(engine.module):  # adapter_config.json + adapter_model.safetensors
                engine.module.save_pretrained(tmp / "adapter", state_dict=whole)
            if export_hf:
                export_model(engine.module, tokenizer, tmp / "hf", whole)
            record = {**trainer_state, "step": step, "zero_stage": engine.zero_optimization_stage()}
            (tmp / "trainer_state.json").write_text(json.dumps(record, indent=1))
    except Exception as error:  # noqa: BLE001  (only a full disk is translated; anything else re-raises as is)
        if not _disk_full(error, root):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # give the space back; earlier checkpoints are untouched
        raise OSError(errno.ENOSPC, f"the disk is full: writing checkpoint {tmp} failed ({type(error).__name__}: "
                      f"{str(error)[:200]}); earlier checkpoints in {root} are intact") from error
    _barrier()
    if os.environ.get("APMPO_FAULT_PAUSE_SAVING_STEP") == str(step):  # fault injection: a window to kill mid-save
        time.sleep(60)
    if rank == 0:
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)  # a re-save of the same step after a resume
        os.replace(tmp, final)
        _prune(root, keep_last)
    _barrier()
    return final


def resume(engine, run_dir: Path, resume_from: str, rank: int) -> dict:
    """Collective. Rank 0 picks the checkpoint: none for "never" (and removes the run's old checkpoints),
    the latest complete one of its run directory for "auto", or the given path. Every rank loads that one, named
    as rank 0 named it (a `step_<k>` of its own run directory for "auto"); each choosing its own made ranks
    with node-local run directories start at different steps and hang. Returns rank 0's trainer state ({}: from
    scratch); raises RuntimeError on every rank, naming the path, when any rank cannot read the checkpoint."""
    choice = None
    if rank == 0:
        if resume_from == "never":
            start_fresh(run_dir)
        remove_incomplete(run_dir)
        if resume_from == "auto":
            latest = latest_checkpoint(run_dir)
            choice = latest.name if latest is not None else None
        elif resume_from != "never":
            choice = resume_from
    choice = _broadcast(choice)
    if choice is None:
        return {}
    path = checkpoint_dir(run_dir) / choice if resume_from == "auto" else Path(choice)
    readable = (path / "trainer_state.json").is_file() and (path / DEEPSPEED_TAG).is_dir()
    unreadable = [r for r, ok in enumerate(_gather(readable)) if not ok]
    if unreadable:
        raise RuntimeError(f"cannot resume: rank(s) {unreadable} cannot read checkpoint {choice!r}, which rank 0 "
                           f"resumes from (rank {rank} looked in {path}); multi-node runs need a run directory "
                           "shared by all nodes")
    state = load_checkpoint(engine, path, rank)
    return _broadcast(state if rank == 0 else None)


def check_zero_stage(run_dir: Path, resume_from: str, zero_stage: int) -> None:
    """Before anything starts: the checkpoint that `resume` would pick must be one DeepSpeed loads under
    train.zero_stage. Stages 1 and 2 share a layout (the optimiser state partitioned, the module whole); stage 0
    keeps the optimiser state in the module's file and stage 3 partitions the module too, and DeepSpeed's load
    fails on a change between those with a bare AssertionError or a missing file. Raises ConfigError naming the
    stage the checkpoint holds."""
    if resume_from == "never":
        return
    path = latest_checkpoint(run_dir) if resume_from == "auto" else Path(resume_from)
    if path is None or not (path / "trainer_state.json").is_file() or not (path / DEEPSPEED_TAG).is_dir():
        return  # from scratch, or a checkpoint that `resume` reports as unreadable
    saved = saved_zero_stage(path)
    loadable = {0, 1, 2} if saved is None else {1, 2} if saved in (1, 2) else {saved}
    if zero_stage not in loadable:
        holds = "ZeRO stage 0, 1 or 2" if saved is None else f"ZeRO stage {saved}"
        again = "" if saved is None else f"resume with --set train.zero_stage={saved}, or "
        raise ConfigError(f"train.zero_stage={zero_stage} cannot resume checkpoint {path}: it holds {holds}, "
                          f"whose DeepSpeed state stage {zero_stage} cannot load; {again}start over with "
                          "train.resume=never (or another logging.run_name)")


def saved_zero_stage(path: Path) -> int | None:
    """The ZeRO stage checkpoint `path` was saved with, as its trainer_state.json records it. A checkpoint of an
    earlier version recorded none: 3 where DeepSpeed's module state is partitioned per rank
    (zero_pp_rank_<r>_mp_rank_00_model_states.pt), else None (0, 1 or 2)."""
    recorded = json.loads((path / "trainer_state.json").read_text()).get("zero_stage")
    if recorded is not None:
        return recorded
    return 3 if any((path / DEEPSPEED_TAG).glob("zero_pp_rank_*_model_states.pt")) else None


def load_checkpoint(engine, path: Path, rank: int) -> dict:
    """Restores the engine and this rank's RNG; returns the trainer state (with "step")."""
    load_path, _ = engine.load_checkpoint(str(path), tag=DEEPSPEED_TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint in {path}")
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():  # absent when resuming with more ranks than were saved
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((path / "trainer_state.json").read_text())


def start_fresh(run_dir: Path) -> None:
    """train.resume: never on a run directory that has checkpoints: they belong to an older run, remove them
    (a later resume would otherwise pick them up)."""
    old = [*checkpoint_dir(run_dir).glob("step_*"), *checkpoint_dir(run_dir).glob("best*")]
    if old:
        print(f"[apmpo] train.resume=never: removing {len(old)} checkpoint(s) of an earlier run in "
              f"{checkpoint_dir(run_dir)}", flush=True)
        for path in old:
            shutil.rmtree(path, ignore_errors=True)


def best_record(run_dir: Path) -> dict | None:
    """checkpoints/best/best.json ({"key", "value", "step"}) of the best validated policy so far, or None."""
    for name in ("best", "best.old"):  # best.old: a kill between the two renames of save_best
        path = checkpoint_dir(run_dir) / name / "best.json"
        if path.is_file():
            return json.loads(path.read_text())
    return None


def save_best(weights, tokenizer, run_dir: Path, step: int, key: str, value: float) -> bool:
    """checkpoint.keep_best, on rank 0 after a validation: when `value` (of the validation metric `key`) beats the
    best so far, writes the policy (apmpo.learner.zero3.WholeWeights: under ZeRO-3 the other ranks join its gather)
    to checkpoints/best/hf (safetensors + tokenizer, as step_<k>/hf: loadable by from_pretrained, the server and
    `python -m apmpo.eval --model runs/<name>/checkpoints/best`) with best.json. Pruning never touches best/.
    Returns whether it was written."""
    best = best_record(run_dir)
    if best is not None and best["key"] == key and not value > best["value"]:
        return False
    root = checkpoint_dir(run_dir)
    tmp, final, old = root / "best.tmp", root / "best", root / "best.old"
    shutil.rmtree(tmp, ignore_errors=True)
    export_model(weights.model, tokenizer, tmp / "hf", weights.export_state())
    (tmp / "best.json").write_text(json.dumps({"key": key, "value": value, "step": step}, indent=1))
    _fsync_tree(tmp)
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return True


def export_model(model, tokenizer, directory: Path, state_dict: dict | None = None) -> None:
    """The policy as a plain HF model (safetensors, config, tokenizer): with LoRA, the adapter merged in.
    `state_dict`: the weights to write where the module's own are partitioned (ZeRO-3), else None."""
    if has_adapter(model):
        save_merged(model, directory, state_dict)
    else:
        model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def remove_incomplete(run_dir: Path) -> None:
    for tmp in checkpoint_dir(run_dir).glob("step_*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def _prune(root: Path, keep_last: int) -> None:
    steps = sorted((int(m.group(1)), p) for p in root.glob("step_*") if (m := STEP_DIR.match(p.name)))
    for _, path in steps[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(path, ignore_errors=True)


def _fsync_tree(path: Path) -> None:
    """Data on disk before the rename makes the checkpoint visible (a crash must not expose empty files)."""
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _check_free_space(tmp: Path, needed: int) -> None:
    """Collective: raises OSError(ENOSPC) on every rank when any rank's disk has less room than `needed` bytes
    (the whole checkpoint: on a shared directory every rank's part lands on the same disk)."""
    free = _gather(shutil.disk_usage(tmp.parent).free)
    short = [r for r, f in enumerate(free) if f < needed]
    if short:
        raise OSError(errno.ENOSPC, f"the disk is full: checkpoint {tmp} needs about {needed / 2**20:.1f} MiB, "
                      f"rank {short[0]} has {free[short[0]] / 2**20:.1f} MiB free; nothing was written and earlier "
                      f"checkpoints in {tmp.parent} are intact (free space, or lower checkpoint.keep_last)")


def _disk_full(error: BaseException, root: Path) -> bool:
    """torch.save's C++ writer loses the errno ("basic_ios::clear: iostream error", "unexpected pos"), so a
    failure also counts as a full disk when less than 1 MiB is left."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return shutil.disk_usage(root).free < (1 << 20)


def _world_size() -> int:
    return torch_dist.get_world_size() if torch_dist.is_available() and torch_dist.is_initialized() else 1


def _gather(value) -> list:
    """Every rank's `value`, by rank (a list of one without a process group)."""
    if _world_size() == 1:
        return [value]
    out = [None] * _world_size()
    torch_dist.all_gather_object(out, value)
    return out


def _broadcast(value):
    """Rank 0's `value` on every rank."""
    if _world_size() == 1:
        return value
    box = [value]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier() -> None:
    if torch_dist.is_available() and torch_dist.is_initialized():
        torch_dist.barrier()
