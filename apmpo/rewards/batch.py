"""Score many completions in worker processes, with a time limit per item.

    scores, summary = score_batch("math", completions, samples, timeout_s=10.0, num_workers=2)

    with RewardPool(num_workers=8, timeout_s=10.0) as pool:      # training: one pool for the run
        scores, summary = pool.score("math", completions, samples)

Processes, not threads: sympy can run for minutes on one expression while holding the GIL, and
only a process can be stopped. Each worker scores one item at a time; an item that runs past
`timeout_s` gets its worker killed and replaced, so the items after it are still scored. A worker whose item
has run for STALL_S (or a quarter of its timeout) is left to it, and an extra worker (at most MAX_STALLED at a
time) takes the next items: hung items then time out side by side, and a few hangs cost about one timeout, not one
each. A worker's address space is capped at `memory_mb` (RLIMIT_AS; apmpo.sandbox.MEMORY_MB by default): a reward
that allocates too much fails at once (MemoryError) instead of swapping the machine. An item whose reward raises,
returns something other than a finite number (NaN, inf, a string, None), or whose worker dies, scores 0; so do the
items left when a call runs past its `deadline`.
`summary` (a RewardSummary) counts them:

    RewardSummary(n=64, errors=1, timeouts=0, crashes=0, unscored=0, first_error="KeyError: 'answer'", seconds=0.4)
    summary.failures  # 1

With `max_failures`, a call stops as soon as more items than that have failed, since the caller's verdict (the
batch is broken) can no longer change: the rest score 0 and count as "unscored" failures.

The first failure of a pool is logged once (a warning), not once per item. Workers are apmpo.sandbox's: they
start from a forkserver, never by forking the caller, and without re-running the caller's `__main__`: a reward must
live in an importable module, not in the script.
"""
from __future__ import annotations

import collections
import logging
import math
import struct
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Callable, Sequence

from apmpo.cpu_threads import usable_cores
from apmpo.sandbox import MEMORY_MB, limit_memory, start_worker

logger = logging.getLogger(__name__)

Reward = str | Callable[[str, dict], float]
# Items sent to a worker ahead of its answers: the running one and one waiting. More would hold items behind a
# slow one (sympy can take seconds) that another worker, once idle, could have taken.
IN_FLIGHT = 2
# A waiting item is sent only if the pipe's buffer surely takes it at once (Linux: about 200 KiB): this process
# must never block on a send to a worker stuck on its running item. Larger items wait for an idle worker.
MAX_QUEUED_BYTES = 64 * 1024
# A worker whose item has run this long (or a quarter of the item timeout, if less; its start-up not counted) takes no
# more items, and an extra worker is started for them; extra workers beyond `num_workers` are at most MAX_STALLED,
# and go when a call ends.
STALL_S = 1.0
MAX_STALLED = 16
# A new worker's start-up and first imports may take this long beyond its first item's timeout (the forkserver's
# own start imports the verifiers: 3 s on a busy machine); its item's clock starts once it is ready.
STARTUP_S = 30.0


@dataclass(frozen=True)
class RewardSummary:
    """What scoring a batch came to: how many items scored 0 because their reward failed, and why."""
    n: int  # items
    errors: int = 0  # the reward raised, or returned no finite number
    timeouts: int = 0  # ran past the item's timeout or the call's deadline, or never started before it
    crashes: int = 0  # the worker died on it (segfault, os._exit, out of memory)
    unscored: int = 0  # left once more than max_failures had failed
    first_error: str | None = None  # the message of the first failure
    seconds: float = 0.0  # the whole call

    @property
    def failures(self) -> int:
        return self.errors + self.timeouts + self.crashes + self.unscored


def _worker_main(conn: Connection, memory_mb: int) -> None:
    limit_memory(memory_mb)
    from apmpo.rewards.registry import get_reward  # noqa: PLC0415  (in the worker, after fork)

    resolved: dict = {}
    ready = False
    while True:
        try:
            task = conn.recv()  # unpickling a reward function imports its module
        except EOFError:
            return
        reward, completion, sample = task
        try:
            fn = resolved.get(reward) if isinstance(reward, str) else reward
            if fn is None:
                fn = resolved[reward] = get_reward(reward)
            if not ready:  # its start-up and imports (seconds on a busy machine) are not its first item's time
                conn.send(("ready", None))
                ready = True
            conn.send(("ok", as_score(fn(completion, sample))))
        except Exception as e:  # noqa: BLE001  (any failure of a reward scores 0 and is reported)
            conn.send(("error", f"{type(e).__name__}: {e}"[:500]))


def as_score(value, what: str = "the reward returned") -> float:
    """A reward's value as a score: the one rule for every reward, a reward function's and an environment's. NaN
    or inf would make the batch's mean, the advantages and the loss NaN (training then silently stops learning),
    and a string or None is a bug of the reward: all are failures (TypeError, ValueError). The check is of the
    value as trained on, float32: 1e300 is finite as a Python float and inf as a float32."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"{what} {type(value).__name__} {value!r:.50}, not a number")
    score = float(value)
    try:
        stored = struct.unpack("f", struct.pack("f", score))[0]  # packing raises OverflowError past float32's range
    except OverflowError:
        stored = math.inf
    if not math.isfinite(stored):
        raise ValueError(f"{what} {score}, not a finite float32 number")
    return score


class _Worker:
    def __init__(self, memory_mb: int) -> None:
        self.conn, self.process = start_worker(_worker_main, memory_mb)
        self.items: list[int] = []  # sent, not yet answered; the first is running, the rest wait in the pipe
        self.ready = False  # started up: it said so
        self.started = 0.0  # when the running item started
        self.deadline = 0.0  # of the running item

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class RewardPool:
    """`num_workers` scoring processes, kept alive across calls to `score`."""

    def __init__(self, num_workers: int | None = None, timeout_s: float = 10.0, memory_mb: int | None = None) -> None:
        self.num_workers = num_workers or usable_cores()
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb or MEMORY_MB
        self.stall_s = min(STALL_S, timeout_s / 4)
        self._workers = [_Worker(self.memory_mb) for _ in range(self.num_workers)]
        self._logged_failure = False

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        index = self._workers.index(worker)
        self._workers[index] = _Worker(self.memory_mb)
        return self._workers[index]

    def _record_failure(self, counts: dict, kind: str, message: str, count: int = 1) -> None:
        counts[kind] += count
        if counts["first_error"] is None:
            counts["first_error"] = message
        if not self._logged_failure:
            self._logged_failure = True
            logger.warning("reward scoring failed (%s; later failures are only counted): %s", kind, message)

    def score(self, reward: Reward, completions: Sequence[str], samples: Sequence[dict],
              deadline: float | None = None, max_failures: int | None = None) -> tuple[list[float], RewardSummary]:
        """Scores of `completions` against `samples` with `reward` (a registry name or a picklable
        function); failed or timed-out items score 0 and are counted in the returned RewardSummary. At `deadline`
        (a time.monotonic() value), items still running are stopped and those not started are not: all of
        them score 0 and count as timeouts. Once more than `max_failures` items failed, the call stops: the
        items not yet scored score 0 and count as "unscored" failures."""
        if len(completions) != len(samples):
            raise ValueError(f"{len(completions)} completions but {len(samples)} samples")
        if callable(reward) and getattr(reward, "__module__", None) == "__main__":
            raise ValueError(f"reward {reward.__name__} is defined in the script being run (__main__); workers "
                             "do not re-run the script: define it in a module and import it from there")
        start = time.monotonic()
        scores = [0.0] * len(completions)
        counts = {"errors": 0, "timeouts": 0, "crashes": 0, "first_error": None}  # the summary's, as they come
        unscored = 0
        pending = collections.deque(range(len(completions)))
        busy: dict[Connection, _Worker] = {}
        encoded: dict[int, bytes] = {}  # pickled items that waited for an idle worker

        def item_deadline(worker: _Worker) -> float:  # of the item `worker` starts now
            own = time.monotonic() + self.timeout_s + (0.0 if worker.ready else STARTUP_S)
            return own if deadline is None else min(own, deadline)

        def failed() -> bool:
            failures = counts["errors"] + counts["timeouts"] + counts["crashes"]
            return max_failures is not None and failures > max_failures

        def stalled(worker: _Worker, now: float) -> bool:
            return worker.ready and bool(worker.items) and now - worker.started >= self.stall_s

        def dispatch(worker: _Worker) -> None:
            """One more item into `worker`'s pipe. A busy worker reads its next item while this process collects the
            last answer: with one item in flight it waited a round trip per item (128 cheap items: 27 -> 8 ms)."""
            if not pending or (deadline is not None and time.monotonic() >= deadline) or failed():
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
                worker.started, worker.deadline = time.monotonic(), item_deadline(worker)
            worker.items.append(index)
            busy[worker.conn] = worker

        def requeue(worker: _Worker) -> None:
            """`worker` is being replaced: the items queued behind its current one never started."""
            pending.extendleft(reversed(worker.items[1:]))
            worker.items.clear()

        def fill() -> None:
            """Workers with room, replacements included, take the next items, round robin: every worker gets an
            item before any gets a second. Stalled workers take none; while items wait, extra workers stand in for
            them (up to MAX_STALLED), so that a hung item holds up no other."""
            now = time.monotonic()
            num_stalled = sum(stalled(w, now) for w in self._workers)
            while (pending and not failed() and len(self._workers) - num_stalled < self.num_workers
                   and len(self._workers) < self.num_workers + MAX_STALLED):
                self._workers.append(_Worker(self.memory_mb))
            for depth in range(IN_FLIGHT):
                for worker in list(self._workers):
                    if len(worker.items) == depth and not stalled(worker, now):
                        dispatch(worker)

        fill()
        while busy:
            now = time.monotonic()
            stall_checks = [w.started + self.stall_s for w in busy.values()
                            if pending and w.ready and not stalled(w, now)]
            wake = min([w.deadline for w in busy.values()] + stall_checks)
            for conn in wait(list(busy), timeout=max(0.0, wake - now)):
                worker = busy[conn]
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):  # the worker died: segfault, os._exit, out of memory
                    del busy[conn]
                    worker.process.join(timeout=5.0)  # its pipe closes an instant before it is reaped
                    self._record_failure(counts, "crashes", f"worker exited with code {worker.process.exitcode}")
                    requeue(worker)
                    self._replace(worker)
                    continue
                if status == "ready":  # its start-up and imports do not count against its first item
                    worker.ready, worker.started = True, time.monotonic()
                    worker.deadline = item_deadline(worker)
                    continue
                index = worker.items.pop(0)
                if status == "ok":
                    scores[index] = value
                else:
                    self._record_failure(counts, "errors", value)
                if worker.items:
                    worker.started, worker.deadline = time.monotonic(), item_deadline(worker)  # the next one starts
                else:
                    del busy[conn]
            now = time.monotonic()
            for conn, worker in sorted(busy.items(), key=lambda item: item[1].items[0]):  # first items first
                if worker.deadline <= now:
                    del busy[conn]
                    late = deadline is not None and worker.deadline == deadline
                    index = worker.items[0]
                    self._record_failure(counts, "timeouts", f"item {index} ran past the call's deadline"
                                         if late else f"item {index} ran past {self.timeout_s}s")
                    requeue(worker)
                    self._replace(worker)
            if failed():  # the caller's verdict is in: stop the items still running
                for conn, worker in list(busy.items()):
                    del busy[conn]
                    unscored += len(worker.items)
                    worker.items.clear()
                    self._replace(worker)
            fill()
        unstarted = len(pending)  # left at the deadline, or after enough failures
        if unstarted and failed():
            unscored += unstarted
        elif unstarted:
            self._record_failure(counts, "timeouts", f"{unstarted} item(s) not started by the call's deadline",
                                 unstarted)
        for extra in self._workers[self.num_workers:]:  # all idle now
            extra.kill()
        del self._workers[self.num_workers:]
        return scores, RewardSummary(len(completions), **counts, unscored=unscored,
                                     seconds=round(time.monotonic() - start, 3))

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
) -> tuple[list[float], RewardSummary]:
    """One-off `RewardPool(num_workers, timeout_s).score(reward, completions, samples)`."""
    num_workers = min(num_workers or usable_cores(), max(1, len(completions)))
    with RewardPool(num_workers, timeout_s) as pool:
        return pool.score(reward, completions, samples)
