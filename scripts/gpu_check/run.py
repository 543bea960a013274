"""Running the GPU check: the checks by name, each run on its own (one that fails or crashes does not stop the
others), the machine's versions, the PASS/FAIL lines and the JSON report; `main` is the command line
(python -m scripts.gpu_check, which bash scripts/gpu_check.sh runs)."""
from __future__ import annotations

import argparse
import gc
import json
import platform
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

import scripts.gpu_check
from scripts.gpu_check.kernels import check_logprobs, check_loss, check_matmul_peak, check_precision_error
from scripts.gpu_check.learner import check_learner, check_zero2_grads
from scripts.gpu_check.measure import DRY_RUN, GPU, MODEL_DIRS, CheckFailed, GiB, Outcome, Shapes
from scripts.gpu_check.transport import check_transport
from scripts.gpu_check.wheels import DISTRIBUTION_OF, download_command


def check_no_vllm(s: Shapes) -> Outcome:
    loaded = sorted(name for name in sys.modules
                    if name.split(".")[0] == "vllm" or name == "apmpo.rollout.vllm_compat")
    if loaded:
        raise CheckFailed(f"imported: {', '.join(loaded[:10])}")
    return Outcome({"vllm_modules": loaded}, "nothing imported vllm or apmpo.rollout.vllm_compat")


CHECKS: dict[str, Callable[[Shapes], Outcome]] = {
    "matmul_peak": check_matmul_peak,
    "loss": check_loss,
    "logprobs": check_logprobs,
    "transport": check_transport,
    "learner_gc": lambda s: check_learner(s, gradient_checkpointing=True),
    "learner_no_gc": lambda s: check_learner(s, gradient_checkpointing=False),
    "learner_fp32_comm": lambda s: check_learner(s, gradient_checkpointing=True, communication_data_type="fp32"),
    "learner_zero3": lambda s: check_learner(s, gradient_checkpointing=True, zero_stage=3),
    "learner_fp16": lambda s: check_learner(s, gradient_checkpointing=True, dtype="fp16"),
    "precision_error": check_precision_error,
    "zero2_grads": check_zero2_grads,
    "no_vllm": check_no_vllm,  # last: it looks at what the others imported
}


def environment(s: Shapes) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("deepspeed", "transformers"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda, **versions,
            "device": "cpu", "driver": None, "cpu_threads": torch.get_num_threads()}
    if s.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info |= {"device": props.name, "gpu_memory_gib": props.total_memory / GiB,
                 "multiprocessors": props.multi_processor_count, "driver": _driver_version()}
    return info


def _driver_version() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def run_checks(s: Shapes, names: list[str], dry_run: bool) -> dict[str, dict]:
    results = {}
    for name in names:
        start = time.perf_counter()
        try:
            outcome = CHECKS[name](s)
        except CheckFailed as error:
            results[name] = {"status": "fail", "reason": str(error)}
        except ModuleNotFoundError as error:  # a package the GPU box lacks: it cannot fetch one, so say how to carry it
            traceback.print_exc()
            results[name] = {"status": "fail", "reason": (
                f"{error}. Carry it as a wheel: where pip has the internet, {download_command([error.name])} "
                f"(or bash scripts/gpu_wheels.sh, everything the checks need); here, {sys.executable} -m pip install "
                f"--no-index --find-links wheels/ {DISTRIBUTION_OF.get(error.name, error.name)}")}
        except Exception as error:  # noqa: BLE001  (one check's crash, an OOM say, must not stop the others)
            traceback.print_exc()
            results[name] = {"status": "fail", "reason": f"{type(error).__name__}: {error}"[:2000]}
        else:
            judged = "" if outcome.goal is None else (
                f" [goal {outcome.goal[1]} {outcome.goal[2]}x" + (", not judged in --dry-run]" if dry_run else "]"))
            missed = outcome.missed() and not dry_run
            results[name] = {"status": "fail" if missed else "pass", "summary": outcome.summary + judged,
                             "figures": outcome.figures}
            if missed:
                results[name]["reason"] = f"missed the goal: {outcome.summary}{judged}"
        finally:
            gc.collect()
            if s.device == "cuda":
                torch.cuda.empty_cache()
        results[name]["seconds"] = time.perf_counter() - start
        r = results[name]
        print(f"{r['status'].upper()} {name}: {r.get('reason') or r['summary']}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.sh", description=scripts.gpu_check.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="run on CPU at tiny shapes (no goal is judged)")
    parser.add_argument("--out", default="gpu_check.json", help="where the figures go (JSON)")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated checks, of: {', '.join(CHECKS)}")
    args = parser.parse_args(argv)
    names = [name for name in args.only.split(",") if name]
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        parser.error(f"--only: unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    s = DRY_RUN if args.dry_run else GPU
    if s.device == "cuda" and not torch.cuda.is_available():
        print(f"FAIL cuda: torch {torch.__version__} sees no CUDA device (on a CPU machine run --dry-run)", flush=True)
        return 1
    mode = "dry-run (CPU, tiny shapes)" if args.dry_run else "GPU"
    print(f"apmpo GPU check, {mode}; not covered: vLLM (generation, its weight reload), which this check never "
          "imports", flush=True)
    env = environment(s)
    print("  " + ", ".join(f"{k} {v}" for k, v in env.items() if v is not None), flush=True)
    try:
        results = run_checks(s, names, args.dry_run)
    finally:
        for path in MODEL_DIRS.values():
            shutil.rmtree(path, ignore_errors=True)
    passed = all(r["status"] == "pass" for r in results.values())
    report = {"mode": "dry-run" if args.dry_run else "gpu", "passed": passed, "environment": env,
              "shapes": {k: str(v) if isinstance(v, torch.dtype) else v for k, v in asdict(s).items()},
              "not_covered": "vLLM: generation, the engine's in-place weight reload, NCCL to a server",
              "checks": results}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'all checks passed' if passed else 'FAILED: ' + ', '.join(n for n, r in results.items() if r['status'] != 'pass')}"
          f"; figures in {args.out}", flush=True)
    return 0 if passed else 1
