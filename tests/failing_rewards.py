"""Reward functions that fail on purpose, in a module the reward workers can import (not `__main__`), and
that imports nothing heavy: tests/reward_pool_main.py checks what a worker has imported."""
import os
import sys


def exit_on_die(completion: str, sample: dict) -> float:
    """The worker dies (os._exit(3)) on the completion "die"; 1.0 otherwise."""
    if completion == "die":
        os._exit(3)
    return 1.0


def module_loaded(completion: str, sample: dict) -> float:
    """1.0 when the module named by the completion is imported in the worker."""
    return float(completion in sys.modules)


def always_exit(completion: str, sample: dict) -> float:
    os._exit(3)


def nan_every_20th(completion: str, sample: dict) -> float:
    """The quickstart reward, but NaN for about 1 completion in 20 (those whose text hashes to 0 mod 20)."""
    from apmpo.rewards.quickstart import quickstart_reward  # noqa: PLC0415

    if sum(completion.encode()) % 20 == 0:
        return float("nan")
    return quickstart_reward(completion, sample)


def hang(completion: str, sample: dict) -> float:
    import time  # noqa: PLC0415

    time.sleep(3600)
    return 1.0


def allocate(completion: str, sample: dict) -> float:
    """Allocates (and touches) as many MiB as the completion says."""
    block = bytearray(int(completion) << 20)
    return float(len(block) > 0)


def hang_on_hang(completion: str, sample: dict) -> float:
    """Hangs on the completion "hang"; 1.0 otherwise."""
    if completion == "hang":
        hang(completion, sample)
    return 1.0
