"""Score many completions in worker processes, with a time limit per item.

    scores, summary = score_batch("math", completions, samples, timeout_s=10.0, num_workers=2)

    with RewardPool(num_workers=8, timeout_s=10.0) as pool:      # training: one pool for the run
        scores, summary = pool.score("math", completions, samples)

Processes, not threads: sympy can run for minutes on one expression while holding the GIL, and
only a process can be stopped. Each worker scores one item at a time; an item that runs past
`timeout_s` gets its worker killed and replaced, so the items after it are still scored. An item
whose reward raises, or whose worker dies, scores 0. `summary` counts them:

    {"n": 64, "errors": 1, "timeouts": 0, "crashes": 0, "failures": 1, "first_error": "KeyError('answer')",
     "seconds": 0.4}

The first failure of a pool is logged once (a warning), not once per item. Workers start from a
forkserver, never by forking the caller, which may hold CUDA or DeepSpeed state.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
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
            conn.send(("ok", float(fn(completion, sample))))
        except Exception as e:  # noqa: BLE001  (any failure of a reward scores 0 and is reported)
            conn.send(("error", f"{type(e).__name__}: {e}"[:500]))


class _Worker:
    def __init__(self) -> None:
        self.conn, child_conn = _CONTEXT.Pipe()
        self.process = _CONTEXT.Process(target=_worker_main, args=(child_conn,), daemon=True)
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

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker()

    def _record_failure(self, summary: dict, kind: str, message: str) -> None:
        summary[kind] += 1
        if summary["first_error"] is None:
            summary["first_error"] = message
        if not self._logged_failure:
            self._logged_failure = True
            logger.warning("reward scoring failed (%s; later failures are only counted): %s", kind, message)

    def score(self, reward: Reward, completions: Sequence[str], samples: Sequence[dict]) -> tuple[list[float], dict]:
        """Scores of `completions` against `samples` with `reward` (a registry name or a picklable
        function); failed or timed-out items score 0 and are counted in the returned summary."""
        if len(completions) != len(samples):
            raise ValueError(f"{len(completions)} completions but {len(samples)} samples")
        start = time.monotonic()
        scores = [0.0] * len(completions)
        summary = {"n": len(completions), "errors": 0, "timeouts": 0, "crashes": 0, "first_error": None}
        pending = iter(range(len(completions)))
        busy: dict[Connection, _Worker] = {}

        def dispatch(worker: _Worker) -> None:
            index = next(pending, None)
            if index is None:
                return
            worker.item, worker.deadline = index, time.monotonic() + self.timeout_s
            worker.conn.send((reward, completions[index], samples[index]))
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
                    self._record_failure(summary, "timeouts", f"item {worker.item} ran past {self.timeout_s}s")
                    self._replace(worker)
            # Idle workers, replacements included, take the next items.
            for worker in self._workers:
                if worker.conn not in busy:
                    dispatch(worker)
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
