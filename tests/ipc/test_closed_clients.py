"""A client process that leaves without cancelling: its requests are dropped when its last connection closes."""

import subprocess
import sys
import textwrap
import time

from conftest import REPO, clean_env, wait_for
from o3edge.ipc import access

LEAVER = textwrap.dedent("""
    import os, sys, time, msgpack, zmq
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(3)]
    for s in socks:
        s.connect(sys.argv[1])
        for i in range(3):  # not streamed: nothing comes back until each request ends
            s.send(msgpack.packb({"v": 1, "op": "generate", "id": f"g{i}", "prompt": "Once upon a time",
                                  "max_tokens": 100000, "ignore_eos": True, "stream": False}))
    time.sleep(1.0)  # the requests are in flight
    os._exit(0)  # gone, without a cancel: the kernel closes its connections
""")


def test_the_requests_of_a_process_that_closed_its_connections_are_dropped(daemon, client):
    """9 long non-streamed requests from a process that then exits: in flight until their final replies failed to
    send (minutes at a large max_tokens); now dropped within a moment of the exit, their KV blocks freed."""
    base = client.stats()
    r = subprocess.run([sys.executable, "-c", LEAVER, daemon.endpoint], cwd=REPO, env=clean_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    t0 = time.monotonic()
    assert wait_for(lambda: client.stats()["requests_in_flight"] == 0, timeout=10)
    assert time.monotonic() - t0 < 5
    assert client.stats()["dropped_peers"] - base["dropped_peers"] == 3
    assert wait_for(lambda: client.stats()["kv_blocks_used"] <= base["kv_blocks_used"], timeout=10)
    assert client.generate("still serving", max_tokens=2).completion_tokens == 2


def test_a_process_id_comes_from_an_ipc_peer_address():
    assert access.address_pid("localhost:1000:1000:4321") == 4321
    assert access.address_pid("127.0.0.1") is None and access.address_pid("localhost:1:2") is None


RECONNECTER = textwrap.dedent("""
    import sys
    from o3edge.ipc.client import O3Client
    for i in range(40):  # a connection per request, each closed before the next opens
        with O3Client(sys.argv[1], timeout=20) as c:
            assert c.generate(f"request {i}", max_tokens=2, stream=False).completion_tokens == 2
    print("ok")
""")


def test_a_process_that_reconnects_for_every_request_is_always_served(daemon, client):
    """One process closing its only connection and opening the next at once: its process is gone for an instant
    between the two, and the next connection's first request must not be taken for a closed process's."""
    base = client.stats()["from_closed_processes"]
    r = subprocess.run([sys.executable, "-c", RECONNECTER, daemon.endpoint], cwd=REPO, env=clean_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    assert client.stats()["from_closed_processes"] == base
