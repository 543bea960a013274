"""Score many completions in worker processes, with a time limit per item.

    scores, summary = score_batch("math", completions, samples, timeout_s=10.0, num_workers=2)

    with RewardPool(num_workers=8, timeout_s=10.0) as pool:      # training: one pool for the run
        scores, summary = pool.score("math", completions, samples)

Processes, not threads: sympy can run for minutes on one expression while holding the GIL, and
only a process can be stopped. Each worker scores one item at a time; an item that runs past
`timeout_s` gets its worker killed and replaced, so the items after it are still scored. An item
whose reward raises, returns something other than a finite number (NaN, inf, a string, None), or whose
worker dies, scores 0; so do the items left when a call runs past its `deadline`. `summary` counts them:

    {"n": 64, "errors": 1, "timeouts": 0, "crashes": 0, "failures": 1, "first_error": "KeyError('answer')",
     "seconds": 0.4}

The first failure of a pool is logged once (a warning), not once per item. Workers start from a
forkserver, never by forking the caller, which may hold CUDA or DeepSpeed state, and without re-running
the caller's `__main__` (see `_Worker`): a reward must live in an importable module, not in the script.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import math
import multiprocessing as mp
import os
import struct
import sys
import time
import types
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Sequence

logger = logging.getLogger(__name__)

Reward = str | Callable[[str, dict], float]
_CONTEXT = mp.get_context("forkserver")
# Workers fork from a server that has already imported the verifiers (sympy takes ~1 s to import).
_CONTEXT.set_forkserver_preload(["apmpo.rewards"])
# Items sent to a worker ahead of its answers: the running one and one waiting. More would hold items behind a
# slow one (sympy can take seconds) that another worker, once idle, could have taken.
IN_FLIGHT = 2
# A waiting item is sent only if the pipe's buffer surely takes it at once (Linux: about 200 KiB): this process
# must never block on a send to a worker stuck on its running item. Larger items wait for an idle worker.
MAX_QUEUED_BYTES = 64 * 1024


def _worker_main(conn: Connection) -> None:
    from apmpo.rewards import get_reward  # noqa: PLC0415  (in the worker, after fork)

    resolved: dict = {}
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        reward, completion, sample = task
        try:
            fn = resolved.get(reward) if isinstance(reward, str) else reward
            if fn is None:
                fn = resolved[reward] = get_reward(reward)
            conn.send(("ok", _as_score(fn(completion, sample))))
        except Exception as e:  # noqa: BLE001  (any failure of a reward scores 0 and is reported)
            conn.send(("error", f"{type(e).__name__}: {e}"[:500]))


def _as_score(value) -> float:
    """A reward's value as a score. NaN or inf would make the batch's mean, the advantages and the loss NaN
    (training then silently stops learning), and a string or None is a bug of the reward: all are failures. The
    check is of the value as stored, float32: 1e300 is finite as a Python float and inf as a float32."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"the reward returned {type(value).__name__} {value!r:.50}, not a number")
    score = float(value)
    try:
        stored = struct.unpack("f", struct.pack("f", score))[0]  # packing raises OverflowError past float32's range
    except OverflowError:
        stored = math.inf
    if not math.isfinite(stored):
        raise ValueError(f"the reward returned {score}, not a finite float32 number")
    return score


@contextlib.contextmanager
def _main_module_hidden():
    """A forkserver child re-runs the caller's `__main__` script before it runs its target (multiprocessing's
    spawn.prepare). For launch/train.py that imports torch, DeepSpeed and transformers: ~4 s per worker on 2
    busy cores, so each crashed worker cost its replacement most of a 5 s item timeout, and every worker held
    torch in memory. With no `__main__` file to name, the child skips it."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class _Worker:
    def __init__(self) -> None:
        self.conn, child_conn = _CONTEXT.Pipe()
        self.process = _CONTEXT.Process(target=_worker_main, args=(child_conn,), daemon=True)
        with _main_module_hidden():
            self.process.start()
        child_conn.close()
        self.items: list[int] = []  # sent, not yet answered; the first is running, the rest wait in the pipe
        self.deadline = 0.0  # of the running item

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class RewardPool:
    """`num_workers` scoring processes, kept alive across calls to `score`."""

    def __init__(self, num_workers: int | None = None, timeout_s: float = 10.0) -> None:
        self.num_workers = num_workers or os.cpu_count() or 1
        self.timeout_s = timeout_s
        self._workers = [_Worker() for _ in range(self.num_workers)]
        self._logged_failure = False

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        index = self._workers.index(worker)
        self._workers[index] = _Worker()
        return self._workers[index]

    def _record_failure(self, summary: dict, kind: str, message: str, count: int = 1) -> None:
        summary[kind] += count
        if summary["first_error"] is None:
            summary["first_error"] = message
        if not self._logged_failure:
            self._logged_failure = True
            logger.warning("reward scoring failed (%s; later failures are only counted): %s", kind, message)

    def score(self, reward: Reward, completions: Sequence[str], samples: Sequence[dict],
              deadline: float | None = None) -> tuple[list[float], dict]:
        """Scores of `completions` against `samples` with `reward` (a registry name or a picklable
        function); failed or timed-out items score 0 and are counted in the returned summary. At `deadline`
        (a time.monotonic() value), items still running are stopped and those not started are not: all of
        them score 0 and count as timeouts."""
        if len(completions) != len(samples):
            raise ValueError(f"{len(completions)} completions but {len(samples)} samples")
        if callable(reward) and getattr(reward, "__module__", None) == "__main__":
            raise ValueError(f"reward {reward.__name__} is defined in the script being run (__main__); workers "
                             "do not re-run the script: define it in a module and import it from there")
        start = time.monotonic()
        scores = [0.0] * len(completions)
        summary = {"n": len(completions), "errors": 0, "timeouts": 0, "crashes": 0, "first_error": None}
        pending = collections.deque(range(len(completions)))
        busy: dict[Connection, _Worker] = {}
        encoded: dict[int, bytes] = {}  # pickled items that waited for an idle worker

        def item_deadline() -> float:  # of the item a worker starts now
            own = time.monotonic() + self.timeout_s
            return own if deadline is None else min(own, deadline)

        def dispatch(worker: _Worker) -> None:
            """One more item into `worker`'s pipe. A busy worker reads its next item while this process collects the
            last answer: with one item in flight it waited a round trip per item (128 cheap items: 27 -> 8 ms)."""
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                return
            index = pending[0]
            task = encoded.pop(index, None) or ForkingPickler.dumps((reward, completions[index], samples[index]))
            if worker.items and len(task) > MAX_QUEUED_BYTES:  # behind a hung item it could block this process
                encoded[index] = task
                return
            pending.popleft()
            try:
                worker.conn.send_bytes(task)
            except (BrokenPipeError, ConnectionResetError):
                if worker.items:  # it died on its current item: its answer's EOF reports the crash
                    pending.appendleft(index)
                    encoded[index] = task
                    return
                worker = self._replace(worker)  # it died while idle (OOM killer): not this item's fault
                worker.conn.send_bytes(task)
            if not worker.items:
                worker.deadline = item_deadline()
            worker.items.append(index)
            busy[worker.conn] = worker

        def requeue(worker: _Worker) -> None:
            """`worker` is being replaced: the items queued behind its current one never started."""
            pending.extendleft(reversed(worker.items[1:]))
            worker.items.clear()

        def fill() -> None:
            """Workers with room, replacements included, take the next items, round robin: every worker gets an
            item before any gets a second."""
            for depth in range(IN_FLIGHT):
                for worker in list(self._workers):
                    if len(worker.items) == depth:
                        dispatch(worker)

        fill()
        while busy:
            next_deadline = min(w.deadline for w in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, next_deadline - time.monotonic())):
                worker = busy[conn]
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):  # the worker died: segfault, os._exit, out of memory
                    del busy[conn]
                    worker.process.join(timeout=5.0)  # its pipe closes an instant before it is reaped
                    self._record_failure(summary, "crashes", f"worker exited with code {worker.process.exitcode}")
                    requeue(worker)
                    self._replace(worker)
                    continue
                index = worker.items.pop(0)
                if status == "ok":
                    scores[index] = value
                else:
                    self._record_failure(summary, "errors", value)
                if worker.items:
                    worker.deadline = item_deadline()  # the next queued item starts now
                else:
                    del busy[conn]
            now = time.monotonic()
            for conn, worker in sorted(busy.items(), key=lambda item: item[1].items[0]):  # first items first
                if worker.deadline <= now:
                    del busy[conn]
                    late = deadline is not None and worker.deadline == deadline
                    index = worker.items[0]
                    self._record_failure(summary, "timeouts", f"item {index} ran past the call's deadline"
                                         if late else f"item {index} ran past {self.timeout_s}s")
                    requeue(worker)
                    self._replace(worker)
            fill()
        unstarted = len(pending)  # left at the deadline
        if unstarted:
            self._record_failure(summary, "timeouts", f"{unstarted} item(s) not started by the call's deadline",
                                 unstarted)
        summary["failures"] = summary["errors"] + summary["timeouts"] + summary["crashes"]
        summary["seconds"] = round(time.monotonic() - start, 3)
        return scores, summary

    def close(self) -> None:
        for worker in self._workers:
            worker.kill()
        self._workers = []

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def score_batch(
    reward: Reward,
    completions: Sequence[str],
    samples: Sequence[dict],
    timeout_s: float = 10.0,
    num_workers: int | None = None,
) -> tuple[list[float], dict]:
    """One-off `RewardPool(num_workers, timeout_s).score(reward, completions, samples)`."""
    num_workers = min(num_workers or os.cpu_count() or 1, max(1, len(completions)))
    with RewardPool(num_workers, timeout_s) as pool:
        return pool.score(reward, completions, samples)
