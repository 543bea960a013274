"""Environments in worker processes (apmpo/envs/workers.py): every environment that stopped, hung or leaked into
the learner when environments were threads of rank 0, now bounded in processes of their own. No server: the calls
are the ones EpisodeRunner makes, with the hostile environments of tests/flaky_envs.py. One pool of workers is
made per test (a fork each, milliseconds)."""
from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from apmpo.envs.calculator import CalculatorEnv
from apmpo.envs.reveal import RevealEnv
from apmpo.envs.workers import EnvWorkers

SAMPLE = {"answer": "123", "question": "What is 120 + 3?"}


@pytest.fixture(autouse=True)
def flaky_envs_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # workers import flaky_envs by name


def hostile(name: str) -> type:
    import flaky_envs

    return getattr(flaky_envs, name)


def start(env_cls: type, episodes: int, workers: int = 2, samples: list[dict] | None = None) -> EnvWorkers:
    samples = samples or [SAMPLE] * episodes
    pool = EnvWorkers(env_cls, workers)
    pool.begin(episodes)
    results = pool.call_all([(k, "reset", s) for k, s in enumerate(samples)], 30.0)
    assert [status for status, _ in results] == ["ok"] * episodes, results
    return pool


def test_a_step_that_holds_the_interpreter_lock_times_out_and_its_worker_goes():
    """4 episodes in 2 workers; episode 0's step never gives the lock back. The call is bounded; the episode that
    shares its worker (2) is stalled with it; the other worker's (1, 3) answer."""
    pool = start(hostile("HoldsTheLock"), 4)
    worker = pool._hosts[0]
    tick = time.monotonic()
    results = pool.call_all([(0, "step", "1"), (1, "step", "1"), (3, "step", "1")], 2.0)
    assert time.monotonic() - tick < 10
    assert results[0] == ("timeouts", "step ran past 2 s")
    assert results[1][0] == results[2][0] == "timeouts"  # the same code in every episode: all hold the lock
    pool.end()
    assert not worker.process.is_alive()  # killed at the batch's end, with its stuck thread
    pool.close()


def test_the_calculators_final_answer_that_hung_the_learner_is_bounded():
    """\\boxed{9^{9^{9^{9}}}} kept sympy inside the interpreter lock: the learner was still stuck at 201 s."""
    pool = start(CalculatorEnv, 2)
    tick = time.monotonic()
    results = pool.call_all([(0, "step", "\\boxed{9^{9^{9^{9}}}}"), (1, "step", "\\boxed{123}")], 2.0)
    assert results[0] == ("timeouts", "step ran past 2 s")
    assert results[1] == ("ok", ("", 1.0, True))  # the other worker's episode scored as usual
    assert time.monotonic() - tick < 10
    pool.end()
    pool.close()


def test_an_environment_that_exits_is_a_named_crash_and_the_next_batch_gets_a_new_worker():
    pool = start(hostile("Exits"), 1, workers=1)
    dead = pool._hosts[0]
    assert pool.call_all([(0, "step", "1")], 5.0) == [("crashes", "environment worker exited with code 1 during step")]
    pool.end()
    pool.begin(1)
    assert pool._hosts[0] is not dead
    assert pool.call_all([(0, "reset", SAMPLE)], 30.0) == [("ok", "start")]
    pool.close()


def test_blocked_steps_cost_only_their_episode_and_leave_nothing_after_the_batch():
    """The probe's environment: a step that blocks on a pipe it opened. Its call times out alone (the worker's
    other calls run in threads of their own), and at the batch's end its worker goes, pipe and thread with it."""
    pool = start(hostile("BlocksAndLeaks"), 2, workers=1, samples=[{"answer": "012"}, SAMPLE])  # "0...": blocks
    worker = pool._hosts[0]
    results = pool.call_all([(0, "step", "1"), (1, "step", "1")], 1.0)
    assert results == [("timeouts", "step ran past 1 s"), ("ok", ("123", None, False))]
    pool.end()
    assert not worker.process.is_alive()
    assert pool._workers == []
    pool.close()


def test_a_worker_left_with_a_thread_after_its_batch_is_replaced():
    pool = start(hostile("LeavesAThread"), 1, workers=1)
    worker = pool._hosts[0]
    pool.end()
    assert not worker.process.is_alive()
    pool.close()


def test_a_clean_worker_is_kept_for_the_next_batch_and_nothing_outlives_close():
    pool = start(RevealEnv, 3, workers=2)
    assert pool.call_all([(k, "step", "1") for k in range(3)], 5.0) == [("ok", ("123", None, False))] * 3
    first = list(pool._workers)
    pool.end()
    pool.begin(3)
    assert pool._workers == first  # its environments dropped, its imports kept
    pool.close()
    assert multiprocessing.active_children() == []


def test_an_unpicklable_answer_is_its_episodes_error():
    pool = start(hostile("Unpicklable"), 1, workers=1)
    status, message = pool.call_all([(0, "step", "1")], 5.0)[0]
    assert status == "errors" and "cannot leave its process" in message
    pool.close()
