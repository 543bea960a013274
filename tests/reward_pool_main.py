"""A script that imports torch first, as launch/train.py does, then scores through a RewardPool
and prints one JSON line: how long 4 worker crashes took and what the workers had imported.

    python tests/reward_pool_main.py

Reward workers start from a forkserver, which re-runs the caller's `__main__` in each new worker unless the
pool prevents it; in training that made every crash cost seconds (tests/test_rewards.py runs this).
"""
import dataclasses
import json
import time

import torch  # noqa: F401  (imported for its cost, as launch/train.py imports it with DeepSpeed and transformers)

from apmpo.rewards import RewardPool
from failing_rewards import exit_on_die, module_loaded  # this script's folder is on sys.path

if __name__ == "__main__":
    with RewardPool(num_workers=2, timeout_s=5.0) as pool:
        pool.score(exit_on_die, ["ok"] * 2, [{}] * 2)  # the workers are up
        start = time.monotonic()
        scores, summary = pool.score(exit_on_die, ["die", "ok", "die", "ok", "die", "ok", "die", "ok"], [{}] * 8)
        seconds = time.monotonic() - start
        loaded, _ = pool.score(module_loaded, ["torch", "apmpo.rewards"], [{}] * 2)
    summary = {**dataclasses.asdict(summary), "failures": summary.failures}
    print(json.dumps({"scores": scores, "summary": summary, "seconds": seconds, "loaded": loaded}))
