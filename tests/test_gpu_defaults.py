"""Defaults that depend on where a run goes (issue 28): resolved in one place each, checked here without a GPU.

- model.gradient_checkpointing: None = on for a GPU learner (16384-token micro-batches of a 1.5B model need it in
  80 GB), off on CPU;
- rollout.gpu_memory_utilization: None = 0.9 on server GPUs of their own, 0.5 on the GPU shared with the learner;
- train.communication_data_type: fp32 reaches DeepSpeed's config; None leaves DeepSpeed's default (the model's);
- model.dtype fp16 (GPUs) reaches DeepSpeed as fp16 with dynamic loss scaling, whose skips are not failures;
- rollout.sync_timeout_s comes from the YAML and reaches the client;
- several servers share one weight group only where this machine reaches them all at one address.
"""
import pytest
import torch

from apmpo.config import ConfigError, load_config
from apmpo.learner.engine import Dist, checkpoints_activations, deepspeed_config, step_failed
from apmpo.rollout import GenerationClient
from apmpo.rollout.client import WeightSender
from apmpo.rollout.launcher import gpu_memory_utilization
from apmpo.rollout.pool import ServerPool

CPU = Dist(0, 1, torch.device("cpu"))


def test_gradient_checkpointing_defaults_on_for_a_gpu_learner_only():
    cfg = load_config(None)
    assert cfg.model.gradient_checkpointing is None and cfg.train.micro_batch_tokens == 16384
    assert checkpoints_activations(cfg, torch.device("cuda", 0)) is True
    assert checkpoints_activations(cfg, torch.device("cpu")) is False
    off = load_config(None, ["model.gradient_checkpointing=false"])
    on = load_config(None, ["model.gradient_checkpointing=true"])
    assert checkpoints_activations(off, torch.device("cuda", 0)) is False
    assert checkpoints_activations(on, torch.device("cpu")) is True


def test_load_model_resolves_the_default_on_cpu(tiny_tied):
    from apmpo.learner.engine import load_model

    model = load_model(str(tiny_tied), load_config(None, ["model.dtype=fp32"]), torch.device("cpu"))
    assert model.training and not model.is_gradient_checkpointing


def test_server_memory_share_defaults_to_0_9_on_its_own_gpus_and_0_5_beside_the_learner():
    assert load_config(None).rollout.gpu_memory_utilization is None
    assert gpu_memory_utilization(None, shares_learner_gpu=False) == 0.9
    assert gpu_memory_utilization(None, shares_learner_gpu=True) == 0.5
    assert gpu_memory_utilization(0.7, shares_learner_gpu=True) == 0.7
    assert gpu_memory_utilization(0.7, shares_learner_gpu=False) == 0.7
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(ConfigError, match=f"rollout.gpu_memory_utilization must lie in \\(0, 1\\].*got {float(bad)}"):
            load_config(None, [f"rollout.gpu_memory_utilization={bad}"])


def test_fp32_gradient_reduction_is_a_key_that_reaches_deepspeed():
    assert "communication_data_type" not in deepspeed_config(load_config(None), CPU)  # DeepSpeed's: the model's
    fp32 = deepspeed_config(load_config(None, ["train.communication_data_type=fp32"]), CPU)
    assert fp32["communication_data_type"] == "fp32"
    assert fp32["data_types"] == {"grad_accum_dtype": "fp32"}
    with pytest.raises(ConfigError, match=r"train.communication_data_type must be one of \['fp32', 'bf16'\]"):
        load_config(None, ["train.communication_data_type=fp16"])


def test_an_fp16_learner_is_deepspeeds_fp16_with_dynamic_loss_scaling():
    fp16 = deepspeed_config(load_config(None, ["model.dtype=fp16"]), CPU)
    assert fp16["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                            "hysteresis": 2, "min_loss_scale": 1}  # loss_scale 0: dynamic
    assert fp16["bf16"]["enabled"] is False and fp16["data_types"] == {"grad_accum_dtype": "fp32"}
    assert deepspeed_config(load_config(None, ["model.dtype=bf16"]), CPU)["fp16"]["enabled"] is False


@pytest.mark.parametrize("dtype, skipped, loss, failed", [
    ("fp16", 1, 0.3, False),  # the loss scaler's search: its scaled gradients overflowed, the scale is halved
    ("fp16", 1, float("nan"), True),
    ("fp16", 0, 0.3, False),
    ("bf16", 1, 0.3, True),  # no scaling: a skipped step is a non-finite gradient norm
    ("fp32", 1, 0.3, True),
])
def test_only_real_failures_count_toward_max_skipped_in_a_row(dtype, skipped, loss, failed):
    cfg = load_config(None, [f"model.dtype={dtype}"])
    assert step_failed(cfg, {"train/skipped_steps": skipped, "loss/total": loss}) is failed


def test_sync_timeout_is_one_key_checked_at_load(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  sync_timeout_s: 45\n")
    assert load_config(path).rollout.sync_timeout_s == 45.0
    assert load_config(None).rollout.sync_timeout_s == 600.0
    with pytest.raises(ConfigError, match=r"rollout.sync_timeout_s must lie in \(0, 86400\], got 0.0"):
        load_config(None, ["rollout.sync_timeout_s=0"])


def test_servers_share_one_weight_group_only_where_one_address_reaches_them_all():
    local = [GenerationClient(f"http://127.0.0.1:{port}") for port in (8001, 8002)]
    assert WeightSender.one_group_reaches(local)
    assert ServerPool(local).sender is not None
    assert ServerPool(local[:1]).sender is None  # one server: its client's own group
    # Two networks: this machine reaches them from different addresses (loopback, and its address on the other).
    mixed = [GenerationClient("http://127.0.0.1:8001"), GenerationClient("http://192.0.2.1:8002", token="t")]
    assert not WeightSender.one_group_reaches(mixed)
    assert ServerPool(mixed).sender is None
    # The same address named for both (sync_host), but other settings differ: a group each.
    named = [GenerationClient(u, token="t", sync_host="192.0.2.2") for u in ("http://192.0.2.1:1", "http://192.0.2.3:1")]
    assert WeightSender.one_group_reaches(named)
    unlike = [GenerationClient("http://127.0.0.1:8001", transport="gloo"), GenerationClient("http://127.0.0.1:8002")]
    assert not WeightSender.one_group_reaches(unlike)
