"""apmpo.dirlock: one process at a time in a directory, and never a dead one."""
import os
import signal
import subprocess
import sys

HOLDER = """
import os, sys, time
from pathlib import Path
from apmpo import dirlock
lock = dirlock.hold(Path(sys.argv[1]), "test")
if os.fork() == 0:  # as a run's reward workers: forked, living on after the holder
    time.sleep(60)
    os._exit(0)
print("held", flush=True)
time.sleep(60)
"""


def test_a_second_holder_is_refused_until_the_first_dies_even_by_sigkill(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    probe = [sys.executable, "-c", "import sys; from pathlib import Path; from apmpo import dirlock\n"
             "try: dirlock.hold(Path(sys.argv[1]), 'run')\nexcept dirlock.Busy as b: sys.exit(str(b))", str(tmp_path)]
    busy = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert busy.returncode == 1 and f"another run (pid {holder.pid}) is running in {tmp_path}" in busy.stderr
    children = subprocess.run(["pgrep", "-P", str(holder.pid)], capture_output=True, text=True).stdout.split()
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    try:
        assert len(children) == 1 and os.path.exists(f"/proc/{children[0]}")  # the forked child lives on
        free = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        assert free.returncode == 0, free.stderr  # and holds nothing
    finally:
        for child in children:
            os.kill(int(child), signal.SIGKILL)
