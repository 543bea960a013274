"""Two learner nodes started by DeepSpeed's own launcher, as a cluster user starts them (docs/training.md, "Several
machines", shows NODE_COMMAND with a cluster's addresses). The nodes are network namespaces joined by a veth pair
(tests/netns.py): node A at 10.77.0.1 runs rank 0 and its generation server (on A's loopback, as on one machine),
node B at 10.77.0.2 runs rank 1; the batch broadcast, ZeRO's reduce-scatter and the heartbeat cross the veth pair
over gloo, bound to eth1 by GLOO_SOCKET_IFNAME. Both see this machine's filesystem, as nodes see a shared one.

One uninterrupted 3-step run is the reference. A second run loses node B mid-step 3 (kill -9 of its rank): A's rank,
its servers and its launcher must stop within LOST_NODE_BOUND_S, naming the lost rank and host, and no process may
be left in A's namespace; both nodes then resume from step 2's checkpoint and must redo step 3 as the reference did.
A third start gives B a run directory of its own at the same path (a tmpfs mounted over it in a mount namespace of
B's: node-local disk where a shared one was meant); every rank refuses it at start with one message.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import netns
from train_runs import ROOT, metrics, with_warm_programs

pytestmark = pytest.mark.slow

WHY_NOT = netns.unusable()
if WHY_NOT:
    pytest.skip(WHY_NOT, allow_module_level=True)

MASTER_ADDR, MASTER_PORT = netns.ADDRESSES[0], 29500
HOSTFILE = "".join(f"{address} slots=1\n" for address in netns.ADDRESSES)  # one learner rank per node
PEER_TIMEOUT_S = 15
LOST_NODE_BOUND_S = 60  # peer_timeout_s + its heartbeat period (2.5 s) + the servers' teardown, with room for load
RUN = ("train.steps=3", "checkpoint.save_every=2", "eval.every=0", "rollout.num_servers=1",
       f"train.peer_timeout_s={PEER_TIMEOUT_S}")


def node_command(hostfile: Path, node_rank: int, *overrides: str) -> list[str]:
    """What each node runs (with GLOO_SOCKET_IFNAME=eth1 in its environment)."""
    return [str(Path(sys.executable).parent / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh",
            "--node_rank", str(node_rank), "--master_addr", MASTER_ADDR, "--master_port", str(MASTER_PORT),
            "launch/train.py", "--config", "configs/quickstart.yaml", *(a for o in overrides for a in ("--set", o))]


class Launch:
    """Both nodes' `deepspeed` runners, started at once, the run in <out>/runs/quickstart; their output in
    <out>/node_{a,b}[_resumed].log."""

    def __init__(self, nodes: netns.TwoNodes, out: Path, *overrides: str, resume: bool = False,
                 node_b_prefix: tuple[str, ...] = ()):
        (out / "runs").mkdir(parents=True, exist_ok=True)
        hostfile = out / "hostfile"
        hostfile.write_text(HOSTFILE)
        self.logs = [out / f"node_{n}{'_resumed' if resume else ''}.log" for n in "ab"]
        env = with_warm_programs({**os.environ, "GLOO_SOCKET_IFNAME": netns.INTERFACE})  # ranks forked, in their nodes
        self.processes = []
        for node in (0, 1):
            command = node_command(hostfile, node, *RUN, f"logging.output_dir={out / 'runs'}", *overrides)
            command += ["--resume"] if resume else []
            prefix = nodes.run_in(node) + list(node_b_prefix if node == 1 else ())
            with open(self.logs[node], "wb") as log:
                self.processes.append(subprocess.Popen(prefix + command, cwd=ROOT, env=env, stdout=log,
                                                       stderr=subprocess.STDOUT, start_new_session=True))

    def wait(self, timeout: float = 600) -> list[int]:
        deadline = time.monotonic() + timeout
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in self.processes]

    def output(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace")


@pytest.fixture(scope="module")
def nodes():
    with netns.TwoNodes() as two:
        yield two


@pytest.fixture(scope="module")
def reference(nodes, tmp_path_factory):
    """The uninterrupted two-node run: its Launch and run directory."""
    out = tmp_path_factory.mktemp("reference")
    launch = Launch(nodes, out)
    try:
        codes = launch.wait()
    finally:
        nodes.kill_all(0), nodes.kill_all(1)
    assert codes == [0, 0], launch.output(0)[-4000:] + launch.output(1)[-4000:]
    return launch, out / "runs/quickstart"


def test_two_nodes_train_through_deepspeeds_launcher(reference):
    launch, run_dir = reference
    assert "2 learner rank(s)" in launch.output(0)
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3]
    # ZeRO-2 partitioned the optimiser over both nodes, and each wrote its part into the shared run directory.
    assert len(list((run_dir / "checkpoints/step_2/deepspeed").glob("*optim_states.pt"))) == 2
    assert all(r["time/weight_sync"] > 0 for r in metrics(run_dir))  # rank 0 pushed every step


def lose_node_b(nodes: netns.TwoNodes, launch: Launch, run_dir: Path, how) -> tuple[int, float, list[int]]:
    """Once step 2's checkpoint is complete (step 3 then starts at once), `how(nodes)` takes node B away: node A's
    launcher's exit code, how long after the loss it ended, and the processes left in A's namespace after it."""
    try:
        deadline = time.monotonic() + 600
        while not (run_dir / "checkpoints/step_2").is_dir():  # renamed once complete
            assert time.monotonic() < deadline and all(p.poll() is None for p in launch.processes), launch.output(0)
            time.sleep(0.1)
        how(nodes)
        lost = time.monotonic()
        code_a = launch.processes[0].wait(timeout=LOST_NODE_BOUND_S + 60)
        stopped_after = time.monotonic() - lost
        launch.processes[1].wait(timeout=LOST_NODE_BOUND_S + 60)  # B's launcher ends too
        time.sleep(1)
        return code_a, stopped_after, nodes.pids(0)
    finally:
        nodes.kill_all(0), nodes.kill_all(1)


def kill_rank_b(nodes: netns.TwoNodes) -> None:
    """B's rank and its relay (apmpo.warm.relay: the rank is forked by the tests' warm process)."""
    rank_b = [pid for pid in nodes.pids(1) if b"--local_rank" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(rank_b) == 2, rank_b
    for pid in rank_b:
        os.kill(pid, 9)


def check_node_a_stopped(launch: Launch, code_a: int, stopped_after: float, left: list[int]) -> None:
    output = launch.output(0)
    assert code_a != 0 and stopped_after < LOST_NODE_BOUND_S, (stopped_after, output[-4000:])
    assert f"learner rank 1 (host {netns.ADDRESSES[1]}) stopped answering" in output, output[-4000:]
    assert left == [], "processes outlived node A's run: " + ", ".join(
        Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120] for pid in left)


def test_a_lost_node_stops_the_run_which_then_resumes_as_if_uninterrupted(nodes, reference, tmp_path):
    """kill -9 of B's rank: the kernel closes its sockets, gloo fails at A's next collective with B, and A waits for
    the heartbeat to name the lost rank before it stops."""
    run_dir = tmp_path / "runs/quickstart"
    launch = Launch(nodes, tmp_path)
    code_a, stopped_after, left = lose_node_b(nodes, launch, run_dir, kill_rank_b)
    print(f"node A stopped {stopped_after:.1f} s after node B's rank was killed")
    check_node_a_stopped(launch, code_a, stopped_after, left)
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]

    resumed = Launch(nodes, tmp_path, resume=True)
    try:
        codes = resumed.wait()
    finally:
        nodes.kill_all(0), nodes.kill_all(1)
    assert codes == [0, 0], resumed.output(0)[-4000:] + resumed.output(1)[-4000:]
    assert "resuming at step 2" in resumed.output(0)
    want, got = metrics(reference[1]), metrics(run_dir)
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(want, got):  # as tests/test_train_cli.py compares a resumed run with an uninterrupted one
        assert b["reward/mean"] == pytest.approx(a["reward/mean"], abs=1e-6), b["step"]
        assert b["loss/policy"] == pytest.approx(a["loss/policy"], rel=1e-3, abs=1e-6), b["step"]


def test_a_node_that_drops_off_the_network_is_noticed_by_the_heartbeat(nodes, tmp_path):
    """B's link goes down mid-step 3: no connection is closed, so gloo would wait train.dist_timeout_s (2 h); the
    heartbeat alone stops A (its main thread held in a collective, in C++, exits after the grace), and B, which no
    longer reaches rank 0's store, stops as well."""
    def link(state: str) -> None:
        subprocess.run(nodes.run_in(1) + ["ip", "link", "set", netns.INTERFACE, state], check=True)

    launch = Launch(nodes, tmp_path)
    try:
        code_a, stopped_after, left = lose_node_b(nodes, launch, tmp_path / "runs/quickstart", lambda _: link("down"))
    finally:
        link("up")
    print(f"node A stopped {stopped_after:.1f} s after node B's link went down")
    check_node_a_stopped(launch, code_a, stopped_after, left)
    assert f"learner rank 0 (host {netns.ADDRESSES[0]}) stopped answering" in launch.output(1), \
        launch.output(1)[-4000:]


def test_a_run_directory_that_one_node_cannot_see_is_refused_at_start(nodes, tmp_path):
    # B gets an empty tmpfs at the run directory's path, in a mount namespace of its own: A's files are not there.
    hide = ("unshare", "--mount", "sh", "-c", f"mount -t tmpfs none {tmp_path / 'runs'} && exec \"$@\"", "sh")
    launch = Launch(nodes, tmp_path, node_b_prefix=hide)
    try:
        codes = launch.wait(timeout=300)
    finally:
        nodes.kill_all(0), nodes.kill_all(1)
    assert codes[0] != 0 and codes[1] != 0, codes
    for node in (0, 1):
        output = launch.output(node)
        assert (f"the run directory {tmp_path / 'runs/quickstart'} is not shared: learner rank(s) [1] "
                f"(host {netns.ADDRESSES[1]}) cannot read the file rank 0 (host {netns.ADDRESSES[0]})") in output, \
            output[-4000:]
        assert "Traceback" not in output, output[-4000:]  # one message, not a failure further on
