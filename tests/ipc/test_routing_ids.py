"""Routing ids a client chooses cannot crash the daemon nor reach another client's requests (o3edge/ipc/peer_ids.py)."""

import os
import subprocess
import sys
import time

import zmq

from conftest import DaemonProcess
from o3edge.ipc import peer_ids
from o3edge.ipc.client import O3Client
from o3edge.ipc.server import LOCAL_PREFIX

FIRST_UNSEEDED = 0x6B8B4567  # libc's first rand() unseeded: where libzmq's generated ids started in every process


def dealers(ctx: zmq.Context, endpoint: str, ids: list[bytes]) -> list[zmq.Socket]:
    socks = []
    for rid in ids:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, rid)
        s.connect(endpoint)
        socks.append(s)
    return socks


def test_claiming_the_ids_libzmq_would_generate_next_does_not_abort_the_daemon(tmp_path, tiny_dir):
    """200 connections claiming the ids an unseeded libzmq gives the next peers (a zero byte and the counter from
    libc's unseeded rand()) used to abort the process when an ordinary client connected (libzmq asserts that a
    generated id is free): the daemon now starts its counter at a random value, and serves that client."""
    d = DaemonProcess(str(tmp_path), tiny_dir).start()
    try:
        d.wait_ready()
        ctx = zmq.Context()
        try:
            claimed = [b"\x00" + (FIRST_UNSEEDED + i).to_bytes(4, "big") for i in range(200)]
            dealers(ctx, d.endpoint, claimed)  # connected, and kept until ctx.destroy
            time.sleep(1.0)  # their handshakes done
            for _ in range(3):  # ordinary clients: generated ids
                with O3Client(d.endpoint, timeout=20.0) as c:
                    assert c.health()["status"] == "ready"
            assert d.proc.poll() is None, d.log()[-2000:]
        finally:
            ctx.destroy(linger=0)
    finally:
        d.stop()
    assert "Assertion failed" not in d.log()


def test_a_message_from_a_chosen_id_in_the_reserved_space_is_dropped_unanswered(daemon, client):
    """A peer that chose a routing id starting with a zero byte (the HTTP door's ids live there) is not answered and
    its message reaches nobody; one of 5 bytes cannot be told from a generated id and is served."""
    import msgpack

    ctx = zmq.Context()
    try:
        spoofed = [LOCAL_PREFIX + (1).to_bytes(8, "big"), b"\x00" + b"x" * 5, b"\x00"]
        generated_like = b"\x00" + os.urandom(4)
        socks = dealers(ctx, daemon.endpoint, spoofed + [generated_like])
        before = client.stats()["reserved_ids"]
        health = msgpack.packb({"v": 1, "op": "health", "id": "h"})
        for s in socks:
            s.send(health)
        assert socks[-1].poll(10_000), "a 5-byte id is served"
        assert msgpack.unpackb(socks[-1].recv())["id"] == "h"
        for s in socks[:-1]:
            assert not s.poll(500), "no reply to a chosen id in the reserved space"
        assert client.stats()["reserved_ids"] - before == len(spoofed)
        assert client.health()["status"] == "ready"
    finally:
        ctx.destroy(linger=0)
    assert "reserved for generated ones" in daemon.log()


def test_generated_ids_start_where_no_client_can_guess():
    """After seed_generated_ids a fresh ROUTER's first generated id differs from process to process (two processes)."""
    code = ("import zmq; from o3edge.ipc import peer_ids; assert peer_ids.seed_generated_ids(); ctx = zmq.Context(); "
            "r = ctx.socket(zmq.ROUTER); port = r.bind_to_random_port('tcp://127.0.0.1'); d = ctx.socket(zmq.DEALER); "
            "d.connect(f'tcp://127.0.0.1:{port}'); d.send(b'x'); print(r.recv_multipart()[0].hex())")
    firsts = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             check=True).stdout.strip() for _ in range(2)}
    assert len(firsts) == 2 and all(len(f) == 10 and f.startswith("00") for f in firsts)
    assert f"00{FIRST_UNSEEDED:08x}" not in firsts


def test_reserved_ids_and_log_tags():
    assert peer_ids.reserved(LOCAL_PREFIX + b"\x00" * 8) and peer_ids.reserved(b"\x00") and peer_ids.reserved(b"\x00ab")
    assert not peer_ids.reserved(b"\x00abcd") and not peer_ids.reserved(b"client-1") and not peer_ids.reserved(b"")
    tag = peer_ids.tag(b"\x00abcd")
    assert tag == peer_ids.tag(b"\x00abcd") != peer_ids.tag(b"\x00abce") and "61626364" not in tag
