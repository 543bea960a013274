"""A warm process (apmpo/warm_server.py) serves its own user only, sends nothing to another's, and no caller can stop
it or hold up another: real unix sockets and real processes, a second user (nobody, uid 65534) where a test is about
users. Its warm process imports only json, and is left reachable by anyone (its folder and socket opened after it
started, as a group-shared umask would leave them): the kernel's uid is then all that keeps another user out."""
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from apmpo import warm
from apmpo.warm_request import MAX_REQUEST_BYTES
from apmpo.warm_server import default_path

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"  # one that another user may run: the venv's lives under /root
REQUEST_TIMEOUT_S = 2.0


def _ready_pid(log: Path) -> int:
    deadline = time.monotonic() + 60
    while "ready on" not in (text := log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, text
        time.sleep(0.05)
    return int(text.split("ready on")[1].split("(pid ")[1].split(",")[0])


@pytest.fixture(scope="module")
def opened():
    """A warm process of ours, its folder (also the one for other users' files) and socket opened to anyone, its log,
    and its pid and the descriptors it holds idle (none held for a caller)."""
    folder = Path(tempfile.mkdtemp(prefix="apmpo-warm-trust-"))
    try:
        with warm.warm_process(folder / "w.sock", folder / "w.log", imports=("json",),
                               request_timeout_s=REQUEST_TIMEOUT_S) as path:
            pid = _ready_pid(folder / "w.log")
            idle = _fds(pid)
            folder.chmod(0o777)
            path.chmod(0o777)
            (folder / "probe.py").write_text("print('ran')\n")
            yield path, folder / "w.log", pid, idle
    finally:
        shutil.rmtree(folder)


@pytest.fixture(scope="module")
def as_nobody():
    """Starts `python -c SCRIPT ARGS` as uid 65534; skips where this cannot be."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to start a process as another user")
    try:
        subprocess.run([SYSTEM_PYTHON, "-c", ""], user=NOBODY, group=NOBODY, extra_groups=[], check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as error:
        pytest.skip(f"cannot run {SYSTEM_PYTHON} as uid {NOBODY}: {error}")

    def start(script: str, *args) -> subprocess.Popen:
        return subprocess.Popen([SYSTEM_PYTHON, "-c", script, *map(str, args)], user=NOBODY, group=NOBODY,
                                extra_groups=[], cwd="/", stdout=subprocess.PIPE, text=True)
    return start


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _settles_at(pid: int, count: int) -> bool:
    """Whether the warm process holds `count` descriptors within a few seconds (it closes a connection just after
    its last reply)."""
    deadline = time.monotonic() + 5
    while _fds(pid) != count and time.monotonic() < deadline:
        time.sleep(0.05)
    return _fds(pid) == count


def _serves(path: Path) -> bool:
    done = warm.run([sys.executable, str(path.parent / "probe.py")], path=path, capture_output=True, text=True)
    return done.stdout == "ran\n" and hasattr(done, "cpu_s")


def _connect(path: Path) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(10)
    conn.connect(str(path))
    return conn


def _refusals(path: Path, message: bytes, fds: int, times: int) -> list[dict]:
    """The warm process's answers to `message`, sent with `fds` descriptors (of /dev/null) on `times` connections."""
    conns = [_connect(path) for _ in range(times)]
    try:
        with open(os.devnull, "rb") as devnull:
            for conn in conns:
                socket.send_fds(conn, [message], [devnull.fileno()] * fds) if fds else conn.send(message)
        return [json.loads(conn.recv(4096)) for conn in conns]
    finally:
        for conn in conns:
            conn.close()


# --- 1. only the owner ---


def test_the_socket_is_0600_from_its_bind_whatever_the_umask_and_only_in_a_folder_of_its_own(tmp_path):
    umask = os.umask(0)  # as open as a umask gets
    try:
        with warm.listen(tmp_path / "w.sock"):
            assert stat.S_IMODE(os.stat(tmp_path / "w.sock").st_mode) == 0o600
            assert os.umask(0) == 0  # ours again once bound
    finally:
        os.umask(umask)
    (tmp_path / "open").mkdir(mode=0o755)
    (tmp_path / "theirs").mkdir(mode=0o700)
    os.chown(tmp_path / "theirs", NOBODY, NOBODY)
    for folder in ("open", "theirs"):
        with pytest.raises(PermissionError, match="is open to others"):
            warm.listen(tmp_path / folder / "w.sock")
        assert not (tmp_path / folder / "w.sock").exists()


def test_the_default_socket_is_in_a_folder_of_its_own_in_xdg_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_path() == tmp_path / "apmpo" / "servers.sock"
    assert stat.S_IMODE(os.stat(tmp_path / "apmpo").st_mode) == 0o700


def test_a_socket_left_by_a_killed_warm_process_is_replaced_and_a_live_one_is_not(tmp_path):
    live = warm.listen(tmp_path / "w.sock")
    with pytest.raises(FileExistsError, match="already listens"):
        warm.listen(tmp_path / "w.sock")
    live.close()  # its file stays, as a warm process killed -9 leaves it
    warm.listen(tmp_path / "w.sock").close()


HOSTILE_CLIENT = """
import json, os, socket, sys
path, request = sys.argv[1], open(sys.argv[2], "rb").read()
replies = []
for _ in range(int(sys.argv[3])):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
        conn.settimeout(10)
        conn.connect(path)
        namespaces = [os.open(f"/proc/self/ns/{name}", os.O_RDONLY) for name in ("net", "mnt")]
        try:
            socket.send_fds(conn, [request], [0, 1, 2, *namespaces])  # as a real request carries them
        except BrokenPipeError:  # refused as it connected
            pass
        try:
            replies.append(json.loads(conn.recv(4096)))
        except ConnectionResetError:  # closed with its request unread
            replies.append("reset")
print(json.dumps(replies))
"""


def test_another_users_request_is_refused_before_anything_of_it_is_read(opened, as_nobody):
    """The request copies ours, context and environment (the request carries both, so only the kernel's uid tells
    them apart), for a script that would leave a file as the uid it ran as."""
    path, log, pid, idle = opened
    folder, lines = path.parent, log.read_text().count("\n")
    (folder / "owned.py").write_text(f"import os\nopen({str(folder / 'owned')!r}, 'w').write(str(os.getuid()))\n")
    (folder / "request.json").write_text(json.dumps({
        "command": [sys.executable, str(folder / "owned.py")], "env": dict(os.environ), "cwd": str(folder),
        "fds": [0, 1, 2], "context": warm.process_context()}))
    (folder / "request.json").chmod(0o644)
    client = as_nobody(HOSTILE_CLIENT, path, folder / "request.json", 20)
    replies = json.loads(client.communicate(timeout=60)[0])
    assert len(replies) == 20 and {json.dumps(reply) for reply in replies} <= {
        json.dumps({"refused": f"it forks for its own user only, uid {os.geteuid()}"}), '"reset"'}
    assert not (folder / "owned").exists()  # never forked
    new = log.read_text().splitlines()[lines:]
    assert new == [f"[apmpo.warm] refused a caller of uid {NOBODY}: it forks for its own user only, uid 0"] * 20
    assert _settles_at(pid, idle)  # its descriptors never taken in
    assert _serves(path)  # and ours still forked


# --- 2. only to the owner ---


HOSTILE_LISTENER = """
import json, socket, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
listener.bind(sys.argv[1])
listener.listen(8)
print("listening", flush=True)
while True:
    conn, _ = listener.accept()
    conn.settimeout(10)
    message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 64)
    print(json.dumps({"bytes": len(message), "fds": len(fds)}), flush=True)
    conn.close()
"""
RELAYED = "import os\nfrom apmpo import warm\nwarm.relay()\nprint(os.getpid(), flush=True)\n"


def test_a_caller_sends_nothing_to_another_users_socket_and_starts_its_program_afresh(opened, as_nobody, capfd,
                                                                                     monkeypatch):
    """At the path a run names, another user's listener: `run`, `fork_server` (the launcher's servers) and `relay`
    connect, send it neither environment nor descriptors, and start their programs here, saying why."""
    folder = opened[0].parent
    theirs = folder / "theirs.sock"
    listener = as_nobody(HOSTILE_LISTENER, theirs)
    try:
        assert listener.stdout.readline() == "listening\n"
        why = f"the process listening at {theirs} runs as uid {NOBODY}, not as this one (0): sent it nothing"
        done = warm.run([sys.executable, str(folder / "probe.py")], path=theirs, capture_output=True, text=True,
                        env={**os.environ, "A_TOKEN": "secret"})
        assert done.stdout == "ran\n" and not hasattr(done, "cpu_s")
        assert capfd.readouterr().err == f"[apmpo] started afresh, not forked: {why}\n"

        with open(folder / "server.log", "wb") as log, monkeypatch.context() as env:
            env.setenv(warm.WARM_SERVERS_ENV, str(theirs))  # restored after: the suite's own warm process may be set
            assert warm.fork_server(["--model", "m"], dict(os.environ), log.fileno(), ()) is None
        assert (folder / "server.log").read_text() == f"[apmpo] started afresh, not forked: {why}\n"

        (folder / "relayed.py").write_text(RELAYED)
        relayed = subprocess.run([sys.executable, str(folder / "relayed.py")], capture_output=True, text=True,
                                 env={**os.environ, warm.WARM_PROGRAMS_ENV: str(theirs)}, timeout=60)
        assert relayed.stderr == f"[apmpo] started afresh, not forked: {why}\n"
        assert relayed.stdout.strip().isdigit()  # it ran here
    finally:
        listener.kill()
    received = listener.communicate(timeout=10)[0].splitlines()
    assert [json.loads(line) for line in received] == [{"bytes": 0, "fds": 0}] * 3


# --- 3. no caller waits on another ---


def test_a_request_behind_100_silent_connections_is_answered_at_once(opened):
    path, _, pid, idle = opened
    silent = [_connect(path) for _ in range(100)]
    try:
        time.sleep(0.2)  # all accepted and held
        start = time.monotonic()
        forked = warm.fork([sys.executable, str(path.parent / "probe.py")], path)
        answered = time.monotonic() - start
        assert forked is not None and forked.wait(timeout=60) == 0
        assert answered < 1.0, answered
    finally:
        for conn in silent:
            conn.close()
    assert _settles_at(pid, idle)  # each dropped as it closed


def test_a_silent_connection_is_dropped_after_its_timeout_without_delaying_anyone(opened):
    path, log, pid, idle = opened
    with _connect(path) as silent:
        start = time.monotonic()
        assert _serves(path)  # meanwhile
        assert json.loads(silent.recv(4096)) == {"refused": f"no request within {REQUEST_TIMEOUT_S:g} s"}
        assert REQUEST_TIMEOUT_S - 0.1 < time.monotonic() - start < REQUEST_TIMEOUT_S + 1
    assert "[apmpo.warm] refused a connection: no request within 2 s" in log.read_text()
    assert _settles_at(pid, idle)


def test_connections_past_the_most_held_are_refused_at_once(opened):
    path, _, pid, idle = opened
    held = [_connect(path) for _ in range(warm.MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        start = time.monotonic()
        with _connect(path) as one_more:
            assert json.loads(one_more.recv(4096)) == {"refused": f"it holds {warm.MAX_CONNECTIONS} already, its most"}
        assert time.monotonic() - start < 1.0
    finally:
        for conn in held:
            conn.close()
    assert _settles_at(pid, idle)
    assert _serves(path)


# --- 4. any malformed request is refused, and the warm process goes on ---


def _malformed(path: Path) -> list[tuple[bytes, int]]:
    """(message, descriptors sent) of every kind of malformed request, each beside a valid one's."""
    valid = {"command": [sys.executable, str(path.parent / "probe.py")], "env": dict(os.environ), "cwd": "/",
             "fds": [0, 1, 2], "context": warm.process_context()}
    good = json.dumps(valid).encode()
    wrong = {"command": ["python probe.py", [1, 2], [], None, {"a": 1}, [sys.executable, 5], [sys.executable, "a\0b"],
                         [sys.executable, "-c", "print(1)"]],
             "env": [["A", "B"], {"A": 1}, "A=B", {"": "x"}, {"A=B": "x"}, None],  # a list: what once stopped it
             "cwd": [5, "relative/path", None, ["/"], "/a\0b"],
             "fds": ["0", [-1], ["1"], [1.5], [0, 0], [1 << 30], None, {"0": 0}, list(range(70))],
             "context": [[], "x", None, 5]}
    cases = [(b"\xff\xfe\x00 not JSON", 0), (good[:len(good) // 2], 5), (b"{}", 0), (b"[]", 0), (b"null", 5),
             (b"[" * 50_000 + b"]" * 50_000, 0), (b" " * (MAX_REQUEST_BYTES + 1), 5),
             (json.dumps({**valid, "extra": 1}).encode(), 5), (good, 2), (good, 9), (good, 100)]
    cases += [(json.dumps({**valid, field: value}).encode(), 5) for field, values in wrong.items() for value in values]
    missing = [(json.dumps({k: v for k, v in valid.items() if k != field}).encode(), 5) for field in valid]
    return cases + missing


def test_every_kind_of_malformed_request_a_thousand_times_is_refused_and_the_warm_process_goes_on(opened):
    path, log, pid, idle = opened
    assert _serves(path)
    lines = len(log.read_text().splitlines())
    cases = _malformed(path)
    for message, count in cases:
        for _ in range(10):  # a hundred at once: answered in the order they came
            assert all("refused" in reply for reply in _refusals(path, message, count, 100))
    refusals = log.read_text().splitlines()[lines:]  # one line each, the same for each kind
    assert len(refusals) == 1000 * len(cases) and all(line.startswith("[apmpo.warm] refused ") for line in refusals)
    assert all(len(set(refusals[k * 1000:(k + 1) * 1000])) == 1 for k in range(len(cases)))
    assert _settles_at(pid, idle)  # every descriptor that came with them closed
    assert _serves(path)
