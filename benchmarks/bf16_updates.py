"""How much of an optimiser update a bf16 forward sees: issue 45's first suspect, measured in isolation.

    python benchmarks/bf16_updates.py [--model smollm2-135m-instruct] [--lr 1e-5] [--problems 8]

A bf16 learner keeps fp32 master weights (DeepSpeed bf16 + ZeRO), but its forward reads their bf16 copy, and a
weight's bf16 copy moves only once the master has moved by half a bf16 step (2^-8 of the weight, relative). Adam's
first updates are about lr * sign(gradient) per weight. This script takes the gradient of the log-likelihood of
correct answers to arithmetic problems (arith_train, the SmolLM2 config's task), applies k such steps of size lr to
the fp32 weights, and measures the change of the answers' log-probabilities three ways:

- fp32: fp32 weights, fp32 compute (what an fp32 learner sees);
- bf16 weights: the same weights rounded to bf16, fp32 compute (the rounding alone);
- bf16: a bf16 model, logits to fp32 for the log-softmax (what apmpo's bf16 learner sees).

It prints, per k, each mean change and its ratio to fp32's, and the share of weights whose bf16 value moved. A ratio
well below 1 at the k of one rollout batch (4 optimiser steps in configs/smollm2_arith.yaml) means the bf16 learner's
forward lags its own master weights. Per token it compares bf16's log-ratio log pi_k / pi_0 (what a PPO ratio sees)
with fp32's: their correlation, and the mean |difference| over fp32's mean |log-ratio| (the rounding's share).

Then (`--learner-prompts`, 0 to skip) the learner itself: `train_on_batch` (apmpo/learner/step.py; DeepSpeed ZeRO-2,
configs/smollm2_arith.yaml's loss and optimiser, 4 optimiser steps) runs once as an fp32 and once as a bf16 learner,
from the same weights on the same batch (`--learner-prompts` x 4 completions sampled from the model, scored by the
math reward; `--reward parity` for a random model). It prints how the two fp32 master-weight updates compare
(norms, cosine, sign agreement) and how much each raises the batch's GRPO surrogate sum_i A_i mean_t log pi(y_it),
measured by an fp32 forward.

Then (`--learner-batches N`) the learner over many updates: N batches of `--learner-prompts` x 4 completions go
through an fp32 learner, a bf16 learner whose fp32 masters start on the bf16 grid (`optim.dither_master=false`) and a
dithered one (the default), the same batches in the same order. Every second batch it prints the GRPO surrogate each
has gained on held-out rollouts, by the learner's own forward, by fp32 compute on its weights (for bf16, the rounding
of its weights alone) and by fp32 compute on its fp32 masters (what the optimiser holds), with the share of bf16
weights that have moved. `--reward finished` (the math reward + 1 for ending within the budget) gives most groups a
gradient, as the length SmolLM2's runs learn first does:

    python benchmarks/bf16_updates.py --learner-prompts 8 --learner-batches 6 --max-new-tokens 96 --reward finished
"""
from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def answer_logprobs(model, batch, fp32_head: bool = False) -> torch.Tensor:
    """The answer tokens' log-probabilities [M], the log-softmax in fp32 (as apmpo.learner.logprobs); `fp32_head`:
    the LM head's matmul in fp32 too, on the backbone's (bf16) hidden states."""
    ids, mask = batch
    with torch.no_grad():
        if fp32_head:
            hidden = model.model(input_ids=ids).last_hidden_state[:, :-1].float()
            logits = hidden @ model.get_output_embeddings().weight.float().T
        else:
            logits = model(input_ids=ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return logp[mask[:, 1:].bool()]


def make_batch(tokenizer, problems: int):
    from apmpo.data import build_messages, load_records

    rows, masks = [], []
    for record in load_records("arith_train")[:problems]:
        prompt = tokenizer.apply_chat_template(build_messages(record), tokenize=False, add_generation_prompt=True)
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a = tokenizer(f"The answer is \\boxed{{{record['answer']}}}.{tokenizer.eos_token or ''}",
                      add_special_tokens=False)["input_ids"]
        rows.append(p + a)
        masks.append([0.0] * len(p) + [1.0] * len(a))
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id or 0
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([m + [0.0] * (width - len(m)) for m in masks])
    return ids, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--steps", default="1,4,16,64")
    parser.add_argument("--learner-prompts", type=int, default=16, help="0: skip the learner comparison")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--reward", choices=["math", "finished", "parity"], default="math",
                        help="finished: math + 1 for ending within --max-new-tokens; parity: 1 where the first "
                             "sampled token's id is even (a random model's smoke run)")
    parser.add_argument("--learner-batches", type=int, default=0,
                        help="then this many batches through each learner: fp32, bf16 on the grid, bf16 dithered")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from apmpo import models

    path = models.resolve(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = make_batch(tokenizer, args.problems)
    tick = time.perf_counter()
    ids, mask = batch
    logits = model(input_ids=ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    ((logp * mask[:, 1:]).sum() / mask[:, 1:].sum()).backward()
    direction = {n: p.grad.sign() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    master = {n: p.detach().clone() for n, p in model.named_parameters()}
    bf16_model = copy.deepcopy(model).to(torch.bfloat16)
    base = {"fp32": answer_logprobs(model, batch)}
    for n, p in model.named_parameters():
        p.data.copy_(master[n].bfloat16().float())
    base["bf16 weights"] = answer_logprobs(model, batch)
    base["bf16"] = answer_logprobs(bf16_model, batch)
    print(f"{args.model}, lr {args.lr:g}, {args.problems} problems ({int(mask.sum())} answer tokens); "
          f"answers' mean log-prob before: fp32 {base['fp32'].mean():.5f}, "
          f"bf16 weights {base['bf16 weights'].mean():.5f}, bf16 {base['bf16'].mean():.5f}")
    error = {name: float((base[name] - base["fp32"]).abs().mean()) for name in ("bf16 weights", "bf16")}
    head = float((answer_logprobs(bf16_model, batch, fp32_head=True) - base["fp32"]).abs().mean())
    print(f"mean |log-prob - fp32's| a token: bf16 weights {error['bf16 weights']:.4f}, bf16 {error['bf16']:.4f}, "
          f"bf16 with the LM head in fp32 {head:.4f}")
    print("Per token, the bf16 log-ratio log pi_k / pi_0 against fp32's: their correlation, and the mean |difference|")
    print("over fp32's mean |log-ratio| (the rounding's share of what a PPO ratio sees).")
    print(f"{'k steps':>8} | {'fp32 change':>12} | {'bf16 weights':>20} | {'bf16':>20} | bf16 weights moved | "
          "per token: corr, noise/signal")
    for k in [int(x) for x in args.steps.split(",")]:
        moved = total = 0
        changes = {}
        for n, p in model.named_parameters():
            p.data.copy_(master[n] + k * args.lr * direction.get(n, 0))
        ratios = {"fp32": answer_logprobs(model, batch) - base["fp32"]}
        for (n, p), (_, q) in zip(model.named_parameters(), bf16_model.named_parameters()):
            rounded = p.data.bfloat16()
            moved += int((rounded != master[n].bfloat16()).sum())
            total += rounded.numel()
            q.data.copy_(rounded)
            p.data.copy_(rounded.float())
        ratios["bf16 weights"] = answer_logprobs(model, batch) - base["bf16 weights"]
        ratios["bf16"] = answer_logprobs(bf16_model, batch) - base["bf16"]
        changes = {name: float(r.mean()) for name, r in ratios.items()}
        f = changes["fp32"]
        corr = float(torch.corrcoef(torch.stack([ratios["fp32"], ratios["bf16"]]))[0, 1])
        noise = float((ratios["bf16"] - ratios["fp32"]).abs().mean() / ratios["fp32"].abs().mean())
        print(f"{k:>8} | {f:>12.2e} | {changes['bf16 weights']:>10.2e} ({changes['bf16 weights'] / f:5.2f}x) | "
              f"{changes['bf16']:>10.2e} ({changes['bf16'] / f:5.2f}x) | {moved / total:.1%} | "
              f"{corr:.2f}, {noise:.2f}")
    print(f"({time.perf_counter() - tick:.0f} s)")
    if args.learner_prompts:
        fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # `model` was rounded above
        compare_learners(path, tokenizer, fresh, args.learner_prompts, args.max_new_tokens, args.reward)
    if args.learner_batches:
        fresh = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        compare_over_batches(path, tokenizer, fresh, args.learner_prompts, args.learner_batches, args.max_new_tokens,
                             args.reward)


def sampled_batch(model, tokenizer, prompts: int, group: int, max_new_tokens: int, reward: str):
    """`prompts` arith_train problems x `group` completions sampled at temperature 0.7, as Rollouts with advantages,
    and their rewards [prompts, group]."""
    from apmpo.data import build_messages, load_records
    from apmpo.trajectory import Rollout
    from apmpo.loss import group_advantages
    from apmpo.rewards import math_reward

    records = load_records("arith_train")[100 : 100 + prompts]  # not the problems of the sections above
    texts = [tokenizer.apply_chat_template(build_messages(r), tokenize=False, add_generation_prompt=True)
             for r in records for _ in range(group)]
    tokenizer.padding_side = "left"
    inputs = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=True, temperature=0.7, top_p=1.0, top_k=0,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id or 0)
    eos = tokenizer.eos_token_id
    pairs, rewards = [], torch.zeros(prompts, group)
    for k, (row, attention) in enumerate(zip(out, inputs["attention_mask"])):
        completion = row[inputs["input_ids"].shape[1]:].tolist()
        if eos in completion:
            completion = completion[: completion.index(eos) + 1]
        pairs.append((inputs["input_ids"][k][attention.bool()].tolist(), completion))
        if reward == "parity":
            rewards.view(-1)[k] = float(completion[0] % 2 == 0)
        else:  # "finished" adds 1 for ending within the budget: what SmolLM2's runs learn first
            rewards.view(-1)[k] = math_reward(tokenizer.decode(completion, skip_special_tokens=True),
                                              records[k // group]) + (reward == "finished") * (completion[-1] == eos)
    advantages = group_advantages(rewards).view(-1)
    rollouts = [Rollout(prompt, completion, [0.0] * len(completion), "stop", group=k // group,
                        reward=float(rewards.view(-1)[k]), advantage=float(advantages[k]))
                for k, (prompt, completion) in enumerate(pairs)]
    return rollouts, rewards


def surrogate(model, rollouts) -> float:
    """sum_i A_i mean_t log pi(y_it) over the batch, fp32."""
    def completion(r):  # answer_logprobs' batch: the ids, and a mask over the completion
        return torch.tensor([r.prompt_ids + r.completion_ids]), torch.tensor(
            [[0.0] * len(r.prompt_ids) + [1.0] * len(r.completion_ids)])

    return sum(r.advantage * float(answer_logprobs(model, completion(r)).mean()) for r in rollouts if r.advantage)


def compare_learners(path: str, tokenizer, model, prompts: int, max_new_tokens: int, reward: str,
                     group: int = 4) -> None:
    import deepspeed

    from apmpo.config import load_config
    from apmpo.learner.engine import build_engine, init_distributed
    from apmpo.learner.step import train_on_batch
    from apmpo.loss import adaptive_params

    tick = time.perf_counter()
    rollouts, rewards = sampled_batch(model, tokenizer, prompts, group, max_new_tokens, reward)
    mini_batch = max(1, prompts // 4)  # the config's 4 optimiser steps a batch, where there are 4 prompts or more
    print(f"\nOne learner update ({prompts // mini_batch} optimiser steps) on {prompts} x {group} sampled completions "
          f"(mean reward {float(rewards.mean()):.3f}, {int((rewards.std(1) > 0).sum())} groups of {prompts} with a "
          f"gradient; {time.perf_counter() - tick:.0f} s to sample):")
    dist = init_distributed()
    deltas = {}
    for dtype in ("fp32", "bf16"):
        cfg = load_config(str(ROOT / "configs" / "smollm2_arith.yaml"),
                          [f"model.path={path}", f"model.dtype={dtype}", f"rollout.prompts_per_step={prompts}",
                           f"train.mini_batch_size={mini_batch}", "optim.warmup_steps=0"])
        learner = copy.deepcopy(model).to(torch.float32 if dtype == "fp32" else torch.bfloat16).train()
        learner.config.use_cache = False
        engine = build_engine(learner, cfg, dist)

        def master() -> dict[str, torch.Tensor]:  # the fp32 weights the optimiser steps (bf16: not the module's)
            return {n: deepspeed.utils.safe_get_full_fp32_param(p).clone()
                    for n, p in engine.module.named_parameters()}

        before = master()
        metrics = train_on_batch(engine, None, rollouts, adaptive_params(rewards, cfg.loss), cfg, dist,
                                 tokenizer.pad_token_id or 0, seed=0)
        deltas[dtype] = {n: p - before[n] for n, p in master().items()}
        print(f"  {dtype} learner: approx_kl {metrics['policy/approx_kl']:.2e}, clipped "
              f"{metrics['loss/clip_frac_lower'] + metrics['loss/clip_frac_upper']:.2%} of tokens (its own forward)")
    flat = {k: torch.cat([v.flatten().double() for v in d.values()]) for k, d in deltas.items()}
    a, b = flat["fp32"], flat["bf16"]
    same_sign = float((a.sign() == b.sign())[a != 0].double().mean())
    print(f"  master-weight update: |bf16| / |fp32| {float(b.norm() / a.norm()):.3f}, cosine "
          f"{float(a @ b / a.norm() / b.norm()):.3f}, same sign {same_sign:.1%}")
    start = surrogate(model, rollouts)
    for dtype, delta in deltas.items():
        moved = copy.deepcopy(model)
        with torch.no_grad():
            for n, p in moved.named_parameters():
                p.add_(delta[n])
        raised = surrogate(moved, rollouts) - start
        print(f"  surrogate raised by the {dtype} learner's update (fp32 forward): {raised:+.4f}")


def compare_over_batches(path: str, tokenizer, model, prompts: int, batches: int, max_new_tokens: int, reward: str,
                         group: int = 4) -> None:
    """`batches` rollout batches through each learner in turn, the same ones in the same order: fp32, bf16 with its
    fp32 masters on the bf16 grid (optim.dither_master=false), bf16 dithered. Every second batch, the GRPO surrogate
    each has gained on held-out rollouts (two more batches) three ways: by its own forward, by fp32 compute on its
    weights (for bf16: the rounding alone), and by fp32 compute on its fp32 masters (what the optimiser holds)."""
    import dataclasses

    import deepspeed

    from apmpo.config import load_config
    from apmpo.learner.engine import build_engine, init_distributed
    from apmpo.learner.step import train_on_batch
    from apmpo.loss import adaptive_params

    tick = time.perf_counter()
    sampler = copy.deepcopy(model).to(torch.bfloat16)  # only the data: bf16 samples as fast, and the same for all
    rollouts, rewards = sampled_batch(sampler, tokenizer, prompts * (batches + 2), group, max_new_tokens, reward)
    size = prompts * group
    data = [([dataclasses.replace(r, group=k // group) for k, r in enumerate(rollouts[b * size:(b + 1) * size])],
             rewards[b * prompts:(b + 1) * prompts]) for b in range(batches)]
    held = rollouts[batches * size:]
    mini_batch = max(1, prompts // 4)
    print(f"\n{batches} batches of {prompts} x {group} completions ({batches * prompts // mini_batch} optimiser steps; "
          f"mean reward {[round(float(r.mean()), 2) for _, r in data]}; {time.perf_counter() - tick:.0f} s to "
          f"sample), through each learner in turn. The GRPO surrogate gained on {len(held) // group} held-out "
          "prompts x 4, by the learner's own forward / by fp32 compute on its weights / on its fp32 masters:")
    start = {"fp32": surrogate(model, held), "bf16": surrogate(sampler, held),
             "rounded": surrogate(copy.deepcopy(sampler).float(), held)}
    dist = init_distributed()
    for name, dtype, dither in (("fp32", "fp32", False), ("bf16, masters on the grid", "bf16", False),
                                ("bf16, dithered masters", "bf16", True)):
        cfg = load_config(str(ROOT / "configs" / "smollm2_arith.yaml"),
                          [f"model.path={path}", f"model.dtype={dtype}", f"optim.dither_master={dither}",
                           f"rollout.prompts_per_step={prompts}", f"train.mini_batch_size={mini_batch}"])
        learner = copy.deepcopy(model).to(torch.float32 if dtype == "fp32" else torch.bfloat16).train()
        learner.config.use_cache = False
        engine = build_engine(learner, cfg, dist)
        cells = []
        for b, (batch, batch_rewards) in enumerate(data):
            train_on_batch(engine, None, batch, adaptive_params(batch_rewards, cfg.loss), cfg, dist,
                           tokenizer.pad_token_id or 0, seed=b)
            if b % 2 == 0 and b + 1 < batches:
                continue
            own = surrogate(engine.module.eval(), held) - start[dtype]
            engine.module.train()
            if dtype == "fp32":  # its weights are its masters: all three views are its own forward
                cells.append(f"{b + 1}: {own:+.3f} / {own:+.3f} / {own:+.3f}")
                continue
            weights = copy.deepcopy(engine.module).float()
            rounded = surrogate(weights, held) - start["rounded"]
            with torch.no_grad():
                for p, q in zip(weights.parameters(), engine.module.parameters()):
                    p.copy_(deepspeed.utils.safe_get_full_fp32_param(q))
            masters = surrogate(weights, held) - start["fp32"]
            moved = sum(int((p != q).sum()) for p, q in zip(engine.module.parameters(), sampler.parameters()))
            cells.append(f"{b + 1}: {own:+.3f} / {rounded:+.3f} / {masters:+.3f} "
                         f"({moved / sum(p.numel() for p in sampler.parameters()):.1%} moved)")
        print(f"  {name:<26} " + " | ".join(cells))


if __name__ == "__main__":
    main()
