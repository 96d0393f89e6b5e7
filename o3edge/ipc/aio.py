"""asyncio client for o3edged: the same calls as O3Client, awaited.

    async with AsyncO3Client() as c:
        async for event in c.stream("Hello", max_tokens=32):
            ...
        done = await c.generate("Hello")

Many requests may run at once on one client (one DEALER connection); a reader task hands each
reply to its request. Exceptions are those of o3edge.ipc.client.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import AsyncIterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from o3edge.ipc import protocol as P
from o3edge.ipc.client import Completion, DaemonUnavailable, PermissionDenied, TokenEvent, check_endpoint, \
    completion, default_endpoint, final_error, generate_fields, reply_and_box


class AsyncO3Client:
    """An asyncio connection to o3edged; `timeout` bounds each wait for the daemon's next message."""

    def __init__(self, endpoint: str | None = None, timeout: float = 30.0):
        self.endpoint = endpoint or default_endpoint()
        self.timeout = timeout
        check_endpoint(self.endpoint, timeout)
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self._refusal: PermissionDenied | None = None  # the daemon's access check turned us away
        self._sock.connect(self.endpoint)
        self._ids = itertools.count(1)
        self._inbox: dict[str, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []

    async def health(self) -> dict:
        return await self._call("health")

    async def stats(self) -> dict:
        return await self._call("stats")

    async def info(self) -> dict:
        return await self._call("info")

    async def cancel(self, request_id: str) -> bool:
        return (await self._call("cancel", target=request_id))["found"]

    async def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                     **params) -> AsyncIterator[TokenEvent | Completion]:
        """Yield TokenEvents, then the Completion; leaving the loop early cancels the request."""
        rid = await self._send("generate", **generate_fields(prompt, messages, {**params, "stream": True}))
        text, ids, finished = [], [], False
        try:
            while True:
                msg = await self._next(rid)
                if msg["type"] == "token":
                    text.append(msg["text"])
                    ids.extend(msg["token_ids"])
                    yield TokenEvent(msg["index"], msg["text"], msg["token_ids"])
                    continue
                finished = True
                if msg["type"] == "error":
                    raise final_error(msg)
                yield completion(msg, "".join(text), ids)
                return
        except DaemonUnavailable:
            finished = True
            raise
        finally:
            self._inbox.pop(rid, None)
            if not finished:
                await self._send("cancel", target=rid)  # its reply is dropped

    async def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                       **params) -> Completion:
        result = None
        async for result in self.stream(prompt, messages=messages, **params):
            pass
        return result

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.disable_monitor()  # before its reader closes: see O3Client.close
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    async def __aenter__(self) -> "AsyncO3Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- plumbing ---------------------------------------------------------------------------
    async def _call(self, op: str, **fields) -> dict:
        rid = await self._send(op, **fields)
        try:
            msg = await self._next(rid)
        finally:
            self._inbox.pop(rid, None)
        if msg["type"] == "error":
            raise final_error(msg)
        return msg

    async def _send(self, op: str, **fields) -> str:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._read())]
        if self._refusal is not None:
            raise self._refusal
        rid = f"a{next(self._ids)}"
        self._inbox[rid] = asyncio.Queue()
        # a DEALER with no connection (one the daemon refused) would wait in send() for ever
        if not await self._sock.poll(self.timeout * 1000, zmq.POLLOUT):
            self._inbox.pop(rid, None)
            raise self._refusal or DaemonUnavailable(f"o3edged at {self.endpoint} kept no "
                                                     f"connection from this client for {self.timeout:g} s (refused "
                                                     "by its access check, or not answering)")
        await self._sock.send(P.pack({"v": P.PROTOCOL_VERSION, "op": op, "id": rid, **fields}))
        return rid

    async def _next(self, rid: str) -> dict:
        try:
            item = await asyncio.wait_for(self._inbox[rid].get(), self.timeout)
        except asyncio.TimeoutError:
            raise DaemonUnavailable(f"no reply from o3edged at {self.endpoint} within {self.timeout:g} s") from None
        if isinstance(item, Exception):
            raise item
        return item

    async def _read(self) -> None:
        """Hand each reply to its request; on a disconnect, fail the requests still waiting."""
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            events = dict(await poller.poll())
            if self._sock in events:
                self._file(await self._sock.recv())
            if self._monitor in events:
                event = parse_monitor_message(await self._monitor.recv_multipart())
                if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    self._refusal = PermissionDenied(f"o3edged at {self.endpoint} refused this connection: this user "
                                                     "is not in its allow-list, or has too many connections open")
                    for box in self._inbox.values():
                        box.put_nowait(self._refusal)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    while await self._sock.poll(0):  # what the daemon sent before it went
                        self._file(await self._sock.recv())
                    gone = DaemonUnavailable(f"o3edged at {self.endpoint} closed the connection (stopped or died)")
                    for box in self._inbox.values():
                        box.put_nowait(gone)

    def _file(self, frame: bytes) -> None:
        msg, box = reply_and_box(frame, self._inbox)
        if box is not None:  # replies to abandoned requests are dropped
            box.put_nowait(msg)
