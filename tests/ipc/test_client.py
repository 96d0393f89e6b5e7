"""The client libraries when the daemon dies mid-stream or is not there at all."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, clean_env
from o3edge.ipc.aio import AsyncO3Client
from o3edge.ipc.client import DaemonUnavailable, O3Client, TokenEvent

# A stand-in daemon: answers one generate with one token, then hangs until it is killed.
STUB = """
import sys, msgpack, zmq
s = zmq.Context().socket(zmq.ROUTER)
s.bind(sys.argv[1])
print("bound", flush=True)
identity, frame = s.recv_multipart()
rid = msgpack.unpackb(frame)["id"]
s.send_multipart([identity, msgpack.packb({"v": 1, "type": "token", "id": rid, "index": 0, "text": "a",
                                           "token_ids": [1]})])
import time; time.sleep(60)
"""


@pytest.fixture
def stub(tmp_path):
    endpoint = f"ipc://{tmp_path}/stub.sock"
    proc = subprocess.Popen([sys.executable, "-c", STUB, endpoint], cwd=REPO, env=clean_env(),
                            stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"bound\n"
    yield endpoint, proc
    proc.kill()
    proc.wait()


def test_daemon_killed_mid_stream_raises_at_once(stub):
    endpoint, proc = stub
    with O3Client(endpoint, timeout=20) as c:
        stream = iter(c.stream("x"))
        assert isinstance(next(stream), TokenEvent)
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="closed the connection"):
            next(stream)
        assert time.monotonic() - t0 < 5  # not the 20 s timeout


def test_async_client_sees_the_daemon_die(stub):
    endpoint, proc = stub

    async def main():
        async with AsyncO3Client(endpoint, timeout=20) as c:
            stream = c.stream("x")
            assert isinstance(await stream.__anext__(), TokenEvent)
            os.kill(proc.pid, signal.SIGKILL)
            with pytest.raises(DaemonUnavailable, match="closed the connection"):
                await stream.__anext__()

    asyncio.run(asyncio.wait_for(main(), 10))


def test_absent_daemon_is_reported_before_any_request(tmp_path):
    with pytest.raises(DaemonUnavailable, match="not running"):
        O3Client(f"ipc://{tmp_path}/none.sock")
    with pytest.raises(DaemonUnavailable, match="not running"):
        AsyncO3Client(f"ipc://{tmp_path}/none.sock")


# Run in its own process: if the bug is back, that process's zmq context is the one that hangs.
CLOSE_AS_IT_DIES = """
import subprocess, sys, time
from o3edge.ipc.client import O3Client, TokenEvent
STUB, directory = sys.argv[1], sys.argv[2]


def stub(name):
    proc = subprocess.Popen([sys.executable, "-c", STUB, f"ipc://{directory}/{name}"], stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"bound\\n"
    return proc


class DiesWhenClosed:  # the client's monitor socket, and the daemon dying just after it is closed
    def __init__(self, monitor, proc):
        self.monitor, self.proc = monitor, proc

    def close(self, linger=None):
        self.monitor.close(linger=linger)
        self.proc.kill()
        self.proc.wait()
        time.sleep(0.3)  # the I/O thread reports the disconnect before the client's socket closes


for name in ("a.sock", "b.sock"):
    proc = stub(name)
    with O3Client(f"ipc://{directory}/{name}", timeout=5) as c:
        assert isinstance(next(iter(c.stream("x"))), TokenEvent)  # DaemonUnavailable if the context hangs
        c._monitor = DiesWhenClosed(c._monitor, proc)
print("ok")
"""


def test_a_client_closed_as_the_daemon_dies_leaves_the_next_client_working(tmp_path):
    # Clients share zmq.Context.instance(), and libzmq reports monitor events with a blocking send
    # from its I/O thread: a disconnect reported after the monitor's reader closed hung that thread.
    result = subprocess.run([sys.executable, "-c", CLOSE_AS_IT_DIES, STUB, str(tmp_path)], cwd=REPO,
                            env=clean_env(), capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr[-2000:]
