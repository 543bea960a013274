"""`--cpu-durations N`: the N tests that cost the most CPU seconds, beside pytest's --durations (wall time).

The suite is CPU-bound on two cores, so its wall time follows its CPU seconds, and a test's wall time says little
about its cost: it also counts the other worker's load. Each phase (setup, call, teardown) is charged the CPU of the
test's process and of every process it started and waited for in that phase, grandchildren included
(os.times(): RUSAGE_CHILDREN counts a child once it is reaped). So a session fixture's servers are charged to the
teardown that stops them, and a process no one waits for (an orphaned engine core) to no test. A fixture may take
what it reaps off the test and show it on a line of its own (`charged_elsewhere`): the warm processes', whose
forked servers served every test (tests/conftest.py). A program that a warm process forked and reaped for a test
(warm.run) is charged to that test (`charge_forked`), and taken off the warm process's line. The figures travel
with the test reports, so they are summed across pytest-xdist workers.
"""
from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from typing import Iterator

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-durations", type=int, default=0, metavar="N",
                     help="show the N tests that cost the most CPU seconds (with the processes they waited for)")


_ELSEWHERE: list[tuple[str, float]] = []  # (what, CPU seconds) of this phase, charged to no test
_FORKED = [0.0, 0.0]  # CPU seconds of forked programs: this phase's, and the session's


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def charge_elsewhere(what: str, seconds: float) -> None:
    """Takes `seconds` of the running phase's CPU off its test and reports them as `what`."""
    _ELSEWHERE.append((what, seconds))


def charge_forked(seconds: float) -> None:
    """Charges the running phase's test with a program that a warm process forked and reaped (warm.run): it
    is taken off that warm process's line (`charged_elsewhere`)."""
    _FORKED[0] += seconds
    _FORKED[1] += seconds


@contextlib.contextmanager
def charged_elsewhere(what: str) -> Iterator[None]:
    """Charges what the block reaps (a warm process, with every program it forked) to `what`, not to the running
    test, less the forked programs that were charged to their own tests (`charge_forked`)."""
    before = os.times()
    yield
    after = os.times()
    reaped = after.children_user + after.children_system - before.children_user - before.children_system
    charge_elsewhere(what, reaped - _FORKED[1])
    _FORKED[0] -= _FORKED[1]  # charged to their tests already: not to this phase's again


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    # makereport runs right after each phase; the phase began at call.start, when the last mark was taken
    outcome = yield
    now = _cpu_s()
    properties = outcome.get_result().user_properties
    elsewhere = sum(seconds for _, seconds in _ELSEWHERE)
    properties.append(("cpu_s", now - getattr(item, "_cpu_mark", now) - elsewhere + _FORKED[0]))
    _FORKED[0] = 0.0
    properties.extend(("cpu_s_elsewhere", charge) for charge in _ELSEWHERE)
    _ELSEWHERE.clear()
    item._cpu_mark = now


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item._cpu_mark = _cpu_s()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    count = config.getoption("cpu_durations")
    if not count:
        return
    per_test, elsewhere = defaultdict(float), defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", ()):
                if key == "cpu_s":
                    per_test[report.nodeid] += value
                elif key == "cpu_s_elsewhere":
                    elsewhere[value[0]] += value[1]
    terminalreporter.write_sep("=", f"most CPU seconds (tests {sum(per_test.values()):.0f} s in all)")
    for nodeid, seconds in sorted(per_test.items(), key=lambda kv: -kv[1])[:count]:
        terminalreporter.write_line(f"{seconds:8.1f}s {nodeid}")
    for what, seconds in elsewhere.items():
        terminalreporter.write_line(f"{seconds:8.1f}s (no test) {what}")
