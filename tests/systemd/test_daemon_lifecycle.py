"""The real o3edged under a stand-in for systemd: a datagram socket at $NOTIFY_SOCKET that the test reads.

What systemd would see and act on: STATUS while loading, READY=1 only once the engine answers,
WATCHDOG=1 from the engine loop at half of WATCHDOG_USEC (and none once the loop hangs), a reload
that applies what it can, and a stop that drains. Each daemon serves the tiny model on CPU.
"""

import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from statistics import median

import pytest

from o3edge.ipc import protocol as P
from o3edge.ipc.client import Completion, DaemonUnavailable, O3Client, RequestError

REPO = Path(__file__).resolve().parents[2]
WATCHDOG_USEC = 400_000  # pings every 0.2 s
START_TIMEOUT_S = 60.0
SO_TIMESTAMPNS = 35  # Linux: the kernel stamps each datagram when it is sent (not in Python's socket module)


class NotifySocket:
    """A bound AF_UNIX datagram socket (path or abstract '@name'); a thread records what arrives.

    Times are the kernel's, taken as each datagram is sent: the reading thread may be late on a busy
    machine, and its own clock would then bunch pings together that were sent well apart.
    """

    def __init__(self, directory: Path, abstract: bool):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        if abstract:
            self.address = f"@o3edge-test-{uuid.uuid4().hex}"
            self.sock.bind("\0" + self.address[1:])
        else:
            self.address = str(directory / "notify.sock")
            self.sock.bind(self.address)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.messages: list[tuple[float, str]] = []  # (time.monotonic() when sent, datagram)
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._closed:
            if select.select([self.sock], [], [], 0.05)[0]:
                data, ancillary, _, _ = self.sock.recvmsg(4096, 64)
                with self._changed:
                    self.messages.append((sent_at(ancillary), data.decode()))
                    self._changed.notify_all()

    def wait(self, line: str, start: int = 0, timeout: float = 10.0) -> int:
        """Index of the first datagram from `start` on holding `line` (or a line starting with it)."""
        end = time.monotonic() + timeout
        with self._changed:
            while True:
                for i in range(start, len(self.messages)):
                    if has(self.messages[i][1], line):
                        return i
                left = end - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {line!r} within {timeout} s; got {self.texts()}")
                self._changed.wait(left)

    def texts(self, start: int = 0, end: int | None = None) -> list[str]:
        return [text for _, text in self.messages[start:end]]

    def ping_times(self, start: int = 0, end: int | None = None) -> list[float]:
        return [t for t, text in self.messages[start:end] if text == "WATCHDOG=1"]

    def close(self) -> None:
        self._closed = True
        self._thread.join(1.0)
        self.sock.close()


def sent_at(ancillary: list) -> float:
    """time.monotonic() when the datagram was sent, from its SO_TIMESTAMPNS stamp (wall clock)."""
    for level, kind, data in ancillary:
        if (level, kind) == (socket.SOL_SOCKET, SO_TIMESTAMPNS):
            sec, nsec = struct.unpack("qq", data[:16])
            return sec + nsec / 1e9 - (time.time() - time.monotonic())
    return time.monotonic()


def has(datagram: str, line: str) -> bool:
    return any(part == line or (line.endswith("=") and part.startswith(line)) for part in datagram.split("\n"))


class Daemon:
    """`python -m o3edge.daemon` with its own config, log and notify socket."""

    def __init__(self, directory: Path, model_dir: str, abstract: bool = False, drain_timeout_s: float = 10.0,
                 socket_path: str | None = None, **env: str):
        self.socket_path = socket_path or str(directory / "o3.sock")
        self.endpoint = "ipc://" + self.socket_path
        self.config = directory / "o3edge.toml"
        self.config.write_text(f'[engine]\nmodel_path = "{model_dir}"\ndevice = "cpu"\nnum_kv_blocks = 64\n'
                               f'[server]\nendpoint = "{self.endpoint}"\ndrain_timeout_s = {drain_timeout_s}\n')
        self.log_path = directory / "o3edged.log"
        self.notify = NotifySocket(directory, abstract)
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("O3EDGE_", "NOTIFY_SOCKET", "WATCHDOG_"))}
        self.env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                        OMP_NUM_THREADS="1", NOTIFY_SOCKET=self.notify.address, XDG_STATE_HOME=str(directory), **env)
        self.proc: subprocess.Popen | None = None

    def start(self, own_watchdog_pid: bool = False) -> "Daemon":
        # sh's exec keeps its pid, so WATCHDOG_PID=$$ names the daemon, as systemd sets it
        export = "export WATCHDOG_PID=$$; " if own_watchdog_pid else ""
        command = ["sh", "-c", export + 'exec "$0" -m o3edge.daemon --config "$1"', sys.executable, str(self.config)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(command, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self) -> int:
        """Index of the first READY=1."""
        try:
            return self.notify.wait("READY=1", timeout=START_TIMEOUT_S)
        except AssertionError:
            raise AssertionError(f"o3edged not ready (exit {self.proc.poll()}):\n{self.log()}") from None

    def client(self, timeout: float = 20.0) -> O3Client:
        return O3Client(self.endpoint, timeout=timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.notify.close()


@pytest.fixture
def make_daemon(tmp_path_factory, tiny_dir):
    made = []

    def make(**kwargs) -> Daemon:
        made.append(Daemon(tmp_path_factory.mktemp("o3d"), tiny_dir, **kwargs))
        return made[-1]

    yield make
    for daemon in made:
        daemon.close()
        print(f"--- {daemon.log_path}\n{daemon.log()}")  # shown when the test failed


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_dir):
    """One daemon on a filesystem notify socket with WATCHDOG_USEC=400000, shared by the tests below in
    order; the last of them stops it."""
    daemon = Daemon(tmp_path_factory.mktemp("o3d"), tiny_dir, WATCHDOG_USEC=str(WATCHDOG_USEC)).start()
    yield daemon
    daemon.close()
    print(f"--- {daemon.log_path}\n{daemon.log()}")


def intervals(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def assert_ping_rate(times: list[float]) -> None:
    """Pings at half of WATCHDOG_USEC: never faster, and never a gap systemd would act on."""
    gaps, half = intervals(times), WATCHDOG_USEC / 2e6
    assert len(gaps) >= 4, times
    assert 0.9 * half <= median(gaps) <= 1.5 * half, gaps
    assert min(gaps) >= 0.75 * half and max(gaps) < 2 * half, gaps  # jitter of the machine, never a timeout


# ---- one daemon through its whole life (filesystem notify socket) ---------------------------------

def test_status_while_loading_then_ready_only_once_it_answers(served):
    ready = served.wait_ready()
    with served.client() as c:  # right after READY=1: the socket is bound and the engine warmed up
        health = c.health()
        answer = c.generate("def main():", max_tokens=4, ignore_eos=True)
    assert health["ready"] and health["status"] == "ready"
    assert answer.completion_tokens == 4
    before = served.notify.texts(0, ready)
    assert [t for t in before if t.startswith("STATUS=")] == ["STATUS=loading", "STATUS=warming up"]
    assert before.index("STATUS=loading") < before.index("STATUS=warming up")
    assert sum(t.startswith("EXTEND_TIMEOUT_USEC=") for t in before) == 2  # one per start-up phase
    assert not any("WATCHDOG=1" in t for t in before)  # systemd arms the watchdog at READY=1
    assert re.fullmatch(r"READY=1\nSTATUS=ready: 0 requests, 0 running, .*", served.notify.texts()[ready])


def test_watchdog_pings_at_half_of_watchdog_usec_idle_and_busy(served):
    served.wait_ready()
    start = len(served.notify.messages)
    time.sleep(1.2)
    idle = served.notify.ping_times(start)
    with served.client() as c:
        busy_start = len(served.notify.messages)
        done = c.generate("while True:", max_tokens=300, ignore_eos=True)
        busy = served.notify.ping_times(busy_start)
    assert_ping_rate(idle)
    assert done.completion_tokens == 300
    if len(busy) >= 5:  # a slow machine decodes longer than a fast one: check what there is
        assert_ping_rate(busy)


def test_status_carries_live_figures(served):
    served.wait_ready()
    start = len(served.notify.messages)
    with served.client() as c:
        for prompt in ("import os", "class A:"):
            c.generate(prompt, max_tokens=48, ignore_eos=True)
    end = time.monotonic() + 8  # STATUS= every 5 s
    while time.monotonic() < end:
        i = served.notify.wait("STATUS=", start, timeout=end - time.monotonic())
        rate = re.search(r"([\d.]+) tokens/s", served.notify.texts()[i])
        if rate and float(rate.group(1)) > 0:
            return
        start = i + 1
    raise AssertionError(f"no STATUS with tokens/s > 0: {served.notify.texts()}")


def test_sighup_reloads_what_it_can_and_names_what_needs_a_restart(served):
    served.wait_ready()
    text = served.config.read_text()
    served.config.write_text(text.replace("num_kv_blocks = 64", "num_kv_blocks = 32")
                             + "[scheduler.normal]\nmax_concurrent = 1\nmax_wait_ms = 60000\n")
    start = len(served.notify.messages)
    before_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    served.proc.send_signal(signal.SIGHUP)
    reloading = served.notify.wait("RELOADING=1", start)
    ready = served.notify.wait("READY=1", reloading)
    stamp = dict(line.split("=", 1) for line in served.notify.texts()[reloading].split("\n"))
    assert before_us <= int(stamp["MONOTONIC_USEC"]) <= time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert ready > reloading
    assert ("applied scheduler.normal.max_concurrent, scheduler.normal.max_wait_ms; "
            "need a restart: engine.num_kv_blocks") in served.log()
    with served.client() as c:
        assert c.info()["num_kv_blocks"] == 64  # restart-only: unchanged
        first = iter(c.stream("def f():", max_tokens=100, ignore_eos=True))
        next(first)
        second = iter(c.stream("def g():", max_tokens=8, ignore_eos=True))
        deadline = time.monotonic() + 5
        while (normal := c.stats()["classes"]["normal"])["waiting"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (normal["running"], normal["waiting"]) == (1, 1)  # the new class limit holds the second back
        assert list(first)[-1].completion_tokens == 100 and list(second)[-1].completion_tokens == 8


def test_sigterm_stops_new_work_and_drains_the_running_stream_then_exits_zero(served):
    served.wait_ready()
    start = len(served.notify.messages)
    with served.client() as c, served.client() as late:
        # long enough to be in flight when the signal lands on a loaded machine (120 tokens, ~0.5 s, once
        # finished first under CI's load)
        stream = iter(c.stream("for i in range(10):", max_tokens=400, ignore_eos=True))
        first = next(stream)
        served.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        stopping = served.notify.wait("STOPPING=1", start)
        assert has(served.notify.texts()[stopping], "STATUS=draining: 1 in flight, up to 10 s")
        with pytest.raises(RequestError) as refused:
            late.generate("import sys", max_tokens=4)
        assert refused.value.code == P.UNAVAILABLE and "shutting down" in str(refused.value)
        rest = list(stream)
    assert isinstance(rest[-1], Completion) and rest[-1].finish_reason == "length"
    assert first.index == 0 and rest[-1].completion_tokens == 400  # completed, not cut
    assert served.proc.wait(10.0) == 0
    assert time.monotonic() - signalled < 10.0  # drain_timeout_s
    assert not os.path.exists(served.socket_path)
    assert "READY=1" not in "".join(served.notify.texts(stopping))


# ---- faults and edges, each on its own daemon --------------------------------------------------------

def test_a_hung_engine_loop_stops_the_watchdog_but_not_the_process(make_daemon):
    # abstract notify socket; WATCHDOG_PID is the daemon's own pid, as systemd sets it
    daemon = make_daemon(abstract=True, WATCHDOG_USEC=str(WATCHDOG_USEC),
                         O3EDGE_TEST_FAULT="stall_engine_after_s=1.0").start(own_watchdog_pid=True)
    ready = daemon.wait_ready()
    time.sleep(2.5)
    pings = daemon.notify.ping_times(ready)
    assert_ping_rate(pings)
    last = pings[-1]
    assert last - daemon.notify.messages[ready][0] < 1.6  # the hang began 1 s into serving
    assert time.monotonic() - last > 2 * WATCHDOG_USEC / 1e6  # systemd would have fired by now
    assert daemon.proc.poll() is None
    with daemon.client(timeout=5) as c:  # the I/O thread still answers; only the engine hangs
        assert c.health()["live"]
    assert "TEST FAULT" in daemon.log()


def test_sighup_while_loading_waits_for_ready_and_drain_timeout_ends_a_long_request(make_daemon):
    # WATCHDOG_PID names another process (a helper inheriting the variables): no pings from us
    daemon = make_daemon(abstract=True, drain_timeout_s=0.5, WATCHDOG_USEC=str(WATCHDOG_USEC),
                         WATCHDOG_PID=str(os.getpid())).start()
    daemon.notify.wait("STATUS=loading", timeout=START_TIMEOUT_S)
    daemon.proc.send_signal(signal.SIGHUP)
    ready = daemon.wait_ready()
    reloading = daemon.notify.wait("RELOADING=1", ready)
    daemon.notify.wait("READY=1", reloading + 1)
    assert not any(has(t, "RELOADING=1") for t in daemon.notify.texts(0, ready))
    with daemon.client() as c:
        stream = iter(c.stream("while True:", max_tokens=1800, ignore_eos=True))
        next(stream)
        daemon.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        with pytest.raises(RequestError) as cut:
            list(stream)
    assert cut.value.code == P.UNAVAILABLE and "drain timeout (0.5 s) ran out" in str(cut.value)
    assert daemon.proc.wait(10.0) == 0
    assert time.monotonic() - signalled < 5.0
    assert not any("WATCHDOG=1" in t for t in daemon.notify.texts())


def test_kill_9_during_decode_then_a_restart_on_the_same_endpoint(make_daemon):
    first = make_daemon().start()
    first.wait_ready()
    with first.client(timeout=10) as c:
        stream = iter(c.stream("class Parser:", max_tokens=1800, ignore_eos=True))
        next(stream), next(stream)
        first.proc.kill()
        killed = time.monotonic()
        with pytest.raises(DaemonUnavailable):
            list(stream)
        assert time.monotonic() - killed < 5.0  # the disconnect, not the client's 10 s timeout
        assert first.proc.wait() == -signal.SIGKILL
        assert os.path.exists(first.socket_path) and os.path.exists(first.socket_path + ".lock")  # left behind
        second = make_daemon(socket_path=first.socket_path).start()
        second.wait_ready()
        assert c.generate("import os", max_tokens=4, ignore_eos=True).completion_tokens == 4  # it reconnects
    assert second.proc.poll() is None
