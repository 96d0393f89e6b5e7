"""The daemon's extra doors, built from [http] and [upstream]: one asyncio thread for both, or nothing.

The daemon calls start() after the IPC server is bound, and close() after it has drained; with
both sections off, nothing is started and no aiohttp is imported.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from o3edge.http.config import HttpSettings, UpstreamSettings

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from o3edge.ipc.metrics import RequestCounter
    from o3edge.ipc.server import IPCServer

log = logging.getLogger(__name__)


class Doors:
    """The HTTP endpoint and the upstream overflow of one IPC server (each only when configured)."""

    def __init__(self, http: HttpSettings, upstream: UpstreamSettings, server: "IPCServer",
                 registry: "CollectorRegistry | None", requests: "RequestCounter | None"):
        self.aio = self.http = self.overflow = None
        if not (http.enabled or upstream.enabled):
            return
        from o3edge.http.loop_thread import LoopThread

        self.aio = LoopThread()
        if upstream.enabled:
            from o3edge.http.overflow import Overflow

            from o3edge.http.metrics import UpstreamCollector

            self.overflow = Overflow(upstream, server, self.aio)  # reads the API key file: ConfigError now
            server.attach_overflow(self.overflow)
            registry.register(UpstreamCollector(self.overflow, requests))
        if http.enabled:
            from o3edge.http.app import HttpServer

            from prometheus_client import generate_latest

            metrics = (lambda: generate_latest(registry)) if registry is not None else None
            self.http = HttpServer(http, server, self.aio, metrics)

    def start(self) -> None:
        """Start the loop thread and bind the HTTP port; raises O3Error endpoint_unavailable."""
        if self.aio is None:
            return
        self.aio.start()
        if self.overflow is not None:
            log.info("upstream overflow to %s (model %s); policy %s", self.overflow.settings.url,
                     self.overflow.settings.model, self.overflow.policy)
        if self.http is not None:
            self.http.start()

    def close(self) -> None:
        if self.aio is None:
            return
        if self.http is not None:
            self.http.close()
        if self.overflow is not None:
            try:
                self.aio.call(self.overflow.close(), timeout=5)
            except (Exception, asyncio.CancelledError):
                log.exception("closing the upstream client failed")
        self.aio.stop()
