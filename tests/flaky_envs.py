"""Environments that fail, for the tests of apmpo.envs (named as a user names theirs: module:Class, with tests/ on
PYTHONPATH). Each fails on the samples whose answer starts with "0" (about one in ten quickstart prompts) and
plays the reveal task (apmpo/envs/reveal.py) on the others."""
import abc
import math
import time

from apmpo.envs.reveal import RevealEnv


def _fails(sample: dict) -> bool:
    return sample["answer"].startswith("0")


class RaisesInReset(RevealEnv):
    def reset(self, sample):
        if _fails(sample):
            raise RuntimeError("reset failed on purpose")
        return super().reset(sample)


class RaisesInStep(RevealEnv):
    def step(self, action):
        if _fails(self.sample):
            raise KeyError("step failed on purpose")
        return super().step(action)


class HangsInStep(RevealEnv):
    def step(self, action):
        if _fails(self.sample) and self.revealed:  # the second step: after a turn of the episode was played
            time.sleep(3600)
        return super().step(action)


class ReturnsGarbage(RevealEnv):
    def step(self, action):
        if _fails(self.sample):
            return [self.sample["answer"], math.nan]
        return super().step(action)


class NaNReward(RevealEnv):
    def step(self, action):
        observation, reward, done = super().step(action)
        return observation, math.nan if _fails(self.sample) and done else reward, done


class HugeReward(RevealEnv):
    """1e300: finite as a Python float, inf as the float32 that is trained on (it poisoned whole steps)."""
    def step(self, action):
        observation, reward, done = super().step(action)
        return observation, 1e300 if _fails(self.sample) and done else reward, done


class Abstract(RevealEnv, abc.ABC):
    """An interface, not an environment: it cannot be instantiated."""
    @abc.abstractmethod
    def step(self, action):
        ...


# --- for tests/test_env_workers.py, test_envs.py and test_trajectory.py ------------------------------------------


class EndsAtOnce:
    """Ends every episode at its first turn with reward 1, as the calculator scores a turn without a call."""

    def reset(self, sample):
        return "start"

    def step(self, action):
        return "", 1.0, True


class NeverEnds:
    """Answers every turn and never ends an episode: it runs out of turns, each scored by the sample's "reward"."""

    def reset(self, sample):
        self.sample = sample
        return "start"

    def step(self, action):
        return "go on", self.sample["reward"], False


def _refuse():
    raise RuntimeError("this object cannot be rebuilt here")


class _Unreadable:
    def __reduce__(self):  # pickles; unpickling raises (in the learner, when answers crossed as they were)
        return _refuse, ()


def _spawn(marker: str) -> None:
    """A child, a child in a session of its own, and a double-forked daemon: `sleep <marker>` each."""
    import os
    import subprocess

    subprocess.Popen(["sleep", marker])
    subprocess.Popen(["sleep", marker], start_new_session=True)
    child = os.fork()
    if child == 0:
        os.setsid()
        if os.fork() == 0:
            os.execvp("sleep", ["sleep", marker])
        os._exit(0)
    os.waitpid(child, 0)


class Hostile(RevealEnv):
    """Plays the reveal task, but does what its sample's "do" says at its first step (its reset for "random"):
    each of these broke the learner, or a neighbouring episode, when environments were threads or shared a
    worker's fate. One class for all, so that tests/test_env_workers.py shares one pool of workers."""

    def reset(self, sample):
        import random

        first = super().reset(sample)
        return f"{first} {random.random()}" if sample.get("do") == "random" else first

    def step(self, action):
        import os
        import re
        import threading

        do = None if self.revealed else self.sample.get("do")
        if do == "hold":  # catastrophic backtracking inside re's C code: the interpreter lock is never given back
            re.match(r"(a+)+$", "a" * 64 + "b")
        elif do == "spin":
            while True:
                pass
        elif do == "exit":
            os._exit(1)
        elif do == "exit later":  # from a thread, once the step has answered: no call is running then
            threading.Timer(0.2, os._exit, (3,)).start()
        elif do == "slow":  # slow, not stuck: it answers within the call's time
            time.sleep(0.5)
        elif do == "block":  # blocks on a pipe it opened, as the third probe's environment did
            read_end, _ = os.pipe()
            os.read(read_end, 1)
        elif do == "huge":
            return "x" * 100_000_000, None, False
        elif do == "unreadable":
            return {"role": "user", "content": "x", "extra": _Unreadable()}, None, False
        elif do == "allocate":
            self.kept = bytearray(1 << 30)
        elif do == "thread":
            threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
        elif do == "spawn":
            _spawn(self.sample["marker"])
        elif do == "spawn and exit later":  # its worker dies by itself, its processes orphaned
            _spawn(self.sample["marker"])
            threading.Timer(0.2, os._exit, (3,)).start()
        elif do == "spawn and hang":
            _spawn(self.sample["marker"])
            time.sleep(3600)
        return super().step(action)
