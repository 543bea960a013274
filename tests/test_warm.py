"""apmpo/warm.py: a program forked by a warm process is what `python` would have started, or is started afresh.

The warm process here imports only json (a second); the suite's own, which import vLLM or what a learner imports,
are tests/conftest.py's (a forked server against a fresh one: tests/test_rollout_server.py)."""
import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apmpo import warm
from apmpo.rollout.launcher import _parent_of

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, os, random, sys
print(json.dumps({"argv": sys.argv, "path": sys.path[:2], "name": __name__, "cwd": os.getcwd(),
                  "env": os.environ.get("PROBE"), "stdin": sys.stdin.read(), "random": random.random()}))
print("50%\\r100%\\r\\nto stderr", file=sys.stderr)  # a progress bar's carriage returns
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def warm_json(tmp_path_factory):
    folder = tmp_path_factory.mktemp("warm_json")
    with warm.warm_process(folder / "json.sock", folder / "json.log", imports=("json",)) as path:
        yield path, folder / "json.log"


@pytest.fixture
def probes(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "probe_module.py").write_text(PROBE)
    (tmp_path / "probe.py").write_text(PROBE)
    return tmp_path


def _both(command, path, **kwargs):
    fresh = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, **kwargs)
    forked = warm.run(command, path=path, capture_output=True, text=True, timeout=60, **kwargs)
    return fresh, forked


@pytest.mark.parametrize("form", ["script", "module"])
def test_a_forked_program_sees_what_python_would_have_given_it(warm_json, probes, form):
    env = {**os.environ, "PROBE": "yes", "PYTHONPATH": str(probes / "lib")}
    program = [str(probes / "probe.py")] if form == "script" else ["-m", "probe_module"]
    fresh, forked = _both([sys.executable, "-u", *program, "3", "an argument"], warm_json[0], env=env,
                          cwd=probes / "lib")
    assert forked.cpu_s > 0  # forked, not started afresh
    assert fresh.returncode == forked.returncode == 3
    assert fresh.stderr == forked.stderr == "50%\n100%\nto stderr\n"  # text: universal newlines
    seen_fresh, seen_forked = (json.loads(done.stdout) for done in (fresh, forked))
    assert seen_fresh.pop("random") != seen_forked.pop("random")  # seeded anew, as every fresh interpreter
    assert seen_fresh == seen_forked
    assert seen_forked["name"] == "__main__" and seen_forked["argv"][1:] == ["3", "an argument"]
    assert seen_forked["path"] == [str(probes if form == "script" else probes / "lib"), str(probes / "lib")]


def test_forks_draw_other_random_numbers(warm_json, probes):
    draws = {warm.run([sys.executable, str(probes / "probe.py"), "0"], path=warm_json[0], capture_output=True,
                      text=True).stdout for _ in range(2)}
    assert len(draws) == 2


@pytest.mark.parametrize("setting", ["OMP_NUM_THREADS", "LD_PRELOAD"])
def test_a_program_whose_startup_settings_differ_is_started_afresh_and_logged(warm_json, probes, setting):
    # libgomp reads OMP_NUM_THREADS as a process starts, the loader LD_PRELOAD: a fork would keep the warm process's
    env = {**os.environ, setting: "7" if setting == "OMP_NUM_THREADS" else "libm.so.6"}
    done = warm.run([sys.executable, str(probes / "probe.py"), "0"], path=warm_json[0], env=env, capture_output=True)
    assert done.returncode == 0 and not hasattr(done, "cpu_s")
    assert f"refused ['{sys.executable}', '{probes / 'probe.py'}', '0']: the warm process started with other " \
           f"{setting}\n" in warm_json[1].read_text()


def test_a_pythonpath_that_would_import_a_loaded_module_from_elsewhere_is_started_afresh(warm_json, probes):
    (probes / "lib" / "json").mkdir()
    (probes / "lib" / "json" / "__init__.py").write_text("dumps = lambda value: 'the shadowing json'\n")
    env = {**os.environ, "PYTHONPATH": str(probes / "lib")}
    fresh, forked = _both([sys.executable, "-m", "probe_module", "0"], warm_json[0], env=env)
    assert fresh.stdout == forked.stdout == "the shadowing json\n" and not hasattr(forked, "cpu_s")
    assert "PYTHONPATH (json would have been imported from there)" in warm_json[1].read_text()


def test_the_learner_preset_names_every_module_that_launch_train_imports():
    """A learners' warm process imports warm.LEARNER_IMPORTS, not the script: they must cover what it imports (beyond
    the standard library) at module level. Imported either way, 2,833 modules and the same ones (2026-12-07)."""
    names = set()
    for node in ast.parse((ROOT / "launch" / "train.py").read_text()).body:  # not the relay under __main__
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":  # a module, or its submodules
            folder = ROOT.joinpath(*node.module.split("."))
            submodules = {f"{node.module}.{alias.name}" for alias in node.names
                          if (folder / f"{alias.name}.py").is_file() or (folder / alias.name).is_dir()}
            names |= submodules or {node.module}
    named = set(warm.LEARNER_IMPORTS)
    covered = named | {name.rsplit(".", k)[0] for name in named for k in range(1, name.count(".") + 1)}
    assert {name for name in names if name.split(".")[0] not in sys.stdlib_module_names} - covered == set()
    assert "transformers.models.auto.tokenization_auto" in named  # AutoTokenizer's, a lazy attribute of transformers
    assert warm.PRESETS["learner"] == warm.LEARNER_IMPORTS and not any(name.endswith(".py") for name in named)


def test_what_is_not_python_running_a_file_or_module_is_started_afresh(warm_json):
    done = warm.run([sys.executable, "-c", "print(6 * 7)"], path=warm_json[0], capture_output=True, text=True)
    assert done.stdout == "42\n" and not hasattr(done, "cpu_s")


def test_a_program_past_its_timeout_is_killed(warm_json, probes):
    (probes / "sleep.py").write_text("import time\ntime.sleep(60)\n")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run([sys.executable, str(probes / "sleep.py")], path=warm_json[0], timeout=1)
    assert time.monotonic() - start < 10  # not the minute it would have slept
    assert "sleep.py" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_the_program_of_a_caller_that_is_gone_is_killed(warm_json, probes):
    (probes / "sleep.py").write_text("import time\ntime.sleep(60)\n")
    caller = subprocess.run([sys.executable, "-c", f"""
import sys
from apmpo import warm
forked = warm.fork([sys.executable, {str(probes / "sleep.py")!r}], {str(warm_json[0])!r})
print(forked.pid, flush=True)
"""], capture_output=True, text=True, check=True, timeout=60)  # exits, its program still sleeping
    pid = int(caller.stdout)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}")


def test_what_a_module_read_from_the_environment_as_it_loaded_is_read_again_under_the_programs(tmp_path):
    # as apmpo.rollout.vllm_compat's defaults for vLLM: a fork of a warm process that imported it has them made
    # under the program's environment, not the warm process's
    (tmp_path / "reads_env.py").write_text("import os\nfrom apmpo import warm\n\ndef read():\n    global MODE\n"
                                            "    MODE = os.environ.get('PROBE_MODE', 'unset')\n\nread()\n"
                                            "warm.at_start(read)\n")
    (tmp_path / "prints.py").write_text("import reads_env\nprint(reads_env.MODE)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    with warm.warm_process(tmp_path / "w.sock", tmp_path / "w.log", env, imports=("reads_env",)) as path:
        fresh, forked = _both([sys.executable, str(tmp_path / "prints.py")], path, env={**env, "PROBE_MODE": "mine"})
    assert forked.cpu_s > 0 and fresh.stdout == forked.stdout == "mine\n"


NAMESPACE_PROBE = """
import json, os, socket, sys
print(json.dumps({"namespaces": [os.stat(f"/proc/self/ns/{name}").st_ino for name in ("net", "mnt")],
                  "interfaces": sorted(name for _, name in socket.if_nameindex()), "files": os.listdir(sys.argv[1])}))
"""
NAMESPACE_CALLER = """
import json, subprocess, sys
from apmpo import warm
probe, folder, path = sys.argv[1:]
fresh = subprocess.run([sys.executable, probe, folder], capture_output=True, text=True, check=True).stdout
forked = warm.run([sys.executable, probe, folder], path=path, capture_output=True, text=True)
print(json.dumps([fresh, forked.stdout, getattr(forked, "cpu_s", None)]))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="namespaces of its own need root")
def test_a_program_forked_for_a_caller_in_other_network_and_mount_namespaces_runs_in_the_callers(warm_json, probes):
    """As `ip netns exec` starts a node's learner (tests/test_multinode.py): a network of its own (loopback only)
    and a mount namespace of its own (a tmpfs over a folder that holds a file outside)."""
    (probes / "probe.py").write_text(NAMESPACE_PROBE)
    (probes / "lib" / "outside").write_text("")
    caller = subprocess.run(["unshare", "--net", "--mount", "sh", "-c", f"mount -t tmpfs none {probes / 'lib'} && "
                             f"exec {sys.executable} -c '{NAMESPACE_CALLER}' {probes / 'probe.py'} {probes / 'lib'} "
                             f"{warm_json[0]}"], capture_output=True, text=True, timeout=60)
    assert caller.returncode == 0, caller.stderr
    fresh, forked, cpu_s = json.loads(caller.stdout)
    assert cpu_s is not None, warm_json[1].read_text()  # forked, not started afresh
    assert forked == fresh
    seen = json.loads(forked)
    assert seen["namespaces"] != [os.stat(f"/proc/self/ns/{name}").st_ino for name in ("net", "mnt")]
    assert seen["interfaces"] == ["lo"] and seen["files"] == []


RELAYED_PROBE = """
import os, signal, sys, time
from apmpo import warm
warm.relay()
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
print(os.getpid(), os.environ.get(warm.RELAY_ENV), flush=True)
if sys.argv[1] == "wait":  # for a SIGTERM
    time.sleep(60)
elif sys.argv[1] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(3)
"""


@pytest.fixture
def relayed(warm_json, probes):
    """`python -u relayed.py WHAT` as a launcher starts it, under $APMPO_WARM_PROGRAMS (None: without)."""
    (probes / "relayed.py").write_text(RELAYED_PROBE)

    def start(what: str, path=warm_json[0]) -> subprocess.Popen:
        env = {**os.environ, warm.WARM_PROGRAMS_ENV: str(path)} if path else os.environ
        return subprocess.Popen([sys.executable, "-u", str(probes / "relayed.py"), what], env=env,
                                stdout=subprocess.PIPE, text=True)
    return start


def test_a_relayed_program_is_forked_and_its_relay_ends_as_it_does(relayed):
    for what, code in (("exit", 3), ("killed", -9)):
        relay = relayed(what)
        pid, relay_pid = relay.stdout.readline().split()
        assert relay.wait(timeout=60) == code
        assert int(pid) != relay.pid and relay_pid == str(relay.pid)  # forked, told its relay
    started_here = relayed("exit", path=None)
    assert started_here.stdout.readline().split() == [str(started_here.pid), "None"]
    assert started_here.wait(timeout=60) == 3


def test_a_signal_to_the_relay_reaches_the_program_and_a_killed_relay_takes_it_down(relayed):
    relay = relayed("wait")
    relay.stdout.readline()
    relay.send_signal(signal.SIGTERM)
    assert relay.wait(timeout=60) == 7  # the program's SIGTERM handler's exit code

    relay = relayed("wait")
    pid = int(relay.stdout.readline().split()[0])
    relay.kill()
    relay.wait(timeout=60)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}")


FOLLOWING_RANK = """
from apmpo import warm
warm.relay()
import os, time
from apmpo.rollout.launcher import follow_deepspeed_runner
follow_deepspeed_runner(poll_s=0.1)
print(os.getpid(), os.environ[warm.RELAY_ENV], flush=True)
try:
    time.sleep(60)
except KeyboardInterrupt:  # as the runner is gone
    print("stopped", flush=True)
"""
# `deepspeed` (the runner) and the launch process it starts, as far as a rank can tell: the launch process's
# command line names deepspeed.launcher.launch
LAUNCHING = "import subprocess, sys; subprocess.run(sys.argv[2:])"


def test_a_relayed_rank_follows_deepspeeds_runner_through_its_relay(warm_json, probes):
    (probes / "rank.py").write_text(FOLLOWING_RANK)
    rank = [sys.executable, "-u", str(probes / "rank.py")]
    launch = [sys.executable, "-c", LAUNCHING, "deepspeed.launcher.launch", *rank]
    runner = subprocess.Popen([sys.executable, "-c", LAUNCHING, "runner", *launch], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, warm.WARM_PROGRAMS_ENV: str(warm_json[0])})
    pid, relay = map(int, runner.stdout.readline().split())
    assert _parent_of(_parent_of(relay)) == runner.pid and _parent_of(pid) != relay  # forked; relay: launch's child
    runner.kill()
    assert runner.communicate(timeout=60)[0] == "stopped\n"  # the output of the rank, its relay and launch, ended
