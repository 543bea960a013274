"""Two "nodes" on one machine: network namespaces joined by a veth pair, each end named eth1 (as a cluster's nodes share
an interface name), at 10.77.0.1 (node A) and 10.77.0.2 (node B), loopback up in both. They share the filesystem, as
nodes share a network filesystem. For tests/test_multinode.py and benchmarks/multinode.py (a helper, not a test).
Needs root and iproute2; closing kills every process left in either namespace, then removes both."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid

ADDRESSES = ("10.77.0.1", "10.77.0.2")
INTERFACE = "eth1"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def unusable() -> str | None:
    """Why two namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2 (ip)"
    probe = f"apmpo-probe-{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


class TwoNodes:
    def __init__(self):
        tag = uuid.uuid4().hex[:6]
        self.names = (f"apmpo-a-{tag}", f"apmpo-b-{tag}")

    def __enter__(self) -> TwoNodes:
        a, b = self.names
        try:
            for args in ([a], [b]):
                self._check("netns", "add", *args)
            self._check("netns", "exec", a, "ip", "link", "add", INTERFACE, "type", "veth", "peer", "name", INTERFACE,
                        "netns", b)
            for name, address in zip(self.names, ADDRESSES):
                for args in (("addr", "add", f"{address}/24", "dev", INTERFACE), ("link", "set", INTERFACE, "up"),
                             ("link", "set", "lo", "up")):  # the servers and vLLM's engines talk over lo
                    self._check("netns", "exec", name, "ip", *args)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for node in (0, 1):
            self.kill_all(node)
        for name in self.names:
            _ip("netns", "del", name)  # the veth pair goes with its namespaces

    def run_in(self, node: int) -> list[str]:
        """The command prefix that runs a program on node 0 (A) or 1 (B)."""
        return ["ip", "netns", "exec", self.names[node]]

    def pids(self, node: int) -> list[int]:
        """Every process in the node's network namespace."""
        return [int(p) for p in _ip("netns", "pids", self.names[node]).stdout.split()]

    def kill_all(self, node: int, timeout_s: float = 10) -> None:
        """SIGKILL every process in the node's namespace (all started by the caller), and wait for them to go."""
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids(node)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    @staticmethod
    def _check(*args: str) -> None:
        done = _ip(*args)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
