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


# --- hostile environments, for tests/test_env_workers.py (each broke the learner when environments were threads) --


class HoldsTheLock(RevealEnv):
    """A step that never gives the interpreter lock back: catastrophic backtracking inside re's C code."""
    def step(self, action):
        import re

        re.match(r"(a+)+$", "a" * 64 + "b")
        return super().step(action)


class Exits(RevealEnv):
    def step(self, action):
        import os

        os._exit(1)


class BlocksAndLeaks(RevealEnv):
    """Opens a pipe and blocks reading it, as the probe's environment did: 72 threads and pipes after two steps."""
    def step(self, action):
        import os

        if _fails(self.sample):
            read_end, _ = os.pipe()
            os.read(read_end, 1)
        return super().step(action)


class LeavesAThread(RevealEnv):
    def reset(self, sample):
        import threading

        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
        return super().reset(sample)


class Unpicklable(RevealEnv):
    def step(self, action):
        return (lambda: None), 1.0, True
