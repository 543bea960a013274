"""tests/cpu_time.py's --cpu-durations, in a pytest process of its own: in this one, the module's counts are the
running session's."""
import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\n"


def _run(pytester, monkeypatch, *args):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    return pytester.runpytest_subprocess("-p", "cpu_time", *args, "-n", "0", "-p", "no:cacheprovider")


def test_a_test_is_charged_the_cpu_of_the_processes_it_waited_for(pytester, monkeypatch):
    pytester.makepyfile(test_burn=f"""
        import subprocess, sys

        def test_idle():
            pass

        def test_child():
            subprocess.run([sys.executable, "-c", {BURN!r}], check=True)
    """)
    result = _run(pytester, monkeypatch, "--cpu-durations=2")
    result.assert_outcomes(passed=2)
    lines = result.stdout.lines
    top = lines.index(next(line for line in lines if "most CPU seconds" in line))
    (child_s, child), (idle_s, idle) = (line.split("s ", 1) for line in lines[top + 1:top + 3])
    assert child.endswith("test_burn.py::test_child") and float(child_s) >= 0.5  # the child's half second
    assert idle.endswith("test_burn.py::test_idle") and float(idle_s) < 0.5


def test_a_fixture_can_charge_what_it_reaps_to_no_test_less_what_its_forks_charged_to_theirs(pytester, monkeypatch):
    pytester.makepyfile(test_burn=f"""
        import subprocess, sys
        import pytest
        import cpu_time

        @pytest.fixture(scope="session")
        def shared():
            yield
            with cpu_time.charged_elsewhere("the shared process"):
                subprocess.run([sys.executable, "-c", {BURN!r}], check=True)  # as the warm process is reaped

        def test_last(shared):
            cpu_time.charge_forked(0.3)  # as warm.run's program, reaped by the shared process
    """)
    result = _run(pytester, monkeypatch, "--cpu-durations=1")
    result.assert_outcomes(passed=1)
    lines = result.stdout.lines
    top = lines.index(next(line for line in lines if "most CPU seconds" in line))
    test_s, test = lines[top + 1].split("s ", 1)
    shared_s, shared = lines[top + 2].split("s ", 1)
    assert test.endswith("test_burn.py::test_last") and 0.3 <= float(test_s) < 0.5  # its fork, not the teardown
    assert shared == "(no test) the shared process" and 0.2 <= float(shared_s) < 0.45  # 0.5 s less the fork's
