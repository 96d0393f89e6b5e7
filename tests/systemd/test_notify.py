"""o3edge.notify against real AF_UNIX datagram sockets, from a real child process, as systemd sees it."""

import os
import select
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from o3edge.notify import Notifier

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["path", "abstract"])
def listener(request, tmp_path):
    """(NOTIFY_SOCKET value, bound datagram socket) in the filesystem or the abstract namespace."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        address = str(tmp_path / "notify.sock")
        sock.bind(address)
    else:
        address = f"@o3edge-test-{uuid.uuid4().hex}"
        sock.bind("\0" + address[1:])
    yield address, sock
    sock.close()


def child_env(**variables: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update({k: v for k, v in variables.items() if v is not None})
    return env


def run_child(code: str, sock: socket.socket | None = None, **variables: str | None) -> tuple[list[str], str]:
    """Run `code` in a fresh interpreter; returns (datagrams received, stdout). Fails on stderr."""
    script = "from o3edge.notify import Notifier\n" + textwrap.dedent(code)
    proc = subprocess.Popen([sys.executable, "-c", script], env=child_env(**variables),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    messages = []
    deadline = time.monotonic() + 20
    while sock is not None and time.monotonic() < deadline:
        # Read while the child runs: a datagram queue holds only ~10 messages.
        if select.select([sock], [], [], 0.02)[0]:
            messages.append(sock.recv(4096).decode("utf-8"))
        elif proc.poll() is not None:
            break
    stdout, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 0 and stderr == "", stderr
    return messages, stdout


def test_ready_and_status(listener):
    address, sock = listener
    messages, _ = run_child("""
        n = Notifier()
        assert n.is_enabled
        n.status("loading model")
        n.ready("serving 0 requests")
    """, sock, NOTIFY_SOCKET=address)
    assert messages == ["STATUS=loading model", "READY=1\nSTATUS=serving 0 requests"]


def test_reloading_carries_monotonic_usec(listener):
    address, sock = listener
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    messages, _ = run_child("Notifier().reloading(); Notifier().ready()", sock, NOTIFY_SOCKET=address)
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    reload_lines = messages[0].split("\n")
    assert reload_lines[0] == "RELOADING=1" and messages[1] == "READY=1"
    key, _, usec = reload_lines[1].partition("=")
    assert key == "MONOTONIC_USEC" and before <= int(usec) <= after


def test_stopping_and_extend_timeout(listener):
    address, sock = listener
    messages, _ = run_child("n = Notifier(); n.extend_timeout(5_000_000); n.stopping(); n.stopping('draining 2')",
                            sock, NOTIFY_SOCKET=address)
    assert messages == ["EXTEND_TIMEOUT_USEC=5000000", "STOPPING=1", "STOPPING=1\nSTATUS=draining 2"]


def test_status_cannot_inject_assignments_and_is_utf8(listener):
    address, sock = listener
    messages, _ = run_child("Notifier().status('a\\nSTOPPING=1 · 12.5 tok/J 温度')", sock, NOTIFY_SOCKET=address)
    assert messages == ["STATUS=a STOPPING=1 · 12.5 tok/J 温度"]


def test_watchdog_is_rate_limited_to_half_the_timeout(listener):
    address, sock = listener
    messages, stdout = run_child("""
        import time
        n = Notifier()
        n.watchdog()                      # before READY=1: dropped
        n.ready()
        end = time.monotonic() + 0.5
        while time.monotonic() < end:     # an engine loop spinning every millisecond
            n.watchdog()
            time.sleep(0.001)
        print(n.watchdog_interval_s)
    """, sock, NOTIFY_SOCKET=address, WATCHDOG_USEC="400000")
    assert float(stdout) == 0.2
    assert messages[0] == "READY=1"
    pings = messages[1:]
    # At 0, 0.2 and 0.4 s; fewer only if the machine starves the child (the exact schedule is
    # checked with a fake clock below).
    assert set(pings) == {"WATCHDOG=1"} and 1 <= len(pings) <= 3


def test_watchdog_for_our_pid_pings(listener):
    address, sock = listener
    messages, _ = run_child("""
        import os
        os.environ["WATCHDOG_PID"] = str(os.getpid())   # as systemd sets it for the main process
        n = Notifier(); n.ready(); n.watchdog()
    """, sock, NOTIFY_SOCKET=address, WATCHDOG_USEC="30000000")
    assert messages == ["READY=1", "WATCHDOG=1"]


def test_watchdog_for_another_pid_stays_silent(listener):
    # A helper process inherits the daemon's environment: it must not ping for the daemon.
    address, sock = listener
    messages, stdout = run_child("n = Notifier(); n.ready(); n.watchdog(); print(n.watchdog_interval_s)",
                                 sock, NOTIFY_SOCKET=address, WATCHDOG_USEC="30000000",
                                 WATCHDOG_PID=str(os.getpid()))
    assert messages == ["READY=1"] and stdout.strip() == "None"


def test_no_watchdog_without_watchdog_usec(listener):
    address, sock = listener
    messages, stdout = run_child("n = Notifier(); n.ready(); n.watchdog(); print(n.watchdog_interval_s)",
                                 sock, NOTIFY_SOCKET=address)
    assert messages == ["READY=1"] and stdout.strip() == "None"


EVERYTHING = """
    n = Notifier()
    n.status("x"); n.ready("y"); n.reloading(); n.extend_timeout(1); n.stopping()
    for _ in range(3):
        n.watchdog()
    print(n.is_enabled)
"""


def test_silent_without_notify_socket():
    _, stdout = run_child(EVERYTHING, WATCHDOG_USEC="1000")
    assert stdout.strip() == "False"


@pytest.mark.parametrize("kind", ["missing path", "dead path", "unbound abstract", "empty"])
def test_silent_when_socket_is_dead(tmp_path, kind):
    if kind == "missing path":
        address = str(tmp_path / "nothing-here.sock")
    elif kind == "dead path":  # the file exists but nobody listens any more
        address = str(tmp_path / "dead.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(address)
        sock.close()
    elif kind == "unbound abstract":
        address = f"@o3edge-dead-{uuid.uuid4().hex}"
    else:
        address = ""
    _, stdout = run_child(EVERYTHING, NOTIFY_SOCKET=address, WATCHDOG_USEC="1000")
    assert stdout.strip() == "False"


def test_listener_that_goes_away_after_connect(tmp_path, monkeypatch):
    # systemd's socket vanishing under a connected notifier: sends fail quietly.
    address = str(tmp_path / "gone.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setenv("WATCHDOG_USEC", "1000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    n = Notifier()
    assert n.is_enabled
    sock.close()
    os.unlink(address)
    n.status("x"); n.ready(); n.reloading(); n.extend_timeout(1); n.watchdog(); n.stopping()


def test_full_queue_never_blocks_the_loop_for_long(listener):
    # Nobody reads (systemd busy): sends give up after SEND_TIMEOUT_S instead of hanging.
    address, sock = listener
    start = time.monotonic()
    _, stdout = run_child("""
        import o3edge.notify
        o3edge.notify.SEND_TIMEOUT_S = 0.05
        n = Notifier()
        for i in range(15):
            n.status(str(i))
        print("done")
    """, None, NOTIFY_SOCKET=address)
    assert stdout.strip() == "done" and time.monotonic() - start < 10


def test_watchdog_schedule_with_a_fake_clock(listener, monkeypatch):
    address, sock = listener
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    now = [100.0]
    n = Notifier(clock=lambda: now[0])
    n.ready()
    sent = []
    for t in (100.0, 100.1, 100.49, 100.5, 100.9, 101.0, 101.2, 101.6):
        now[0] = t
        n.watchdog()
        sock.setblocking(False)
        try:
            while True:
                if sock.recv(4096) == b"WATCHDOG=1":
                    sent.append(t)
        except BlockingIOError:
            pass
    assert sent == [100.0, 100.5, 101.0, 101.6]
