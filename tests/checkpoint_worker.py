"""Saves or resumes a checkpoint of a tiny model on the real DeepSpeed engine, without a server.

    python tests/checkpoint_worker.py save RUN_DIR --step 2 [--no-space-check]
    deepspeed --num_gpus 2 tests/checkpoint_worker.py resume RUN_DIR OUT_DIR
    deepspeed --num_gpus 2 tests/checkpoint_worker.py save RUN_DIR OUT_DIR --step 2   # save, then resume

RUN_DIR may contain "{rank}": each rank then has its own run directory, as nodes with node-local disks do.
`resume` writes OUT_DIR/rank<r>.json: the step it resumes at and its first parameter's sum. `save` with an OUT_DIR
then resumes as `resume` does, into a fresh engine on other initial weights (one DeepSpeed launch, not two).
`--no-space-check` is a fake for the one fault the tests cannot cause otherwise: a disk that fills up after the
free-space check passed (it makes the check see no need for space). tests/test_checkpoint.py runs this.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from apmpo.config import load_config  # noqa: E402
from apmpo.learner import checkpoint  # noqa: E402
from apmpo.learner.engine import build_engine, close_distributed, init_distributed  # noqa: E402
from apmpo.tiny import build_model, build_tokenizer  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "resume"])
    parser.add_argument("run_dir")
    parser.add_argument("out_dir", nargs="?")
    parser.add_argument("--step", type=int, default=1)
    parser.add_argument("--no-space-check", action="store_true")
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    cfg = load_config(None, ["model.dtype=fp32", "optim.lr=1e-2"])
    dist = init_distributed(120.0)  # a rank that hangs fails the test within minutes, not hours
    run_dir = Path(args.run_dir.format(rank=dist.rank))
    tokenizer = build_tokenizer()
    if args.mode == "save":  # one optimiser step: Adam's moments exist and are saved, as in training
        engine = build_engine(build_model(tokenizer, seed=args.step).train(), cfg, dist)
        engine.backward(engine(torch.tensor([[5, 6, 7, 8]])).logits.float().pow(2).mean())
        engine.step()
        if args.no_space_check:
            checkpoint.checkpoint_bytes = lambda *a, **k: 0
        checkpoint.save_checkpoint(engine, run_dir, args.step, {"sampler": {"epoch": 0, "position": args.step}},
                                   tokenizer, dist.rank, keep_last=2)
    if args.out_dir is not None:
        engine = build_engine(build_model(tokenizer, seed=args.step + 1).train(), cfg, dist)
        state = checkpoint.resume(engine, run_dir, "auto", dist.rank)
        first = next(engine.module.parameters())
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{dist.rank}.json").write_text(json.dumps({"step": state.get("step", 0),
                                                               "param_sum": float(first.detach().sum())}))
    close_distributed()


if __name__ == "__main__":
    main()
