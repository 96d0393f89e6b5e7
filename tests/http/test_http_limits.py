"""The HTTP door under load and abuse: busy as 429, draining as 503, connection cap, slow and oversized headers."""

import signal
import socket
import threading
import time

import openai
import pytest

from tests.helpers import wait_for
from tests.http.conftest import start_http_daemon

LONG = dict(max_tokens=4000, temperature=0, stream=True, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def small(tmp_path_factory, tiny_dir):
    """A daemon that holds one running and one waiting request, 4 connections, 1 s to send headers."""
    d = start_http_daemon(tmp_path_factory.mktemp("http-limits"), tiny_dir,
                          tables={"engine": {"max_num_seqs": 1}, "server": {"queue_max_requests": 1},
                                  "http": {"max_connections": 4, "header_timeout_s": 1.0, "max_header_bytes": 1024}})
    yield d
    d.stop()


def client(d):
    return openai.OpenAI(base_url=d.url, api_key="unused", max_retries=0, timeout=60.0)


def model(d) -> str:
    with client(d) as c:
        return c.models.list().data[0].id


def hold(d, n):
    """Start n long streamed requests (each waits for its first chunk); returns their streams."""
    streams = []
    for _ in range(n):
        s = client(d).completions.create(model=model(d), prompt="hold the line", **LONG)
        next(iter(s))
        streams.append(s)
    return streams


def raw(d) -> socket.socket:
    return socket.create_connection(("127.0.0.1", d.port), timeout=10)


def test_busy_is_429(small):
    streams = hold(small, 1)  # running; a second one would wait, a third is one too many
    waiting = threading.Thread(target=lambda: list(client(small).completions.create(
        model=model(small), prompt="wait", max_tokens=2, stream=True)), daemon=True)
    waiting.start()
    try:
        time.sleep(0.3)
        with client(small) as c, pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=model(small), prompt="one too many", max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "busy"
    finally:
        for s in streams:
            s.close()
    waiting.join(30)
    assert not waiting.is_alive()


def test_connection_cap(small):
    """Past max_connections, a new connection gets one 503 and is closed; a freed slot serves again."""
    held = [raw(small) for _ in range(4)]
    try:
        assert wait_for(lambda: _answer(small, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").startswith(
            b"HTTP/1.1 503"), timeout=5)
        assert b"too many open connections" in _answer(small, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    finally:
        for s in held:
            s.close()
    assert wait_for(lambda: _answer(small, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").startswith(
        b"HTTP/1.1 200"), timeout=5)


def test_slow_headers_are_cut(small):
    """A client that dribbles its headers is disconnected after header_timeout_s (no slowloris)."""
    s = raw(small)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    start = time.monotonic()
    try:
        for _ in range(30):
            s.sendall(b"X-Slow: 1\r\n")
            time.sleep(0.1)
        s.settimeout(5)
        data = s.recv(100)
    except (ConnectionResetError, BrokenPipeError):
        data = b""
    assert data in (b"", None) or not data.startswith(b"HTTP/1.1 200")
    assert time.monotonic() - start < 4.5


def test_oversized_header_is_refused(small):
    reply = _answer(small, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4000 + b"\r\n\r\n")
    assert reply.split(b" ")[1] in (b"400", b"431")


def test_draining_is_503(tmp_path, tiny_dir):
    """After SIGTERM, while a request still runs, new requests get 503 with code unavailable."""
    d = start_http_daemon(tmp_path, tiny_dir)
    try:
        streams = hold(d, 1)
        d.proc.send_signal(signal.SIGTERM)
        name = model(d)
        with client(d) as c:
            def refused():
                try:
                    c.completions.create(model=name, prompt="late", max_tokens=2)
                except openai.APIStatusError as exc:
                    return exc
                return None
            exc = wait_for(refused, timeout=10)
        assert exc.status_code == 503 and exc.body["code"] == "unavailable"
        for s in streams:
            s.close()
    finally:
        assert d.stop() == 0


def _answer(d, request: bytes) -> bytes:
    with raw(d) as s:
        s.sendall(request)
        try:
            return s.recv(4096)
        except ConnectionResetError:
            return b""


def test_port_taken_exits_73(small, tmp_path, tiny_dir):
    """A second daemon on a taken HTTP port says so and exits with the endpoint status (73)."""
    from tests.http.conftest import HttpDaemon

    d = HttpDaemon(str(tmp_path), tiny_dir, port=small.port).start()
    try:
        assert d.proc.wait(60) == 73
        assert "cannot listen for HTTP" in d.log()
    finally:
        d.stop()

