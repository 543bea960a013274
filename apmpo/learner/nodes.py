"""Learner ranks on several machines: each rank's host, a heartbeat that notices a lost rank in seconds, and a check
that every rank sees the run directory.

A collective waits for its peers up to train.dist_timeout_s (2 h), as ranks 1..N wait in the batch broadcast while
rank 0 generates: a node that dies or drops off the network would hold every other rank, and rank 0's servers, for
that long. So each rank beats, on a thread of its own, into the process group's TCP store (on rank 0's host,
MASTER_ADDR:MASTER_PORT), whatever its main thread waits for. Rank 0 watches every rank's beat, the others watch
rank 0's; a beat unchanged for train.peer_timeout_s (counted on the watcher's clock: no clock is compared across
machines) stops the watching rank with "learner rank K (host H) stopped answering N s ago". Its main thread gets a
KeyboardInterrupt, so that rank 0's ExitStack stops the servers, and the process exits after GRACE_S if a
collective holds that thread in C++ (the servers then follow their launcher, apmpo.rollout.server.follow_launcher).
The other ranks notice rank 0's silence the same way: every rank is down within about 2 x peer_timeout_s + GRACE_S.
A rank that exits normally writes "done" as its beat, so that a peer still validating or logging does not count
it as lost.
"""
from __future__ import annotations

import datetime
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

import torch.distributed as torch_dist

from apmpo.rollout.net import local_address_towards

GRACE_S = 15.0  # for the interrupted main thread to stop the servers before the process exits anyway
DONE = b"done"


class Nodes:
    """Context manager around a rank's loop (after init_distributed): the heartbeat runs inside it. A collective that
    fails inside (gloo's "Connection closed by peer" after a kill) is re-raised as the lost rank's error once the
    heartbeat has named it, within peer_timeout_s."""

    def __init__(self, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.period_s = min(10.0, timeout_s / 6)
        self.lost: str | None = None  # the error, once a peer is lost
        self._stop, self._exiting = threading.Event(), threading.Event()
        address = local_address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        self.hosts = [address]
        if world_size == 1:
            return
        self.hosts = [None] * world_size
        torch_dist.all_gather_object(self.hosts, address)
        # A client of its own, with a deadline of peer_timeout_s: the process group's waits up to dist_timeout_s.
        self.store = torch_dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                         timeout=datetime.timedelta(seconds=timeout_s))
        self.store.add(_key(rank), 1)
        torch_dist.barrier()  # every beat key exists before anyone reads one
        watched = [r for r in range(world_size) if r != rank] if rank == 0 else [0]
        self._thread = threading.Thread(target=self._beat, args=(watched,), name="heartbeat", daemon=True)
        self._thread.start()

    def check_shared(self, run_dir: Path) -> None:
        """Collective, at start: rank 0 writes a token into the run directory and every rank reads it back. A rank on a
        node with a run directory of its own (node-local disk at the same path) stops the run here, on every rank, with
        one message, instead of at its first resume or at the model rank 0 wrote."""
        if self.world_size == 1:
            return
        path = Path(run_dir) / ".shared_check"
        box = [secrets.token_hex(8) if self.rank == 0 else None]
        if self.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(box[0])
        torch_dist.broadcast_object_list(box, src=0)
        try:
            seen = path.read_text() == box[0]
        except OSError:
            seen = False
        everyone = [None] * self.world_size
        torch_dist.all_gather_object(everyone, seen)
        if self.rank == 0:
            path.unlink()
        blind = [r for r, ok in enumerate(everyone) if not ok]
        if blind:
            hosts = sorted({self.hosts[r] for r in blind})
            raise SystemExit(
                f"apmpo: the run directory {run_dir} is not shared: learner rank(s) {blind} (host {', '.join(hosts)}) "
                f"cannot read the file rank 0 (host {self.hosts[0]}) wrote there. Put logging.output_dir on a "
                "filesystem every node mounts at the same path: the model, checkpoints and resume live there.")

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, kind, error, tb) -> None:
        if self.world_size == 1:
            return
        self._exiting.set()
        if error is not None and _collective_failed(error):
            deadline = time.monotonic() + self.timeout_s + 2 * self.period_s
            while self.lost is None and time.monotonic() < deadline:
                time.sleep(0.2)
        self._stop.set()
        if self.lost is not None:  # the thread exits the process after GRACE_S if the teardown has not by then
            raise RuntimeError(self.lost) from error
        self._thread.join(timeout=2 * self.period_s)  # a store call blocked towards a lost host is left behind
        if error is None:
            self.store.set(_key(self.rank), DONE)

    def _beat(self, watched: list[int]) -> None:
        """Beats, and reads the watched ranks' beats, on a thread of its own: a store call towards a host that
        dropped off the network can block far longer than the store's deadline (TCP retransmits), so the silence is
        judged on another thread (_judge), never by a store call returning."""
        values, changed = {}, {r: time.monotonic() for r in watched}
        threading.Thread(target=self._judge, args=(values, changed), name="heartbeat-judge", daemon=True).start()
        while not self._stop.wait(self.period_s):
            try:
                self.store.add(_key(self.rank), 1)
                for r in watched:
                    value = self.store.get(_key(r))
                    if value != values.get(r):
                        values[r], changed[r] = value, time.monotonic()
            except Exception:  # noqa: BLE001 (rank 0's store unreachable: its beat is not seen, and ages)
                pass

    def _judge(self, values: dict, changed: dict) -> None:
        while not self._stop.wait(self.period_s):
            silent = [r for r in changed if values.get(r) != DONE and time.monotonic() - changed[r] > self.timeout_s]
            if silent:
                r = silent[0]
                self.lost = (f"learner rank {r} (host {self.hosts[r]}) stopped answering "
                             f"{time.monotonic() - changed[r]:.0f} s ago (train.peer_timeout_s={self.timeout_s:g}); "
                             f"rank {self.rank} (host {self.hosts[self.rank]}) stops")
                print(f"[apmpo] {self.lost}", file=sys.stderr, flush=True)
                if self._exiting.is_set():
                    return  # __exit__ raises it
                os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: rank 0's ExitStack stops its servers
                time.sleep(GRACE_S)
                os._exit(1)  # the main thread waits in a collective, in C++


def _key(rank: int) -> str:
    return f"apmpo/heartbeat/{rank}"


def _collective_failed(error: BaseException) -> bool:
    """A process-group error (gloo raises a RuntimeError naming itself)."""
    return isinstance(error, torch_dist.DistError) or (
        isinstance(error, RuntimeError) and "gloo" in str(error))
