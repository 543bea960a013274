"""How far a bf16 engine's next-token distributions are from fp32's, and how much of it an fp32 LM head removes.

    python benchmarks/bf16_mismatch.py --model <a trained policy's hf/ dir> [--samples <its eval samples.jsonl>]

MiniMax-M1 (arXiv 2506.13585) closed its training-inference mismatch by computing the LM head in fp32. This script
measures that remedy on a policy and its own samples: each completion is teacher-forced through the model three
ways, on the same weights (a trained policy's are bf16 values, so fp32 holds them exactly):

- fp32: fp32 compute (what an fp32 engine samples from);
- bf16: bf16 compute, logits to fp32 for the softmax (what a bf16 engine samples from);
- bf16, fp32 head: the same bf16 hidden states, the LM head's matmul in fp32 (MiniMax-M1's remedy).

It prints, per position and on average, each bf16 side's KL to fp32, the |difference| of the sampled token's
log-prob, the entropy (is the bf16 policy flatter?) and P(EOS) where fp32's lies in 0.02-0.98 (is it slower to
stop?). `--samples`: an apmpo.eval samples.jsonl of the policy (its first two samples of each problem), else
`--problems` x 2 completions sampled here at temperature 0.7 by the fp32 model (HF generate).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def sequences(tokenizer, model, samples: str | None, problems: int, max_new_tokens: int) -> list[tuple[list, list]]:
    """(prompt ids, completion ids) pairs: the policy's own samples of arith_test."""
    from apmpo.data import encode_prompt, load_records

    records = load_records("arith_test")
    eos = tokenizer.eos_token_id
    if samples:
        rows = [json.loads(line) for line in open(samples)]
        rows = [r for r in rows if r["sample"] < 2][: 2 * problems]
        return [(encode_prompt(records[r["index"]], tokenizer),
                 tokenizer(r["completion"], add_special_tokens=False)["input_ids"]
                 + [eos] * (r["finish_reason"] == "stop")) for r in rows]
    torch.manual_seed(0)
    pairs = []
    for record in records[:problems]:
        prompt = encode_prompt(record, tokenizer)
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt] * 2), do_sample=True, temperature=0.7, top_p=1.0, top_k=0,
                                 max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id or 0)
        for row in out[:, len(prompt):].tolist():
            pairs.append((prompt, row[: row.index(eos) + 1] if eos in row else row))
    return pairs


def distributions(fp32_model, bf16_model, prompt: list[int], completion: list[int]) -> dict[str, torch.Tensor]:
    """Log-softmax [completion, vocab] at each completion position, the three ways."""
    ids = torch.tensor([prompt + completion])
    span = slice(len(prompt) - 1, ids.shape[1] - 1)
    with torch.no_grad():
        out = bf16_model(ids, output_hidden_states=True)
        hidden = out.hidden_states[-1][0, span]  # after the final norm
        return {"fp32": F.log_softmax(fp32_model(ids).logits[0, span].float(), -1),
                "bf16": F.log_softmax(out.logits[0, span].float(), -1),
                "bf16, fp32 head": F.log_softmax(
                    hidden.float() @ bf16_model.get_output_embeddings().weight.float().T, -1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--samples", help="the policy's apmpo.eval samples.jsonl (else sampled here)")
    parser.add_argument("--problems", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from apmpo import models

    torch.set_num_threads(1)  # beside a running study; one forward per completion
    path = models.resolve(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    fp32_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    bf16_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    pairs = sequences(tokenizer, fp32_model, args.samples, args.problems, args.max_new_tokens)
    sides = ("fp32", "bf16", "bf16, fp32 head")
    kl, dlogp, entropy, eos = ({s: [] for s in sides} for _ in range(4))
    for prompt, completion in pairs:
        logp = distributions(fp32_model, bf16_model, prompt, completion)
        sampled = torch.tensor(completion)[:, None]
        for side in sides:
            p = logp[side].exp()
            kl[side] += (p * (logp[side] - logp["fp32"])).sum(-1).tolist()
            dlogp[side] += (logp[side].gather(1, sampled) - logp["fp32"].gather(1, sampled)).abs()[:, 0].tolist()
            entropy[side] += (-(p * logp[side]).sum(-1)).tolist()
            eos[side] += p[:, tokenizer.eos_token_id].tolist()
    stops = [i for i, x in enumerate(eos["fp32"]) if 0.02 < x < 0.98]  # the positions where it decides to stop
    mean = statistics.fmean
    print(f"{args.model}: {len(pairs)} completions, {len(kl['fp32'])} positions, {len(stops)} stop decisions")
    print(f"{'next-token distribution':>24} | KL to fp32 | |d log p| sampled | entropy | P(EOS) at stop decisions")
    for side in sides:
        print(f"{side:>24} | {mean(kl[side]):10.2e} | {mean(dlogp[side]):16.2e} | {mean(entropy[side]):7.4f} | "
              f"{mean(eos[side][i] for i in stops) if stops else float('nan'):.4f}")
    print(f"ratio fp32 head/bf16 head: KL {mean(kl['bf16, fp32 head']) / mean(kl['bf16']):.2f}x")


if __name__ == "__main__":
    main()
