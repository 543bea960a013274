"""What a config needs of this machine and of the other packages, checked before any process starts.

    cfg = preflight.check(load_config("configs/x.yaml", overrides), resume="auto")

`apmpo.config` checks a config's values and how they fit together, on the ground floor; this module checks what
they name: the model (the cache's bytes, its positions), the data file's records, the reward's or the environment's
import, the benchmarks, the GPUs of the servers and, for a training run, the learner's and the checkpoint that
`resume` would load. Training (`launch/train.py`), the study and the benchmarks that train call it after loading;
every failure is a ConfigError naming the key (exit 2 there). A config meant for another machine is loaded
without it.
"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import torch

from apmpo.config import Config, ConfigError, DataConfig, native_fp16

# A hub id is "org/name"; anything else that is not a built-in name must exist on this machine.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def check(cfg: Config, resume: str | None = None) -> Config:
    """Raises ConfigError for the first thing `cfg` names that this machine lacks. `resume` (a training run's
    train.resume or --resume): also the learner's GPUs and the ZeRO stage of the checkpoint it would resume."""
    _check_model(cfg)
    _check_data(cfg)
    _check_precision_and_transport(cfg)
    _check_server_devices(cfg)
    _check_benchmarks(cfg)
    if resume is not None:
        from apmpo.learner.checkpoint import check_zero_stage  # noqa: PLC0415  (DeepSpeed: only for training)
        from apmpo.learner.engine import check_devices  # noqa: PLC0415

        check_devices(cfg)
        check_zero_stage(cfg.run_dir, resume, cfg.train.zero_stage)
    return cfg


def _check_model(cfg: Config) -> None:
    """The model exists here (a damaged cache entry is refused by its bytes, once per run), and
    rollout.max_model_len fits its positions (vLLM would refuse it only after the server started)."""
    from apmpo import models  # noqa: PLC0415  (light: no torch)

    path = cfg.model.path
    if path in models.MODELS:
        try:
            path = str(models.resolve(path, verify=True))
        except FileNotFoundError as error:
            raise ConfigError(f"model.path: {error}") from None
    elif path != "quickstart" and not Path(path).expanduser().is_dir() and not HUB_ID.match(path):
        raise ConfigError(f"model.path {path!r} is neither a local directory, a hub id (org/name) nor a fetchable "
                          f"model ({', '.join(models.MODELS)}: python -m apmpo.models fetch NAME)")
    try:
        model = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return  # a hub id, the quickstart's (written at the start of the run), or vLLM's to judge
    positions = model.get("max_position_embeddings", (model.get("text_config") or {}).get("max_position_embeddings"))
    if isinstance(positions, int) and cfg.rollout.max_model_len > positions:
        raise ConfigError(f"rollout.max_model_len ({cfg.rollout.max_model_len}) exceeds the model's "
                          f"max_position_embeddings ({positions}, {cfg.model.path}/config.json)")


def _check_data(cfg: Config) -> None:
    """The prompts exist, and what scores them imports: the environment's class, else the reward function."""
    from apmpo.data import BUILTIN  # noqa: PLC0415  (light: no torch, no sympy)

    train = cfg.data.train
    if train not in BUILTIN and train != "quickstart":
        if Path(train).expanduser().is_file():
            _check_data_file(cfg.data)
        elif not Path(train).expanduser().exists() and (train.endswith(DATA_SUFFIXES) or not HUB_ID.match(train)):
            raise ConfigError(f"data.train {train!r}: no such file, and not a built-in dataset "
                              f"({', '.join(sorted(BUILTIN))}, quickstart) or a hub id (org/name)")
    if cfg.data.env is None:
        _check_reward(cfg.data.reward)
        return
    from apmpo.envs import get_env  # noqa: PLC0415

    try:
        get_env(cfg.data.env)
    except Exception as exc:  # noqa: BLE001  (any import failure of the user's module is a config error)
        raise ConfigError(f"data.env {cfg.data.env!r}: {type(exc).__name__}: {exc}") from None


def _check_data_file(d: DataConfig) -> None:
    """A local data file is read and mapped to records here (no tokenizer: cheap), so that an empty or malformed
    file, or one missing a field, fails before any server starts."""
    from apmpo.data import load_records  # noqa: PLC0415

    try:
        records = load_records(d.train, split=d.split, fields=d.fields, db_root=d.db_root,
                               system_prompt=d.system_prompt, image_root=d.image_root)
    except Exception as error:  # noqa: BLE001  (whatever the file does wrong is the config's error)
        message = f"missing field {error}" if isinstance(error, KeyError) else f"{type(error).__name__}: {error}"
        raise ConfigError(f"data.train {d.train!r}: {message}") from None
    if not records:
        raise ConfigError(f"data.train {d.train!r} holds no records (with a gold answer)")


def _check_reward(reward: str, key: str = "data.reward") -> None:
    from apmpo.rewards import get_reward  # noqa: PLC0415

    try:
        get_reward(reward)
    except Exception as exc:  # noqa: BLE001  (any import failure of the user's module is a config error)
        raise ConfigError(f"{key} {reward!r}: {type(exc).__name__}: {exc}") from None


def _check_precision_and_transport(cfg: Config) -> None:
    if cfg.model.dtype == "fp16" and not native_fp16():
        raise ConfigError(
            "model.dtype: fp16 needs a GPU, or a CPU whose oneDNN computes fp16 (AVX512-FP16 or AMX-FP16), and this "
            f"CPU has neither (torch {torch.__version__}: oneDNN fp16 unsupported): DeepSpeed refuses fp16 here ('Type "
            "fp16 is not supported on your device'), and fp16 matmuls would be converted to fp32, slower than fp32 "
            "itself. Use bf16 or fp32 on this machine (docs/precision.md)")
    if cfg.rollout.weight_sync in ("nccl", "cuda_ipc") and not torch.cuda.is_available():
        raise ConfigError(f"rollout.weight_sync: {cfg.rollout.weight_sync} needs CUDA, which this machine lacks; "
                          "use auto (gloo or shm on CPU)")
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb: true, but wandb is not installed (pip install wandb)")


def _check_server_devices(cfg: Config) -> None:
    """rollout.devices splits into one GPU group per server, each of tensor_parallel_size GPUs."""
    r = cfg.rollout
    if r.devices is None:
        return
    from apmpo.rollout.launcher import server_groups  # noqa: PLC0415

    try:
        groups = server_groups(r.devices, r.num_servers)
    except ValueError as error:
        raise ConfigError(f"rollout.devices: {error} (rollout.num_servers)") from None
    sizes = {len(group.split(",")) for group in groups}
    if r.tensor_parallel_size is not None and sizes != {r.tensor_parallel_size}:
        raise ConfigError(f"rollout.tensor_parallel_size ({r.tensor_parallel_size}) must equal the GPUs of each "
                          f"server's group in rollout.devices={r.devices!r}, or be left unset")


def _check_benchmarks(cfg: Config) -> None:
    """Validation's benchmarks exist (a local file, a built-in, a hub id), and checkpoint.keep_best names a score
    they log."""
    e, keep_best = cfg.eval, cfg.checkpoint.keep_best
    if not e.every:
        return
    from apmpo.eval.run import EvalError, benchmark_names, check_benchmark_sources  # noqa: PLC0415

    try:
        names = benchmark_names(e.benchmarks)
        check_benchmark_sources(e.benchmarks)
    except EvalError as error:
        raise ConfigError(f"eval.benchmarks: {error}") from None
    if keep_best is not None:
        keys = [f"val/{name}/pass@{k}" for name in names for k in dict.fromkeys([1, e.k or e.n])]
        if keep_best not in keys:
            raise ConfigError(f"checkpoint.keep_best {keep_best!r} is not a logged validation score; one of {keys}")
    if e.reward is not None:
        _check_reward(e.reward, "eval.reward")
