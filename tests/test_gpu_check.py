"""scripts/gpu_check.sh: the GPU check's code runs here on CPU at tiny shapes (`--dry-run`), so it cannot rot
while CI has no GPU. Its figures are not judged here, only that every check runs and reports them. Its parts that
need no device (judging a goal, running checks by name, the report's lines, the adapter's plan, what to carry to
the GPU machine) are tested as functions of the package scripts/gpu_check/."""
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from importlib.metadata import requires

from packaging.utils import canonicalize_name
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from scripts.gpu_check import measure, run, transport, wheels

ROOT = Path(__file__).resolve().parents[1]

FIGURES = {  # per check, the figures the issue asks for: each must be a positive finite number
    "matmul_peak": ["tflops"],
    "learner_gc": ["tokens_per_s", "mfu", "mfu_with_attention", "peak_memory_gib", "logprob_tokens_per_s"],
    "learner_no_gc": ["tokens_per_s", "mfu", "mfu_with_attention", "peak_memory_gib", "logprob_tokens_per_s"],
    "loss": ["grpo_ms", "apmpo_ms", "apmpo_over_grpo", "compiled_apmpo_over_grpo"],
    "logprobs": ["chunked_extra_gib", "naive_extra_gib", "chunked_over_naive"],
    "learner_fp32_comm": ["tokens_per_s", "mfu", "peak_memory_gib"],
    "learner_zero3": ["tokens_per_s", "mfu", "peak_memory_gib"],
    "transport": ["bytes_per_s", "raw_copy_bytes_per_s", "ratio_to_raw_copy"],
    "zero2_grads": ["tensors"],
    "learner_fp16": ["tokens_per_s", "peak_memory_gib", "loss_scale", "masters_dithered_share"],
    "precision_error": ["rms_rel_fp32", "rms_rel_bf16", "rms_rel_bf16 + fp32 head", "rms_rel_fp16", "abs_nats_fp16"],
}


def absent(tmp_path: Path, package: str) -> Path:
    """A FAKE: a folder whose `package` fails to import as an uninstalled one does. vLLM and DeepSpeed are
    installed here; the GPU box has no vLLM, and may lack DeepSpeed."""
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text(
        f'raise ModuleNotFoundError("No module named {package!r} (a fake: blocked by the test)", name={package!r})\n')
    return tmp_path


def gpu_check_sh(*args: str, pythonpath: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def check_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if re.match(r"(PASS|FAIL) \w+:", line)]


@pytest.mark.slow  # about 20 s of CPU (50 s on the shared 2-core machine)
def test_dry_run_passes_every_check_and_writes_the_figures_without_vllm(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = gpu_check_sh("--dry-run", "--out", str(out), pythonpath=absent(tmp_path, "vllm"), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert [line.split(":")[0] for line in check_lines(result.stdout)] == [f"PASS {name}" for name in run.CHECKS]

    report = json.loads(out.read_text())
    assert report["mode"] == "dry-run" and report["passed"] is True
    assert report["environment"]["torch"] == torch.__version__
    assert {name: r["status"] for name, r in report["checks"].items()} == {name: "pass" for name in run.CHECKS}
    for name, keys in FIGURES.items():
        figures = report["checks"][name]["figures"]
        for key in keys:
            assert isinstance(figures[key], (int, float)) and math.isfinite(figures[key]) and figures[key] > 0, \
                (name, key, figures[key])
    assert report["checks"]["learner_gc"]["figures"]["gradient_checkpointing"] is True
    assert report["checks"]["learner_no_gc"]["figures"]["gradient_checkpointing"] is False
    assert report["checks"]["learner_gc"]["figures"]["communication_data_type"] == "float32"  # a dry run is fp32
    assert report["checks"]["learner_fp32_comm"]["figures"]["communication_data_type"] == "float32"
    assert report["checks"]["learner_zero3"]["figures"]["zero_stage"] == 3
    fp16 = report["checks"]["learner_fp16"]["figures"]
    # DeepSpeed's fp16 through the dry run's workaround: scaled from 2^16, masters dithered on fp16's grid
    assert fp16["dtype"] == "fp16" and fp16["loss_scale"] <= 2**16 and fp16["skipped_steps"] < fp16["steps"]
    assert 0.5 < fp16["masters_dithered_share"] <= 1
    assert report["checks"]["zero2_grads"]["figures"]["max_relative_diff"] <= 1e-4
    assert report["checks"]["logprobs"]["figures"]["vocab"] == 151_936
    assert report["checks"]["transport"]["figures"]["transport"] in ("shm", "gloo")  # cuda_ipc's CPU stand-ins
    assert report["checks"]["no_vllm"]["figures"]["vllm_modules"] == []


def test_without_deepspeed_the_learner_fails_with_instructions_and_the_other_checks_run(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = gpu_check_sh("--dry-run", "--only", "learner_gc,matmul_peak", "--out", str(out),
                          pythonpath=absent(tmp_path, "deepspeed"), timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr[-4000:]
    lines = check_lines(result.stdout)
    assert [line.split(":")[0] for line in lines] == ["FAIL learner_gc", "PASS matmul_peak"]
    assert lines[0].startswith("FAIL learner_gc: DeepSpeed is not importable here (No module named 'deepspeed'")
    assert "pip wheel --no-deps --no-build-isolation -w wheels/" in result.stdout
    assert "-m pip install --no-index --find-links wheels/ deepspeed" in result.stdout
    report = json.loads(out.read_text())
    assert report["passed"] is False
    assert [report["checks"][name]["status"] for name in ("learner_gc", "matmul_peak")] == ["fail", "pass"]


def test_an_unknown_check_is_refused_by_name(tmp_path):
    result = gpu_check_sh("--dry-run", "--only", "loss,lerner", pythonpath=tmp_path, timeout=120)
    assert result.returncode == 2
    assert "unknown check(s) lerner" in result.stderr


def test_the_deepspeed_requirements_listed_are_those_of_the_installed_deepspeed():
    """The GPU box is told which of these it lacks; they must not drift from DeepSpeed's own list."""
    needs = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requires("deepspeed") if "extra ==" not in r}
    assert needs == set(wheels.DEEPSPEED_REQUIRES)


def test_a_missing_module_is_fetched_under_its_distributions_name():
    assert wheels.download_command(["yaml", "math_verify", "einops"]).endswith(" pyyaml math-verify einops")


def test_the_wheel_folder_holds_what_the_checks_import():
    """scripts/gpu_wheels.sh fetches scripts/gpu_wheels.txt's distributions and all they require. Every
    distribution that the code the checks load imports (at module level or in a function) must be among them or
    be the GPU machine's torch, but for the few named below, which the checks never reach. No download here."""
    probe = """
import ast, json, sys, importlib.util
from importlib.metadata import packages_distributions
from pathlib import Path
root = Path.cwd()
import scripts.gpu_check.run
import benchmarks.loss_overhead, apmpo.learner.step, apmpo.learner.logprobs, apmpo.rollout.weight_sync  # what the checks import inside
files = {Path(m.__file__).resolve() for m in list(sys.modules.values()) if getattr(m, "__file__", None)}
roots = set()
for f in (f for f in files if f.is_relative_to(root) and f.suffix == ".py" and f.is_file()
                                    and "site-packages" not in f.parts):
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
dists = packages_distributions()
print(json.dumps(sorted({d for r in roots for d in dists.get(r, [])})))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = {canonicalize_name(name) for name in json.loads(done.stdout.splitlines()[-1])}
    wheels_spec = importlib.util.spec_from_file_location("gpu_wheels", ROOT / "scripts" / "gpu_wheels.py")
    gpu_wheels = importlib.util.module_from_spec(wheels_spec)
    wheels_spec.loader.exec_module(gpu_wheels)
    carried = set(gpu_wheels.pins("3.12"))
    never_reached = {"apmpo": "this clone, on PYTHONPATH", "datasets": "hub datasets (apmpo.data), not loaded",
                     "pyarrow": "through datasets", "wandb": "an optional logger (apmpo.learner.metrics)",
                     "peft": "LoRA adapters (apmpo.learner.lora), imported only for a model.lora run",
                     "gguf": "the model fetch (apmpo.models)", "accelerate": "the model fetch (apmpo.models)"}
    assert imported - carried - {"torch"} - set(never_reached) == set()
    assert {"deepspeed", "transformers", "pyyaml", "math-verify", "requests", "hjson", "py-cpuinfo"} <= carried
    assert "torch" not in carried and "sympy" not in carried  # the machine's torch and its requirements


@pytest.mark.parametrize("goal, missed", [(None, False), ((1.2, "<=", 1.1), True), ((1.1, "<=", 1.1), False),
                                          ((0.2, ">=", 0.25), True), ((0.25, ">=", 0.25), False)])
def test_a_goal_is_missed_only_on_its_wrong_side(goal, missed):
    assert measure.Outcome({}, "", goal).missed() is missed


def test_the_median_skips_the_warm_up(monkeypatch):
    # A FAKE clock, which only the function timed moves: its runs take 10, 1, 3, 2 s. With warmup=1 and repeats=3
    # the warm-up's 10 is dropped, and the median of 1, 3, 2 is 2.
    clock, durations = [0.0], iter([10.0, 1.0, 3.0, 2.0])
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def run_once() -> None:
        clock[0] += next(durations)

    assert measure.median_seconds(run_once, "cpu", repeats=3, warmup=1) == 2.0


def test_checks_run_by_name_each_on_its_own_and_the_report_says_how_each_ended(monkeypatch, tmp_path, capsys):
    def slow(s):  # misses its goal: failed on the GPU, reported but not judged in a dry run
        return measure.Outcome({"x": 1.5}, "1.50x", goal=(1.5, "<=", 1.1))

    def wrong(s):
        raise measure.CheckFailed("bytes differ")

    def lacking(s):  # a package the GPU machine lacks: the reason says how to carry it, under its distribution's name
        raise ModuleNotFoundError("No module named 'yaml'", name="yaml")

    def crashing(s):
        raise ValueError("out of memory")

    checks = {"slow": slow, "wrong": wrong, "lacking": lacking, "crashing": crashing}
    monkeypatch.setattr(run, "CHECKS", checks)
    results = run.run_checks(measure.DRY_RUN, ["slow", "wrong", "lacking", "crashing"], dry_run=True)
    assert {name: r["status"] for name, r in results.items()} == {"slow": "pass", "wrong": "fail", "lacking": "fail",
                                                                  "crashing": "fail"}
    assert results["slow"]["summary"] == "1.50x [goal <= 1.1x, not judged in --dry-run]"
    assert results["slow"]["figures"] == {"x": 1.5}
    assert results["wrong"]["reason"] == "bytes differ"
    assert results["lacking"]["reason"].startswith("No module named 'yaml'. Carry it as a wheel: where pip has the "
                                                   "internet, .venv/bin/python -m pip download")
    assert results["lacking"]["reason"].endswith("-m pip install --no-index --find-links wheels/ pyyaml")
    assert results["crashing"]["reason"] == "ValueError: out of memory"
    assert all(r["seconds"] >= 0 for r in results.values())
    assert run.run_checks(measure.DRY_RUN, ["slow"], dry_run=False)["slow"] == {
        "status": "fail", "summary": "1.50x [goal <= 1.1x]", "figures": {"x": 1.5},
        "reason": "missed the goal: 1.50x [goal <= 1.1x]", "seconds": pytest.approx(0, abs=1)}
    lines = [line for line in capsys.readouterr().out.splitlines() if re.match(r"(PASS|FAIL) \w+:", line)]
    assert lines[:2] == ["PASS slow: 1.50x [goal <= 1.1x, not judged in --dry-run]", "FAIL wrong: bytes differ"]

    out = tmp_path / "report.json"
    assert run.main(["--dry-run", "--only", "slow,wrong", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["mode"] == "dry-run" and report["passed"] is False
    assert report["shapes"]["dtype"] == "torch.float32" and report["shapes"]["device"] == "cpu"
    assert [(name, r["status"]) for name, r in report["checks"].items()] == [("slow", "pass"), ("wrong", "fail")]
    assert capsys.readouterr().out.splitlines()[-1] == f"FAILED: wrong; figures in {out}"


def test_the_adapter_pushed_has_both_halves_of_every_linear_layer_at_its_rank():
    # TINY: hidden 64, ffn 128, 2 heads and 1 key-value head, so k and v project to 64 / 2 * 1 = 32. Per layer, at
    # rank 16, elements: q 16*64 + 64*16 = 2048, k 16*64 + 32*16 = 1536, v 1536, o 2048, gate 16*64 + 128*16 = 3072,
    # up 3072, down 16*128 + 64*16 = 3072: 16384 a layer, 32768 for 2 layers, 131072 bytes in fp32.
    buckets = transport.adapter_buckets_of(measure.TINY, torch.float32, bucket_bytes=64 << 10)
    specs = [spec for bucket in buckets for spec in bucket.tensors]
    assert len(specs) == 2 * 7 * 2
    assert specs[0].name == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert (specs[0].shape, specs[1].shape) == ((16, 64), (64, 16))
    assert sum(math.prod(spec.shape) for spec in specs) * 4 == 131072
    assert all(spec.dtype == "float32" for spec in specs)


def test_the_payload_is_the_same_on_both_sides_of_a_push():
    buckets = transport.adapter_buckets_of(measure.TINY, torch.float32, bucket_bytes=64 << 10)
    sent, received = transport.payload(buckets, "cpu", seed=1), transport.payload(buckets, "cpu", seed=1)
    pairs = list(zip(sent, received, [spec for bucket in buckets for spec in bucket.tensors], strict=True))
    assert all(torch.equal(a, b) and a.shape == spec.shape for a, b, spec in pairs)
    assert not torch.equal(next(transport.payload(buckets, "cpu", seed=2)), pairs[0][0])
