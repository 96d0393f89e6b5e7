"""Real o3edged processes with the HTTP door on, on free loopback ports."""

import socket

import pytest

from tests.ipc.conftest import DaemonProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpDaemon(DaemonProcess):
    """An o3edged with [http] on; `url` is its OpenAI base URL (http://127.0.0.1:PORT/v1)."""

    def __init__(self, directory, model_dir, name="o3.sock", http_extra="", extra="", port=None, **kw):
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/v1"
        server_extra = kw.pop("server_extra", "")
        http = f'\n[http]\nenabled = true\nlisten = "127.0.0.1:{self.port}"\n{http_extra}\n{extra}\n'
        super().__init__(directory, model_dir, name, server_extra=server_extra + http, **kw)


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
