"""Real o3edged processes with the HTTP door on, on free loopback ports."""

import socket

import pytest

from tests.ipc.conftest import DaemonProcess
from tools.daemon_process import merge


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpDaemon(DaemonProcess):
    """An o3edged with [http] on; `url` is its OpenAI base URL (http://127.0.0.1:PORT/v1).

    `tables` ({"engine": {...}, "http": {...}, "upstream": {...}}) are merged over [http] enabled on `port`.
    """

    def __init__(self, directory, model_dir, name="o3.sock", tables=None, port=None, **kw):
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/v1"
        http = {"http": {"enabled": True, "listen": f"127.0.0.1:{self.port}"}}
        super().__init__(directory, model_dir, name, merge(http, tables or {}), **kw)


def start_http_daemon(directory, model_dir, **kw) -> HttpDaemon:
    d = HttpDaemon(str(directory), model_dir, **kw).start()
    d.wait_ready()
    return d


@pytest.fixture(scope="module")
def http_daemon(tmp_path_factory, tiny_dir):
    """One o3edged with the HTTP door on, for a test module."""
    d = start_http_daemon(tmp_path_factory.mktemp("http"), tiny_dir)
    yield d
    d.stop()


@pytest.fixture
def oai(http_daemon):
    """The openai Python client pointed at the daemon (no retries: a 429 must reach the test)."""
    import openai

    with openai.OpenAI(base_url=http_daemon.url, api_key="unused", max_retries=0, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(http_daemon):
    import openai

    with openai.OpenAI(base_url=http_daemon.url, api_key="unused", max_retries=0) as c:
        return c.models.list().data[0].id
