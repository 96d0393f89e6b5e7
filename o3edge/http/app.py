"""The HTTP door's server: aiohttp on its own asyncio thread, hardened like the ZeroMQ socket.

aiohttp was chosen over uvicorn + starlette (+ httpx for the upstream): one well-kept package gives
both the asyncio HTTP server and the streaming client the upstream overflow needs, with no ASGI
layer between the socket and the handlers (less per-token work on a 2-core device).

Limits: request bodies past max_body_bytes get 413 before they are read; a header line past
max_header_bytes, or more than max_headers headers, gets 400/431 from aiohttp's parser; a
connection that has not sent a whole request within header_timeout_s is closed (aiohttp's
keep-alive timer also runs from the moment a connection opens); a body must arrive within
body_timeout_s; a reply write blocked for send_timeout_s (the client stopped reading and the socket
buffers are full) cancels its request; past max_connections open connections, a new one gets one
503 and is closed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING, Callable

from aiohttp import web

from o3edge.errors import O3Error
from o3edge.http.config import HttpSettings, split_listen
from o3edge.http.door import LocalDoor
from o3edge.http.loop_thread import LoopThread
from o3edge.http.routes import Routes, openai_errors

if TYPE_CHECKING:
    from o3edge.ipc.server import IPCServer

log = logging.getLogger(__name__)
_FULL_BODY = (b'{"error":{"message":"too many open connections","type":"server_error","param":null,'
              b'"code":"unavailable"}}')
FULL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(_FULL_BODY), _FULL_BODY))
BACKLOG = 128


class _Full(asyncio.Protocol):
    """Answers a connection past the cap with one 503 and closes it."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        transport.write(FULL)
        transport.close()


class HttpServer:
    """The OpenAI-compatible endpoint of one IPCServer, on `aio`'s loop."""

    def __init__(self, settings: HttpSettings, server: "IPCServer", aio: LoopThread,
                 metrics: Callable[[], bytes] | None = None):
        self.settings, self.aio = settings, aio
        self.door = LocalDoor(server, aio.loop)
        self.routes = Routes(server, self.door, settings, metrics)
        self.port: int | None = None
        self.num_refused = 0  # connections turned away at the cap
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None

    def start(self) -> None:
        """Bind and serve (on the loop thread); raises O3Error endpoint_unavailable if it cannot bind."""
        self.aio.call(self._start(), timeout=30)
        host = self.settings.listen.rpartition(":")[0]
        log.info("HTTP (OpenAI-compatible) on %s:%d%s", host, self.port,
                 "" if self.settings.is_loopback else " -- NOT loopback: anyone who can reach it may use it")

    async def _start(self) -> None:
        app = web.Application(middlewares=[openai_errors], client_max_size=self.settings.max_body_bytes)
        self.routes.add_to(app)
        s = self.settings
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                                     keepalive_timeout=s.header_timeout_s, max_line_size=s.max_header_bytes,
                                     max_field_size=s.max_header_bytes, max_headers=s.max_headers)
        await self._runner.setup()
        host, port = split_listen(s.listen)
        try:
            self._listener = await asyncio.get_running_loop().create_server(
                self._protocol, host, port, backlog=BACKLOG, reuse_address=True,
                family=socket.AF_INET6 if ":" in host else socket.AF_UNSPEC)
        except OSError as exc:
            await self._runner.cleanup()
            raise O3Error(f"cannot listen for HTTP on {s.listen}: {exc}", "endpoint_unavailable") from None
        self.port = self._listener.sockets[0].getsockname()[1]

    def _protocol(self) -> asyncio.Protocol:
        server = self._runner.server
        if len(server.connections) >= self.settings.max_connections:
            self.num_refused += 1
            return _Full()
        return server()

    def close(self, timeout: float = 5.0) -> None:
        """Stop listening, close open connections (their requests are cancelled)."""
        if self._runner is not None:
            try:
                self.aio.call(self._close(timeout), timeout=timeout + 5)
            except Exception:
                log.exception("stopping the HTTP server failed")

    async def _close(self, timeout: float) -> None:
        if self._listener is not None:
            self._listener.close()
        await self._runner.shutdown()
        await self._runner.cleanup()
