"""Hostile input (RELIABILITY.md's list) against a real o3edged: each message gets a coded error or
its peer is dropped, the daemon keeps serving, and its memory and file descriptors stay flat."""

import math
import random
import socket

import msgpack
import psutil
import zmq

from conftest import wait_for
from o3edge.ipc import protocol as P
from o3edge.ipc.client import O3Client

RSS_TOLERANCE = 8 << 20  # bytes: allocator noise, not a leak (a leak of 1 KiB a message would be 500 KiB+)
FD_TOLERANCE = 2
ROUNDS = 12


def msg(**fields):
    return msgpack.packb({"v": 1, "op": "generate", "id": "f", "prompt": "hi", **fields})


def reply_cases(rng: random.Random):
    """(frames, expected error code or None for "any code"): the daemon must answer each with an error."""
    good = msg()
    cases = [
        ([b""], P.BAD_MESSAGE),  # empty frame
        ([good[:-2]], P.BAD_MESSAGE),  # truncated msgpack
        ([b"\xc1"], P.BAD_MESSAGE),  # reserved byte
        ([good + b"\x00"], P.BAD_MESSAGE),  # trailing bytes
        ([b"\x91" * 100_000], P.BAD_MESSAGE),  # nesting 100k deep
        ([b"\xdd" + (300_000).to_bytes(4, "big") + b"\x90" * 300_000], P.BAD_MESSAGE),  # 300k empty arrays
        ([b"\xdc\x04\x00" + (b"\xdc\x04\x00" + b"\x90" * 1024) * 600], P.BAD_MESSAGE),  # 600k, nested
        ([b"\xdf" + (1_000_000).to_bytes(4, "big") + b"\xa1a\x00" * 1000], P.BAD_MESSAGE),  # map of a million
        ([msgpack.packb({1: 2, "v": 1})], P.BAD_MESSAGE),  # integer map keys
        ([b"\x83\xa1v\x01\xa2op\xa6health\xa1v\x01"], P.BAD_MESSAGE),  # duplicate keys
        ([b"\x83\xa1v\x01\xa2op\xa6health\xa2id\xa2\xc3\x28"], P.BAD_MESSAGE),  # invalid UTF-8
        ([msgpack.packb({"v": 1, "op": "health", "id": msgpack.ExtType(5, b"xx")})], P.BAD_MESSAGE),  # ext
        ([msgpack.packb({"v": 1, "op": "health", "id": msgpack.Timestamp(1, 2)})], P.BAD_MESSAGE),  # timestamp
        ([msgpack.packb([1, 2, 3])], P.BAD_MESSAGE),
        ([msgpack.packb(b"binary")], P.BAD_MESSAGE),
        ([good, good], P.BAD_MESSAGE),  # two frames
        ([b"", good], P.BAD_MESSAGE),  # a REQ-style empty delimiter
        ([msg(temperature=math.nan)], P.INVALID_REQUEST),
        ([msg(temperature=math.inf)], P.INVALID_REQUEST),
        ([msg(top_p=-math.inf)], P.INVALID_REQUEST),
        ([msg(max_tokens=-1)], P.INVALID_REQUEST),
        ([msg(max_tokens=2**64 - 1)], P.INVALID_REQUEST),
        ([msg(top_k=2**63)], P.INVALID_REQUEST),
        ([msg(seed=-2**63)], P.INVALID_REQUEST),
        ([msg(stop=["x"] * 1000)], P.INVALID_REQUEST),
        ([msg(priority="now")], P.INVALID_REQUEST),
        ([msg(id="x" * 1000)], P.INVALID_REQUEST),
        ([msg(unexpected=True)], P.INVALID_REQUEST),
        ([msgpack.packb({"v": 1, "op": "generate", "id": "f"})], P.INVALID_REQUEST),
        ([msgpack.packb({"v": 1, "op": "generate", "id": "f", "messages": [{"role": 1}]})], P.INVALID_REQUEST),
        ([msgpack.packb({"v": 1, "op": "rm -rf", "id": "f"})], P.UNKNOWN_OP),
        ([msgpack.packb({"v": 99, "op": "health", "id": "f"})], P.UNSUPPORTED_VERSION),
        ([msgpack.packb({"v": 1, "op": "health"})], P.INVALID_REQUEST),
        ([msg(prompt="word " * 5000)], P.PROMPT_TOO_LONG),  # longer than the 2048-token context
        ([msgpack.packb({"v": 1, "op": "cancel", "id": "f", "target": 7})], P.INVALID_REQUEST),
    ]
    for _ in range(6):  # random garbage: any error code will do
        cases.append(([rng.randbytes(rng.randrange(1, 300))], None))
    return cases


def drop_cases():
    """Messages whose peer is dropped without a reply (too many frames, or a frame over MAXMSGSIZE)."""
    return [[b"x"] * 100, [b"y" * 1000] * 1000, [b"z" * (2 << 20)]]


GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32


def zmtp_ready() -> bytes:
    prop = b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    body = b"\x05READY" + prop
    return b"\x04" + bytes([len(body)]) + body


def raw_cases(rng: random.Random):
    """Byte streams for a plain UNIX socket: garbage instead of a greeting, and broken ZMTP sessions."""
    hello = GREETING + zmtp_ready()
    return [
        rng.randbytes(512),  # garbage instead of a ZMTP greeting
        b"GET / HTTP/1.1\r\nHost: o3edge\r\n\r\n",
        GREETING.replace(b"NULL", b"CURV"),  # a mechanism we do not speak
        hello,  # a session that sends zero frames
        hello + b"\x01\x03abc",  # a multipart message that never ends
        hello + b"\x02" + (1 << 40).to_bytes(8, "big"),  # a frame of 1 TiB announced
    ]


def send_raw(path: str, data: bytes) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
        s.sendall(data)
        s.recv(256)
    except OSError:
        pass
    finally:
        s.close()


def expect_error(sock, frames, code) -> None:
    sock.send_multipart(frames)
    assert sock.poll(10_000), f"no reply to {frames[0][:40]!r}"
    reply = msgpack.unpackb(sock.recv(), raw=False)
    assert reply["type"] == "error" and reply["code"] in P.ERROR_CODES, reply
    assert code is None or reply["code"] == code, (frames[0][:40], reply)


def expect_dropped(ctx, endpoint, frames) -> None:
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(endpoint)
    peer.send_multipart(frames)
    assert not peer.poll(150), "a dropped peer must get no reply"
    peer.close()


def fuzz_round(ctx, daemon, rng) -> int:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)
    sent = 0
    for frames, code in reply_cases(rng):
        expect_error(sock, frames, code)
        sent += 1
    sock.close()
    return sent


def snapshot(proc: psutil.Process) -> tuple[int, int]:
    return proc.memory_info().rss, proc.num_fds()


def test_malformed_messages_get_errors_and_leave_the_daemon_flat(daemon, client):
    ctx, rng = zmq.Context.instance(), random.Random(1234)
    proc = psutil.Process(daemon.proc.pid)
    fuzz_round(ctx, daemon, rng)  # warm-up: first-use allocations are not leaks
    for frames in drop_cases():
        expect_dropped(ctx, daemon.endpoint, frames)
    for data in raw_cases(rng):
        send_raw(daemon.socket_path, data)
    bad_before = client.stats()["bad_messages"]
    rss0, fds0 = snapshot(proc)

    sent = 0
    for i in range(ROUNDS):
        sent += fuzz_round(ctx, daemon, rng)
        if i % 4 == 0:
            for frames in drop_cases():
                expect_dropped(ctx, daemon.endpoint, frames)
                sent += 1
        for data in raw_cases(rng):
            send_raw(daemon.socket_path, data)
            sent += 1
    assert sent >= 500

    done = client.generate("def handler(request):", max_tokens=4)
    assert done.completion_tokens == 4 and client.health()["ready"]
    stats = client.stats()
    num_replied = len(reply_cases(rng)) - 1  # all but prompt_too_long count as bad messages
    assert stats["bad_messages"] - bad_before >= ROUNDS * num_replied and stats["requests_in_flight"] == 0
    # libzmq closes the broken connections asynchronously: give it a moment before counting fds
    assert wait_for(lambda: snapshot(proc)[1] <= fds0 + FD_TOLERANCE, timeout=5), (fds0, snapshot(proc))
    rss1 = snapshot(proc)[0]
    assert rss1 - rss0 <= RSS_TOLERANCE, f"RSS grew by {(rss1 - rss0) / 2**20:.1f} MiB over {sent} bad messages"
    with O3Client(daemon.endpoint, timeout=10) as other:  # a fresh client is served normally
        assert other.generate("import", max_tokens=2).completion_tokens == 2
