"""What each learner rank holds under ZeRO-2, ZeRO-3 and ZeRO-3 with the optimiser offloaded, side by side, measured
on 2 CPU ranks (gloo) after one optimiser step, against the formulas of docs/training.md ("Memory").

    python benchmarks/zero_memory.py                                    # SmolLM2-135M-Instruct (fetched), fp32
    python benchmarks/zero_memory.py --model PATH --dtype bf16

Per rank: the parameter bytes it holds (ZeRO-3: its slice), the optimiser's (fp32 master weights and Adam's two
moments, partitioned by every stage), and the process's peak RSS. The formulas, with N ranks, P parameters and
w bytes a weight (4 in fp32, 2 in bf16): weights w*P under ZeRO-2 and w*P/N under ZeRO-3; optimiser 12*P/N, fp32
master weights and Adam's two moments (a copy of its own even where the weights are fp32).
"offload" moves the optimiser's to host memory: on a CPU learner that is the same memory. Peak RSS says little on
CPU: every rank loads the whole model before DeepSpeed partitions it, as on GPU (docs/training.md, "Memory").
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from apmpo.rollout.net import free_port

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"zero2": ["train.zero_stage=2"], "zero3": ["train.zero_stage=3"],
        "zero3_offload": ["train.zero_stage=3", "train.offload_optimizer=cpu"]}


def worker(model_path: str, dtype: str, sets: list[str], out: str) -> None:
    """One optimiser step on 2 x 32 tokens, then what this rank holds."""
    from apmpo.config import load_config
    from apmpo.learner.engine import build_engine, close_distributed, init_distributed, load_model, start_micro_batch
    from apmpo.learner.logprobs import token_logprobs
    from apmpo.learner.zero3 import is_partitioned

    dist = init_distributed()
    # Only the model and ZeRO settings matter here: the data and serving checks are skipped.
    cfg = load_config(None, [f"model.path={model_path}", f"model.dtype={dtype}", *sets])
    engine = build_engine(load_model(model_path, cfg, dist.device), cfg, dist)
    vocab = engine.module.config.vocab_size
    ids = torch.randint(3, vocab, (2, 32), generator=torch.Generator().manual_seed(dist.rank))
    scored = torch.zeros_like(ids, dtype=torch.bool)
    scored[:, 16:] = True
    start_micro_batch(engine, last=True)
    logp, _ = token_logprobs(engine.module, ids, torch.ones_like(ids), scored)
    engine.backward(-logp.sum() / scored.sum())
    engine.step()
    params = list(engine.module.parameters())
    held = sum((p.ds_tensor if is_partitioned(p) else p).numel() * p.element_size() for p in params)
    zero = engine.optimizer  # its fp32 master partitions; torch's AdamW inside it holds the moments
    partitions = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
    master = sum(p.numel() * p.element_size() for p in partitions)
    moments = sum(t.numel() * t.element_size() for state in zero.optimizer.state.values() for t in state.values()
                  if torch.is_tensor(t) and t.dim() > 0)
    numel = sum(p.ds_numel if is_partitioned(p) else p.numel() for p in params)
    record = {"rank": dist.rank, "world": dist.world_size, "numel": numel, "weight_bytes": params[0].element_size(),
              "params": held, "master": master, "moments": moments,
              "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    Path(f"{out}.rank{dist.rank}.json").write_text(json.dumps(record))
    close_distributed()
    # Its record written, the rank leaves without the interpreter's teardown, which this script does not measure: a
    # ZeRO-3 rank aborted there once under CI's load ('terminate called without an active exception'), after the
    # barrier and destroy_process_group of close_distributed.
    sys.stdout.flush()
    os._exit(0)


def expected(record: dict, run: str) -> tuple[float, float]:
    """(weights, optimiser) bytes a rank holds by the formulas."""
    p, n, w = record["numel"], record["world"], record["weight_bytes"]
    weights = w * p / n if run.startswith("zero3") else w * p
    return weights, 12 * p / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (default: the fetched SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--runs", default=",".join(RUNS), help=f"which of {', '.join(RUNS)} (zero2 and zero3 at least)")
    parser.add_argument("--worker", nargs=2, metavar=("RUN", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not {"zero2", "zero3"} <= set(args.runs.split(",")) <= set(RUNS):
        parser.error(f"--runs {args.runs!r}: zero2 and zero3, and optionally zero3_offload")
    if args.model is None:
        from apmpo.models import fetch

        args.model = str(fetch("smollm2-135m-instruct"))
    if args.worker:
        worker(args.model, args.dtype, RUNS[args.worker[0]], args.worker[1])
        return

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run in args.runs.split(","):
            out = os.path.join(tmp, run)
            command = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port",
                       str(free_port()), __file__, "--model", args.model, "--dtype", args.dtype,
                       "--worker", run, out]
            done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900)
            if done.returncode:
                sys.exit(f"{run} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
            rows[run] = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    mib = 1 << 20
    print(f"{rows['zero2'][0]['numel'] / 1e6:.1f}M parameters, {args.dtype}, 2 ranks; MiB per rank (rank 0), "
          "measured (formula)")
    print(f"{'run':>14} | {'weights':>17} | {'optimiser':>17} | {'peak RSS':>8}")
    for run, (record, _) in rows.items():
        weights, optimiser = expected(record, run)
        print(f"{run:>14} | {record['params'] / mib:7.1f} ({weights / mib:7.1f}) | "
              f"{(record['master'] + record['moments']) / mib:7.1f} ({optimiser / mib:7.1f}) | "
              f"{record['peak_rss'] / mib:8.0f}")
    z2, z3 = rows["zero2"][0], rows["zero3"][0]
    print(f"ratio zero3/zero2: weights {z3['params'] / z2['params']:.2f}x, "
          f"peak RSS {z3['peak_rss'] / z2['peak_rss']:.2f}x")


if __name__ == "__main__":
    main()
