"""Blocking client for o3edged: generate, stream, cancel, health, stats, info.

    with O3Client() as c:
        print(c.generate("Hello", max_tokens=32).text)
        for event in c.stream("Hello"):
            print(event.text if isinstance(event, TokenEvent) else event.timings)

One client is one DEALER connection; use it from one thread (a second thread needs its own).
`timeout` bounds every wait for the daemon's next message, so a stream can run for longer than
`timeout` as long as tokens keep coming. Errors: DaemonUnavailable (no daemon, or it died or went
silent), PermissionDenied (the socket is not ours to open), RequestError (the daemon refused or
failed the request; `.code` is the protocol's error code).
"""

from __future__ import annotations

import itertools
import os
import socket
import stat
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import msgpack
import zmq
from zmq.utils.monitor import parse_monitor_message

from o3edge.errors import O3Error
from o3edge.ipc import protocol as P
from o3edge.ipc.endpoint import ipc_path


class DaemonUnavailable(O3Error):
    """No daemon at the endpoint, or it stopped answering."""

    code = P.UNAVAILABLE


class PermissionDenied(O3Error):
    """The socket (or its directory) does not let this user connect."""

    code = "permission_denied"


class RequestError(O3Error):
    """The daemon answered a request with an error reply."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(message, code)
        self.request_id = request_id

    def __str__(self) -> str:
        return f"{self.code}: {self.args[0]}"


@dataclass
class TokenEvent:
    """Newly generated tokens of a streamed request."""

    index: int  # position of token_ids[0] in the completion
    text: str
    token_ids: list[int]


@dataclass
class Completion:
    """A finished generation: the `done` reply, with the text put together."""

    id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict
    timings: dict
    energy: dict | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def prompt_tokens(self) -> int:
        return self.usage["prompt_tokens"]

    @property
    def completion_tokens(self) -> int:
        return self.usage["completion_tokens"]

    @property
    def tokens_per_joule(self) -> float | None:
        return (self.energy or {}).get("tokens_per_joule")


def default_endpoint() -> str:
    """$O3EDGE_ENDPOINT, else the daemon's own $O3EDGE_SERVER_ENDPOINT, else the system socket."""
    return os.environ.get("O3EDGE_ENDPOINT") or os.environ.get("O3EDGE_SERVER_ENDPOINT") or P.DEFAULT_ENDPOINT


def check_endpoint(endpoint: str, timeout: float = 2.0) -> None:
    """Fail fast and clearly when an ipc:// endpoint has no daemon or is not ours to open."""
    path = ipc_path(endpoint)
    if path is None:
        return
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise DaemonUnavailable(f"o3edged is not running: no socket at {path} (endpoint {endpoint})") from None
    except PermissionError:
        raise PermissionDenied(f"permission denied on the directory of {path}: join the socket's group "
                               "(o3edge) to use the daemon") from None
    if not stat.S_ISSOCK(mode):
        raise DaemonUnavailable(f"{path} is not a socket (endpoint {endpoint})")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(path)
    except PermissionError:
        raise PermissionDenied(f"permission denied on {path}: join the socket's group (o3edge) to use the "
                               "daemon") from None
    except (ConnectionRefusedError, FileNotFoundError):
        raise DaemonUnavailable(f"o3edged is not running: {path} exists but nothing listens on it") from None
    except OSError as exc:
        raise DaemonUnavailable(f"cannot connect to {path}: {exc}") from None
    finally:
        probe.close()


def generate_fields(prompt, messages, params: dict) -> dict:
    """The generate request's fields (None values are left out: the daemon's defaults apply)."""
    out = {"prompt": prompt, "messages": messages, **params}
    return {k: v for k, v in out.items() if v is not None}


def final_error(msg: dict) -> RequestError:
    return RequestError(msg.get("code", P.INTERNAL), msg.get("message", ""), msg.get("id"))


def completion(msg: dict, text: str, token_ids: list[int]) -> Completion:
    return Completion(msg["id"], msg.get("text", text), msg.get("token_ids", token_ids), msg["finish_reason"],
                      msg["usage"], msg["timings"], msg.get("energy"), msg)


class O3Client:
    """A blocking connection to o3edged (see the module docstring)."""

    def __init__(self, endpoint: str | None = None, timeout: float = 30.0):
        self.endpoint = endpoint or default_endpoint()
        self.timeout = timeout
        check_endpoint(self.endpoint, timeout)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self._sock.connect(self.endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._ids = itertools.count(1)
        self._inbox: dict[str, deque] = {}  # request id -> replies not yet read
        self._cut: set[str] = set()  # requests in flight when the connection dropped: no more replies come

    # ---- requests ---------------------------------------------------------------------------
    def health(self) -> dict:
        return self._call("health")

    def stats(self) -> dict:
        return self._call("stats")

    def info(self) -> dict:
        return self._call("info")

    def cancel(self, request_id: str) -> bool:
        """Ask the daemon to stop a generate request; False if it was not in flight."""
        return self._call("cancel", target=request_id)["found"]

    def wait_ready(self, timeout: float | None = None) -> dict:
        """Poll health until the engine is ready; raises DaemonUnavailable after `timeout`."""
        end = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            health = self.health()
            if health["ready"] or health["status"] in ("failed", "stopped", "draining"):
                return health
            if time.monotonic() > end:
                raise DaemonUnavailable(f"the engine at {self.endpoint} is still {health['status']}")
            time.sleep(0.1)

    def stream(self, prompt: str | None = None, *, messages: list[dict] | None = None, **params) -> "Stream":
        """Start a streamed generation; iterate the result for TokenEvents, then one Completion."""
        rid = self._send("generate", **generate_fields(prompt, messages, {**params, "stream": True}))
        return Stream(self, rid)

    def generate(self, prompt: str | None = None, *, messages: list[dict] | None = None, **params) -> Completion:
        """Generate and wait for the whole completion (streamed underneath, so `timeout` is per token).

        params: max_tokens, temperature, top_p, top_k, seed, stop, priority, deadline_ms, ignore_eos.
        """
        result = None
        for result in self.stream(prompt, messages=messages, **params):
            pass
        return result

    def close(self) -> None:
        # Stop the monitor before closing its reader: libzmq reports events with a blocking send
        # from the context's I/O thread, so a disconnect reported to a closed reader (the daemon
        # dying as we close) would hang that thread and every socket of Context.instance().
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    def __enter__(self) -> "O3Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- plumbing ---------------------------------------------------------------------------
    def _call(self, op: str, **fields) -> dict:
        rid = self._send(op, **fields)
        try:
            msg = self._next(rid)
        finally:
            self._inbox.pop(rid, None)
        if msg["type"] == "error":
            raise final_error(msg)
        return msg

    def _send(self, op: str, **fields) -> str:
        while self._monitor.poll(0):  # forget disconnects from before this request (not a refusal)
            self._refused(parse_monitor_message(self._monitor.recv_multipart()))
        rid = f"c{next(self._ids)}"
        # a DEALER with no connection (one the daemon refused) would wait in send() for ever
        if not self._sock.poll(self.timeout * 1000, zmq.POLLOUT):
            while self._monitor.poll(0):
                self._refused(parse_monitor_message(self._monitor.recv_multipart()))
            raise DaemonUnavailable(f"o3edged at {self.endpoint} kept no connection from this client for "
                                    f"{self.timeout:g} s (refused by its access check, or not answering)")
        self._inbox[rid] = deque()
        self._sock.send(P.pack({"v": P.PROTOCOL_VERSION, "op": op, "id": rid, **fields}))
        return rid

    def _next(self, rid: str) -> dict:
        """The next reply for request `rid`, buffering replies for other requests."""
        box = self._inbox[rid]
        end = time.monotonic() + self.timeout
        while not box:
            if rid in self._cut:  # what came before the drop is read: the rest never will
                self._cut.discard(rid)
                raise DaemonUnavailable(f"o3edged at {self.endpoint} closed the connection (stopped or died)")
            left = end - time.monotonic()
            if left <= 0:
                raise DaemonUnavailable(f"no reply from o3edged at {self.endpoint} within {self.timeout:g} s")
            events = dict(self._poller.poll(left * 1000))
            if self._sock in events:
                self._file(self._sock.recv())
            if self._monitor in events and self._disconnected():
                self._cut.update(self._inbox)
        return box.popleft()

    def _disconnected(self) -> bool:
        """Read one monitor event; on a disconnect, first take in what the daemon sent before it."""
        event = parse_monitor_message(self._monitor.recv_multipart())
        self._refused(event)
        if event["event"] != zmq.EVENT_DISCONNECTED:
            return False
        while self._sock.poll(0):
            self._file(self._sock.recv())
        return True

    def _refused(self, event: dict) -> None:
        """Raise PermissionDenied if the daemon's access check turned this connection away."""
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            raise PermissionDenied(f"o3edged at {self.endpoint} refused this connection: this user is not in its "
                                   "allow-list, or has too many connections open")

    def _file(self, frame: bytes) -> None:
        msg, box = reply_and_box(frame, self._inbox)
        if box is not None:  # replies to abandoned requests are dropped
            box.append(msg)


def reply_and_box(frame: bytes, inbox: dict):
    """Decode a reply frame and find the inbox of the request it answers (None: drop it)."""
    try:
        msg = msgpack.unpackb(frame, raw=False)
    except Exception:
        return None, None
    return msg, (inbox.get(msg.get("id")) if isinstance(msg, dict) else None)


class Stream:
    """Iterate for TokenEvents, then the Completion; closing it early cancels the request."""

    def __init__(self, client: O3Client, request_id: str):
        self.client, self.request_id = client, request_id
        self.completion: Completion | None = None
        self._finished = False

    def __iter__(self) -> Iterator[TokenEvent | Completion]:
        text, ids = [], []
        try:
            while not self._finished:
                msg = self.client._next(self.request_id)
                if msg["type"] == "token":
                    text.append(msg["text"])
                    ids.extend(msg["token_ids"])
                    yield TokenEvent(msg["index"], msg["text"], msg["token_ids"])
                    continue
                self._finished = True
                self.client._inbox.pop(self.request_id, None)
                if msg["type"] == "error":
                    raise final_error(msg)
                self.completion = completion(msg, "".join(text), ids)
                yield self.completion
        except (GeneratorExit, KeyboardInterrupt):  # the caller stopped: stop the generation too
            self.close()
            raise
        except BaseException:  # an error reply, or the daemon went away: nothing left to cancel
            self._finished = True
            self.client._inbox.pop(self.request_id, None)
            raise

    def cancel(self) -> bool:
        return self.client.cancel(self.request_id)

    def close(self) -> None:
        """Cancel the request if it is still running, and stop listening for it."""
        if self._finished:
            return
        self._finished = True
        try:
            self.client.cancel(self.request_id)
        except (O3Error, zmq.ZMQError):  # the daemon or the client is already gone
            pass
        self.client._inbox.pop(self.request_id, None)
