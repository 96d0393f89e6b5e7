"""One asyncio event loop on its own thread: the HTTP door's server and the upstream client run on it."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Awaitable

log = logging.getLogger(__name__)


class LoopThread:
    """An asyncio loop running forever on a daemon thread until stop()."""

    def __init__(self, name: str = "o3edge-http"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    def call(self, coro: Awaitable, timeout: float | None = None):
        """Run a coroutine on the loop from another thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the HTTP loop did not stop within %g s", timeout)
