"""Train a policy by RL from verifiable rewards with APMPO, or the GRPO, DAPO and GMPO baselines.

    deepspeed launch/train.py --config configs/quickstart.yaml [--set loss.name=grpo ...] [--resume]
    python launch/train.py --config configs/quickstart.yaml            # one process, no launcher

One step, as in ARCHITECTURE.md: rank 0 samples B prompts, asks the generation server(s) (separate vLLM
processes) for G completions each, scores them and derives advantages and APMPO's p, FSS and eps_ada (with
train.max_staleness >= 1 the next batches are generated meanwhile, in a background thread). Every rank receives
the batch and computes the same plan: optimiser mini-batches, its token-balanced shard and token-budget
micro-batches. Reference log-probs, and the old ones when there is more than one optimiser step per batch, are
computed first in fp32 (with one, the old log-probs are the update forward's own); then each mini-batch is one
optimiser step of DeepSpeed ZeRO-2. Rank 0 pushes the new weights into the server(s), validates every
eval.every steps, logs, and every `save_every` steps all ranks write an atomic checkpoint. APMPO departs from
GRPO only in the loss (apmpo/loss.py): a power mean of the clipped ratios whose power and upper clip follow the
batch's rewards.
"""
from __future__ import annotations

import gc

if __name__ == "__main__":
    # No automatic garbage collection while the learner imports and builds: collections of its growing heap took
    # 1.5 s of CPU (on 2 cores, shared with the starting servers). main() turns it back on for the steps.
    gc.disable()

import argparse
import contextlib
import functools
import os
import sys
import time

import torch
import torch.distributed as torch_dist
from transformers import AutoTokenizer

from apmpo.config import Config, ConfigError, load_config, save_config
from apmpo.data import stop_token_ids
from apmpo.eval.validate import Validation
from apmpo.learner import lora
from apmpo.learner.batching import Rollout, collate, plan_step
from apmpo.learner.checkpoint import resume as resume_checkpoint, save_best, save_checkpoint
from apmpo.learner.collect import PromptSampler, RolloutStream, collect_rollouts
from apmpo.learner.engine import Dist, build_engine, check_devices, close_distributed, init_distributed, load_model
from apmpo.learner.logprobs import shares_prompts
from apmpo.learner.metrics import MetricsLogger
from apmpo.learner.prepare import load_prompts, load_vision, prepare_model
from apmpo.learner.update import StepTotals, logprobs, rollout_correction
from apmpo.loss import AdaptiveParams, adaptive_params, policy_loss
from apmpo.rewards import RewardPool, get_reward
from apmpo.rollout.launcher import serve


def main(cfg: Config, resume: str) -> None:
    is_main = int(os.environ.get("RANK", "0")) == 0  # the launcher's; the process group comes after the server
    run_dir = cfg.run_dir
    model_path = prepare_model(cfg, is_main)
    with contextlib.ExitStack() as stack:
        # -------------------------------------------------------------- generation server (rank 0), started first
        if is_main:
            save_config(cfg, run_dir / "config.yaml")
            r = cfg.rollout
            # Its engine loads while the learner imports DeepSpeed and loads (wait_ready below), unless it shares
            # rank 0's GPU: vLLM sizes its KV cache from the free memory it measures while it loads. One server
            # (a GenerationClient), or several (a ServerPool: prompts spread over them, weights to all).
            server = stack.enter_context(serve(
                model_path, url=r.url, urls=r.urls, token=os.environ.get("APMPO_SERVER_TOKEN") or None,
                log_path=run_dir / "server.log", devices=r.devices,
                num_servers=r.num_servers, gpu_memory_utilization=r.gpu_memory_utilization,
                tensor_parallel_size=r.tensor_parallel_size, max_model_len=r.max_model_len,
                extra_args=(("--enforce-eager",) if r.enforce_eager else ()) + lora.server_args(cfg),
                dtype="bfloat16" if cfg.model.dtype == "bf16" else "float32", seed=cfg.train.seed, wait=check_devices(cfg),
                learner_idle=cfg.train.max_staleness == 0))
        dist = init_distributed(cfg.train.dist_timeout_s, generates_meanwhile=cfg.train.max_staleness > 0)
        torch_dist.barrier()  # rank 0 has written the model (model.path quickstart)
        torch.manual_seed(cfg.train.seed + dist.rank)

        # -------------------------------------------------------------- model, data, engine
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        engine = build_engine(load_model(model_path, cfg, dist.device), cfg, dist)
        # With LoRA the reference is the policy itself, its adapter off (lora.adapter_disabled): no second copy.
        reference = None if cfg.loss.kl_beta == 0 else (
            engine.module if cfg.model.lora else load_model(model_path, cfg, dist.device, trainable=False))
        vision = load_vision(model_path, tokenizer)  # None for text models
        samples, prompt_ids = load_prompts(cfg, tokenizer, vision) if dist.is_main else ([], [])
        stop_ids = stop_token_ids(model_path, tokenizer)  # as in evaluation
        # Held-out benchmarks through the same server, as `python -m apmpo.eval` scores them (bad prompts fail here).
        validation = Validation(cfg, tokenizer, model_path) if dist.is_main and cfg.eval.every else None

        # -------------------------------------------------------------- resume
        trainer_state = resume_checkpoint(engine, run_dir, resume, dist.rank)  # rank 0 picks it, every rank loads it
        start_step = trainer_state.get("step", 0)

        # -------------------------------------------------------------- rewards, the server's client (rank 0)
        client = logger = score = None
        if dist.is_main:
            sampler = PromptSampler(len(samples), cfg.data.seed, **trainer_state.get("sampler", {}))
            # Rewards run in worker processes with a per-item time limit: a crash or a hang scores 0, is counted.
            pool = stack.enter_context(RewardPool(cfg.rollout.reward_workers, cfg.rollout.reward_timeout_s))
            score = functools.partial(pool.score, get_reward(cfg.data.reward))
            print(f"[apmpo] run {run_dir}, {dist.world_size} learner rank(s) on {dist.device}, "
                  f"{'resuming at step ' + str(start_step) if start_step else 'from scratch'}", flush=True)
            server.wait_ready()
            client = stack.enter_context(server.client(transport=None if r.weight_sync == "auto" else r.weight_sync,
                                                       bucket_bytes=r.bucket_mb << 20))
            policy_version = 0  # the servers' count of weight pushes: a fresh server holds our initial weights
            if start_step > 0 or r.url or r.urls:  # the servers must generate with the weights we train
                policy_version = lora.push_policy(client, engine.module)
            logger = stack.enter_context(contextlib.closing(MetricsLogger(cfg, start_step)))
            # Batches are generated up to train.max_staleness steps ahead, while the learner updates (0: in step).
            stream = RolloutStream(lambda step: collect_rollouts(
                client, sampler, prompt_ids, samples, score, cfg.rollout, cfg.loss, run_seed=cfg.train.seed, step=step,
                stop_token_ids=stop_ids, vision=vision), cfg.train.max_staleness, cfg.train.steps)
            stack.callback(stream.close)

        # One full collection now, of all the start-up left, and then the heap it leaves is frozen: the steps'
        # collections never scan it (the first one after start-up took 0.33 s of a 0.25 s step). Unfrozen at the
        # end, so that the interpreter's teardown frees it as usual (triton's bindings report leaks otherwise).
        gc.collect()
        gc.freeze()
        stack.callback(gc.unfreeze)
        gc.enable()
        skipped_in_a_row = 0
        for step in range(start_step + 1, cfg.train.steps + 1):
            step_start, times = time.perf_counter(), {}
            step_seed = cfg.train.seed * 100_003 + step  # the mini-batch order, resumable

            # ---------------------------------------------------------- 1-4. prompts, generate, score, statistics
            if dist.is_main:
                tick = time.perf_counter()
                batch = stream.get(step, policy_version)
                params = adaptive_params(batch.rewards, cfg.loss)
                times |= {**batch.times, "wait_rollouts": time.perf_counter() - tick}
            # ---------------------------------------------------------- 5. every rank gets the batch
            payload = [(batch.rollouts, params) if dist.is_main else None]
            torch_dist.broadcast_object_list(payload, src=0)
            rollouts, params = payload[0]

            # ---------------------------------------------------------- 6-7. log-probs, then the optimiser steps
            metrics = train_on_batch(engine, reference, rollouts, params, cfg, dist, tokenizer.pad_token_id, step_seed)
            skipped_in_a_row = skipped_in_a_row + 1 if metrics["train/skipped_steps"] else 0
            if skipped_in_a_row >= cfg.train.max_skipped_in_a_row:
                raise RuntimeError(
                    f"{skipped_in_a_row} steps in a row had a non-finite loss or gradient norm (step {step}: "
                    f"loss/total={metrics.get('loss/total')}); stopping rather than training on nothing. Check the "
                    "rewards (reward/failures), the learning rate and the model's dtype.")

            # ---------------------------------------------------------- 8. weight sync
            tick = time.perf_counter()
            if dist.is_main:
                policy_version = lora.push_policy(client, engine.module)  # the adapter alone with LoRA
                times["weight_sync_engine_load"] = client.last_push["reload_s"] - client.last_push["wait_s"]
            times["weight_sync"] = time.perf_counter() - tick

            # ---------------------------------------------------------- 9. validate, log and checkpoint
            if dist.is_main:
                times["step"] = time.perf_counter() - step_start  # validation excluded: it is not every step
                if validation and (step % cfg.eval.every == 0 or step == cfg.train.steps):
                    with stream.paused():  # the server holds this step's weights
                        metrics |= validation.run(client, pool.score, step)
                    if cfg.checkpoint.keep_best:
                        save_best(engine.module, vision or tokenizer, run_dir, step, cfg.checkpoint.keep_best,
                                  metrics[cfg.checkpoint.keep_best])
                staleness = {"rollout/staleness": policy_version - 1 - batch.weight_version,
                             "rollout/discarded_stale": stream.discarded}
                logger.log(step, {**batch.metrics, **metrics, **staleness, "optim/lr": engine.get_lr()[0],
                                  **{f"time/{k}": v for k, v in times.items()}})
            if cfg.checkpoint.save_every and (step % cfg.checkpoint.save_every == 0 or step == cfg.train.steps):
                state = {"sampler": stream.sampler_state(step + 1, sampler)} if dist.is_main else {}
                save_checkpoint(engine, run_dir, step, state, vision or tokenizer, dist.rank, cfg.checkpoint.keep_last,
                                cfg.checkpoint.export_hf)
    close_distributed()
    if dist.is_main:
        print(f"[apmpo] done: {run_dir}", flush=True)


def train_on_batch(engine, reference, rollouts: list[Rollout], params: AdaptiveParams, cfg: Config, dist: Dist,
                   pad_id: int, seed: int, recompute_old: bool = False) -> dict[str, float]:
    """Steps 6-7 on every rank: old and reference log-probs, then `epochs` passes over the mini-batches, one
    DeepSpeed optimiser step each. Returns the step's metrics, reduced over ranks, with their timings."""
    packed = shares_prompts(engine.module) and not any(r.mm for r in rollouts)  # as token_logprobs will do
    plan = plan_step(rollouts, cfg.mini_batches_per_rollout, dist.world_size, cfg.train.micro_batch_tokens, seed,
                     packed)
    micro = [[collate(rollouts, indices, pad_id) for indices in step.micro[dist.rank]] for step in plan]
    groups = torch.tensor([r.group for r in rollouts])
    totals, times, device = StepTotals(), {}, dist.device
    # One optimiser step on the batch it sampled: the old policy is the current one, so the old log-probs are
    # the update forward's own, detached (as TRL and verl do), and a whole forward pass is saved. The step is
    # the same bit for bit (tests/test_learner.py). Otherwise the old log-probs are computed first.
    on_policy = len(plan) == 1 and cfg.train.epochs == 1 and not recompute_old

    # -------------------------------------------------------------- 6. old and reference log-probs
    tick = time.perf_counter()
    with torch.no_grad():
        for mb in (mb for mini in micro for mb in mini):
            if not on_policy:
                mb.old_logp, entropy = logprobs(engine.module, mb, cfg, device, with_entropy=True)
                totals.add_entropy(entropy, mb, device)
            if reference is not None:
                with lora.adapter_disabled(reference):
                    mb.ref_logp, _ = logprobs(reference, mb, cfg, device)
    times["time/logprob"] = time.perf_counter() - tick

    # -------------------------------------------------------------- 7. update: epochs x mini-batches
    tick = time.perf_counter()
    skipped = 0
    for _ in range(cfg.train.epochs):
        for step, mini in zip(plan, micro):
            for k, mb in enumerate(mini):
                engine.set_gradient_accumulation_boundary(k == len(mini) - 1)
                logp, entropy = logprobs(engine.module, mb, cfg, device, with_entropy=on_policy)
                if on_policy:
                    mb.old_logp = logp.detach()
                    totals.add_entropy(entropy, mb, device)
                # Importance weights against the engine that sampled (cfg.correction); the mismatch is logged.
                advantages, token_weights = rollout_correction(mb, cfg.correction, totals, device)
                # Global normalisers of this optimiser step; DeepSpeed averages gradients over ranks, hence / world.
                loss, metrics = policy_loss(
                    logp, mb.old_logp, advantages, mb.loss_mask.to(device), cfg.loss,
                    params.per_sequence(groups[mb.indices]), ref_logp=mb.ref_logp,
                    num_seqs=step.num_seqs / dist.world_size, num_tokens=step.num_tokens / dist.world_size,
                    token_weights=token_weights)
                engine.backward(loss * mb.weight)
                totals.add(metrics, mb)
            engine.step()  # skipped by DeepSpeed, gradients cleared, when the gradient norm is not finite
            skipped += not engine.was_step_applied()
    times["time/update"] = time.perf_counter() - tick
    return {**totals.reduce(device, dist.world_size, len(plan) * cfg.train.epochs), **times,
            "optim/grad_norm": float(engine.get_global_grad_norm() or 0.0), "train/skipped_steps": skipped}


def parse_args(argv=None) -> tuple[Config, str]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML file, e.g. configs/quickstart.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set loss.name=grpo (repeatable)")
    parser.add_argument("--resume", nargs="?", const="auto", default=None,
                        help="resume from the latest checkpoint of the run (or from the given checkpoint)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by deepspeed
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.set)
    check_devices(cfg)
    return cfg, args.resume or cfg.train.resume


if __name__ == "__main__":
    try:
        config, resume_from = parse_args()
    except ConfigError as error:  # before any process group or server exists
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"apmpo: bad config: {error}", file=sys.stderr)
        sys.exit(2)
    main(config, resume_from)
