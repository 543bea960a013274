"""Environments in worker processes: `num_workers` processes hold a batch's environment objects, episode k at first
in worker k % num_workers, and run every reset and step call there, one call at a time in each worker.

    workers = EnvWorkers(CalculatorEnv, num_workers=4, max_chars=100_000)
    workers.begin(num_episodes)
    results = workers.call_all([(k, "reset", sample), ...], timeout_s=10.0)  # ("ok", answer) | (kind, message)
    workers.end()      # the batch is over: its environments go, with every process they started

Why processes (issue 42): as threads of the learner's rank 0, an environment that held the interpreter lock
(sympy on `\\boxed{9^{9^{9^{9}}}}`, a regex over 140k characters) could not be bounded: the join waited for ever.
One that called os._exit took the learner down, and each timed-out thread stayed behind with what it had opened.
Not one process per episode: a batch of the quickstart's multi-turn config plays 128 episodes, its validation 360,
and that many processes put the 24 GiB machine out of memory (the OOM killer took the learner).

Only the guilty episode fails (issue 55). A worker runs one call at a time (its calls of a turn come in one message,
and it answers each as it is done: a round trip per call made a turn three times as long), so the call it is running
when its time is up, or when it dies, is known: that episode alone fails ("timeouts": past `timeout_s`; "crashes": os._exit, a
segfault). The worker is killed at once, and the episodes it held move to another worker: their environment is
rebuilt there by replaying its reset and steps so far (each replayed call within `timeout_s`), and must give the
same answers as it first did, else the episode fails ("errors": it does not replay). An environment must be
deterministic given its sample and actions for that (the built-ins are); a move happens only when a neighbour fails
or stalls. When a
call has run STALL_S (or a quarter of `timeout_s`), the calls queued behind it move the same way (to an idle
worker, or to one of at most MAX_STALLED extra workers), so that hangs time out side by side, not one after the
other. A call that raises is its episode's "errors" failure, and the worker goes on.

What crosses the pipe is checked in the worker before it is sent (`answer`): reset's first prompt as chat messages,
step's (message or None when done, reward or None, done), in plain types, and at most `max_chars` characters of
messages (EpisodeRunner derives it from the tokenizer: more characters than the episode's token limit can hold with
the vocabulary's longest token could never fit). Anything else is its episode's "errors" failure: a 100 MB
observation never reaches the learner, which tokenised and rendered it whole. The learner reads answers as plain data
only (`_PlainData`): an answer it cannot read is its episode's error, naming the environment.

A worker's address space is capped at `memory_mb` (RLIMIT_AS, as reward workers are): a call that allocates past it
fails with MemoryError, its episode's "errors" failure, and the worker is replaced as after a crash; the OOM killer,
which may pick the learner, is not reached.

No process an environment starts outlives its batch: each worker is a child subreaper in a session of its own, so
every process started under it (a setsid child, a double-forked daemon) stays in its tree; `kill_tree` stops the
whole tree, then kills it. At a batch's end a worker kills its own descendants (environments may keep a process
from step to step, not from batch to batch), and one left with more threads or open files than it started with is
killed; a worker killed for a failure goes with its tree. When the learner is gone, even by SIGKILL, the workers
and everything under them go too: the forkserver they fork from follows the learner and, as a subreaper, holds
the processes of workers that died by themselves (os._exit) until then (apmpo/forkserver.py); those still in
such a worker's process group are killed at once.
The next batch starts new workers where needed (milliseconds: they fork from apmpo.sandbox's forkserver, which
reward workers share).
"""
from __future__ import annotations

import collections
import io
import itertools
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from apmpo.rewards.batch import as_score
from apmpo.sandbox import MEMORY_MB, PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, kill_tree, limit_memory, start_worker

STARTUP_S = 30.0  # a new worker's start and its import of the environment's module, beyond its first call's time
END_S = 2.0  # for a worker to drop its environments, end their processes and say whether it is clean
# A call running this long (or a quarter of the call's time, if less) has the calls queued behind it moved to other
# workers, extra ones included: at most MAX_STALLED beyond num_workers, for the length of a call_all.
STALL_S = 1.0
MAX_STALLED = 16


def _open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


def _end_descendants() -> None:
    """In a worker: kill every process its environments started, and reap them (they are its children, or
    orphans handed to it as the subreaper)."""
    try:
        os.waitpid(-1, os.WNOHANG)  # ChildProcessError: no child at all (the usual case: no walk of /proc)
        kill_tree(os.getpid(), with_root=False)
        while True:
            os.waitpid(-1, 0)
    except ChildProcessError:  # none left
        pass


def answer(op: str, value: Any, max_chars: int) -> Any:
    """What crosses the pipe for a reset or step's `value`: reset's first prompt as a list of chat messages, step's
    (message, or None when done; reward or None; done), as plain data; TypeError or ValueError when it is none of
    these or its messages hold more than `max_chars` characters."""
    if op == "reset":
        messages = [_as_message(m) for m in value] if isinstance(value, (list, tuple)) and value else \
            [_as_message(value)]
    else:
        observation, reward, done = check_step(value)
        messages = [] if done else [_as_message(observation)]
    messages, chars = _plain(messages)
    if chars > max_chars:
        raise ValueError(f"{'its first prompt' if op == 'reset' else 'the observation'} has {chars:,} characters, "
                         f"more than the {max_chars:,} that could fit in the episode's tokens")
    return messages if op == "reset" else (messages[0] if messages else None, reward, done)


def _as_message(observation: Any) -> dict:
    if isinstance(observation, str):
        return {"role": "user", "content": observation}
    if isinstance(observation, dict) and isinstance(observation.get("role"), str) \
            and isinstance(observation.get("content"), str):
        return observation
    raise TypeError(f"an observation must be a str or a {{'role': str, 'content': str}} message, got "
                    f"{type(observation).__name__} {observation!r:.60}")


def _plain(value: Any) -> tuple[Any, int]:
    """`value` as plain data (str, numbers, None, and lists and str-keyed dicts of them; a subclass becomes its
    base type), and its size in characters (of its strings and keys; any other item, or an empty one, counts one).
    TypeError for anything else."""
    if isinstance(value, str):
        return str.__str__(value), max(1, len(value))  # an exact str, even of a subclass
    if value is None or isinstance(value, (bool, float)):
        return value if value is None or isinstance(value, bool) else float(value), 1
    if isinstance(value, int):
        return int(value), 1 + value.bit_length() // 8
    if isinstance(value, (list, tuple)):
        items = [_plain(item) for item in value]
        return [item for item, _ in items], max(1, sum(size for _, size in items))
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        items = {str.__str__(key): _plain(item) for key, item in value.items()}
        return {key: item for key, (item, _) in items.items()}, max(1, sum(len(k) + n for k, (_, n) in items.items()))
    raise TypeError(f"{type(value).__name__} {value!r:.40} is not plain data (str, numbers, lists, dicts)")


def check_step(value: Any) -> tuple[Any, float | None, bool]:
    """step's (observation, reward or None, done), checked: a finite number or None, and a bool."""
    if not (isinstance(value, tuple) and len(value) == 3):
        raise TypeError(f"step must return (observation, reward or None, done), got {type(value).__name__} "
                        f"{value!r:.60}")
    observation, reward, done = value
    if not isinstance(done, bool):
        raise TypeError(f"step's done must be a bool, got {type(done).__name__} {done!r:.30}")
    if reward is not None:  # the rule of every reward (apmpo.rewards.batch.as_score): 1e300 is inf in float32
        reward = as_score(reward, "step's reward must be a number or None, got")
    return observation, reward, done


def _worker_main(conn: Connection, env_cls: type, max_chars: int, memory_mb: int) -> None:
    import ctypes  # noqa: PLC0415

    # Its own session: a terminal's Ctrl-C or hang-up reaches the learner, which ends the workers in order.
    os.setsid()
    libc = ctypes.CDLL("libc.so.6")
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlive the learner (its forkserver)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of its descendants (daemons) become its children
    limit_memory(memory_mb)
    envs: dict[int, Any] = {}
    threads, files = threading.active_count(), _open_files()
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the learner is gone
            _end_descendants()
            return
        if message == "end":
            envs.clear()  # no gc.collect(): 50-100 ms of this heap per batch; an environment's cycles go later
            _end_descendants()
            clean = threading.active_count() <= threads and _open_files() <= files
            conn.send(("end", clean))
            if not clean:
                return
            continue
        for data in message:  # calls, each pickled alone: one that cannot be read is its own failure
            episode = None
            try:
                episode, op, arg = pickle.loads(data)
                if op == "reset":
                    envs[episode] = env_cls()
                reply = ("ok", answer(op, getattr(envs[episode], op)(arg), max_chars))
            except MemoryError as error:
                reply = ("memory", f"MemoryError: past its worker's {memory_mb} MiB of address space "
                                   f"(rollout.env_memory_mb) {error}".strip())
            except BaseException as error:  # noqa: BLE001  (sys.exit() in a step too: the episode's failure)
                envs.pop(episode, None)  # an episode ends with its first failure
                reply = ("errors", f"{type(error).__name__}: {error}"[:500])
            conn.send(reply)


def _read(conn: Connection) -> Any:
    return _PlainData(io.BytesIO(conn.recv_bytes())).load()


class _PlainData(pickle.Unpickler):
    """Reads a worker's answer as plain data (str, numbers, tuples, lists, dicts), never as an object of a class:
    nothing of the environment's runs in the learner, and nothing grows past the bytes that crossed."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


@dataclass(eq=False)
class _Call:
    episode: int
    op: str  # "reset" | "step"
    arg: Any
    slot: int | None  # in call_all's results; None: a call replayed to rebuild the episode's environment
    expect: Any = None  # a replayed call's answer when it was first played
    stale: bool = False  # sent, then its episode moved or failed: its answer is dropped, its failure no one's

    def what(self) -> str:
        return self.op if self.slot is not None else f"{self.op} (replayed on a new worker)"


class EnvWorker:
    def __init__(self, env_cls: type, max_chars: int, memory_mb: int) -> None:
        self.conn, self.process = start_worker(_worker_main, env_cls, max_chars, memory_mb, name="apmpo-env")
        self.born = time.monotonic()
        self.ready = False
        self.dead = False
        self.queue: collections.deque[_Call] = collections.deque()  # to send, once all it was sent is answered
        self.sent: collections.deque[_Call] = collections.deque()  # sent, unanswered: the first runs
        self.started = 0.0  # when the first of `sent` started

    def load(self) -> int:
        return len(self.queue) + len(self.sent)

    def kill(self) -> None:
        self.dead = True
        if self.process.is_alive():
            kill_tree(self.process.pid)
        try:  # if it died by itself, its descendants left its tree; those of its process group are still found
            os.killpg(self.process.pid, signal.SIGKILL)
        except OSError:  # none left
            pass
        self.process.join()
        self.conn.close()


class EnvWorkers:
    """The worker processes of one environment class, kept from batch to batch while they stay clean."""

    def __init__(self, env_cls: type, num_workers: int, max_chars: int, memory_mb: int | None = None) -> None:
        self.env_cls, self.num_workers, self.max_chars = env_cls, num_workers, max_chars
        self.memory_mb = memory_mb or MEMORY_MB
        self.name = f"{env_cls.__module__}:{env_cls.__qualname__}"
        self._workers: list[EnvWorker] = []
        self._hosts: dict[int, EnvWorker | None] = {}  # per episode of the batch; None: to rebuild at its next call
        self._history: dict[int, list[_Call]] = {}  # per episode: its calls answered "ok", as replays
        self._lost: dict[int, str] = {}  # episodes whose worker died between calls: why
        self._results: list[tuple[str, Any] | None] = []
        self._left = 0  # results still to come
        self._stall_s = STALL_S

    def _start(self) -> EnvWorker:
        self._workers.append(EnvWorker(self.env_cls, self.max_chars, self.memory_mb))
        return self._workers[-1]

    def begin(self, num_episodes: int) -> None:
        """A batch of episodes: episode k lives in worker k % num_workers (started if need be)."""
        count = min(self.num_workers, max(1, num_episodes))
        while len(self._workers) < count:
            self._start()
        self._hosts = {k: self._workers[k % count] for k in range(num_episodes)}
        self._history = {k: [] for k in range(num_episodes)}
        self._lost = {}

    def call_all(self, calls: list[tuple[int, str, Any]], timeout_s: float,
                 deadline: float | None = None) -> list[tuple[str, Any]]:
        """Each (episode, "reset" | "step", sample | action) in its episode's worker; returns, per call,
        ("ok", answer) (see `answer`) or (kind, message) with kind "errors", "timeouts" or "crashes". Each call has
        timeout_s from its start (a new worker's start-up, up to STARTUP_S, not counted), never past `deadline`
        (a time.monotonic() value)."""
        self._results, self._left = [None] * len(calls), len(calls)
        self._stall_s = stall_s = min(STALL_S, timeout_s / 4)
        for slot, (episode, op, arg) in enumerate(calls):
            self._enqueue(_Call(episode, op, arg, slot))
        while self._left:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self._past_deadline()
                break
            for worker in list(self._workers):
                self._send(worker)
            watched = [w for w in self._workers if w.sent or not w.ready]
            wakes = [w.started + (timeout_s if self._stalled(w, now) or not self._movable(w) else stall_s)
                     for w in watched if w.sent] + [w.born + STARTUP_S + timeout_s for w in watched if not w.ready]
            wakes += [deadline] if deadline is not None else []
            for conn in wait([w.conn for w in watched], timeout=max(0.0, min(wakes) - now) if wakes else None):
                worker = next(w for w in watched if w.conn is conn)
                self._receive(worker)
                while not worker.dead and (worker.sent or not worker.ready) and worker.conn.poll():
                    self._receive(worker)  # the answers already there, without a wait() each
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.sent and now >= worker.started + timeout_s:
                    guilty = worker.sent.popleft()
                    if not guilty.stale:
                        self._fail(worker, guilty, "timeouts", f"{guilty.what()} ran past {timeout_s:g} s")
                    self._kill(worker)
                elif not worker.ready and now >= worker.born + STARTUP_S + timeout_s:
                    self._fail_all(worker, "timeouts", f"its worker did not start in {STARTUP_S + timeout_s:g} s")
                elif self._stalled(worker, now) and self._movable(worker):
                    self._unqueue(worker)
        results, self._results = self._results, []
        return results

    # ------------------------------------------------------------ where calls go

    def _enqueue(self, call: _Call, avoid: EnvWorker | None = None) -> None:
        episode = call.episode
        if episode in self._lost:
            self._resolve(call, ("crashes", self._lost[episode]))
            return
        worker = self._hosts[episode]
        if worker is None:  # its worker was killed, or is stalled: its environment is rebuilt elsewhere
            worker = self._hosts[episode] = self._target(avoid) or min(self._workers, key=EnvWorker.load)
            worker.queue.extend(_Call(episode, c.op, c.arg, None, c.expect) for c in self._history[episode])
        worker.queue.append(call)

    def _stalled(self, worker: EnvWorker, now: float) -> bool:
        return bool(worker.sent) and now - worker.started >= self._stall_s

    def _movable(self, worker: EnvWorker) -> list[_Call]:
        """The calls waiting behind `worker`'s running one, of other episodes."""
        running = worker.sent[0].episode if worker.sent else None
        return [c for c in itertools.chain(itertools.islice(worker.sent, 1, None), worker.queue)
                if c.slot is not None and not c.stale and c.episode != running]

    def _target(self, avoid: EnvWorker | None) -> EnvWorker | None:
        """Where moved calls go: a new worker while there are fewer than num_workers, else the least loaded one
        (not `avoid`) whose call is not stalled, else an extra one (MAX_STALLED at most); None: nowhere."""
        now = time.monotonic()
        free = [w for w in self._workers if w is not avoid and not self._stalled(w, now)]
        if len(self._workers) < self.num_workers or (not free and len(self._workers) < self.num_workers
                                                     + MAX_STALLED):
            return self._start()
        return min(free, key=EnvWorker.load) if free else None

    def _unqueue(self, worker: EnvWorker) -> None:
        """`worker`'s running call is stalled: the calls behind it move, if there is somewhere to go."""
        moving = self._movable(worker)
        if self._target(worker) is None:
            return
        for call in moving:
            self._drop(worker, call.episode)
            self._hosts[call.episode] = None
            self._enqueue(_Call(call.episode, call.op, call.arg, call.slot), avoid=worker)
        if len(self._workers) < self.num_workers + MAX_STALLED and all(w.load() for w in self._workers):
            self._start()  # a spare, starting while the moved calls run: a next stall moves them at once

    def _drop(self, worker: EnvWorker, episode: int) -> None:
        """`episode` leaves `worker`: its calls there are dropped (those sent: their answers)."""
        for call in worker.sent:
            call.stale = call.stale or call.episode == episode
        worker.queue = collections.deque(c for c in worker.queue if c.episode != episode)

    # ------------------------------------------------------------ talking to a worker

    def _send(self, worker: EnvWorker) -> None:
        """All `worker`'s queued calls in one message, once it answered all it was sent: a worker never has a
        message it has not read, so a send never waits on one that is stuck."""
        if not worker.ready or worker.sent or not worker.queue:
            return
        batch = []
        for call in list(worker.queue):
            try:
                batch.append(pickle.dumps((call.episode, call.op, call.arg), pickle.HIGHEST_PROTOCOL))
                worker.sent.append(call)
            except Exception as error:  # noqa: BLE001  (a sample or action that cannot be pickled)
                self._fail(worker, call, "errors", f"cannot send it to the environment's process: {error}"[:500])
        worker.queue.clear()
        try:
            worker.conn.send(batch)
        except (BrokenPipeError, ConnectionResetError, OSError):
            worker.queue, worker.sent = worker.sent, collections.deque()
            self._died_between_calls(worker)
            return
        worker.started = time.monotonic()

    def _receive(self, worker: EnvWorker) -> None:
        try:
            data = worker.conn.recv_bytes()
        except (EOFError, OSError):  # it died: the call it was running is the one that killed it
            worker.process.join(timeout=5.0)  # its pipe closes an instant before it is reaped
            message = f"environment worker exited with code {worker.process.exitcode}"
            if not worker.ready:
                self._fail_all(worker, "crashes", f"{message} as it started")
                return
            call = worker.sent.popleft()
            if not call.stale:
                self._fail(worker, call, "crashes", f"{message} during {call.what()}")
            self._kill(worker)
            return
        try:
            status, value = _PlainData(io.BytesIO(data)).load()
        except Exception as error:  # noqa: BLE001  (whatever the bytes, a failure of this call alone)
            status, value = "errors", f"its answer cannot be read by the learner ({self.name}): " \
                                      f"{type(error).__name__}: {error}"[:500]
        if status == "ready":
            worker.ready = True
            return
        call = worker.sent.popleft()
        worker.started = time.monotonic()  # the next one's start
        if call.stale:
            return
        if status == "ok" and call.slot is not None:
            self._history[call.episode].append(_Call(call.episode, call.op, call.arg, None, value))
            self._resolve(call, ("ok", value))
        elif status == "ok" and value == call.expect:
            pass
        elif status == "memory":
            self._fail(worker, call, "errors", value)
            self._kill(worker)
        elif call.slot is None:
            self._fail(worker, call, "errors", f"its environment does not replay: {call.op} gave "
                       + ("another answer than when first played" if status == "ok" else value))
        else:
            self._fail(worker, call, status, value)

    # ------------------------------------------------------------ failures

    def _resolve(self, call: _Call, result: tuple[str, Any]) -> None:
        self._results[call.slot] = result
        self._left -= 1

    def _fail(self, worker: EnvWorker, call: _Call, kind: str, message: str) -> None:
        """`call`'s episode failed: its call of this call_all (`call`, or one behind the calls replaying its past)
        fails, and its other calls on `worker` are dropped."""
        real = call if call.slot is not None else next(
            c for c in itertools.chain(worker.sent, worker.queue) if c.episode == call.episode and c.slot is not None
            and not c.stale)
        self._drop(worker, call.episode)
        self._resolve(real, (kind, message))

    def _fail_all(self, worker: EnvWorker, kind: str, message: str) -> None:
        """A worker that did not start: its calls fail (the environment's module, not one episode, is at fault)."""
        for call in itertools.chain(worker.sent, worker.queue):
            if call.slot is not None and not call.stale:
                self._resolve(call, (kind, message))
        worker.sent, worker.queue = collections.deque(), collections.deque()
        self._kill(worker)

    def _kill(self, worker: EnvWorker) -> None:
        """Kills `worker` and its processes; the episodes it held are rebuilt elsewhere at their next call, now for
        those with a call on it."""
        self._workers.remove(worker)
        worker.kill()
        for episode, host in self._hosts.items():
            if host is worker:
                self._hosts[episode] = None
        for call in itertools.chain(worker.sent, worker.queue):
            if call.slot is not None and not call.stale:
                self._enqueue(_Call(call.episode, call.op, call.arg, call.slot))

    def _died_between_calls(self, worker: EnvWorker) -> None:
        """No call of its was running (the OOM killer, a thread an environment left): its episodes are lost."""
        worker.process.join(timeout=5.0)
        message = f"environment worker exited with code {worker.process.exitcode} between calls"
        for episode, host in self._hosts.items():
            if host is worker:
                self._lost[episode] = message
        self._kill(worker)

    def _past_deadline(self) -> None:
        for worker in list(self._workers):
            for call in itertools.chain(worker.sent, worker.queue):
                if call.slot is not None and not call.stale:
                    self._resolve(call, ("timeouts", f"{call.op} ran past the call's deadline"))
            worker.queue.clear()
            if worker.sent:
                worker.sent.clear()
                self._kill(worker)

    def end(self) -> None:
        """The batch is over: every worker drops its environments and ends their processes; one that is not clean
        then, or not among the first num_workers, is killed."""
        asked = []
        for worker in self._workers:
            try:
                worker.conn.send("end")  # after the calls it is still running, if any; or once it has started
                asked.append(worker)
            except OSError:
                pass
        until = time.monotonic() + END_S
        keep = []
        for worker in self._workers:
            clean = False
            while worker in asked and worker.conn.poll(max(0.0, until - time.monotonic())):
                try:
                    status, value = _read(worker.conn)
                except Exception:  # noqa: BLE001  (dead, or not itself)
                    break
                if status == "end":  # past "ready" and the answers of calls it was still running
                    clean = value is True
                    break
            if clean and len(keep) < self.num_workers:
                keep.append(worker)
            else:
                worker.kill()
        self._workers, self._hosts, self._history, self._lost = keep, {}, {}, {}

    def close(self) -> None:
        for worker in self._workers:
            worker.kill()
        self._workers, self._hosts, self._history, self._lost = [], {}, {}, {}
