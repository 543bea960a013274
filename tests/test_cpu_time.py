"""tests/cpu_time.py's --cpu-durations, in a pytest session of its own."""

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\n"


def test_a_test_is_charged_the_cpu_of_the_processes_it_waited_for(pytester):
    pytester.makepyfile(test_burn=f"""
        import subprocess, sys

        def test_idle():
            pass

        def test_child():
            subprocess.run([sys.executable, "-c", {BURN!r}], check=True)
    """)
    result = pytester.runpytest("-p", "cpu_time", "--cpu-durations=2", "-n", "0", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    lines = result.stdout.lines
    top = lines.index(next(line for line in lines if "most CPU seconds" in line))
    (child_s, child), (idle_s, idle) = (line.split("s ", 1) for line in lines[top + 1:top + 3])
    assert child.endswith("test_burn.py::test_child") and float(child_s) >= 0.5  # the child's half second
    assert idle.endswith("test_burn.py::test_idle") and float(idle_s) < 0.5
