"""The generation server's protocol: the request models with their checks, the responses, and the caps a server
holds requests to (`Limits`), as the routes (apmpo/rollout/server.py) take them and the engine
(apmpo/rollout/engine.py) reads them; below both, as vLLM's protocol.py sits below its server and engine. A
request's fields are checked here (422, pydantic) and against the served model and the caps (400, check_generate and
the requests' own checks), before the engine sees them."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import HTTPException
from pydantic import BaseModel, ConfigDict, Field, model_validator

from apmpo.rollout.weight_sync import Transport
from apmpo.sampling import Sampling, check_sampling


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt sampling parameter is an error, not a default


MAX_SEED = 2**64 - 1  # vLLM sends each sample's seed to its engine process as a msgpack uint64


@dataclass(frozen=True)
class Limits:
    max_prompts: int = 4096
    max_n: int = 64
    max_tokens: int = 32768
    update_timeout_s: float = 600.0  # a weight update (receive + load), and how long generate waits for one
    generate_timeout_s: float = 3600.0  # one /generate's hold on the engine; then its requests are aborted (504)


class GenerateRequest(_Strict):
    # Numbers out of range fail here (422), before the engine sees them: an unserialisable seed once wedged it.
    prompts: list[list[int]] = Field(min_length=1)
    n: int = Field(ge=1)
    # The fields of a Sampling, each required: no silent default. Their ranges: check_sampling, below.
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = Field(default=None, ge=0)  # prompt i uses seed + i * n, its samples seed + i * n + j
    # Or one seed per prompt (its samples: seeds[i] + j): multi-turn episodes draw each turn with the seed of the
    # episode and turn, whichever other episodes share the request (apmpo.envs).
    seeds: list[int] | None = None
    # Vision-language models: images[i] are prompt i's images, base64 PNG/JPEG, in the order of its image pads;
    # the prompt holds ONE <|image_pad|> per image (the engine expands it).
    images: list[list[str]] | None = None

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.max_tokens, self.temperature, self.top_p, self.top_k, tuple(self.stop_token_ids))

    @model_validator(mode="after")
    def _engine_ranges(self) -> GenerateRequest:
        check_sampling(self.sampling, self.n)
        if self.seed is not None and self.seed + len(self.prompts) * self.n - 1 > MAX_SEED:
            raise ValueError(f"seed: the last sample's seed, seed + prompts * n - 1, exceeds {MAX_SEED}")
        if self.seeds is not None and (self.seed is not None or len(self.seeds) != len(self.prompts)
                                       or not all(0 <= s <= MAX_SEED - self.n + 1 for s in self.seeds)):
            raise ValueError(f"seeds: one per prompt, each in [0, {MAX_SEED} - n + 1], and not with seed")
        return self


def check_generate(req: GenerateRequest, limits: Limits, max_model_len: int, vocab_size: int,
                   multimodal: bool = False) -> None:
    """Raises HTTPException(400) naming the first violated cap or invalid field."""
    def fail(message: str) -> None:
        raise HTTPException(status_code=400, detail=message)

    if len(req.prompts) > limits.max_prompts:
        fail(f"{len(req.prompts)} prompts > --max-prompts {limits.max_prompts}")
    if req.n > limits.max_n:
        fail(f"n={req.n} > --max-n {limits.max_n}")
    if req.max_tokens > limits.max_tokens:
        fail(f"max_tokens={req.max_tokens} > --max-tokens {limits.max_tokens}")
    for i, prompt in enumerate(req.prompts):
        if not prompt:
            fail(f"prompt {i} is empty")
        if len(prompt) >= max_model_len:
            fail(f"prompt {i} has {len(prompt)} tokens; the engine's max_model_len is {max_model_len}")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            fail(f"prompt {i} has a token id outside [0, {vocab_size})")
    if any(not 0 <= t < vocab_size for t in req.stop_token_ids):
        fail(f"stop_token_ids must lie in [0, {vocab_size})")
    if req.images is not None and not multimodal and any(req.images):
        fail("images were sent, but the served model is not a vision-language model")
    if req.images is not None and len(req.images) != len(req.prompts):
        fail(f"images has {len(req.images)} entries for {len(req.prompts)} prompts")


class Sample(BaseModel):
    token_ids: list[int]
    text: str
    logprobs: list[float]  # of each sampled token, under the distribution it was sampled from (after temperature)
    finish_reason: Literal["stop", "length"] | str


class GenerateResponse(BaseModel):
    outputs: list[list[Sample]]  # [prompt][sample]
    weight_version: int


class InfoResponse(BaseModel):
    model: str
    max_model_len: int
    vocab_size: int
    dtype: str
    weight_version: int
    num_workers: int
    multimodal: bool
    kv_block_size: int  # the n samples of a prompt share its whole blocks of this many tokens (prefix cache)
    compiled: bool  # the model runs through torch.compile (--enforce-eager: no; on CPU, --enable-lora: no)
    max_lora_rank: int | None  # --enable-lora: vLLM's adapter rank limit; None: no adapters
    lora_ids: list[int]  # the adapters loaded, by weight version (policy-v<id>), oldest first
    device_uuids: list[str]  # one per worker; empty strings on CPU
    limits: dict[str, float]


class InitWeightGroupRequest(_Strict):
    transport: Transport
    host: str
    port: int = Field(gt=0, lt=65536)
    world_size: int = Field(ge=2)
    timeout_s: float = Field(gt=0)
    first_rank: int = Field(default=1, ge=1)  # of this server's workers; a group shared with other servers: later

    def check(self, num_workers: int) -> None:
        """Ranks for the engine's `num_workers` workers, and a store that answers."""
        if self.first_rank + num_workers > self.world_size:
            raise HTTPException(400, f"world_size {self.world_size} has no ranks {self.first_rank}.."
                                     f"{self.first_rank + num_workers - 1} for this server's engine workers")
        try:  # the workers would retry a store they cannot reach until the timeout, then fail without its address
            socket.create_connection((self.host, self.port), timeout=5).close()
        except OSError as error:
            raise HTTPException(502, f"cannot reach the learner's weight-group store at {self.host}:{self.port}: "
                                     f"{error}") from None


class TensorSpecModel(_Strict):
    name: str
    dtype: str
    shape: list[int]
    offset: int = Field(ge=0)


class BucketModel(_Strict):
    nbytes: int = Field(ge=0)
    tensors: list[TensorSpecModel]


class BeginUpdateRequest(_Strict):  # its tensors are checked against the served model: ServedEngine.check_push
    buckets: list[BucketModel]
    # --enable-lora: the buckets hold a LoRA adapter's tensors (as adapter_model.safetensors names them), and this
    # is its adapter_config.json; the server loads them as the next adapter version, not into the model.
    adapter: dict[str, Any] | None = None


class LoadUpdateRequest(BeginUpdateRequest):
    segment: str  # the shm segment the workers mapped in an earlier push (its path, a unique name)


class LoadAdapterRequest(_Strict):
    path: str  # a folder as PEFT's save_pretrained writes it (adapter_config.json, adapter_model.safetensors)

    def folder(self, adapter_root: str | None) -> str:
        """The folder to load: under `adapter_root` (None: none may be read), holding an adapter_config.json."""
        if adapter_root is None:
            raise HTTPException(403, "this server was started without --adapter-root: /lora/load reads no folder "
                                     "(the learner's adapter pushes need none)")
        # Symlinks and .. resolved once: the folder checked is the one loaded, whatever a link leads to later
        # (the load may wait behind a generation).
        root, folder = os.path.realpath(adapter_root), os.path.realpath(self.path)
        if os.path.commonpath([root, folder]) != root:
            raise HTTPException(403, f"{self.path} is not under this server's --adapter-root {adapter_root}")
        if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
            raise HTTPException(400, f"{self.path} holds no adapter_config.json: not a PEFT adapter folder on this "
                                     "machine (the server reads the path itself)")
        return folder


class WeightVersionResponse(BaseModel):
    weight_version: int


class WeightUpdateResponse(WeightVersionResponse):
    reload_s: float  # in vLLM's in-place reload, slowest worker
    wait_s: float  # of it, waiting for the learner's bytes
