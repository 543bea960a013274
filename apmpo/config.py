"""Typed run configuration: YAML -> nested dataclasses, one per concern, with `--set a.b=v` overrides.

    cfg = load_config("configs/quickstart.yaml", overrides=["loss.name=grpo", "train.steps=20"])

- A YAML file may name `base: other.yaml` (or a list of them, relative to itself); it is deep-merged on top.
- Unknown keys are rejected with the file and the nearest valid key; values are checked against each field's
  type (ints are accepted for floats, and numbers in strings for numeric fields, since YAML reads `1e-6` as a
  string). `--set` values are parsed as YAML, then checked the same way.
- Every numeric field declares its range (`ranged(default, "[lo, hi]")`): values outside it, and floats that are
  not finite, fail at load naming the key. Paths longer than the file system takes fail too.
- What a run needs of this machine and of other packages (the model, data, reward, environment, benchmarks, GPUs,
  the checkpoint to resume) is `apmpo.preflight`'s, run after loading and before any process starts. This module
  imports nothing of apmpo above the ground floor (loss, sampling, seeding, typed_yaml).
- Derived values live in one place: the properties under "derived" in `Config`.

How YAML becomes checked dataclasses (ranges, paths, base files, unknown keys, types) is apmpo.typed_yaml's, which
knows none of the keys. This module is what a run's configuration holds: every key, documented where it is
declared, and the rules between keys (`Config.validate`). It is long because that one idea is long, about 120 keys
in ten sections with the reason for each default beside it; split by section, the rules that cross sections
(max_tokens against max_model_len, the correction against top_p, eval against rollout) would have no home.
"""
from __future__ import annotations

import dataclasses
import re
import typing
import urllib.parse
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import yaml

from apmpo import seeding
from apmpo.loss import POLICY_LOSSES, LossConfig
from apmpo.sampling import Sampling, check_sampling
from apmpo.typed_yaml import ConfigError, build, path_field, ranged, read_yaml

# How the learner pushes weights into the engines (apmpo.rollout.weight_sync, which picks one for "auto").
Transport = Literal["gloo", "shm", "nccl", "cuda_ipc"]


# The decoder's linear layers: what PEFT adapts and vLLM serves adapters for, in the Qwen2 and Llama models apmpo
# trains (vLLM packs q/k/v and gate/up into one layer each, and takes adapters on any subset of their parts).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    """LoRA adapters (PEFT) on the policy's linear layers: only the adapter trains, only the adapter is pushed to
    the generation servers, and the KL reference is the base model (the adapter off). docs/lora.md."""
    rank: int = ranged(16, "[1, 512]")  # vLLM serves adapters up to rank 512 (its largest --max-lora-rank)
    alpha: float = ranged(32.0, "(0, 1e6]")  # the update is scaled by alpha / rank
    # Must be 0: dropout makes the learner's log-probs random, so every ratio pi/pi_old would be noisy (the same
    # reason engine.load_model refuses models with dropout), and vLLM applies none, so the engine would sample
    # from another policy than the learner scores. Kept as a key so a PEFT habit (0.05) fails with that reason.
    dropout: float = ranged(0.0, "[0, 1)")
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))

    def __post_init__(self) -> None:
        if self.dropout != 0:
            raise ValueError(f"model.lora.dropout must be 0, got {self.dropout}: dropout makes the learner's "
                             "log-probs random (noisy ratios pi/pi_old) and vLLM's engine applies none")
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"model.lora.target_modules names a module twice: {self.target_modules}")
        if not self.target_modules or unknown:
            raise ValueError(f"model.lora.target_modules must be a non-empty subset of {list(LORA_TARGETS)}, "
                             f"got {self.target_modules}")


@dataclass
class ModelConfig:
    # HF hub id, local directory, "quickstart" (the CPU quickstart's), or a name of apmpo.models (fetched)
    path: str = path_field("Qwen/Qwen2.5-Math-1.5B-Instruct")
    # The learner's dtype. auto: bf16 where the hardware computes it natively (a GPU; a CPU with AMX or AVX512-BF16,
    # where bf16 matmuls run about 4x fp32's), else fp32. Resolved when the config is built, so a run's config.yaml
    # holds what ran; ranks on several CPU hosts each resolve it on theirs. fp16: DeepSpeed's fp16 with dynamic loss
    # scaling (fp32 masters), the engine in float16 too unless rollout.dtype says otherwise: 8x finer than bf16,
    # which the FP16 paper (arXiv 2510.26788) found removes the learner-engine mismatch. GPUs only, checked at load
    # (native_fp16): DeepSpeed refuses fp16 on a CPU whose oneDNN has no fp16 (this project's AMD CPUs).
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    # The learner's LM head: "fp32" computes the logits as hidden.float() @ weight.float().T (tied embeddings too:
    # the cast is of the operands, the parameter stays in dtype); "model": in dtype, the softmax in fp32 either way.
    # The engine's follows it unless rollout.head_dtype says otherwise. No effect on an fp32 side.
    head_dtype: Literal["model", "fp32"] = "model"
    # Recompute activations in the backward. None: on when the learner runs on a GPU, where the default
    # micro_batch_tokens (16384) of a 1.5B model does not fit in 80 GB without it; off on CPU (small models, where
    # the recomputation is only time).
    gradient_checkpointing: bool | None = None
    # torch.compile (Inductor) of each decoder layer's MLP and RMSNorms, where the update's elementwise work is
    # (apmpo/learner/compiled.py), for 5-40 s of compilation at start. Off by default: SmolLM2's fp32 update on a
    # 2-core CPU is 81% matmul and gained 1.02x, and compiled values differ from eager ones in the last digits (a
    # compiled run does not repeat an eager one exactly). Not with ZeRO-3 (its hooks gather parameters per module).
    compile: bool = False
    # Vision-language models: freeze the vision encoder, train the merger (projector) and the language model.
    # Default on: RL rewards judge the text, a few thousand diagrams are too few to retrain a 670M-parameter
    # encoder, and freezing drops its gradients and Adam state (~8 GB at 3B scale).
    freeze_vision_tower: bool = True
    lora: LoraConfig | None = None  # None: full fine-tuning

    def __post_init__(self) -> None:
        if self.dtype == "auto":  # resolved once, here: nothing downstream sees "auto"
            self.dtype = "bf16" if native_bf16() else "fp32"


@dataclass
class DataConfig:
    # built-in dataset name ("quickstart" too), hub id, or local jsonl/json/parquet file
    train: str = path_field("math12k")
    split: str = "train"  # for hub ids and dataset folders
    fields: str | None = None  # field mapping (apmpo.data.FIELD_MAPS: math, minerva, spider, bird, ...); None: detect
    reward: str = "math"  # math | sql | choice | quickstart, or "pkg.module:function" for your own
    system_prompt: str | None = None  # None: the task's default (apmpo.data.SYSTEM_PROMPTS)
    max_prompt_tokens: int = ranged(1024, "[1, 2**20]")  # longer prompts are skipped, and counted
    db_root: str | None = path_field(None)  # SQL: directory holding <db_id>/<db_id>.sqlite
    # images given as relative paths: resolved here (None: the data file's folder)
    image_root: str | None = path_field(None)
    seed: int = ranged(0, "[0, 2**32 - 1]")  # data order; resumable
    # Multi-turn episodes (apmpo.envs): an environment answers between the policy's turns and gives the reward
    # (`reward` is then unused): "reveal", "calculator" or your "pkg.module:Class". None: single-turn completions.
    env: str | None = None
    max_turns: int = ranged(2, "[1, 1024]")  # policy turns per episode
    max_episode_tokens: int = ranged(1024, "[1, 2**20]")  # after the first prompt: sampled and environment tokens
    env_timeout_s: float = ranged(10.0, "(0, 86400]")  # each environment call; past it the episode scores 0, counted


# rollout.reward_step_timeout_s's default, in item time-outs: hung items time out side by side (apmpo.rewards.batch),
# so a hang costs about one; the rest is for the batch's own scoring, however many items it has.
STEP_TIMEOUT_ITEMS = 30


@dataclass
class RolloutConfig:
    prompts_per_step: int = ranged(512, "[1, 2**20]")  # B
    group_size: int = ranged(8, "[2, 2**16]")  # G samples per prompt; advantages need two
    temperature: float = ranged(1.0, "[0, 2]")  # 0 (greedy) or [0.01, 2]: apmpo.sampling.check_sampling
    top_p: float = ranged(1.0, "(0, 1]")
    top_k: int = ranged(-1, "[-1, 2**20]")  # -1: off; not 0
    max_tokens: int = ranged(1024, "[1, 2**20]")
    url: str | None = None  # use a running generation server instead of starting one
    urls: list[str] | None = None  # several running servers (other nodes too): the prompts are spread over them
    # how long the run waits for rollout.url(s) to answer; its own servers: their engines' load
    ready_timeout_s: float = ranged(30.0, "(0, 86400]")
    # servers to start; each step's prompts are spread over them, weights pushed to all
    num_servers: int = ranged(1, "[1, 1024]")
    # CUDA_VISIBLE_DEVICES of the servers it starts, one group per server separated by ";": "3" (one server on
    # GPU 3), "4;5;6;7" (four one-GPU servers), "4,5;6,7" (two servers with TP 2). None: CPU or shared GPU
    devices: str | None = None
    # vLLM's share of each server GPU's memory. None: 0.9 on GPUs of its own, 0.5 on the GPU it shares with the
    # learner (apmpo.rollout.launcher.gpu_memory_utilization).
    gpu_memory_utilization: float | None = ranged(None, "(0, 1]")
    # per server; None: the size of its device group (1 without devices)
    tensor_parallel_size: int | None = ranged(None, "[1, 1024]")
    max_model_len: int = ranged(4096, "[2, 2**24]")  # <= the model's max_position_embeddings
    # No torch.compile (nor CUDA graphs on GPU) in the servers it starts: a faster start, slower generation. On CPU
    # the compiled quickstart model generated 1.27-1.36x faster, for 6-25 s more start-up (vllm_compat).
    enforce_eager: bool = False
    # The engines' dtype; "auto": the learner's (model.dtype). Another one isolates what each side's precision does
    # to learning (docs/precision.md): a bf16 engine sampling for an fp32 learner is a GPU run's usual mismatch.
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    # The engines' LM head, and so the logits they sample from (vLLM's hf-overrides {"head_dtype": "float32"}, which
    # casts the head's operands on CPU and accumulates a bf16/fp16 matmul in fp32 on CUDA); "auto": model.head_dtype.
    head_dtype: Literal["auto", "model", "fp32"] = "auto"
    weight_sync: Literal["auto", Transport] = "auto"  # auto: apmpo.rollout.weight_sync.select_transport
    bucket_mb: int = ranged(256, "[1, 2**16]")  # weight-sync bucket size
    # How long either side of a weight sync waits for the other: the workers' join of the group (made before any
    # generation) and each transfer.
    sync_timeout_s: float = ranged(600.0, "(0, 86400]")
    dynamic_sampling: bool = False  # DAPO: drop all-equal groups, sample more until the batch is full
    max_sampling_rounds: int = ranged(4, "[1, 2**8]")  # cap on dynamic-sampling rounds per step
    # DAPO overlong shaping: penalise the last N tokens before max_tokens (0: off)
    overlong_buffer: int = ranged(0, "[0, 2**20]")
    overlong_penalty: float = ranged(1.0, "[0, 1000]")  # the penalty at max_tokens, linear over the buffer
    mask_truncated: bool = False  # DAPO: truncated completions get no loss
    reward_workers: int = ranged(2, "[1, 1024]")
    # Processes that hold a batch's multi-turn environments (data.env; apmpo.envs.workers): a call past
    # data.env_timeout_s, or one that kills its process, ends only its own episode
    env_workers: int = ranged(2, "[1, 1024]")
    env_memory_mb: int | None = ranged(None, "[64, 2**20]")  # per env worker (RLIMIT_AS); None: apmpo.sandbox's
    reward_memory_mb: int | None = ranged(None, "[64, 2**20]")  # per worker (RLIMIT_AS); None: apmpo.sandbox's
    reward_timeout_s: float = ranged(10.0, "(0, 86400]")
    # A step's total scoring time: items unscored by then score 0, as timeouts. None: STEP_TIMEOUT_ITEMS item
    # time-outs (hung items time out side by side, apmpo.rewards.batch, so a hang costs about one per step)
    reward_step_timeout_s: float | None = ranged(None, "(0, 604800]")

    def __post_init__(self):
        if self.reward_step_timeout_s is None and isinstance(self.reward_timeout_s, (int, float)):
            self.reward_step_timeout_s = STEP_TIMEOUT_ITEMS * self.reward_timeout_s

    def sampling(self, stop_token_ids: typing.Sequence[int] = ()) -> Sampling:
        """How each training sample is drawn; the stop tokens are the model's (apmpo.data.stop_token_ids)."""
        return Sampling(self.max_tokens, self.temperature, self.top_p, self.top_k, tuple(stop_token_ids))


@dataclass
class OptimConfig:
    lr: float = ranged(1e-6, "(0, 1]")
    weight_decay: float = ranged(0.0, "[0, 1]")
    adam_beta1: float = ranged(0.9, "[0, 1)")
    adam_beta2: float = ranged(0.999, "[0, 1)")
    adam_eps: float = ranged(1e-8, "(0, 1]")
    warmup_steps: int = ranged(0, "[0, 2**31 - 1]")
    schedule: Literal["constant", "cosine", "linear"] = "constant"  # after warm-up
    max_grad_norm: float = ranged(1.0, "[0, 1e6]")  # gradient clipping; 0: off (DeepSpeed's gradient_clipping)
    # A bf16 learner's fp32 master weights start at a random point of each weight's bf16 rounding interval, its
    # bf16 weights unchanged: a master loaded from bf16 sits on the grid, where every drift under half a bf16 step
    # is lost to the forward, and RL's small noisy updates are such drifts (docs/precision.md). fp16 learners are
    # dithered likewise on fp16's grid. No effect in fp32.
    dither_master: bool = True


@dataclass
class TrainConfig:
    steps: int = ranged(400, "[1, 2**31 - 1]")  # and within apmpo.seeding's layout
    # prompts per optimiser step; a rollout batch gives B / mini_batch_size steps
    mini_batch_size: int = ranged(128, "[1, 2**20]")
    epochs: int = ranged(1, "[1, 1000]")  # passes over each rollout batch
    micro_batch_tokens: int = ranged(16384, "[1, 2**31 - 1]")  # token budget of one forward/backward per rank
    logprob_chunk_tokens: int = ranged(1024, "[1, 2**31 - 1]")  # positions per chunk of the fp32 log-softmax
    # The old policy's log-probs, the ratio's denominator. "recompute": the learner's own (SPEC.md 2.4), by a forward
    # over the batch before its optimiser steps (or the update forward's, with one step). "engine": the engine's
    # log-probs of the tokens it sampled, and no forward; PPO then clips against the policy that sampled (verl's
    # bypass mode, AReaL without its decoupled loss). fp32 engines: 5e-6 nats a token apart on average, 6e-5 at most
    # (docs/training.md, "Old log-probs from the engine").
    old_logprobs: Literal["recompute", "engine"] = "recompute"
    # How long learner ranks wait in a collective. Ranks 1..N wait in the batch broadcast while rank 0 starts the
    # server, generates and scores: a cold start or a long rollout must not abort the job (NCCL's and DeepSpeed's
    # default is 10-30 min).
    dist_timeout_s: float = ranged(7200.0, "(0, 2592000]")  # at most 30 days
    # A learner rank whose heartbeat (apmpo/learner/nodes.py) stops this long stops the run, however long a rollout
    # takes: a lost node is noticed within about twice this, not after dist_timeout_s.
    peer_timeout_s: float = ranged(60.0, "[1, 2592000]")
    # A step whose gradient norm is not finite is skipped (and counted, train/skipped_steps); this many training
    # steps in a row with a skip stop the run: training must never go on silently doing nothing.
    max_skipped_in_a_row: int = ranged(3, "[1, 2**31 - 1]")
    # Asynchronous training: batches are generated up to this many steps ahead, while the learner updates
    # (apmpo.learner.collect.RolloutStream). 0: the synchronous loop. Pair it with `correction` (e.g. mode: tis),
    # which corrects the gap between the engine's (older) policy and the learner's.
    max_staleness: int = ranged(0, "[0, 1024]")
    # DeepSpeed ZeRO: 2 partitions gradients and optimiser state, every rank keeps whole weights; 3 partitions the
    # weights too (a model that does not fit replicated: docs/training.md, "Memory"), gathered a layer at a time
    # for the forward, the weight push and the hf/ export.
    zero_stage: int = ranged(2, "[0, 3]")
    # "cpu": the fp32 master weights and Adam state live in host memory and the optimiser steps there (ZeRO-Offload,
    # stage >= 1); about 12 bytes a parameter off each GPU, for a slower step.
    offload_optimizer: Literal["none", "cpu"] = "none"
    # dtype of ZeRO's gradient reduce-scatter (DeepSpeed's communication_data_type). None: the model's (bf16 on
    # GPU); "fp32" reduces in fp32, twice the bytes on the wire (its cost: scripts/gpu_check/, learner_fp32_comm).
    communication_data_type: Literal["fp32", "bf16"] | None = None
    seed: int = ranged(0, "[0, 2**31 - 1]")  # and within apmpo.seeding's layout
    resume: str = "auto"  # "auto": latest complete checkpoint of this run, "never", or a checkpoint path


@dataclass
class CorrectionConfig:
    """Rollout correction: importance weights w = pi_old / pi_engine between the learner's old policy and the
    engine that sampled (bf16 numerics, or a stale weight version). How w enters each loss: apmpo/loss.py."""
    # off: no weights (the mismatch is still logged); tis: w = min(ratio, tis_cap); mis: w = 1 if the ratio lies
    # in [mis_low, mis_high], else 0 (the token or sequence gets no policy term)
    mode: Literal["off", "tis", "mis"] = "off"
    # sequence: ratio exp(mean_t(log pi_old - log pi_engine)), its w multiplies the advantage; token: one w per token
    level: Literal["token", "sequence"] = "sequence"
    tis_cap: float = ranged(2.0, "(0, 1e6]")
    mis_low: float = ranged(0.5, "[0, 1)")  # identical numerics give ratio 1, which must never be masked
    mis_high: float = ranged(2.0, "(1, 1e6]")


@dataclass
class LoggingConfig:
    run_name: str = path_field("run")
    output_dir: str = path_field("runs")
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "apmpo"


@dataclass
class CheckpointConfig:
    save_every: int = ranged(50, "[0, 2**31 - 1]")  # steps; 0 disables
    keep_last: int = ranged(2, "[0, 2**31 - 1]")  # older checkpoints are deleted; 0: none is
    export_hf: bool = True  # write hf/ (safetensors + tokenizer) in each checkpoint
    # "val/<benchmark>/pass@<k>" (a key the validation logs): the policy with its highest value so far is kept in
    # checkpoints/best/hf (with best.json: step, value), beside the last checkpoints and never pruned. None: off.
    keep_best: str | None = None


@dataclass
class EvalConfig:
    """Validation during training: every `every` steps and after the last, the current weights are evaluated through
    the generation server as `python -m apmpo.eval --seeds <train.seed>` does with these settings (apmpo/eval)."""
    every: int = ranged(0, "[0, 2**31 - 1]")  # steps between validations; 0: off
    benchmarks: str = "math500"  # comma-separated, as `python -m apmpo.eval --benchmarks`: built-ins, NAME=PATH, hub ids
    n: int = ranged(4, "[1, 2**16]")  # samples per problem
    temperature: float = ranged(0.6, "[0, 2]")
    top_p: float = ranged(0.95, "(0, 1]")
    max_tokens: int = ranged(1024, "[1, 2**20]")  # new tokens per sample
    limit: int | None = ranged(None, "[1, 2**31 - 1]")  # only the first `limit` problems of each benchmark; None: all
    k: int | None = ranged(None, "[1, 2**16]")  # pass@k logged beside pass@1; None: k = n
    reward: str | None = None  # None: each benchmark's own (math, sql, ...); "pkg.module:function": yours, for all

    def sampling(self, stop_token_ids: typing.Sequence[int] = ()) -> Sampling:
        """How each validation sample is drawn (top_k off), as `python -m apmpo.eval` with these settings."""
        return Sampling(self.max_tokens, self.temperature, self.top_p, -1, tuple(stop_token_ids))


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    # ---------------------------------------------------------------- derived (the only place)

    @property
    def run_dir(self) -> Path:
        return Path(self.logging.output_dir) / self.logging.run_name

    @property
    def samples_per_step(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.group_size

    @property
    def mini_batches_per_rollout(self) -> int:
        """Optimiser steps per epoch over a rollout batch."""
        return self.rollout.prompts_per_step // self.train.mini_batch_size

    @property
    def overlap(self) -> bool:
        """Generation overlaps the learner's update (train.max_staleness >= 1): the asynchronous loop."""
        return self.train.max_staleness > 0

    @property
    def engine_dtype(self) -> str:
        """The generation servers' --dtype: rollout.dtype, or the learner's."""
        dtype = self.model.dtype if self.rollout.dtype == "auto" else self.rollout.dtype
        return {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]

    @property
    def engine_head_dtype(self) -> str | None:
        """The generation servers' --head-dtype: "float32", or None for the engine's dtype."""
        head = self.model.head_dtype if self.rollout.head_dtype == "auto" else self.rollout.head_dtype
        return "float32" if head == "fp32" and self.engine_dtype != "float32" else None

    @property
    def total_optimizer_steps(self) -> int:
        return self.train.steps * self.mini_batches_per_rollout * self.train.epochs

    def validate(self) -> "Config":
        """Cross-field checks; field types were checked on load. What the config needs of this machine:
        apmpo.preflight."""
        r, t = self.rollout, self.train
        if r.prompts_per_step % t.mini_batch_size:
            raise ConfigError(f"rollout.prompts_per_step ({r.prompts_per_step}) must be a multiple of "
                              f"train.mini_batch_size ({t.mini_batch_size})")
        _check_sampling(r.sampling(), r.group_size, "rollout.")
        if r.top_k == 0:  # the engine's also "off", but -1 is how the config says it
            raise ConfigError(f"rollout.top_k must be -1 (off) or > 0, got {r.top_k}")
        if r.overlong_buffer > r.max_tokens:
            raise ConfigError(f"rollout.overlong_buffer ({r.overlong_buffer}) must be <= rollout.max_tokens "
                              f"({r.max_tokens}): it is the last part of the generation budget")
        if r.max_tokens + self.data.max_prompt_tokens > r.max_model_len:
            raise ConfigError(
                f"rollout.max_tokens ({r.max_tokens}) + data.max_prompt_tokens ({self.data.max_prompt_tokens}) "
                f"> rollout.max_model_len ({r.max_model_len}): the longest prompts could not be completed; lower "
                "one of the first two or raise the third")
        _check_correction(self)
        _warn_if_head_dtype_does_nothing(self)
        _check_zero(self)
        _check_servers(self)
        _check_episodes(self)
        turns = self.data.max_turns if self.data.env else 1  # each turn of each episode has a seed of its own
        layout_error = seeding.check_training(t.seed, t.steps, r.max_sampling_rounds if r.dynamic_sampling else 1,
                                              self.samples_per_step * turns)
        if layout_error:
            raise ConfigError(layout_error)
        _check_eval(self)
        _warn_if_ratios_are_one(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["derived"] = {"run_dir": str(self.run_dir), "samples_per_step": self.samples_per_step,
                          "mini_batches_per_rollout": self.mini_batches_per_rollout,
                          "total_optimizer_steps": self.total_optimizer_steps, "overlap": self.overlap}
        return out


def _check_zero(cfg: Config) -> None:
    t = cfg.train
    if cfg.model.compile and t.zero_stage == 3:
        raise ConfigError("model.compile needs train.zero_stage <= 2: ZeRO-3 gathers each module's parameters in "
                          "hooks around its forward, which the compiler would have to trace")
    if t.offload_optimizer != "none" and t.zero_stage == 0:
        raise ConfigError("train.offload_optimizer: cpu needs train.zero_stage >= 1: ZeRO-Offload moves ZeRO's "
                          "partitioned optimiser state; stage 0 has none")


def _check_sampling(sampling: Sampling, n: int, where: str) -> None:
    """As the generation server checks a request (the one rule, apmpo.sampling.check_sampling)."""
    try:
        check_sampling(sampling, n, where)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _is_url(url: str) -> bool:
    """An http(s)://host[:port] URL, the port (when given) in 1..65535."""
    try:
        parts = urllib.parse.urlsplit(url)
        port_ok = parts.port != 0  # .port raises ValueError outside 0..65535
    except ValueError:
        return False
    return port_ok and parts.scheme in ("http", "https") and bool(parts.hostname) and not re.search(r"\s", url)


class ConfigWarning(UserWarning):
    """A configuration that runs, but not as its author probably meant."""


# Their loss is a clipped ratio aggregated per sequence (power mean, geometric mean, sequence ratio): at ratio 1
# each reduces to the token mean of the advantage-weighted log-probs, GRPO's gradient (tests/test_loss.py).
RATIO_LOSSES = ("apmpo", "gmpo", "gspo")


def _warn_if_ratios_are_one(cfg: Config) -> None:
    if (cfg.loss.name in RATIO_LOSSES and cfg.mini_batches_per_rollout == 1 and cfg.train.epochs == 1
            and cfg.train.max_staleness == 0):
        warnings.warn(ConfigWarning(
            f"loss.name {cfg.loss.name} with one optimiser step per rollout batch (rollout.prompts_per_step = "
            "train.mini_batch_size, train.epochs 1, synchronous): every ratio is 1, so the clip and the sequence "
            f"mean never act and the gradient equals GRPO's. For {cfg.loss.name} to differ, take several optimiser "
            "steps per batch: lower train.mini_batch_size or raise train.epochs"), stacklevel=3)


def _warn_if_head_dtype_does_nothing(cfg: Config) -> None:
    """An fp32 head where the side it reaches computes in fp32 already: it changes nothing."""
    m, r = cfg.model, cfg.rollout
    engine_fp32 = cfg.engine_dtype == "float32"
    unused = ([("rollout.head_dtype", "the engine's dtype")] if r.head_dtype == "fp32" and engine_fp32 else []) + (
        [("model.head_dtype", "model.dtype and the engine's dtype")]
        if m.head_dtype == "fp32" and m.dtype == "fp32" and (r.head_dtype != "auto" or engine_fp32) else [])
    for key, dtypes in unused:
        warnings.warn(ConfigWarning(f"{key}: fp32 changes nothing here: {dtypes} (what it reaches) are fp32 "
                                    "already"), stacklevel=3)


def _check_servers(cfg: Config) -> None:
    r = cfg.rollout
    if r.url is not None and not _is_url(r.url):
        raise ConfigError(f"rollout.url must be an http(s)://host:port URL (port 1-65535), got {r.url!r}")
    if r.urls is not None:
        if r.url is not None:
            raise ConfigError("rollout.url and rollout.urls are both set: list every server in rollout.urls")
        if not r.urls or not all(map(_is_url, r.urls)) or len(set(r.urls)) < len(r.urls):
            raise ConfigError(f"rollout.urls must list distinct http(s)://host:port URLs (port 1-65535), got {r.urls}")
        if r.num_servers not in (1, len(r.urls)):
            raise ConfigError(f"rollout.num_servers ({r.num_servers}) is for servers the run starts; rollout.urls "
                              f"names {len(r.urls)} running ones")


def _check_episodes(cfg: Config) -> None:
    d, r = cfg.data, cfg.rollout
    if d.env is None:
        return
    if not d.env.strip():
        raise ConfigError("data.env is empty: name an environment (reveal, calculator, pkg.module:Class), or leave "
                          "the key out (or null) for single-turn completions")
    if d.max_prompt_tokens + d.max_episode_tokens > r.max_model_len:
        raise ConfigError(f"data.max_prompt_tokens ({d.max_prompt_tokens}) + data.max_episode_tokens "
                          f"({d.max_episode_tokens}) > rollout.max_model_len ({r.max_model_len}): the longest episodes "
                          "could not be played; lower one of the first two or raise the third")
    if r.overlong_buffer:
        raise ConfigError("rollout.overlong_buffer is per completion of rollout.max_tokens, not per episode: set it "
                          "to 0 with data.env")


def _check_correction(cfg: Config) -> None:
    c, r = cfg.correction, cfg.rollout
    if c.mode != "off" and (r.top_p < 1.0 or r.top_k > 0):
        # The engine's log-probs are of the top-p/top-k truncated, renormalised distribution; the learner's
        # are of the full softmax / temperature. Their ratio would bias every importance weight.
        raise ConfigError(f"correction.mode: {c.mode} needs rollout.top_p: 1.0 and rollout.top_k: -1: the engine's "
                          "log-probs then come from the distribution the learner computes")
    if cfg.train.old_logprobs == "engine":
        if c.mode != "off":
            raise ConfigError(f"train.old_logprobs: engine makes pi_old the engine's policy, so correction.mode: "
                              f"{c.mode}'s weights pi_old / pi_engine would all be 1: set correction.mode: off")
        if r.top_p < 1.0 or r.top_k > 0:
            raise ConfigError("train.old_logprobs: engine needs rollout.top_p: 1.0 and rollout.top_k: -1: the "
                              "engine's log-probs are of the truncated distribution, the learner's of the full one")


def _check_eval(cfg: Config) -> None:
    e, keep_best = cfg.eval, cfg.checkpoint.keep_best
    if e.every == 0:
        if keep_best is not None:
            raise ConfigError("checkpoint.keep_best needs validation: set eval.every > 0")
        return
    checks = [(bool(e.benchmarks.strip()), "eval.benchmarks is empty"),
              (e.k is None or e.k <= e.n, f"eval.k must lie in [1, eval.n={e.n}], got {e.k}"),
              (e.max_tokens < cfg.rollout.max_model_len,
               f"eval.max_tokens must lie in [1, rollout.max_model_len={cfg.rollout.max_model_len}), got {e.max_tokens}")]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    _check_sampling(e.sampling(), e.n, "eval.")


# --------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: typing.Iterable[str] = ()) -> Config:
    """Read a YAML file (with its `base:` files), apply `a.b=v` overrides, type-check, validate. What the config
    needs of this machine is apmpo.preflight.check's."""
    data: dict[str, Any] = read_yaml(Path(path)) if path is not None else {}
    source = str(path) if path is not None else "<defaults>"
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. loss.name=grpo")
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is not a section")
        # `key=` is the empty string, as YAML's `key: ""`: null says None (an empty data.env must not silently mean
        # single-turn)
        node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    loss = data.get("loss") or {}
    name = loss.get("name", LossConfig.name) if isinstance(loss, dict) else None
    entry = POLICY_LOSSES.get(name) if isinstance(name, str) else None  # other values fail in build, naming the key
    if entry is not None and entry.needs_token_budget and loss.get("token_budget") is None:
        # Dr. GRPO's constant: the generation budget per sequence, as TRL's max_completion_length; of an episode,
        # the tokens its turns may sample.
        budget = (data.get("rollout") or {}).get("max_tokens", RolloutConfig.max_tokens)
        d = data.get("data") or {}
        if d.get("env") is not None and all(isinstance(d.get(k, 1), int) for k in ("max_turns", "max_episode_tokens")):
            budget = min(budget * d.get("max_turns", DataConfig.max_turns),
                         d.get("max_episode_tokens", DataConfig.max_episode_tokens))
        data["loss"] = {**loss, "token_budget": budget}
    return build(Config, data, prefix="", source=source).validate()


def native_bf16() -> str | None:
    """What computes bf16 natively here ("a GPU", or the CPU flag: AMX or AVX512-BF16), else None: a CPU without
    them emulates bf16 matmuls, slower than fp32."""
    import torch

    if torch.cuda.is_available():
        return "a GPU"
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return None
    return next((f"this CPU's {flag}" for flag in ("amx_bf16", "avx512_bf16") if flag in flags), None)


def native_fp16() -> str | None:
    """What computes fp16 here ("a GPU", or a CPU whose oneDNN has fp16: AVX512-FP16 or AMX-FP16), else None. The
    same test as DeepSpeed's CPU accelerator, which refuses an fp16 engine without it."""
    if torch.cuda.is_available():
        return "a GPU"
    return "this CPU's oneDNN fp16" if torch.ops.mkldnn._is_mkldnn_fp16_supported() else None


def save_config(config: Config, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # a run's first file: its directory may not exist yet
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
