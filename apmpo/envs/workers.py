"""Environments in worker processes: `num_workers` processes hold a batch's environment objects, episode k in
worker k % num_workers, and run every reset and step call there, each call in a thread of its own.

    workers = EnvWorkers(CalculatorEnv, num_workers=4)
    workers.begin(num_episodes)
    results = workers.call_all([(k, "reset", sample), ...], timeout_s=10.0)  # ("ok", value) | (kind, message)
    workers.end()      # the batch is over: its environments go, and so does every worker a failure touched

Why processes (issue 42): as threads of the learner's rank 0, an environment that held the interpreter lock
(sympy on `\\boxed{9^{9^{9^{9}}}}`, a regex over 140k characters) could not be bounded: the join waited for ever.
One that called os._exit took the learner down, and each timed-out thread stayed behind with what it had opened
(72 threads and pipes after two steps of an environment that blocked 30% of the time).

Here a call past its time ends its episode (reward 0, a "timeouts" failure) and taints its worker; a worker that
dies (os._exit, a segfault, the OOM killer) ends every episode it held, named in the failure ("environment worker
exited with code 1 during step", "crashes"); a call that raises is its episode's "errors" failure. At `end` the
batch's environments are dropped, and a worker that was tainted, or is left with more threads or open files than
it started with, is killed: whatever an episode started goes with its batch. The next batch starts new workers
where needed (milliseconds: they fork from the reward pool's forkserver, apmpo.rewards imported, and import the
environment's module once).

Not one process per episode: a batch of the quickstart's multi-turn config plays 128 episodes, its validation 360,
and that many processes put the 24 GiB machine out of memory (the OOM killer took the learner). The price of
sharing: a call that holds the interpreter lock in a worker stalls that worker's other calls until its time is up,
so they fail with it (a fraction 1/num_workers of the batch); an environment that merely blocks (I/O, sleep)
costs only its own episode.

The learner keeps the tokenisation and the transcript: only text, samples and the environment's answers cross the
pipe. Workers die with the learner (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from apmpo.rewards.batch import _CONTEXT, _main_module_hidden

STARTUP_S = 30.0  # a new worker's start and its import of the environment's module, beyond its first call's time
END_S = 2.0  # for a worker to drop its environments and say whether it is clean


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def _worker_main(conn: Connection, env_cls: type) -> None:
    import ctypes  # noqa: PLC0415
    import signal  # noqa: PLC0415

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the learner
    send_lock = threading.Lock()
    envs: dict[int, Any] = {}

    def send(message) -> None:
        with send_lock:
            try:
                conn.send(message)
            except Exception as error:  # noqa: BLE001  (an answer that cannot be pickled)
                conn.send(("errors", message[1], f"its answer cannot leave its process: {type(error).__name__}: "
                                                 f"{error}"[:500]))

    def call(op: str, episode: int, arg: Any) -> None:
        try:
            if op == "reset":
                envs[episode] = env_cls()
                value = envs[episode].reset(arg)
            else:
                value = envs[episode].step(arg)
        except BaseException as error:  # noqa: BLE001  (sys.exit() in a step too: the episode's failure)
            send(("errors", episode, f"{type(error).__name__}: {error}"[:500]))
            return
        send(("ok", episode, value))

    calls: list[threading.Thread] = []
    threads, files = threading.active_count(), _open_files()
    send(("ready", -1, None))
    while True:
        try:
            op, episode, arg = conn.recv()
        except (EOFError, OSError):
            return
        if op == "calls":  # a turn's calls of this worker's episodes, in one message
            for call_episode, call_op, call_arg in arg:
                calls.append(threading.Thread(target=call, args=(call_op, call_episode, call_arg), daemon=True,
                                              name="env-call"))
                calls[-1].start()
            continue
        if op == "end":
            for thread in calls:  # each has answered: it is done, or about to be
                thread.join(timeout=1.0)
            calls.clear()
            envs.clear()  # no gc.collect(): 50-100 ms of this heap per batch; an environment's cycles go later
            clean = threading.active_count() <= threads and _open_files() <= files
            send(("ok", -1, clean))
            if not clean:
                return


class EnvWorker:
    def __init__(self, env_cls: type) -> None:
        self.conn, child = _CONTEXT.Pipe()
        self.process = _CONTEXT.Process(target=_worker_main, args=(child, env_cls), daemon=True, name="apmpo-env")
        with _main_module_hidden():
            self.process.start()
        child.close()
        self.ready = False
        self.tainted = False  # a call of its ran past its time: it goes at `end`
        self.dead: str | None = None  # why its episodes are lost

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class EnvWorkers:
    """The worker processes of one environment class, kept from batch to batch while they stay clean."""

    def __init__(self, env_cls: type, num_workers: int) -> None:
        self.env_cls, self.num_workers = env_cls, num_workers
        self._workers: list[EnvWorker] = []
        self._hosts: list[EnvWorker] = []  # per episode of the batch

    def begin(self, num_episodes: int) -> None:
        """A batch of episodes: episode k lives in worker k % num_workers (started if need be)."""
        count = min(self.num_workers, max(1, num_episodes))
        while len(self._workers) < count:
            self._workers.append(EnvWorker(self.env_cls))
        self._hosts = [self._workers[k % count] for k in range(num_episodes)]

    def call_all(self, calls: list[tuple[int, str, Any]], timeout_s: float,
                 deadline: float | None = None) -> list[tuple[str, Any]]:
        """Each (episode, "reset" | "step", sample | action) in its episode's worker, all at once; returns, per call,
        ("ok", value) or (kind, message) with kind "errors", "timeouts" or "crashes". A call's time is timeout_s
        (STARTUP_S more in a worker still starting), never past `deadline` (a time.monotonic() value)."""
        results: list[tuple[str, Any] | None] = [None] * len(calls)
        slot = {episode: i for i, (episode, _, _) in enumerate(calls)}
        ends: dict[int, float] = {}  # episode -> when its call's time is up
        for worker in dict.fromkeys(self._hosts[episode] for episode, _, _ in calls):
            own = [call for call in calls if self._hosts[call[0]] is worker]
            if worker.dead is None:
                try:
                    worker.conn.send(("calls", -1, own))  # one message a worker: 128 sends took 3x the calls
                except (BrokenPipeError, ConnectionResetError, OSError):
                    self._died(worker, own[0][1])
                except Exception as error:  # noqa: BLE001  (a sample or action that cannot be pickled)
                    for episode, _, _ in own:
                        results[slot[episode]] = ("errors", f"cannot send it to the environment's process: "
                                                            f"{error}"[:500])
                    continue
            for episode, _, _ in own:
                if worker.dead is not None:
                    results[slot[episode]] = ("crashes", worker.dead)
                else:
                    ends[episode] = self._end(worker, time.monotonic(), timeout_s, deadline)
        while ends:
            busy = {self._hosts[e].conn: self._hosts[e] for e in ends}
            for conn in wait(list(busy), timeout=max(0.0, min(ends.values()) - time.monotonic())):
                worker = busy[conn]
                try:
                    status, episode, value = conn.recv()
                except (EOFError, OSError):  # it died: every call waiting on it is lost
                    self._died(worker, next(op for e, op, _ in calls if self._hosts[e] is worker and e in ends))
                    for e in [e for e in ends if self._hosts[e] is worker]:
                        results[slot[e]] = ("crashes", worker.dead)
                        del ends[e]
                    continue
                if status == "ready":  # started: its calls' own time starts now
                    worker.ready = True
                    for e in [e for e in ends if self._hosts[e] is worker]:
                        ends[e] = self._end(worker, time.monotonic(), timeout_s, deadline)
                    continue
                if episode in ends:  # a late answer of a call already timed out is dropped
                    results[slot[episode]] = (status, value)
                    del ends[episode]
            now = time.monotonic()
            for episode in [e for e, end in ends.items() if end <= now]:
                late = deadline is not None and ends[episode] >= deadline
                op = calls[slot[episode]][1]
                results[slot[episode]] = ("timeouts", f"{op} ran past the call's deadline" if late
                                          else f"{op} ran past {timeout_s:g} s")
                self._hosts[episode].tainted = True
                del ends[episode]
        return results

    @staticmethod
    def _end(worker: EnvWorker, now: float, timeout_s: float, deadline: float | None) -> float:
        end = now + timeout_s + (0.0 if worker.ready else STARTUP_S)
        return end if deadline is None else min(end, deadline)

    @staticmethod
    def _died(worker: EnvWorker, op: str) -> None:
        worker.process.join(timeout=5.0)  # its pipe closes an instant before it is reaped
        worker.dead = f"environment worker exited with code {worker.process.exitcode} during {op}"

    def end(self) -> None:
        """The batch is over: every worker drops its environments; a tainted, dead or unclean one is killed."""
        asked = []
        for worker in self._workers:
            if worker.dead is None and not worker.tainted:
                try:
                    worker.conn.send(("end", -1, None))
                    asked.append(worker)
                except OSError:
                    pass
        until = time.monotonic() + END_S
        keep = []
        for worker in self._workers:
            clean = False
            while worker in asked and worker.conn.poll(max(0.0, until - time.monotonic())):
                try:
                    status, _, value = worker.conn.recv()
                except (EOFError, OSError):
                    break
                if status == "ready":  # a worker no call reached yet
                    worker.ready = True
                    continue
                clean = status == "ok" and value is True
                break
            if clean:
                keep.append(worker)
            else:
                worker.kill()
        self._workers, self._hosts = keep, []

    def close(self) -> None:
        for worker in self._workers:
            worker.kill()
        self._workers, self._hosts = [], []
