"""Shared fixtures: tiny random Qwen2 checkpoints built in code (tied and untied embeddings), generation servers on
them for the whole session, and one short quickstart run with a server on its exported checkpoint."""
import contextlib
import os
import sys
from pathlib import Path

import pytest

# Two test workers (pytest.ini) share the 2 cores with every process their tests start. libgomp teams that together
# outnumber the cores spin against each other at every barrier (benchmarks/omp_wait.py), so each process computes
# on one thread. Set before torch loads: libgomp reads it then, and every process a test starts inherits it.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from apmpo.tiny import save_perturbed_copy, save_tiny_model

pytest_plugins = ("cpu_time", "pytester")  # cpu_time: --cpu-durations (pytest.ini), the tests that cost the most CPU

TESTS = Path(__file__).resolve().parent

# pytest-xdist builds a session fixture once per worker that uses it. The files sharing one (a training run, a pair
# of servers) therefore go to one worker as one group; every other file is a group of its own. Before, each worker
# built the quickstart run its files needed: twice. (xdist's own --dist loadgroup marks a test by suffixing its id,
# which pytest 9 ignores: a scheduler of ours groups by file name instead.)
SHARED = {"quickstart_run": ("test_train_cli", "test_checkpoint", "test_validation", "test_correction",
                             "test_train_faults", "test_zero3"),  # quickstart_run, two_rank_run, their servers
          "session_servers": ("test_server_reliability", "test_rollout_server", "test_servers_pool", "test_lora_server")}
# The longest groups first (seconds in one process, 2026-11-28: 683 with test_zero3, 400, 320, 285, 212, 198, 161,
# 91), then the rest in file order (pytest.ini: --no-loadscope-reorder), so that no long group starts last and runs
# alone.
LONGEST_FIRST = ("quickstart_run", "session_servers", "test_benchmarks", "test_study", "test_envs_server",
                 "test_multinode", "test_real_model", "test_lora")


def _group(path: str) -> str:
    stem = Path(path.split("::")[0]).stem
    return next((name for name, files in SHARED.items() if stem in files), stem)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item.nodeid), len(rank)))  # stable: a file's tests stay in order


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        """A group's tests go to one worker, whole (a scope is what LoadScopeScheduling keeps together)."""

        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ByGroup(config, log)


def tiny_server_env(**changes: str) -> dict[str, str]:
    """A tiny model's CPU server's startup environment as the launcher makes it here (OpenMP threads: the
    launcher's 1 for these models where the suite sets none, -n 0), with `changes`."""
    from apmpo.warm import server_env  # noqa: PLC0415

    return server_env({**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **changes})


@pytest.fixture(scope="session", autouse=True)
def warm_processes(request, tmp_path_factory):
    """Every CPU server this worker's tests start, directly or through a run, is forked from a warm process that
    has imported vLLM (apmpo/warm.py): about 14 CPU seconds less each, on some 60 servers a suite; and every
    learner, benchmark or worker script that a test runs through train_runs.warm_run from one that has imported
    what a learner imports (warm.LEARNER_IMPORTS, launch/train.py's modules), and DeepSpeed (one such process for
    each startup environment). A test of a fresh start removes APMPO_WARM_SERVERS from its environment. Without
    slow tests (-m "not slow"), whose runs and servers these are, no warm process: its own imports would cost more
    than it saves. Their sockets are in a folder of pytest's that only this user may enter (mode 700)."""
    import cpu_time  # noqa: PLC0415  (loaded as a plugin first: pytest_plugins)
    import train_runs  # noqa: PLC0415
    from apmpo import warm  # noqa: PLC0415

    if not any(item.get_closest_marker("slow") for item in request.session.items):
        yield
        return
    folder = tmp_path_factory.mktemp("warm")
    with contextlib.ExitStack() as stack:
        os.environ[warm.WARM_SERVERS_ENV] = str(stack.enter_context(
            warm.warm_process(folder / "servers.sock", folder / "servers.log", tiny_server_env())))
        train_runs.WARM = train_runs.WarmPrograms(folder, stack)
        try:
            yield
        finally:
            del os.environ[warm.WARM_SERVERS_ENV]
            train_runs.WARM = None
            with cpu_time.charged_elsewhere("the warm processes and the servers they forked for this worker"):
                stack.close()  # the warm processes reaped, and with them what their forked programs used


# The session's servers: one token, and caps that every module using them fits in (a request over one is a 400).
SERVER_TOKEN = "test-token"
SERVER_LIMITS = dict(max_prompts=4096, max_n=64, max_tokens=200, generate_timeout_s=15)


@pytest.fixture(scope="session")
def tiny_tied(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_tied"), tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_untied(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_untied"), tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_perturbed(tiny_tied, tmp_path_factory):
    """tiny_tied with N(0, 0.5^2) noise on every weight (seed 1): weights that generate visibly differently."""
    path = tmp_path_factory.mktemp("tiny_perturbed")
    save_perturbed_copy(tiny_tied, path, seed=1)
    return path


def start_test_server(model_dir, log_path, *extra_args, limits=None, **kwargs):
    """A server as the session's are (fp32, 256 tokens of context, SERVER_TOKEN, SERVER_LIMITS updated with
    `limits`), with `extra_args`; `kwargs` go to start_server (wait=False: start several at once)."""
    from apmpo.rollout.launcher import start_server  # noqa: PLC0415

    limits = [arg for key, value in {**SERVER_LIMITS, **(limits or {})}.items()
              for arg in (f"--{key.replace('_', '-')}", str(value))]
    return start_server(str(model_dir), log_path=log_path, token=SERVER_TOKEN, dtype="float32", max_model_len=256,
                        extra_args=(*limits, *extra_args), ready_timeout_s=300, **kwargs)


@pytest.fixture(scope="session")
def session_servers(tiny_tied, tiny_perturbed, tmp_path_factory):
    """tiny_server and perturbed_server, loading at once (two engine starts take about the time of one)."""
    from apmpo.rollout.launcher import ServerSet  # noqa: PLC0415

    logs = tmp_path_factory.mktemp("logs")
    servers = ServerSet([])
    try:
        for name, model_dir in (("tiny_server", tiny_tied), ("perturbed_server", tiny_perturbed)):
            servers.servers.append(start_test_server(model_dir, logs / f"{name}.log", wait=False))
        servers.wait_ready(timeout_s=300)
        yield servers.servers
    finally:
        servers.stop()


@pytest.fixture(scope="session")
def tiny_server(session_servers):
    """One compiled server on tiny_tied for the server, reliability and pool tests (an engine start costs 30-45 s
    on 2 cores). A test that pushes other weights pushes tiny_tied's back before it ends; weight versions only
    grow, so tests compare with the version they read first."""
    return session_servers[0]


@pytest.fixture(scope="session")
def perturbed_server(session_servers):
    """A fresh server on tiny_perturbed: the reference a push of those weights must equal. Never pushed to."""
    return session_servers[1]


class QuickstartServers:
    """Two servers on the quickstart model, started as a run of configs/quickstart.yaml starts its own, for the
    runs whose tests read nothing of their servers (two engine starts a run saved, about 16 s of CPU each). A run
    pushes its weights at connect, so it generates exactly as on servers of its own: the kill test's run, on its
    own servers, matches quickstart_run to the last digit. Started at first use and stopped when the group of
    tests that used them ends (pytest_runtest_teardown below): alive to the end of the session, two pairs (one
    per test worker) held about 6 GB, and the SmolLM2 test's run was killed for memory."""

    def __init__(self, root: Path):
        self.root, self.running = root, None  # a ServerSet while started

    def urls(self) -> str:
        """`--set rollout.urls=[...]`, the pair started if it is not running."""
        from apmpo.config import load_config  # noqa: PLC0415
        from apmpo.quickstart import save_quickstart_model  # noqa: PLC0415
        from apmpo.rollout.launcher import ServerSet, start_servers  # noqa: PLC0415

        if self.running is None:
            cfg = load_config(str(TESTS.parent / "configs/quickstart.yaml"))
            model = self.root / "model"
            if not (model / "config.json").is_file():
                save_quickstart_model(model, seed=cfg.train.seed)
            self.running = ServerSet(start_servers(
                str(model), log_paths=[self.root / "server.0.log", self.root / "server.1.log"], devices=[None, None],
                max_model_len=cfg.rollout.max_model_len, dtype=cfg.engine_dtype, seed=cfg.train.seed,
                extra_args=("--enforce-eager",), overlap=cfg.overlap, ready_timeout_s=300))
        return "rollout.urls=[" + ", ".join(self.running.urls) + "]"

    def stop(self) -> None:
        running, self.running = self.running, None
        if running is not None:
            running.stop()  # both at once


_SERVER_PAIRS: list[QuickstartServers] = []


@pytest.fixture(scope="session")
def quickstart_servers(tmp_path_factory):
    pair = QuickstartServers(tmp_path_factory.mktemp("quickstart_servers"))
    _SERVER_PAIRS.append(pair)
    yield pair
    pair.stop()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if nextitem is None or _group(nextitem.nodeid) != _group(item.nodeid):
        for pair in _SERVER_PAIRS:
            pair.stop()


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory, quickstart_servers):
    """The run directory of `launch/train.py --config configs/quickstart.yaml` with train_runs.QUICKSTART_RUN: one
    short run shared by every test that reads what a run leaves behind (see there)."""
    from train_runs import QUICKSTART_RUN, run, train_command  # noqa: PLC0415

    out = tmp_path_factory.mktemp("quickstart_run")
    run(train_command("configs/quickstart.yaml", *QUICKSTART_RUN, quickstart_servers.urls(),
                      f"logging.output_dir={out}"), timeout=900)
    return out / "quickstart"


@pytest.fixture(scope="session")
def quickstart_export_server(quickstart_run):
    """A server on quickstart_run's step-4 export (hf/), as `python -m apmpo.eval --model` starts one (fp32, 128
    tokens of context): the export loads in the server, and the eval CLI reaches it with --server."""
    from apmpo.rollout.launcher import start_server  # noqa: PLC0415

    server = start_server(str(quickstart_run / "checkpoints" / "step_4" / "hf"), dtype="float32", max_model_len=128,
                          log_path=quickstart_run.parent / "export_server.log", ready_timeout_s=300)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory, quickstart_servers):
    """The quickstart for 2 steps (a checkpoint at step 2) through the `deepspeed` launcher with 2 learner ranks, with
    a reward that returns NaN now and then (tests/failing_rewards.py, named as a user names theirs): one run for
    test_train_cli's two-rank test and test_train_faults' NaN test. The launcher's CompletedProcess and the run
    directory."""
    from apmpo.rollout.net import free_port  # noqa: PLC0415
    from train_runs import run, train_command, with_warm_programs  # noqa: PLC0415

    out = tmp_path_factory.mktemp("two_rank_run")
    command = train_command("configs/quickstart.yaml", "train.steps=2", "checkpoint.save_every=2",
                            "data.reward=failing_rewards:nan_every_20th", quickstart_servers.urls(),
                            f"logging.output_dir={out}")
    launcher = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                *command[1:]]
    pythonpath = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])  # for failing_rewards
    done = run(launcher, env=with_warm_programs({**os.environ, "PYTHONPATH": pythonpath}))  # the ranks forked
    return done, out / "quickstart"
