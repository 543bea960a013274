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
"""
from __future__ import annotations

import argparse
import copy
import time

import torch


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


if __name__ == "__main__":
    main()
