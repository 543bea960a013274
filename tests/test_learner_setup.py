"""The learner's set-up for a first GPU run, each shown on CPU: the collective timeout, the device checks, train
mode (gradient checkpointing runs) and fp32 accumulation of bf16 micro-batch gradients."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from apmpo import preflight
from apmpo.config import ConfigError, load_config
from apmpo.learner.engine import check_devices, cpu_threads, load_model
from train_runs import Ranks

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "learner_setup_worker.py"


def start_ranks(logs, *args, world_size=2) -> Ranks:
    return Ranks([sys.executable, str(WORKER), *map(str, args)], world_size, logs,
                 {**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
def test_ranks_outwait_a_slow_rank_zero_within_the_timeout(tmp_path):
    # Rank 0 busy for 8 s (starting the server, generating): a 3 s timeout kills the waiting rank, as NCCL's
    # default does after 10 min on a real cold start; a timeout above the delay lets every rank go on.
    short, long = start_ranks(tmp_path / "short", "timeout", 3, 8), start_ranks(tmp_path / "long", "timeout", 60, 8)
    codes, outs = short.finish()  # both at once: half the time
    assert codes[1] != 0 and "received" not in outs[1], outs[1][-2000:]
    codes, outs = long.finish()
    assert codes == [0, 0], outs
    assert all(f"rank {r} received batch" in out for r, out in enumerate(outs))


def test_dist_timeout_default_is_at_least_two_hours():
    assert load_config(None).train.dist_timeout_s >= 7200


def gpu_config(devices, weight_sync="auto"):
    """A config meant for a GPU machine, loaded without apmpo.preflight's checks of this (CPU) machine, as for any
    config checked elsewhere than where it runs; check_devices is given the GPUs."""
    return load_config(None, [f"rollout.devices={devices!r}", f"rollout.weight_sync={weight_sync}"])


@pytest.mark.parametrize("cores, ranks, overlap, threads", [
    (2, 1, False, 2), (2, 1, True, 1), (16, 2, False, 8), (16, 2, True, 5), (2, 2, False, 1), (2, 4, True, 1)])
def test_cpu_ranks_take_every_core_unless_the_server_generates_meanwhile(cores, ranks, overlap, threads):
    assert cpu_threads(cores, ranks, overlap=overlap) == threads


@pytest.mark.parametrize("cores, servers, overlap, hidden, threads", [
    (2, 1, False, 128, 1), (2, 1, False, 512, 2), (2, 1, True, 512, 1), (16, 2, False, 512, 8), (16, 2, False, 128, 7),
    (16, 2, True, 1024, 7), (1, 1, False, 128, 1)])
def test_cpu_servers_take_every_core_for_a_compute_bound_model_in_the_synchronous_loop(
        tmp_path, cores, servers, overlap, hidden, threads):
    from transformers import Qwen2Config

    from apmpo.rollout.launcher import cpu_server_threads

    Qwen2Config(hidden_size=hidden, num_attention_heads=hidden // 64, num_key_value_heads=1).save_pretrained(tmp_path)
    assert cpu_server_threads(str(tmp_path), servers, overlap=overlap, cores=cores) == threads


def test_the_cores_counted_are_those_this_process_may_use():
    """`taskset -c 0` (or a container's cpuset) leaves one core: threads are counted from it, not from the machine's
    count, and a server started from there counts the same (children inherit the affinity)."""
    code = ("from apmpo.cpu_threads import usable_cores; from apmpo.learner.engine import cpu_threads; "
            "print(usable_cores(), cpu_threads(usable_cores(), 1, overlap=False))")
    one = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))
    assert one.stdout.split() == ["1", "1"]
    every = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert every.stdout.split()[0] == str(len(os.sched_getaffinity(0)))


def test_gpu_devices_without_cuda_are_refused():
    with pytest.raises(ConfigError, match=r"rollout.devices='3' names GPUs, but this learner sees no CUDA device"):
        check_devices(gpu_config("3"), env={}, gpu_count=0)
    check_devices(load_config(None), env={}, gpu_count=0)  # CPU run: nothing named, nothing to check


@pytest.mark.parametrize("devices, env, outcome", [
    ("3", {"LOCAL_SIZE": "3"}, "own GPU"),  # the paper layout: learners on 0-2, the server on 3
    ("2,3", {"LOCAL_SIZE": "3"}, "refused"),  # GPU 2 is rank 2's
    ("0", {"LOCAL_SIZE": "1"}, "shared"),  # one GPU shared with rank 0: CUDA IPC
    ("0", {"LOCAL_SIZE": "2"}, "shared"),  # the server shares rank 0's GPU
    ("1", {"LOCAL_SIZE": "2"}, "refused"),  # rank 1 pushes nothing: no IPC with rank 1's GPU
    ("0,1", {"LOCAL_SIZE": "1"}, "refused"),  # two server GPUs, one of them the learner's
    ("5", {"CUDA_VISIBLE_DEVICES": "4,5", "LOCAL_WORLD_SIZE": "2"}, "refused"),  # physical ids, under torchrun
    ("6", {"CUDA_VISIBLE_DEVICES": "4,5", "LOCAL_WORLD_SIZE": "2"}, "own GPU"),
    (None, {"LOCAL_SIZE": "1"}, "shared"),  # none named on a GPU machine: the server takes the first GPU
])
def test_server_gpus_must_not_overlap_the_learners(devices, env, outcome):
    """check_devices also says whether the server shares rank 0's GPU: then the run waits for its engine to load
    before loading the learner (vLLM sizes its KV cache from the free memory it measures)."""
    cfg = gpu_config(devices) if devices else load_config(None)
    if outcome == "refused":
        with pytest.raises(ConfigError, match=rf"rollout.devices='{devices}' overlaps the learner's GPUs"):
            check_devices(cfg, env=env, gpu_count=8)
    else:
        assert check_devices(cfg, env=env, gpu_count=8) == (outcome == "shared")
    assert check_devices(load_config(None, ["rollout.url=http://10.0.0.2:8000"]), env=env, gpu_count=8) is False


def test_shared_gpu_with_forced_nccl_is_refused():
    with pytest.raises(ConfigError, match="overlaps"):
        check_devices(gpu_config("0", weight_sync="nccl"), env={"LOCAL_SIZE": "1"}, gpu_count=1)


def test_gpu_config_is_refused_on_a_cpu_machine():
    """As launch/train.py checks a config before anything starts (a ConfigError: one line, exit 2)."""
    cfg = load_config(ROOT / "configs/quickstart.yaml", ["rollout.devices=3", "rollout.num_servers=1"])  # it has 2
    with pytest.raises(ConfigError, match="rollout.devices='3' names GPUs, but this learner sees no CUDA device"):
        preflight.check(cfg, cfg.train.resume)


def saved_activation_bytes(model, ids):
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return sum(saved)


def test_policy_is_in_train_mode_and_gradient_checkpointing_runs(tiny_tied):
    ids = torch.randint(3, 200, (4, 96), generator=torch.Generator().manual_seed(0))
    plain = load_model(str(tiny_tied), load_config(None, ["model.dtype=fp32"]), torch.device("cpu"))
    checkpointed = load_model(str(tiny_tied), load_config(None, ["model.dtype=fp32", "model.gradient_checkpointing=true"]),
                              torch.device("cpu"))
    reference = load_model(str(tiny_tied), load_config(None, ["model.dtype=fp32"]), torch.device("cpu"), trainable=False)
    assert plain.training and checkpointed.training and not reference.training
    # Checkpointed layers keep only their inputs for the backward pass (measured: the 2-layer model saves
    # under half of the activations); in eval mode transformers skipped checkpointing and saved them all.
    with_ckpt, without = saved_activation_bytes(checkpointed, ids), saved_activation_bytes(plain, ids)
    assert with_ckpt < 0.5 * without, (with_ckpt, without)
    # Train mode changes nothing else for Qwen2 (no dropout): the same log-probs as eval mode.
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=0, atol=0)


def test_a_policy_with_dropout_is_refused(tmp_path, tiny_tied):
    import json
    import shutil

    shutil.copytree(tiny_tied, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    with pytest.raises(ValueError, match="the policy has dropout"):
        load_model(str(tmp_path / "m"), load_config(None, ["model.dtype=fp32"]), torch.device("cpu"))


@pytest.mark.slow
def test_bf16_micro_batch_gradients_accumulate_in_fp32(tmp_path):
    k = 32  # at paper scale ~60 micro-batches per optimiser step
    codes, outs = start_ranks(tmp_path, "bf16_accumulation", tmp_path / "grads.pt", k, world_size=1).finish()
    assert codes == [0], outs[0][-3000:]
    result = torch.load(tmp_path / "grads.pt")
    worst_engine = worst_bf16 = 0.0
    for name, accumulated in result["accumulated"].items():
        micro = [s[name] for s in result["singles"]]
        exact = torch.stack([m.double() for m in micro]).sum(0)  # the sum of the same bf16 gradients, in fp64
        bf16_sum = micro[0].clone()
        for m in micro[1:]:
            bf16_sum += m  # what DeepSpeed did by default: accumulate in the model's dtype
        scale = exact.abs().max()
        worst_engine = max(worst_engine, float((accumulated.double() - exact).abs().max() / scale))
        worst_bf16 = max(worst_bf16, float((bf16_sum.double() - exact).abs().max() / scale))
    assert worst_engine < 1e-5, worst_engine  # fp32 rounding only
    assert worst_bf16 > 1e-3, worst_bf16  # the tolerance tells the two apart (this test fails without the fix)


def test_a_bf16_learner_dithers_its_master_weights_so_that_small_drifts_reach_the_forward(tmp_path):
    # Two ZeRO-2 ranks, each holding half of the masters. Every master drifts up by a tenth of its bf16 interval:
    # on the grid (no dither) no bf16 weight moves; dithered, a tenth of them moves, each one step up.
    codes, outs = start_ranks(tmp_path, "dither", tmp_path / "dither").finish()
    assert codes == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    ranks = [torch.load(tmp_path / f"dither.{r}.pt") for r in (0, 1)]
    initial, on, off = ranks[0]["initial"], ranks[0]["on"], ranks[0]["off"]
    for name, weight in initial.items():
        for run in (on, off):
            assert torch.equal(run["built"][name], weight), name  # the forward's weights are untouched
        assert torch.equal(on["masters"][name].bfloat16(), weight), name  # each master rounds to its weight
        assert torch.equal(off["masters"][name], weight.float()), name  # on the grid
        for r in (0, 1):  # every rank set its partition from the same noise
            assert torch.equal(ranks[r]["on"]["masters"][name], on["masters"][name]), name
        assert torch.equal(ranks[0]["zero3"][name], on["masters"][name]), name  # ZeRO-3's partitions alike
    flat = {key: torch.cat([t.flatten() for t in tensors.values()]) for key, tensors in
            [("initial", initial), ("masters", on["masters"]), ("on", on["drifted"]), ("off", off["drifted"])]}
    grid = flat["initial"]
    inf = torch.full_like(grid, float("inf"))
    low = (grid.float() + torch.nextafter(grid, -inf).float()) / 2
    high = (grid.float() + torch.nextafter(grid, inf).float()) / 2
    where = (flat["masters"] - low) / (high - low)  # the master's place in its interval: uniform on [0, 1)
    middle = (where > 0.25) & (where < 0.75)
    assert abs(float(where.mean()) - 0.5) < 0.01 and abs(float(middle.float().mean()) - 0.5) < 0.01
    nonzero = grid != 0  # (zeros, whose interval is tiny, are moved by the step of lr 1e-12 itself)
    assert torch.equal(flat["off"][nonzero], grid[nonzero])
    moved = (flat["on"] != grid) & nonzero
    assert abs(float(moved[nonzero].float().mean()) - 0.1) < 0.01, float(moved[nonzero].float().mean())
    assert torch.equal(flat["on"][moved], torch.nextafter(grid, inf)[moved])  # one step, up


@pytest.mark.parametrize("devices, servers, env, ok", [
    ("4;5;6;7", 4, {"LOCAL_SIZE": "4"}, True),  # 8 GPUs: 4 learners, 4 one-GPU servers
    ("4,5;6,7", 2, {"LOCAL_SIZE": "4"}, True),  # 2 servers with TP 2
    ("3,4;5,6", 2, {"LOCAL_SIZE": "4"}, False),  # GPU 3 is rank 3's
    ("5;3", 2, {"LOCAL_SIZE": "4"}, False),  # the second server's GPU is a learner's
    ("0;1", 2, {"LOCAL_SIZE": "1"}, False),  # sharing rank 0's GPU is for a single server only
    ("0,1", 1, {"LOCAL_SIZE": "1"}, False),  # one server, but on more than rank 0's GPU
    ("6;7", 2, {"CUDA_VISIBLE_DEVICES": "4,5", "LOCAL_WORLD_SIZE": "2"}, True),  # physical ids
    ("6;5", 2, {"CUDA_VISIBLE_DEVICES": "4,5", "LOCAL_WORLD_SIZE": "2"}, False),
])
def test_every_server_group_is_disjoint_from_the_learners(devices, servers, env, ok):
    cfg = load_config(None, [f"rollout.devices={devices!r}", f"rollout.num_servers={servers}"])
    if ok:
        check_devices(cfg, env=env, gpu_count=8)
    else:
        with pytest.raises(ConfigError, match=rf"rollout.devices='{devices}' overlaps the learner's GPUs"):
            check_devices(cfg, env=env, gpu_count=8)


def test_several_servers_on_a_gpu_machine_need_device_groups():
    cfg = load_config(None, ["rollout.num_servers=2"])
    with pytest.raises(ConfigError, match="rollout.num_servers=2 on a GPU machine needs rollout.devices"):
        check_devices(cfg, env={"LOCAL_SIZE": "4"}, gpu_count=8)
    check_devices(cfg, env={}, gpu_count=0)  # CPU: two CPU servers
