"""Weight sync to a server at a non-loopback address (multi-node, rollout.url/urls): each side hands gloo its own
address towards the other (apmpo.rollout.weight_sync.gloo_devices). Before, a non-loopback group asked gloo for
`create_device(hostname="")`, which torch refuses ("Specify either hostname or interface") on both sides.

The end-to-end test puts a real server in a network namespace of its own, joined to this one by a veth pair the
test creates (and removes): learner and server then talk over addresses that are not loopback, as two nodes do,
without leaving this machine. Loopback aliases (127.0.0.2) would not do: they count as loopback.
"""
import os
import shutil
import subprocess
import sys
import uuid

import pytest
import torch

from apmpo.rollout import GenerationClient
from apmpo.rollout.net import local_address_towards
from apmpo.sampling import Sampling
from apmpo.rollout.weight_sync import gloo_devices
from apmpo.tiny import save_perturbed_copy

TOKEN = "test-token"


# --- which address each side hands gloo ----------------------------------------------------------------------


def test_the_learner_binds_the_address_it_gave_the_workers():
    assert gloo_devices(0, "10.20.30.1", env={}) == [{"hostname": "10.20.30.1"}]
    assert gloo_devices(0, "127.0.0.1", env={}) == [{"hostname": "127.0.0.1"}]


def test_a_worker_binds_its_own_address_towards_the_learner():
    assert gloo_devices(1, "127.0.0.1", env={}) == [{"hostname": "127.0.0.1"}]
    own = local_address_towards("192.0.2.1")  # TEST-NET-1: only a route is looked up, no packet is sent
    assert own != "127.0.0.1" and not own.startswith("127.")
    assert gloo_devices(3, "192.0.2.1", env={}) == [{"hostname": own}]


def test_gloo_socket_ifname_names_the_interfaces_on_both_sides():
    env = {"GLOO_SOCKET_IFNAME": "eth1,eth2"}
    assert gloo_devices(0, "10.20.30.1", env=env) == [{"interface": "eth1"}, {"interface": "eth2"}]
    assert gloo_devices(2, "10.20.30.1", env=env) == [{"interface": "eth1"}, {"interface": "eth2"}]
    assert gloo_devices(1, "127.0.0.1", env={"GLOO_SOCKET_IFNAME": ""}) == [{"hostname": "127.0.0.1"}]


# --- a push across a veth pair --------------------------------------------------------------------------------


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def namespace():
    """(netns name, learner's address, server's address): a namespace linked to this one by a veth pair."""
    why = ("needs root" if os.geteuid() != 0 else "needs iproute2 (ip)" if shutil.which("ip") is None else None)
    if why:
        pytest.skip(f"a network namespace {why}")
    tag = uuid.uuid4().hex[:6]
    name, outer, inner = f"apmpo-{tag}", f"apm{tag}a", f"apm{tag}b"
    subnet = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    learner, server = f"{subnet}.1", f"{subnet}.2"
    made = _ip("netns", "add", name)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
    try:
        for args in (("link", "add", outer, "type", "veth", "peer", "name", inner),
                     ("link", "set", inner, "netns", name),
                     ("addr", "add", f"{learner}/30", "dev", outer), ("link", "set", outer, "up"),
                     ("netns", "exec", name, "ip", "addr", "add", f"{server}/30", "dev", inner),
                     ("netns", "exec", name, "ip", "link", "set", inner, "up"),
                     ("netns", "exec", name, "ip", "link", "set", "lo", "up")):  # vLLM talks to itself over lo
            done = _ip(*args)
            if done.returncode != 0:
                pytest.skip(f"cannot link a network namespace here (ip {' '.join(args)}): {done.stderr.strip()}")
        yield name, learner, server
    finally:
        _ip("link", "del", outer)  # takes its peer with it
        _ip("netns", "del", name)


@pytest.mark.slow  # one server start: ~40 s on the shared 2-core machine
def test_a_push_reaches_a_server_at_a_non_loopback_address(namespace, tiny_tied, tmp_path):
    name, learner, server_host = namespace
    assert local_address_towards(server_host) == learner  # the address the learner hands gloo and the server
    perturbed = save_perturbed_copy(tiny_tied, tmp_path / "perturbed", seed=1)
    from transformers import AutoModelForCausalLM

    served = AutoModelForCausalLM.from_pretrained(tiny_tied, dtype=torch.float32)
    log = open(tmp_path / "server.log", "wb")
    port = 18000 + int(uuid.uuid4().hex[:3], 16) % 1000
    process = subprocess.Popen(
        ["ip", "netns", "exec", name, sys.executable, "-m", "apmpo.rollout.server", "--model", str(tiny_tied),
         "--host", server_host, "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
         "--max-tokens", "64"],
        env={**os.environ, "APMPO_SERVER_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with GenerationClient(f"http://{server_host}:{port}", TOKEN, sync_timeout_s=60) as client:
            client.wait_ready(timeout_s=300)
            prompts = [[1, 2, 3, 4], [5, 6, 7]]

            def greedy():
                return [row[0].token_ids for row in client.generate(prompts, Sampling(max_tokens=12, temperature=0.0))]

            before = greedy()
            assert client.push_weights(perturbed.named_parameters()) == 1
            # The transport a learner on another node gets, over the veth pair (not loopback, not shm).
            assert client.last_push.transport == "gloo"
            changed = greedy()
            assert changed != before
            assert client.push_weights(served.named_parameters()) == 2  # back to the served weights: B -> A
            assert greedy() == before
    finally:
        os.killpg(process.pid, 9)
        process.wait()
        log.close()
