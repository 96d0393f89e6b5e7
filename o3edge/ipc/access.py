"""Who may connect: a ZAP handler that vets every ZMTP/3 connection, and open connections per uid.

Setting a ZAP domain on the ROUTER makes libzmq (a) drop at once any peer whose greeting is not
ZMTP/3 — a peer whose first byte is not 0xFF is otherwise taken as a ZMTP/1.0 peer with no
handshake timeout and no heartbeat, and held forever (enough of them exhaust file descriptors and
libzmq aborts the whole process) — and (b) ask this handler about every other connection. On an
ipc:// endpoint libzmq gives the peer's credentials in the request's Address field
(`localhost:<uid>:<gid>:<pid>`, from SO_PEERCRED), so the handler can enforce a uid/group
allow-list and a cap on open connections per uid. A TCP (loopback) peer has no uid: it is allowed
only when no allow-list is set.

Connections are counted from the socket's monitor (accepted: +1 for the uid SO_PEERCRED gives
for the fd; disconnected: -1), read on the same thread that answers ZAP requests, so no lock is
needed. They are counted by client process too: when a process's last connection closes, the server
is told (on_process_gone) and drops that process's requests, which a client that left without
cancelling would otherwise keep in flight until their final reply failed to send. The handshake
events carry no fd, so a connection counts from accept, junk included: a uid flooding junk may
briefly find its own new connections refused, never other uids'.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import socket
import struct
import threading
import time
from collections import Counter
from typing import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from o3edge.errors import ConfigError

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = b"o3edge"
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
LOG_EVERY_S = 10.0
GONE_TTL_S, GONE_KEPT = 30.0, 4096  # how long, and how many, closed processes are remembered (is_gone)
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


def parse_uids(text: str) -> frozenset[int]:
    """'1000, alice' -> {1000, uid of alice}; raises ConfigError for an unknown name."""
    return frozenset(_ids(text, lambda name: pwd.getpwnam(name).pw_uid, "user"))


def parse_gids(text: str) -> frozenset[int]:
    """'o3edge, 44' -> {gid of o3edge, 44}."""
    return frozenset(_ids(text, lambda name: grp.getgrnam(name).gr_gid, "group"))


def _ids(text: str, lookup, kind: str):
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item.isdigit():
            yield int(item)
            continue
        try:
            yield lookup(item)
        except KeyError:
            raise ConfigError(f"no such {kind}: {item!r}") from None


def peer_creds(fd: int) -> tuple[int, int] | None:
    """(pid, uid) at the other end of a unix socket, or None (not a unix socket, or already closed)."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if s.family != socket.AF_UNIX:
            return None
        pid, uid, _ = _CRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
        return pid, uid
    except OSError:
        return None
    finally:
        s.detach()  # the fd belongs to libzmq


def address_pid(address: str) -> int | None:
    """The process id in a message's Peer-Address on an ipc:// endpoint (`localhost:<uid>:<gid>:<pid>`), or None."""
    parts = address.split(":")
    if len(parts) == 4 and parts[0] == "localhost" and parts[3].isdigit():
        return int(parts[3])
    return None


class AccessControl:
    """Answers libzmq's ZAP requests on its own thread; see the module docstring."""

    def __init__(self, ctx: zmq.Context, uids: frozenset[int] = frozenset(), gids: frozenset[int] = frozenset(),
                 max_per_uid: int = 256):
        self.ctx = ctx
        self.uids, self.gids, self.max_per_uid = uids, gids, max_per_uid
        self.open_by_uid: Counter[int] = Counter()
        self.counts = {"allowed": 0, "refused_uid": 0, "refused_too_many": 0, "refused_tcp": 0}
        self._fd_uid: dict[int, int] = {}
        # open connections by client process, and processes whose last one closed (pid -> when): the server drops
        # the requests of a process that is gone (on_process_gone, called on this thread) rather than run them
        # until their final reply fails to send
        self.open_by_pid: Counter[int] = Counter()
        self.gone_pids: dict[int, float] = {}
        self.on_process_gone: Callable[[int], None] | None = None
        self._fd_pid: dict[int, int] = {}
        self._last_log: dict[str, float] = {}
        self._zap: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._stop_r, self._stop_w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="o3edge-zap", daemon=True)

    @property
    def restricted(self) -> bool:
        return bool(self.uids or self.gids)

    def prepare(self, router: zmq.Socket) -> None:
        """Before bind: make libzmq consult us about every connection to `router`."""
        self._zap = self.ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        router.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)
        router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no answer from us: no connection
        self._monitor = router.get_monitor_socket(_EVENTS)
        self._monitor.setsockopt(zmq.RCVHWM, 0)  # libzmq blocks its I/O thread on a full monitor pipe
        self._thread.start()

    def close(self, router: zmq.Socket | None) -> None:
        """Stop the thread; `router` (if still open) stops reporting to the monitor first."""
        if self._stop_w < 0:
            return
        if router is not None and not router.closed:
            router.disable_monitor()
        os.write(self._stop_w, b"\0")
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        elif self._zap is not None:  # prepared, never started
            self._zap.close(linger=0)
            self._monitor.close(linger=0)
        os.close(self._stop_r)
        os.close(self._stop_w)
        self._stop_r = self._stop_w = -1

    def allowed(self, uid: int, gid: int) -> str | None:
        """None if a peer with these credentials may connect, else the reason it may not."""
        if self.restricted and uid != os.getuid() and uid not in self.uids and not self._in_groups(uid, gid):
            self.counts["refused_uid"] += 1
            return "uid not allowed"
        if self.open_by_uid[uid] >= self.max_per_uid:
            self.counts["refused_too_many"] += 1
            return f"more than {self.max_per_uid} connections from uid {uid}"
        return None

    def _in_groups(self, uid: int, gid: int) -> bool:
        if gid in self.gids:
            return True
        try:
            name = pwd.getpwuid(uid).pw_name
            return any(g in self.gids for g in os.getgrouplist(name, gid))
        except KeyError:
            return False

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if self._stop_r in events:
                    break
                if self._monitor in events or self._zap in events:
                    # every event first: a connection's accept is emitted before its handshake asks us, so once it is
                    # answered, its process counts as open (is_gone: a process that closed one connection and opened
                    # the next must not find its first request taken for a closed process's)
                    while True:
                        try:
                            frames = self._monitor.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_event(parse_monitor_message(frames))
                if self._zap in events:
                    self._answer(self._zap.recv_multipart())
        except zmq.ZMQError as exc:  # the context is being torn down
            if exc.errno != zmq.ETERM:
                log.exception("access control failed")
        finally:
            self._zap.close(linger=0)
            self._monitor.close(linger=0)

    def _on_event(self, event: dict) -> None:
        fd = event["value"]
        if event["event"] == zmq.EVENT_ACCEPTED:
            creds = peer_creds(fd)
            self._forget(fd)
            if creds is not None:
                pid, uid = creds
                self._fd_uid[fd], self._fd_pid[fd] = uid, pid
                self.open_by_uid[uid] += 1
                self.open_by_pid[pid] += 1
                self.gone_pids.pop(pid, None)
        elif event["event"] == zmq.EVENT_DISCONNECTED:
            self._forget(fd)

    def _forget(self, fd: int) -> None:
        uid = self._fd_uid.pop(fd, None)
        if uid is not None:
            self.open_by_uid[uid] -= 1
            if self.open_by_uid[uid] <= 0:
                del self.open_by_uid[uid]
        pid = self._fd_pid.pop(fd, None)
        if pid is not None:
            self.open_by_pid[pid] -= 1
            if self.open_by_pid[pid] <= 0:
                del self.open_by_pid[pid]
                self._process_gone(pid)

    def _process_gone(self, pid: int) -> None:
        now = time.monotonic()
        self.gone_pids.pop(pid, None)
        self.gone_pids[pid] = now  # (oldest first)
        while len(self.gone_pids) > GONE_KEPT or next(iter(self.gone_pids.values())) < now - GONE_TTL_S:
            self.gone_pids.pop(next(iter(self.gone_pids)))
        if self.on_process_gone is not None:
            try:
                self.on_process_gone(pid)
            except Exception:
                log.exception("dropping the requests of a closed process failed")

    def is_gone(self, pid: int) -> bool:
        """Whether process pid closed its last connection lately and opened none since (its messages still queued
        come from a client that will read no reply)."""
        return pid in self.gone_pids and pid not in self.open_by_pid

    def _answer(self, frames: list[bytes]) -> None:
        version, request_id, _domain, address = frames[:4]
        why = self._verdict(address.decode(errors="replace"))
        if why is None:
            self.counts["allowed"] += 1
            reply = [b"200", b"OK"]
        else:
            self._log_refusal(address.decode(errors="replace"), why)
            reply = [b"400", why.encode()]
        self._zap.send_multipart([version, request_id, *reply, b"", b""])

    def _log_refusal(self, address: str, why: str) -> None:
        """One warning per reason every LOG_EVERY_S: a flood of refusals must not flood the journal."""
        now = time.monotonic()
        if now - self._last_log.get(why, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last_log[why] = now
            log.warning("refused a connection from %s: %s (%s so far)", address, why,
                        ", ".join(f"{k} {v}" for k, v in self.counts.items() if k.startswith("refused") and v))

    def _verdict(self, address: str) -> str | None:
        parts = address.split(":")
        if len(parts) == 4 and parts[0] == "localhost" and parts[1].isdigit() and parts[2].isdigit():
            return self.allowed(int(parts[1]), int(parts[2]))
        if self.restricted:  # a TCP peer has no uid to check
            self.counts["refused_tcp"] += 1
            return "TCP connections are refused while a uid/group allow-list is set"
        return None
