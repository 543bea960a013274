"""ZeRO-3 end to end: the quickstart with 2 learner ranks (gloo, started as DeepSpeed's launcher starts them; the
launcher itself: tests/test_train_cli.py), each holding half
of every weight. Every reader of whole weights is on the path: the push after each step (streamed, a module's
parameters gathered at a time, the other rank joining rank 0's gathers), the checkpoints' hf/ export, save_best
after each validation, and the KL reference (partitioned as the policy is). The step itself against ZeRO-2's, and
the memory per rank: tests/test_learner.py."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from apmpo import preflight
from apmpo.config import ConfigError, load_config
from apmpo.learner.checkpoint import check_zero_stage, saved_zero_stage
from test_validation import CLI as EVAL_CLI  # the quickstart's validation settings, as the eval CLI takes them
from train_runs import ROOT, Ranks, metrics, train_command, warm_run

ZERO3_RUN = ("train.zero_stage=3", "loss.kl_beta=0.01", "train.steps=4", "checkpoint.save_every=2",
             "checkpoint.keep_last=3", "eval.every=2", "eval.limit=40",
             "checkpoint.keep_best=val/quickstart_val/pass@1")


def on_two_ranks(command: list[str], logs: Path) -> str:
    """`command` as 2 learner ranks; rank 0's output once both have ended, each with exit code 0."""
    codes, outputs = Ranks(command, 2, logs).finish(900)
    assert codes == [0, 0], outputs[0][-4000:] + outputs[1][-4000:]
    return outputs[0]


def zero3_command(out_dir, servers: str, *extra: str) -> list[str]:
    """ZERO3_RUN generating on `servers` (conftest's quickstart_servers: rollout.urls)."""
    return [*train_command("configs/quickstart.yaml", *ZERO3_RUN, servers, f"logging.output_dir={out_dir}"), *extra]


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, quickstart_servers):
    out = tmp_path_factory.mktemp("zero3")
    return on_two_ranks(zero3_command(out, quickstart_servers.urls()), out / "logs"), out / "quickstart"


@pytest.mark.slow
def test_zero3_trains_checkpoints_and_exports_on_two_ranks(zero3_run, tmp_path):
    output, run_dir = zero3_run
    assert "2 learner rank(s)" in output
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["train/skipped_steps"] == 0 and r["loss/kl"] > 0 for r in rows)  # the reference was used
    # Each rank saved its own slice of the weights and of the optimiser state.
    states = sorted(p.name for p in (run_dir / "checkpoints/step_4/deepspeed").glob("*_states.pt"))
    assert sum("optim_states" in name for name in states) == 2 and sum("model_states" in name for name in states) == 2
    # hf/ holds whole weights: a fresh server on it (as `python -m apmpo.eval` starts one) scores the step-4
    # validation's prompts as the run's server did after step 4's push, to the last digit.
    export = run_dir / "checkpoints" / "step_4" / "hf"
    model = AutoModelForCausalLM.from_pretrained(export)
    assert all(p.numel() > 0 and torch.isfinite(p).all() for p in model.parameters())
    cli = tmp_path / "cli"
    evaluated = warm_run([sys.executable, "-m", "apmpo.eval", "--model", str(export), *EVAL_CLI, "--seeds", "0",
                          "--out", str(cli)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads((cli / "results.json").read_text())["benchmarks"]["quickstart_val"]
    assert rows[3]["val/quickstart_val/pass@1"] == result["pass@1"]["mean"]
    assert rows[3]["val/quickstart_val/length_mean"] == result["mean_tokens"]  # the same samples, token for token
    best = json.loads((run_dir / "checkpoints" / "best" / "best.json").read_text())
    assert best["value"] == max(rows[1]["val/quickstart_val/pass@1"], rows[3]["val/quickstart_val/pass@1"])
    assert (run_dir / "checkpoints" / "best" / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_zero3_resumes_on_both_ranks_to_the_same_next_steps(zero3_run, quickstart_servers, tmp_path):
    _, run_dir = zero3_run
    shutil.copytree(run_dir, tmp_path / "quickstart")
    shutil.rmtree(tmp_path / "quickstart" / "checkpoints" / "step_4")
    output = on_two_ranks(zero3_command(tmp_path, quickstart_servers.urls(), "--resume"), tmp_path / "logs")
    assert "resuming at step 2" in output
    reference, resumed = metrics(run_dir), metrics(tmp_path / "quickstart")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for want, got in zip(reference[2:], resumed[2:]):
        assert got["reward/mean"] == pytest.approx(want["reward/mean"], abs=1e-6), got["step"]
        assert got["loss/policy"] == pytest.approx(want["loss/policy"], rel=1e-3, abs=1e-6), got["step"]
    assert resumed[3]["val/quickstart_val/pass@1"] == reference[3]["val/quickstart_val/pass@1"]


@pytest.mark.slow
def test_a_zero3_checkpoint_is_refused_under_another_stage_before_anything_starts(zero3_run, tmp_path):
    """Resuming a ZeRO-3 checkpoint with train.zero_stage 2 ended in DeepSpeed's bare AssertionError, after the
    servers had started. Now: exit 2 with one line naming the key and the stage the checkpoint holds."""
    _, run_dir = zero3_run
    cfg = load_config(ROOT / "configs/quickstart.yaml",
                      ["train.zero_stage=2", f"logging.output_dir={run_dir.parent}"])
    with pytest.raises(ConfigError) as refused:  # as launch/train.py --resume checks it (exit 2, this one line)
        preflight.check(cfg, "auto")
    assert str(refused.value) == (
        f"train.zero_stage=2 cannot resume checkpoint {run_dir / 'checkpoints' / 'step_4'}: it "
        "holds ZeRO stage 3, whose DeepSpeed state stage 2 cannot load; resume with --set train.zero_stage=3, or "
        "start over with train.resume=never (or another logging.run_name)")
    check_zero_stage(run_dir, "auto", 3)
    # A checkpoint saved before the stage was recorded: stage 3 is told by DeepSpeed's per-rank module states.
    legacy = tmp_path / "step_2"
    shutil.copytree(run_dir / "checkpoints" / "step_2", legacy)
    state = json.loads((legacy / "trainer_state.json").read_text())
    assert state.pop("zero_stage") == 3
    (legacy / "trainer_state.json").write_text(json.dumps(state))
    assert saved_zero_stage(legacy) == 3
    with pytest.raises(ConfigError, match=r"train.zero_stage=1 cannot resume checkpoint .*: it holds ZeRO stage 3,"):
        check_zero_stage(run_dir, str(legacy), 1)


@pytest.mark.slow
def test_zero3_with_lora_pushes_and_exports_the_whole_adapter(tmp_path):
    """LoRA on two ZeRO-3 ranks: the adapter (gathered at once) reaches the servers exactly, and the checkpoint's
    adapter/ and merged hf/ hold whole tensors. (The step against ZeRO-2's: tests/test_learner.py.)"""
    command = train_command("configs/quickstart_lora.yaml", "train.zero_stage=3", "train.steps=2",
                            "checkpoint.save_every=2", "eval.every=2", "eval.limit=20",
                            "checkpoint.keep_best=val/quickstart_val/pass@1", f"logging.output_dir={tmp_path}")
    on_two_ranks(command, tmp_path / "logs")
    run_dir = tmp_path / "quickstart_lora"
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    # Step 2's batch came from the adapter pushed after step 1, and the engine's log-probs are the learner's: an
    # adapter pushed with empty or stale tensors would show as a mismatch.
    assert all(r["rollout/staleness"] == 0 and abs(r["rollout/mismatch_kl_k3"]) < 1e-5 for r in rows)
    step = run_dir / "checkpoints" / "step_2"
    adapter = load_file(step / "adapter" / "adapter_model.safetensors")
    assert adapter and all(t.numel() > 0 for t in adapter.values())
    assert any(t.abs().max() > 0 for name, t in adapter.items() if ".lora_B." in name)  # B has moved from 0
    merged = AutoModelForCausalLM.from_pretrained(step / "hf")
    assert not any(".lora_" in name for name in merged.state_dict())
    assert (run_dir / "checkpoints" / "best" / "hf" / "model.safetensors").is_file()
