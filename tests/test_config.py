"""Typed configuration: every shipped YAML loads; bad keys, types and files fail clearly."""
from pathlib import Path

import pytest
import yaml

from apmpo.config import Config, ConfigError, load_config, save_config
from apmpo.loss import LossConfig

CONFIGS = sorted((Path(__file__).parent.parent / "configs").rglob("*.yaml"))


def test_there_are_configs():
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_every_shipped_config_loads(path):
    # The paper's SQL configs name BIRD-train files a user downloads: existence is checked where they run.
    cfg = load_config(path, check_sources=False)
    assert isinstance(cfg, Config) and isinstance(cfg.loss, LossConfig)


def test_a_config_whose_data_is_not_here_fails_naming_it():
    with pytest.raises(ConfigError, match=r"data.train 'data/bird/train/train.json': no such file"):
        load_config(Path(__file__).parent.parent / "configs" / "paper" / "base_sql.yaml")


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
    ("optim.lr=0", r"optim.lr must be > 0, got 0.0"),
    ("optim.lr=-1e-6", r"optim.lr must be > 0"),
    ("rollout.temperature=-0.1", r"rollout.temperature must be 0 \(greedy\) or lie in \[0.01, 2\], got -0.1"),
    ("rollout.temperature=.inf", r"rollout.temperature must be 0 \(greedy\) or lie in \[0.01, 2\]"),
    ("rollout.temperature=0.005", r"rollout.temperature must be 0 \(greedy\) or lie in \[0.01, 2\]"),
    ("rollout.temperature=0", r"rollout.temperature is 0 \(greedy\), which gives 8 identical samples per prompt"),
    ("rollout.temperature=2.5", r"rollout.temperature must be 0 \(greedy\) or lie in \[0.01, 2\]"),
    ("rollout.top_p=0", r"rollout.top_p must lie in \(0, 1\], got 0.0"),
    ("rollout.top_p=1.5", r"rollout.top_p must lie in \(0, 1\]"),
    ("rollout.top_p=.nan", r"rollout.top_p must lie in \(0, 1\]"),
    ("rollout.top_k=0", r"rollout.top_k must be -1 \(off\) or > 0"),
    ("train.dist_timeout_s=0", r"train.dist_timeout_s must be > 0"),
    ("data.reward=maths", r"data.reward 'maths': KeyError: .*unknown reward 'maths'"),
    ("data.reward=no_such_pkg.rewards:score", r"data.reward 'no_such_pkg.rewards:score': ModuleNotFoundError"),
    ("data.reward=json:no_such_function", r"data.reward 'json:no_such_function'"),
    ("model.path=./models/missing", r"model.path './models/missing' is neither a local directory nor a hub id"),
    ("data.train=/data/missing.jsonl", r"data.train '/data/missing.jsonl': no such file"),
    ("data.train=math12k_typo.jsonl", r"data.train 'math12k_typo.jsonl': no such file"),
    # 3072 + 1024 = 4096 fits; 3073 does not, and vLLM would silently truncate the longest prompts' completions
    ("rollout.max_tokens=3073", r"rollout.max_tokens \(3073\) \+ data.max_prompt_tokens \(1024\) > rollout.max_model_len \(4096\)"),
])
def test_bad_values_fail_at_load_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_values_at_the_edges_are_accepted(tmp_path):
    (tmp_path / "train.jsonl").write_text("")
    cfg = load_config(None, ["rollout.max_tokens=3072", "rollout.temperature=0.01", "rollout.top_p=1", "rollout.top_k=5",
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


def test_dr_grpo_budget_defaults_to_the_generation_budget():
    assert load_config(None, ["loss.name=dr_grpo", "rollout.max_tokens=512"]).loss.token_budget == 512
    assert load_config(None, ["loss.name=dr_grpo"]).loss.token_budget == 1024  # rollout.max_tokens' default
    assert load_config(None, ["loss.name=dr_grpo", "loss.token_budget=4096"]).loss.token_budget == 4096
