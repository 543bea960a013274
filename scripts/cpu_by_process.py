"""Where a command's CPU goes, by kind of process: every process it starts, sampled from /proc.

    python scripts/cpu_by_process.py -- .venv/bin/python -m pytest tests          # the suite's CPU, by kind
    python scripts/cpu_by_process.py --json out.json -- COMMAND ...                # and every process, as JSON

The suite is CPU-bound on two cores, so its wall time follows its CPU seconds; this says which processes spend
them (engine starts, learners, pytest's own workers, ...) and how many of each the command started. Each
process's user + system time is read from /proc/PID/stat every --every seconds; a process is counted at its
last reading, so each loses up to --every seconds of its end (a process shorter than that may be missed). This
process is the command's subreaper: a process whose parent exits stays in the tree, and is read once more as it
exits.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
PR_SET_CHILD_SUBREAPER = 36
KINDS = [  # (kind, a substring of the command line): the first that matches names the process
    ("vLLM engine core", "VLLM::EngineCore"), ("vLLM engine core", "EngineCore"),
    ("warm process", "apmpo.warm"), ("generation server", "apmpo.rollout.server"),
    ("learner (launch/train.py)", "launch/train.py"),
    ("deepspeed runner", "bin/deepspeed"), ("deepspeed runner", "deepspeed.launcher"),
    ("benchmark script", "benchmarks/"), ("study", "apmpo.study"), ("evaluation", "apmpo.eval"),
    ("test worker script", "tests/"), ("pytest", "pytest"), ("pytest-xdist worker", "exec(eval(sys.stdin"),
    ("forkserver / sandbox", "forkserver"),
    ("multiprocessing child", "multiprocessing"),
]


def kind(cmdline: str) -> str:
    return next((name for name, part in KINDS if part in cmdline), cmdline.split(" ")[0].rsplit("/", 1)[-1] or "?")


def descendants(root: int) -> dict[int, str]:
    """Every live process under `root` (by parent pid), with its command line."""
    parent, cmd = {}, {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                parent[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
    children: dict[int, list[int]] = defaultdict(list)
    for child, p in parent.items():
        children[p].append(child)
    found, frontier = {}, [root]
    while frontier:
        for child in children[frontier.pop()]:
            found[child] = cmd.get(child, "")
            frontier.append(child)
    return found


def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime: the process's own, not its children's


def reap_orphans(command_pid: int) -> None:
    """Reaps the orphans that came to us (their last reading was taken while they were zombies); the command's own
    process is left to Popen."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == command_pid:
            return
        os.waitpid(info.si_pid, 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=float, default=0.5, help="seconds between readings of /proc")
    parser.add_argument("--json", type=Path, help="also write every process (kind, command, CPU seconds) here")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans come to us, not to init
    start = time.time()
    child = subprocess.Popen(command)
    seen: dict[tuple[int, float], dict] = {}  # (pid, first seen): its kind, command and last CPU reading
    started: dict[int, float] = {}
    while child.poll() is None:
        tree = descendants(os.getpid())  # the command, its tree, and orphans reparented here
        for pid, cmdline in tree.items():
            cpu = cpu_seconds(pid)
            if cpu is None:
                continue
            key = (pid, started.setdefault(pid, time.time()))
            seen.setdefault(key, {"kind": kind(cmdline), "command": cmdline[:300], "cpu_s": 0.0})["cpu_s"] = cpu
        reap_orphans(child.pid)
        started = {pid: t for pid, t in started.items() if pid in tree}  # gone from the tree: a reused pid is new
        time.sleep(args.every)
    wall = time.time() - start
    by_kind: dict[str, list[float]] = defaultdict(list)
    for process in seen.values():
        by_kind[process["kind"]].append(process["cpu_s"])
    total = sum(map(sum, by_kind.values()))
    print(f"\n[cpu_by_process] {wall:.0f} s wall, {total:.0f} CPU s in {len(seen)} processes "
          f"({total / wall:.2f} cores busy on average); by kind:", file=sys.stderr)
    for name, values in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {name:28s} {len(values):5d} processes {sum(values):8.0f} CPU s ({100 * sum(values) / total:4.1f}%), "
              f"{sum(values) / len(values):6.1f} s each", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"wall_s": wall, "processes": list(seen.values())}, indent=1))
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
