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

import contextlib
import logging
import math
import multiprocessing as mp
import os
import sys
import time
import types
from multiprocessing.connection import Connection, wait
from typing import Callable, Sequence

logger = logging.getLogger(__name__)

Reward = str | Callable[[str, dict], float]
_CONTEXT = mp.get_context("forkserver")
# Workers fork from a server that has already imported the verifiers (sympy takes ~1 s to import).
_CONTEXT.set_forkserver_preload(["apmpo.rewards"])


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
    (training then silently stops learning), and a string or None is a bug of the reward: all are failures."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"the reward returned {type(value).__name__} {value!r:.50}, not a number")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"the reward returned {score}, not a finite number")
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
        self.item: int | None = None
        self.deadline = 0.0

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
        pending = iter(range(len(completions)))
        busy: dict[Connection, _Worker] = {}

        def dispatch(worker: _Worker) -> None:
            index = next(pending, None) if deadline is None or time.monotonic() < deadline else None
            if index is None:
                return
            try:
                worker.conn.send((reward, completions[index], samples[index]))
            except (BrokenPipeError, ConnectionResetError):  # it died while idle (OOM killer): not this item's fault
                worker = self._replace(worker)
                worker.conn.send((reward, completions[index], samples[index]))
            worker.item, worker.deadline = index, time.monotonic() + self.timeout_s
            if deadline is not None:
                worker.deadline = min(worker.deadline, deadline)
            busy[worker.conn] = worker

        for worker in list(self._workers):
            dispatch(worker)
        while busy:
            next_deadline = min(w.deadline for w in busy.values())
            for conn in wait(list(busy), timeout=max(0.0, next_deadline - time.monotonic())):
                worker = busy.pop(conn)
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):  # the worker died: segfault, os._exit, out of memory
                    worker.process.join(timeout=5.0)  # its pipe closes an instant before it is reaped
                    self._record_failure(summary, "crashes", f"worker exited with code {worker.process.exitcode}")
                    self._replace(worker)
                    continue
                if status == "ok":
                    scores[worker.item] = value
                else:
                    self._record_failure(summary, "errors", value)
            now = time.monotonic()
            for conn, worker in list(busy.items()):
                if worker.deadline <= now:
                    del busy[conn]
                    late = deadline is not None and worker.deadline == deadline
                    self._record_failure(summary, "timeouts", f"item {worker.item} ran past the call's deadline"
                                         if late else f"item {worker.item} ran past {self.timeout_s}s")
                    self._replace(worker)
            # Idle workers, replacements included, take the next items.
            for worker in self._workers:
                if worker.conn not in busy:
                    dispatch(worker)
        unstarted = sum(1 for _ in pending)  # left at the deadline
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
