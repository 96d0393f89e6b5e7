"""The in-process door: requests from the HTTP routes enter the IPC server as if from a ZeroMQ peer.

Each HTTP request gets its own routing id (o3edge.ipc.server.LOCAL_PREFIX + a counter), so it takes
the same path as a ZeroMQ request (admission limits, tokenizer lanes, the engine loop, energy
accounting, upstream overflow) and its replies come back through the server's local sink instead
of the ROUTER socket. The sink runs on the engine thread (or the I/O and tokenizer threads, for
refusals): it queues the packed reply and wakes the asyncio loop at most once per batch, so one
engine step that produces tokens for many HTTP requests costs one wake-up, not one per token.
Leaving a request's `open()` block before its last reply aborts it (its KV blocks are freed).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, AsyncIterator

import msgpack

from o3edge.ipc import protocol as P
from o3edge.ipc.server import LOCAL_PREFIX

if TYPE_CHECKING:
    from o3edge.ipc.server import IPCServer


class Stream:
    """One request's replies, in order, on the asyncio loop."""

    def __init__(self):
        self.queue: asyncio.Queue[dict] = asyncio.Queue()
        self.finished = False

    async def next_batch(self) -> list[dict]:
        """The replies that arrived since the last call (waits for at least one)."""
        batch = [await self.queue.get()]
        while not self.queue.empty():
            batch.append(self.queue.get_nowait())
        if batch[-1].get("type") in ("done", "error"):
            self.finished = True
        return batch


class LocalDoor:
    """Opens requests on the IPC server for code running on `loop`."""

    def __init__(self, server: "IPCServer", loop: asyncio.AbstractEventLoop):
        self.server, self.loop = server, loop
        self._ids = itertools.count(1)
        self._streams: dict[bytes, Stream] = {}  # only touched on the loop
        self._inbox: deque[tuple[bytes, bytes]] = deque()
        self._lock = threading.Lock()
        self._wake_pending = False
        server.local_sink = self.sink

    def sink(self, identity: bytes, payload: bytes) -> None:
        """Any thread: a reply for one of our requests."""
        with self._lock:
            self._inbox.append((identity, payload))
            if self._wake_pending:
                return
            self._wake_pending = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: the HTTP door has stopped
            pass

    def _drain(self) -> None:
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
            self._wake_pending = False
        for identity, payload in items:
            stream = self._streams.get(identity)
            if stream is not None:
                stream.queue.put_nowait(msgpack.unpackb(payload, raw=False))

    @asynccontextmanager
    async def open(self, req: P.GenerateRequest) -> AsyncIterator[Stream]:
        """Submit `req`; yields its Stream; leaving early (disconnect, error) cancels the request."""
        identity = LOCAL_PREFIX + next(self._ids).to_bytes(8, "big")
        stream = self._streams[identity] = Stream()
        try:
            self.server.submit(identity, req)
            yield stream
        finally:
            del self._streams[identity]
            if not stream.finished:
                self.server.disconnect(identity)
