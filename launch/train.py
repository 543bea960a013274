"""Train a policy by RL from verifiable rewards with APMPO, or the GRPO, DAPO and GMPO baselines.

    deepspeed launch/train.py --config configs/quickstart.yaml [--set loss.name=grpo ...] [--resume]
    python launch/train.py --config configs/quickstart.yaml            # one process, no launcher

One step, as in docs/ARCHITECTURE.md: rank 0 samples B prompts, asks the generation server(s) (separate vLLM
processes) for G completions each, scores them and derives advantages and APMPO's p, FSS and eps_ada (with
train.max_staleness >= 1 the next batches are generated meanwhile, in a background thread). Every rank receives
the batch and runs the step, `train_on_batch` (apmpo/learner/step.py), which computes the same plan on every
rank: optimiser mini-batches, its token-balanced shard and token-budget micro-batches. Reference log-probs, and
the old ones when there is more than one optimiser step per batch, are computed first in fp32 (with one, the old
log-probs are the update forward's own); then each mini-batch is one optimiser step of DeepSpeed ZeRO-2 (or 3).
Rank 0 pushes the new weights into the server(s), validates every eval.every steps, logs, and every `save_every`
steps all ranks write an atomic checkpoint. APMPO departs from GRPO only in the loss (`policy_loss`,
apmpo/loss.py, which the step calls): a power mean of the clipped ratios whose power and upper clip follow the
batch's rewards.
"""
from __future__ import annotations

import gc

if __name__ == "__main__":
    from apmpo import warm

    # Under $APMPO_WARM_PROGRAMS (CPU): this rank forked from a warm process that has imported what follows, this
    # process its relay (a rank that DeepSpeed's launcher starts is a fresh `python`).
    warm.relay()
    # No automatic garbage collection while the learner imports and builds: collections of its growing heap took
    # 1.5 s of CPU (on 2 cores, shared with the starting servers). main() turns it back on for the steps.
    gc.disable()

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.distributed as torch_dist
from transformers import AutoTokenizer

from apmpo import dirlock, preflight
from apmpo.config import Config, ConfigError, load_config, native_bf16
from apmpo.learner.checkpoint import resume as resume_checkpoint, save_checkpoint
from apmpo.learner.driver import Driver
from apmpo.learner.engine import (build_engine, close_distributed, init_distributed, load_model,
                                  loss_scale_metrics, partition_reference, step_failed)
from apmpo.learner.nodes import Nodes
from apmpo.learner.prepare import load_vision, prepare_model
from apmpo.learner.step import train_on_batch
from apmpo.learner.zero3 import WholeWeights
from apmpo.rollout.launcher import follow_deepspeed_runner


def main(cfg: Config, resume: str) -> None:
    follow_deepspeed_runner()  # a run whose `deepspeed` runner is stopped goes down with it
    is_main = int(os.environ.get("RANK", "0")) == 0  # the launcher's; the process group comes after the servers
    model_path = prepare_model(cfg, is_main)
    with contextlib.ExitStack() as stack:
        # -------------------------------------------------------------- rank 0's half: the servers start first
        # (apmpo/learner/driver.py: servers, client, sampler, rewards, stream, validation, push, log)
        driver = stack.enter_context(Driver(cfg, model_path)) if is_main else None
        dist = init_distributed(cfg.train.dist_timeout_s, overlap=cfg.overlap)
        # Several nodes: a heartbeat stops the run when a rank is lost, and every rank must see the run directory.
        nodes = stack.enter_context(Nodes(dist.rank, dist.world_size, cfg.train.peer_timeout_s))
        nodes.check_shared(cfg.run_dir)
        torch_dist.barrier()  # rank 0 has written the model (model.path quickstart)
        torch.manual_seed(cfg.train.seed + dist.rank)

        # -------------------------------------------------------------- model, engine, resume
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        engine = build_engine(load_model(model_path, cfg, dist.device), cfg, dist)
        # With LoRA the reference is the policy itself, its adapter off (lora.adapter_disabled): no second copy.
        reference = None if cfg.loss.kl_beta == 0 else (
            engine.module if cfg.model.lora
            else partition_reference(load_model(model_path, cfg, dist.device, trainable=False), cfg))
        vision = load_vision(model_path, tokenizer)  # None for text models
        trainer_state = resume_checkpoint(engine, cfg.run_dir, resume, dist.rank)  # rank 0 picks it, all load it
        start_step = trainer_state.get("step", 0)
        weights = WholeWeights(engine.module, engine, dist.rank, dist.world_size)  # for the push and save_best
        if dist.is_main:
            native = native_bf16()
            if cfg.model.dtype == "bf16":
                why = f"bf16 native: {native}" if native else "no native bf16 here"
            else:
                why = f"as configured; bf16 would be native: {native}" if native else "bf16 would be emulated here"
            print(f"[apmpo] run {cfg.run_dir}, {dist.world_size} learner rank(s) on {dist.device} in {cfg.model.dtype}"
                  f" ({why}), "
                  f"{'resuming at step ' + str(start_step) if start_step else 'from scratch'}", flush=True)
            driver.connect(engine, weights, tokenizer, vision, trainer_state)  # servers ready; the stream starts
        weights.settle()  # ZeRO-3: the other ranks join the gathers of rank 0's reads until here

        # One full collection now, of all the start-up left, and then the heap it leaves is frozen: the steps'
        # collections never scan it (the first one after start-up took 0.33 s of a 0.25 s step). Unfrozen at the
        # end, so that the interpreter's teardown frees it as usual (triton's bindings report leaks otherwise).
        gc.collect()
        gc.freeze()
        stack.callback(gc.unfreeze)
        gc.enable()
        skipped_in_a_row = 0
        for step in range(start_step + 1, cfg.train.steps + 1):
            step_start = time.perf_counter()
            step_seed = cfg.train.seed * 100_003 + step  # the mini-batch order, resumable

            # ---------------------------------------------------------- 1-4. prompts, generate, score, statistics
            batch = driver.next_batch(step) if dist.is_main else None
            # ---------------------------------------------------------- 5. every rank gets the batch
            payload = [(batch.rollouts, batch.params) if dist.is_main else None]
            torch_dist.broadcast_object_list(payload, src=0)
            rollouts, params = payload[0]

            # ---------------------------------------------------------- 6-7. log-probs, then the optimiser steps
            metrics = train_on_batch(engine, reference, rollouts, params, cfg, dist, tokenizer.pad_token_id, step_seed)
            metrics |= loss_scale_metrics(engine)
            skipped_in_a_row = skipped_in_a_row + 1 if step_failed(cfg, metrics) else 0
            if skipped_in_a_row >= cfg.train.max_skipped_in_a_row:
                raise RuntimeError(
                    f"{skipped_in_a_row} steps in a row had a non-finite loss or gradient norm (step {step}: "
                    f"loss/total={metrics.get('loss/total')}); stopping rather than training on nothing. Check the "
                    "rewards (reward/failures), the learning rate and the model's dtype.")

            # ---------------------------------------------------------- 8-9. weight sync, validate, log (rank 0)
            if dist.is_main:
                metrics |= batch.metrics | batch.times | driver.push(weights)
                metrics["time/step"] = time.perf_counter() - step_start  # validation excluded: not every step
                driver.log(step, metrics, engine, weights)
            weights.settle()
            # ---------------------------------------------------------- 9. checkpoint (every rank)
            if cfg.checkpoint.save_every and (step % cfg.checkpoint.save_every == 0 or step == cfg.train.steps):
                state = driver.resume_state(step + 1) if dist.is_main else {}
                save_checkpoint(engine, cfg.run_dir, step, state, vision or tokenizer, dist.rank,
                                cfg.checkpoint.keep_last, cfg.checkpoint.export_hf)
    close_distributed()
    if dist.is_main:
        print(f"[apmpo] done: {cfg.run_dir}", flush=True)


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
    resume = args.resume or cfg.train.resume
    return preflight.check(cfg, resume), resume


if __name__ == "__main__":
    try:
        config, resume_from = parse_args()
    except ConfigError as error:  # before any process group or server exists
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"apmpo: bad config: {error}", file=sys.stderr)
        sys.exit(2)
    try:  # one run at a time in a run directory: two would write the same checkpoints and logs
        run_lock = dirlock.hold(config.run_dir, "training run") if os.environ.get("RANK", "0") == "0" else None
    except dirlock.Busy as busy:
        print(f"apmpo: {busy}: stop it, or give this run another logging.run_name", file=sys.stderr)
        sys.exit(1)
    except OSError as error:
        print(f"apmpo: bad config: logging.output_dir: cannot write the run directory {config.run_dir} "
              f"({error.strerror or error})", file=sys.stderr)
        sys.exit(2)
    main(config, resume_from)
