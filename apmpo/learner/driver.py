"""Rank 0's half of a training step, as one object: `Driver`.

It owns the generation servers and their client, the prompt sampler, the reward pool, the rollout stream (batches
generated up to train.max_staleness steps ahead), validation, the weight push and the metrics log. The other
learner ranks hold none of it; launch/train.py keeps the loop visible and calls into it:

    driver = stack.enter_context(Driver(cfg, model_path))   # starts the servers; their engines load meanwhile
    ...                                                      # the learner builds its model and engine
    driver.connect(engine, weights, tokenizer, vision, state) # servers ready, the stream starts generating
    batch = driver.next_batch(step)                          # rollouts, advantages, APMPO's p / FSS / eps_ada
    push_times = driver.push(weights)                        # the new weights into every server
    driver.log(step, metrics, engine, weights)               # validation every eval.every steps, then one log line

`weights` (apmpo.learner.zero3.WholeWeights) reads the policy's whole weights: under ZeRO-3 the other ranks join
each read, in `weights.settle()`.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import time
import zlib
from array import array
import dataclasses

from apmpo.config import Config, save_config
from apmpo.data import stop_token_ids
from apmpo.envs.episodes import EpisodeRunner
from apmpo.eval.validate import Validation
from apmpo.learner import lora
from apmpo.trajectory import Rollout
from apmpo.learner.checkpoint import save_best
from apmpo.learner.batching import StepRollouts
from apmpo.learner.collect import PromptSampler, RolloutStream, collect_rollouts
from apmpo.learner.engine import check_devices
from apmpo.learner.metrics import MetricsLogger, drop_steps_after
from apmpo.learner.prepare import load_prompts
from apmpo.learner.zero3 import WholeWeights
from apmpo.rewards import RewardPool, get_reward
from apmpo.rollout.launcher import gpu_memory_utilization, serve


class Driver(contextlib.ExitStack):
    """Rank 0's servers, sampler, rewards, stream, validation, push and log (the module's docstring)."""

    def __init__(self, cfg: Config, model_path: str):
        super().__init__()
        self.cfg, self.model_path = cfg, model_path
        save_config(cfg, cfg.run_dir / "config.yaml")
        r = cfg.rollout
        # The engines load while the learner imports DeepSpeed and builds (connect() waits for them), unless a
        # server shares rank 0's GPU: vLLM sizes its KV cache from the free memory it measures while it loads.
        shares_gpu = check_devices(cfg)
        self.servers = self.enter_context(serve(
            model_path, url=r.url, urls=r.urls, url_ready_timeout_s=r.ready_timeout_s,
            token=os.environ.get("APMPO_SERVER_TOKEN") or None,
            log_path=cfg.run_dir / "server.log", devices=r.devices, num_servers=r.num_servers,
            gpu_memory_utilization=gpu_memory_utilization(r.gpu_memory_utilization, shares_gpu),
            tensor_parallel_size=r.tensor_parallel_size,
            max_model_len=r.max_model_len,
            extra_args=(("--enforce-eager",) if r.enforce_eager else ()) + lora.server_args(cfg)
            + (("--head-dtype", cfg.engine_head_dtype) if cfg.engine_head_dtype else ()),
            dtype=cfg.engine_dtype, seed=cfg.train.seed,
            wait=shares_gpu, overlap=cfg.overlap))
        self.policy_version = 0  # the servers' count of weight pushes: a fresh server holds our initial weights

    def connect(self, engine, weights: WholeWeights, tokenizer, vision, trainer_state: dict) -> None:
        """Once the learner is built (and resumed): the data, the reward pool, the client (pushing the learner's
        weights where the servers may hold others), validation, the log and the stream."""
        cfg, start_step = self.cfg, trainer_state.get("step", 0)
        samples, prompt_ids = load_prompts(cfg, tokenizer, vision)
        self.vision, self.tokenizer = vision, tokenizer
        self.sampler = PromptSampler(len(samples), cfg.data.seed, **trainer_state.get("sampler", {}))
        # Rewards run in worker processes with a per-item time limit: a crash or a hang scores 0, is counted.
        self.pool = self.enter_context(RewardPool(cfg.rollout.reward_workers, cfg.rollout.reward_timeout_s,
                                                   cfg.rollout.reward_memory_mb))
        score = functools.partial(self.pool.score, get_reward(cfg.data.reward))
        # Held-out benchmarks through the same servers, as `python -m apmpo.eval` scores them.
        self.validation = Validation(cfg, tokenizer, self.model_path) if cfg.eval.every else None
        self.servers.wait_ready()
        r = cfg.rollout
        self.client = self.enter_context(self.servers.client(
            transport=None if r.weight_sync == "auto" else r.weight_sync, bucket_bytes=r.bucket_mb << 20,
            sync_timeout_s=r.sync_timeout_s))
        # Now, while no generation holds the engines: a join behind a batch's generation would outlast the deadline
        # (minutes of 512 x 8 samples on GPU) with max_staleness >= 1.
        self.client.join_weight_group(lora.policy_tensors(weights))  # with LoRA, the adapter's alone
        if start_step > 0 or r.url or r.urls:  # the servers must generate with the weights we train
            self.push(weights)
        self.logger = self.enter_context(contextlib.closing(MetricsLogger(cfg, start_step)))
        self.digests_path = cfg.run_dir / "rollouts.jsonl"
        drop_steps_after(self.digests_path, start_step)  # as the metrics: a step's digests once
        sampling = cfg.rollout.sampling(stop_token_ids(self.model_path, tokenizer))  # stops as in evaluation
        episodes = EpisodeRunner.from_config(cfg, tokenizer)  # data.env: multi-turn episodes, else None
        if episodes is not None:
            self.callback(episodes.close)  # after the stream's close below, whose thread may be playing episodes
        self.stream = RolloutStream(lambda step: collect_rollouts(
            self.client, self.sampler, prompt_ids, samples, score, cfg.rollout, cfg.loss, run_seed=cfg.train.seed,
            step=step, sampling=sampling, vision=vision, episodes=episodes), cfg.train.max_staleness,
            cfg.train.steps)
        self.callback(self.stream.close)

    def next_batch(self, step: int) -> StepRollouts:
        """The step's rollouts with their advantages and adaptive parameters, at most train.max_staleness pushes
        older than the policy being trained; for the step's log, its metrics with the staleness added, and its times
        named as logged (time/generate, time/reward, time/wait_rollouts)."""
        tick = time.perf_counter()
        batch = self.stream.get(step, self.policy_version)
        times = {f"time/{k}": v for k, v in batch.times.items()} | {"time/wait_rollouts": time.perf_counter() - tick}
        staleness = {"rollout/staleness": batch.staleness(self.policy_version),
                     "rollout/discarded_stale": self.stream.discarded}
        self._log_digests(step, batch.rollouts)
        return dataclasses.replace(batch, metrics=batch.metrics | staleness, times=times)

    def _log_digests(self, step: int, rollouts: list[Rollout]) -> None:
        """One line of the digests file (RUN_DIR/rollouts.jsonl): a CRC-32 of each trained completion's token ids,
        in batch order. Two runs that share their seeds (a study's methods) sample with the same random numbers, so
        comparing their lines shows the step at which their trajectories part (apmpo.study.report.separation)."""
        digests = [zlib.crc32(bytes(memoryview(array("i", r.completion_ids)))) for r in rollouts]
        with open(self.digests_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "crc32": digests}) + "\n")

    def push(self, weights: WholeWeights) -> dict[str, float]:
        """The learner's weights (or its adapter) into every server; the seconds, and the engines' loading part."""
        self.policy_version = lora.push_policy(self.client, weights)  # the adapter alone with LoRA
        push = self.client.last_push
        return {"time/weight_sync": push.seconds, "time/weight_sync_engine_load": push.reload_s - push.wait_s}

    def log(self, step: int, metrics: dict[str, float], engine, weights: WholeWeights) -> None:
        """Validation every eval.every steps and after the last (keeping the best policy when asked), then the
        step's one log line."""
        cfg = self.cfg
        if self.validation and (step % cfg.eval.every == 0 or step == cfg.train.steps):
            with self.stream.paused():  # the servers hold this step's weights
                metrics |= self.validation.run(self.client, self.pool.score, step)
            if cfg.checkpoint.keep_best:
                save_best(weights, self.vision or self.tokenizer, cfg.run_dir, step, cfg.checkpoint.keep_best,
                          metrics[cfg.checkpoint.keep_best])
        self.logger.log(step, {**metrics, "optim/lr": engine.get_lr()[0]})

    def resume_state(self, next_step: int) -> dict:
        """What a checkpoint needs of rank 0 to resume at `next_step`: where the prompt sampler starts."""
        return {"sampler": self.stream.sampler_state(next_step, self.sampler)}

