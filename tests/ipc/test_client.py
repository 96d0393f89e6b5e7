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


def test_closing_a_client_as_the_daemon_dies_leaves_later_clients_working(tmp_path):
    # Clients share zmq.Context.instance(). A disconnect that libzmq reported to an already closed
    # monitor reader once blocked the context's I/O thread for good: every later client hung.
    for round_ in range(3):
        endpoint = f"ipc://{tmp_path}/stub{round_}.sock"
        proc = subprocess.Popen([sys.executable, "-c", STUB, endpoint], cwd=REPO, env=clean_env(),
                                stdout=subprocess.PIPE)
        try:
            assert proc.stdout.readline() == b"bound\n"
            with O3Client(endpoint, timeout=5) as c:
                assert isinstance(next(iter(c.stream("x"))), TokenEvent)  # DaemonUnavailable if wedged
                proc.kill()
                proc.wait()
        finally:
            proc.kill()
            proc.wait()
