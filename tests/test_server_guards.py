"""The generation server's guards that need no engine (issue 17): request ranges, tokens, stopping a server's
process group whose leader is already gone; and (issue 31) what a push must hold, non-finite weights, orphaned shm
segments, running servers that are not there."""
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fastapi import HTTPException
from pydantic import ValidationError

from apmpo.rollout.client import GenerationClient, ServerUnavailable
from apmpo.rollout.launcher import ServerProcess, serve, start_server
from apmpo.rollout.net import free_port
from apmpo.rollout.protocol import GenerateRequest, Limits, check_generate
from apmpo.rollout.server import parse_args
from apmpo.rollout.push_check import BadPush, ExpectedWeights
from apmpo.rollout.weight_sync import SHM_DIR, Bucket, all_finite, plan_buckets, sweep_orphans_in_shm

BASE = dict(prompts=[[1, 2, 3], [4, 5]], n=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8)


# --- request ranges (422: FastAPI answers a ValidationError of the request model with 422) ---


@pytest.mark.parametrize("overrides", [
    dict(seed=2**64 - 1),  # the wedging request: prompt 0's second sample would use seed 2**64
    dict(seed=-1),  # vLLM reads -1 as "no seed": silently unseeded
    dict(seed=10**30),
    dict(temperature=math.nan), dict(temperature=math.inf), dict(temperature=1e308), dict(temperature=2.5),
    dict(temperature=0.001),  # vLLM would raise it to 0.01: the log-probs would not be of the asked temperature
    dict(top_p=math.nan), dict(top_p=1.5), dict(top_p=0.0),
    dict(top_k=-2), dict(top_k=2**64),
    dict(n=0), dict(max_tokens=0),
])
def test_out_of_range_numbers_fail_validation(overrides):
    with pytest.raises(ValidationError):
        GenerateRequest(**{**BASE, **overrides})


def test_the_largest_seed_is_the_one_whose_last_sample_fits():
    # 2 prompts x n=2 use seeds seed .. seed + 3, which must fit vLLM's uint64
    GenerateRequest(**{**BASE, "seed": 2**64 - 4})
    with pytest.raises(ValidationError, match="seed"):
        GenerateRequest(**{**BASE, "seed": 2**64 - 3})


def test_in_range_numbers_pass():
    for overrides in [dict(seed=0), dict(temperature=0.0, n=1), dict(temperature=0.01), dict(temperature=2.0),
                      dict(top_p=1e-6), dict(top_k=0), dict(top_k=2**31 - 1)]:
        GenerateRequest(**{**BASE, **overrides})


def test_images_for_a_text_model_are_400():
    request = GenerateRequest(**{**BASE, "images": [["aGVsbG8="], []]})
    limits = Limits(max_prompts=4, max_n=8, max_tokens=100)
    check_generate(request, limits, max_model_len=32, vocab_size=50, multimodal=True)
    with pytest.raises(HTTPException) as error:
        check_generate(request, limits, max_model_len=32, vocab_size=50, multimodal=False)
    assert error.value.status_code == 400 and "not a vision-language model" in error.value.detail


# --- tokens ---


def test_empty_token_is_refused(capsys, monkeypatch):
    for argv in (["--host", "0.0.0.0", "--token", ""], ["--host", "127.0.0.1", "--token", ""],
                 ["--host", "0.0.0.0", "--token", "  "]):
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", *argv])
        assert "--token must not be empty" in capsys.readouterr().err
    monkeypatch.setenv("APMPO_SERVER_TOKEN", "")
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--host", "0.0.0.0"])
    assert "APMPO_SERVER_TOKEN" in capsys.readouterr().err
    with pytest.raises(ValueError, match="empty"):
        GenerationClient("http://127.0.0.1:1", token="")
    with pytest.raises(ValueError, match="empty"):
        start_server("no-model", log_path="unused.log", token="")


# --- a process group outlives its leader ---


def test_stop_kills_the_group_when_the_leader_is_already_dead(tmp_path):
    # Stand-in for a server whose vLLM engine processes outlive it: a leader (own session, like the launcher's)
    # with a child that ignores SIGTERM, as a busy engine might not stop on it.
    child_pid_file = tmp_path / "child.pid"
    script = ("import os, signal, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
              f"open({str(child_pid_file)!r}, 'w').write(str(child.pid))\n"
              "time.sleep(600)\n")
    process = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 30
    while not (child_pid_file.exists() and child_pid_file.read_text()):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(child_pid_file.read_text())
    os.kill(process.pid, signal.SIGKILL)  # the server is killed -9; its child is reparented, still in the group
    process.wait(timeout=10)
    ServerProcess("http://127.0.0.1:1", None, process).stop(grace_s=1.0)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie waits for its reaper: it is gone
    except FileNotFoundError:
        return False


# --- pushes: what the client refuses, what a server expects, what shared memory keeps (issue 31) ---


def test_the_client_refuses_non_finite_weights_naming_the_first():
    from apmpo.rollout.client import refuse_non_finite

    good = [("a", torch.ones(3)), ("ids", torch.arange(3)), ("b", torch.zeros(2, dtype=torch.bfloat16))]
    refuse_non_finite(good)
    for bad_value in (math.nan, math.inf, -math.inf):
        bad = good + [("c", torch.tensor([1.0, bad_value])), ("d", torch.tensor([math.nan]))]
        with pytest.raises(ValueError, match="'c' holds NaN or infinite values"):
            refuse_non_finite(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_agrees_with_isfinite_everywhere_in_a_tensor(dtype):
    """A NaN or an infinity at any position (vectorised body and scalar tail) and the largest finite values."""
    for n in (1, 7, 64, 65, 1031):
        for position in range(n):
            for bad in (math.nan, math.inf, -math.inf):
                x = torch.randn(n).to(dtype)
                x[position] = bad
                assert not all_finite(x) and not all_finite(x.view(1, n, 1))
        extremes = torch.tensor([torch.finfo(dtype).min, torch.finfo(dtype).max], dtype=dtype)
        assert all_finite(torch.randn(n).to(dtype)) and all_finite(extremes)
    assert all_finite(torch.empty(0, dtype=dtype)) and all_finite(torch.tensor(2.0, dtype=dtype))


def test_expected_weights_of_a_tied_model_allow_but_do_not_require_the_head(tiny_tied):
    expected = ExpectedWeights.of_model(str(tiny_tied), "float32")
    assert expected.optional == {"lm_head.weight"}
    assert expected.shapes["lm_head.weight"] == expected.shapes["model.embed_tokens.weight"]
    named = [(n, torch.float32, s) for n, s in expected.shapes.items() if n != "lm_head.weight"]
    expected.check(plan_buckets(named, 1 << 16))  # without the head, as HF named_parameters() gives it
    expected.check(plan_buckets(named + [("lm_head.weight", torch.float32, expected.shapes["lm_head.weight"])],
                                1 << 16))
    with pytest.raises(BadPush, match="'model.norm.weight' is declared twice"):
        expected.check(plan_buckets(named + named[-1:], 1 << 16))
    with pytest.raises(BadPush, match="'model.norm.weight' ends past its bucket's 64 bytes"):
        [bucket] = plan_buckets(named[-1:], 1 << 16)
        expected.check(plan_buckets(named[:-1], 1 << 16) + [Bucket(64, bucket.tensors)])


def test_an_adapter_push_must_hold_both_halves_of_each_layer_at_the_configured_rank(tiny_tied):
    expected = ExpectedWeights.of_model(str(tiny_tied), "float32")
    layer = "base_model.model.model.layers.1.mlp.down_proj"  # [128, 256] in the model: A [r, 256], B [128, r]
    good = [(f"{layer}.lora_A.weight", torch.float32, (8, 256)), (f"{layer}.lora_B.weight", torch.float32, (128, 8))]
    config = {"r": 8, "lora_alpha": 16, "rank_pattern": {}}

    def check(named, config=config, max_rank=16):
        expected.check_adapter(plan_buckets(named, 1 << 16), config, max_rank)

    check(good)
    with pytest.raises(BadPush, match=r"has shape \[8, 128\]; with r=8 it must be \[8, 256\]"):
        check([(good[0][0], torch.float32, (8, 128)), good[1]])
    with pytest.raises(BadPush, match="'base_model.model.model.layers.1.mlp.down_proj.lora_B.weight' is missing"):
        check(good[:1])
    with pytest.raises(BadPush, match="has dtype bfloat16; the engine's is float32"):
        check([(good[0][0], torch.bfloat16, (8, 256)), good[1]])
    for name in ("model.layers.1.mlp.down_proj.lora_A.weight",  # without PEFT's prefix
                 "base_model.model.model.norm.lora_A.weight",  # a 1-D weight: not a linear layer
                 "base_model.model.model.layers.1.mlp.down_proj.lora_C.weight"):
        with pytest.raises(BadPush, match=f"tensor '{name}' is not a LoRA tensor of the served model"):
            check(good + [(name, torch.float32, (8, 256))])
    with pytest.raises(BadPush, match=r"r=32 must be an integer in \[1, 16\]"):
        check(good, {**config, "r": 32})
    with pytest.raises(BadPush, match=r"r=True must be an integer"):  # JSON's true is not rank 1
        check([(good[0][0], torch.float32, (1, 256)), (good[1][0], torch.float32, (128, 1))], {**config, "r": True})
    with pytest.raises(BadPush, match="rank_pattern or alpha_pattern"):
        check(good, {**config, "rank_pattern": {"down_proj": 4}})
    with pytest.raises(BadPush, match="holds no tensors"):
        check([])


def test_segments_and_adapter_folders_of_processes_that_are_gone_are_swept(tmp_path):
    # the names written out, as a person cleaning /dev/shm by hand sees them
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = Path(SHM_DIR) / f"apmpo-weights-{gone.pid}-test0001"
    ours = Path(SHM_DIR) / f"apmpo-weights-{os.getpid()}-test0002"
    other = Path(SHM_DIR) / "apmpo-weights-notapid-test0003"
    orphan_adapter = Path(SHM_DIR) / f"apmpo-adapter-{gone.pid}-test0004"  # a server killed during a push
    our_adapter = Path(SHM_DIR) / f"apmpo-adapter-{os.getpid()}-test0005"
    try:
        for path in (orphan, ours, other):
            path.write_bytes(b"\0" * 4096)
        for folder in (orphan_adapter, our_adapter):
            folder.mkdir()
            (folder / "adapter_model.safetensors").write_bytes(b"\0" * 4096)
        assert sorted(sweep_orphans_in_shm()) == sorted([str(orphan), str(orphan_adapter)])
        assert not orphan.exists() and ours.exists() and other.exists()
        assert not orphan_adapter.exists() and our_adapter.exists()
    finally:
        for path in (orphan, ours, other):
            path.unlink(missing_ok=True)
        shutil.rmtree(our_adapter, ignore_errors=True)


# --- running servers that are not there (issue 31, item 12) ---


def test_urls_where_nothing_answers_fail_within_the_ready_deadline_naming_the_url():
    refused = f"http://127.0.0.1:{free_port()}"
    silent = socket.socket()  # listens (the kernel completes the handshake), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        for url, reason in [(refused, "nothing answers there"),
                            (silent_url, "it accepts connections but does not answer")]:
            start = time.monotonic()
            with pytest.raises(ServerUnavailable, match=f"{url} not ready after 2 s: {reason}"):
                with serve(urls=[url], url_ready_timeout_s=2):
                    pass
            assert time.monotonic() - start < 10  # was 309-313 s
    finally:
        silent.close()
