"""The ZeroMQ service: one ROUTER socket, an I/O thread that reads it, and the engine loop's thread.

The I/O thread reads requests, validates them, answers health/stats/info/cancel itself and hands
generate requests to a tokenizer lane (o3edge.ipc.intake: off this thread, fair between
connections), which hands the tokenized job to the engine loop over a queue. A prompt longer in
bytes than the context window could ever hold is refused before any tokenizing (no unbounded
tokenizer work or memory). The engine loop sends its replies (tokens, done, errors) itself, once
per step, under `lock`, which guards the socket and the routing table: a ZeroMQ socket may be used
by several threads one at a time. The I/O thread never holds the lock
while it waits: it sleeps in poll() on the socket's ZMQ_FD and a wake-up pipe, and whoever touches
the socket last checks ZMQ_EVENTS, so no incoming message is left unnoticed (ZMQ_FD is
edge-triggered). A client that vanishes (EHOSTUNREACH) or stops reading (EAGAIN once its
high-water mark fills) has its jobs aborted, which frees their KV blocks. One that stopped reading
is still owed one final `cancelled` error per aborted request: the I/O thread retries those sends
until they fit (a frozen client that resumes reads them), the peer disconnects, or OWED_TTL_S passes.

Lifecycle: start() binds (after taking the endpoint lock) and begins loading the engine in the
background, so `health` answers `loading` at once and `ready` after the warm-up; drain() refuses
new work with `unavailable`; shutdown() drains, waits for running jobs up to a timeout, and closes.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import os
import select
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable

import zmq

from o3edge.errors import O3Error
from o3edge.ipc import peer_ids, replies
from o3edge.ipc import protocol as P
from o3edge.ipc.access import AccessControl, address_pid, parse_gids, parse_uids
from o3edge.ipc.endpoint import EndpointLock, ipc_path, prepare_socket_dir, remove_socket, secure_socket
from o3edge.ipc.engine_loop import END, EngineLoop, Hooks, Job
from o3edge.ipc.intake import PRIORITY_RANK, Lane
from o3edge.ipc.routes import Routes
from o3edge.memory import Trimmer
from o3edge.policy import RequestLimits
from o3edge.settings import ServerSettings

if TYPE_CHECKING:
    from o3edge.engine.engine import LLMEngine  # built and owned by the engine loop's thread

log = logging.getLogger(__name__)

SNDHWM = 256  # replies queued per client before it counts as not reading
RCVHWM = 64
LINGER_MS = 500
HANDSHAKE_IVL_MS = 3000
HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 6000
BAN_S = 60.0  # how long a peer that broke the framing rules is ignored
POLL_MS = 100
BATCH = 64  # messages read per turn of the I/O thread
OWED_TTL_S = 600.0  # how long final replies to a client that stopped reading are kept for it
OWED_MAX_PEERS = 1024
PIDS_KEPT = 4096  # routing ids whose client process is remembered before those with nothing in flight are forgotten
SHORT_PROMPT_BYTES = 4096  # prompts up to this size take the short lane: never behind a long encode
# Routing ids of requests from in-process doors (the HTTP door): a ZeroMQ peer may choose one, but its messages are
# dropped unread (peer_ids.reserved: a zero byte first and not 5 bytes long, where libzmq's generated ids are 5).
LOCAL_PREFIX = b"\x00local:"


@dataclasses.dataclass(frozen=True)
class Pending:
    """A generate request admitted but not yet tokenized."""

    rid: str
    identity: bytes
    request: P.GenerateRequest
    received: float


class IPCServer:
    """Serves one LLMEngine over ZeroMQ; see the module docstring for the lifecycle."""

    def __init__(self, settings: ServerSettings, load_engine: Callable[[], "LLMEngine"],
                 hooks: Hooks | None = None, idle_wake_s: float = 1.0, limits: RequestLimits = RequestLimits()):
        self.settings = settings
        self.limits = limits  # what one request may ask for: the engine's policy (O3Config.policy.requests)
        self.hooks = hooks or Hooks()
        self.ctx = zmq.Context()
        self.access = AccessControl(self.ctx, parse_uids(settings.allowed_uids), parse_gids(settings.allowed_groups),
                                    settings.max_connections_per_uid)
        self.access.on_process_gone = self._process_gone
        self.loop = EngineLoop(load_engine, self._deliver, self.hooks, idle_wake_s)
        self.lock = threading.RLock()  # the ROUTER socket and self.routes
        self.routes = Routes()
        self.started_at = time.monotonic()
        self.draining = False
        self.io_failed = False
        self.counts = {"requests_total": 0, "rejected": 0, "bad_messages": 0, "dropped_peers": 0, "reserved_ids": 0,
                       "from_closed_processes": 0}
        self._pids: dict[bytes, int] = {}  # routing id -> its client's process, for ipc:// peers with generate requests
        self._socket_path = ipc_path(settings.endpoint)
        self._lock_file = EndpointLock(self._socket_path)
        self._router: zmq.Socket | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._ids = itertools.count(1)
        self._tokenizing: set[str] = set()  # rids admitted, not yet handed to the engine loop (under lock)
        self._lanes = (Lane("o3edge-tokenize-short", self._encode), Lane("o3edge-tokenize-long", self._encode))
        self.about: dict = {}  # extra `info` fields from the daemon (the energy log's path)
        self.trimmer = Trimmer()  # gives memory back after large inputs, when the I/O thread idles
        self._owed: OrderedDict[bytes, tuple[float, list[bytes]]] = OrderedDict()  # final replies not yet sent
        self._stop_io = False
        self._closed = False
        self._stop_reason = "the daemon stopped before this request finished"  # for jobs cut at close
        self.local_sink: Callable[[bytes, bytes], None] | None = None  # replies to LOCAL_PREFIX ids
        self.overflow = None  # o3edge.http.overflow.Overflow when [upstream] is set
        self._remote: dict[str, Callable[[], None]] = {}  # rid -> cancel, for requests served upstream
        self._io_thread = threading.Thread(target=self._io_run, name="o3edge-io", daemon=True)
        self._engine_thread = threading.Thread(target=self.loop.run, name="o3edge-engine", daemon=True)

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Lock and bind the endpoint(s), then start the I/O thread and the engine load."""
        prepare_socket_dir(self._socket_path)
        self._lock_file.acquire()
        try:
            self._router = self._bind()
        except BaseException:
            self._lock_file.release()
            raise
        self._io_thread.start()
        self._engine_thread.start()
        for lane in self._lanes:
            lane.start()
        log.info("listening on %s%s", self.settings.endpoint,
                 f" and {self.settings.tcp_endpoint}" if self.settings.tcp_endpoint else "")

    def _bind(self) -> zmq.Socket:
        peer_ids.seed_generated_ids()  # before the socket: where its generated routing ids start (peer_ids.py)
        r = self.ctx.socket(zmq.ROUTER)
        for opt, value in ((zmq.ROUTER_MANDATORY, 1), (zmq.SNDHWM, SNDHWM), (zmq.RCVHWM, RCVHWM),
                           (zmq.LINGER, LINGER_MS), (zmq.MAXMSGSIZE, self.settings.max_message_bytes),
                           (zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS), (zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS),
                           (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)):
            r.setsockopt(opt, value)
        self.access.prepare(r)  # before bind: no connection escapes the ZAP check
        try:
            r.bind(self.settings.endpoint)
            secure_socket(self._socket_path, self.settings.socket_mode)
            if self.settings.tcp_endpoint:
                r.bind(self.settings.tcp_endpoint)
        except (zmq.ZMQError, OSError) as exc:
            self.access.close(r)
            r.close(linger=0)
            raise O3Error(f"cannot listen on {self.settings.endpoint}: {exc}", "endpoint_unavailable") from None
        return r

    @property
    def state(self) -> str:
        """loading, ready, draining, failed or stopped."""
        engine_state = self.loop.state
        if self.io_failed:
            return "failed"
        if engine_state in ("failed", "stopped"):
            return engine_state
        return "draining" if self.draining else engine_state

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the engine is loaded and warmed (True) or failed / timed out (False)."""
        self.loop.ready.wait(timeout)
        return self.loop.state == "ready"

    def drain(self) -> None:
        """Refuse new generate requests with `unavailable`; running ones go on."""
        if not self.draining:
            log.info("draining: %d requests in flight", len(self.routes))
        self.draining = True

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if some remain after `timeout` seconds."""
        end = time.monotonic() + timeout
        while len(self.routes) and time.monotonic() < end and self._io_thread.is_alive():
            time.sleep(0.05)
        return not len(self.routes)

    def shutdown(self, timeout: float | None = None) -> None:
        """Graceful stop: drain, let running jobs finish up to `timeout` (default drain_timeout_s), close."""
        self.drain()
        limit = self.settings.drain_timeout_s if timeout is None else timeout
        if self.loop.state == "ready" and not self.wait_idle(limit):
            log.warning("drain timed out after %g s; aborting %d requests", limit, len(self.routes))
            self._stop_reason = (f"the daemon stopped: its drain timeout ({limit:g} s) ran out before "
                                 "this request finished")
        self.close()

    def close(self) -> None:
        """Stop both threads, fail what is left with `unavailable`, remove the socket, release the lock."""
        if self._closed:
            return
        self._closed = True
        self.draining = True
        self.loop.stop(self._stop_reason)
        if self._engine_thread.is_alive() and self.loop.state != "loading":  # a load is not worth waiting for
            self._engine_thread.join(timeout=10.0)
        for lane in self._lanes:
            lane.stop()
        self._stop_io = True
        self._wake_io()
        if self._io_thread.is_alive():
            self._io_thread.join(timeout=5.0)
        if not self._io_thread.is_alive():
            self.access.close(None)
        if not self._engine_thread.is_alive() and not self._io_thread.is_alive():
            self.ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)
        if self._lock_file.fd is not None:  # never remove a socket file another daemon owns
            remove_socket(self._socket_path)
            self._lock_file.release()
        log.info("stopped")

    def update_limits(self, settings: ServerSettings) -> None:
        """Apply reloaded limits (queue_max_*, max_inflight_per_client); endpoints and socket options stay."""
        kept = ("endpoint", "tcp_endpoint", "socket_mode", "max_message_bytes", "allowed_uids", "allowed_groups",
                "max_connections_per_uid")
        self.settings = dataclasses.replace(settings, **{k: getattr(self.settings, k) for k in kept})

    def status_line(self) -> str:
        """One line for systemd's STATUS= and logs."""
        return replies.status_line(self)

    # ---- the I/O thread ---------------------------------------------------------------------
    def _io_run(self) -> None:
        poller = select.poll()
        poller.register(self._router.getsockopt(zmq.FD), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while not self._stop_io:
                with self.lock:
                    if self._owed:
                        self._pay_owed(time.monotonic())
                    batch, more = self._read_batch()
                for message in batch:
                    self._handle(*message)
                if not batch and not more:
                    self.trimmer.maybe_trim(busy=len(self.routes) > 0)
                    self._sleep(poller)
            with self.lock:
                self._forward()
                self._fail_remaining()
        except Exception:  # a bug: report `failed` so the daemon exits and systemd restarts it
            log.exception("I/O thread failed")
            self.io_failed = True
        finally:
            with self.lock:
                self._router.disable_monitor()
                self._router.close()

    def _read_batch(self) -> tuple[list, bool]:
        """Up to BATCH whole messages (lock held), and whether more are waiting."""
        batch = []
        while len(batch) < BATCH and self._router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            identity, frames, count, pid = self._router.recv(), [], 0, None
            while self._router.getsockopt(zmq.RCVMORE):
                frame = self._router.recv(copy=False)
                count += 1
                self.trimmer.note(len(frame))
                if count == 1:  # the client's process, on an ipc:// endpoint (access.address_pid)
                    try:
                        pid = address_pid(frame.get("Peer-Address"))
                    except zmq.ZMQError:  # no such property (not a socket connection)
                        pass
                if count <= P.MAX_FRAMES:
                    frames.append(frame.bytes)
            batch.append((identity, frames, count, time.monotonic(), pid))
        return batch, len(batch) == BATCH

    def _sleep(self, poller: select.poll) -> None:
        if any(fd == self._wake_r for fd, _ in poller.poll(POLL_MS)):
            try:
                os.read(self._wake_r, 4096)
            except BlockingIOError:
                pass

    def _wake_io(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):  # full (a wake is pending anyway) or already closed
            pass

    def _handle(self, identity: bytes, frames: list[bytes], count: int, now: float, pid: int | None = None) -> None:
        if peer_ids.reserved(identity):  # a peer-chosen id in the reserved space: dropped unread and unanswered
            self.counts["bad_messages"] += 1
            self.counts["reserved_ids"] += 1
            if self.counts["reserved_ids"] & (self.counts["reserved_ids"] - 1) == 0:  # the 1st, 2nd, 4th, 8th...
                log.warning("dropped %d messages from peers that chose a routing id reserved for generated ones",
                            self.counts["reserved_ids"])
            return
        try:
            self._dispatch(identity, frames, count, now, pid)
        except Exception:
            log.exception("failed to handle a message")
            self._reply(identity, P.error(None, P.INTERNAL, "internal error"))

    def _dispatch(self, identity: bytes, frames: list[bytes], count: int, now: float, pid: int | None = None) -> None:
        with self.lock:  # is_banned forgets expired bans: the routing table changes only under the lock
            if self.routes.is_banned(identity, now):
                return
        if count > P.MAX_FRAMES:
            self.counts["bad_messages"] += 1
            with self.lock:
                self._drop_peer(identity, f"sent a message of {count} frames", ban_until=now + BAN_S)
            return
        if count != 1:
            self.counts["bad_messages"] += 1
            return self._reject(identity, None, P.BAD_MESSAGE, f"a request is exactly one frame, got {count}")
        try:
            req = P.parse(frames[0], self.settings.max_message_bytes, self.limits)
        except P.ProtocolError as exc:
            self.counts["bad_messages"] += 1
            return self._reject(identity, exc.request_id, exc.code, exc.message)
        if isinstance(req, P.GenerateRequest):
            self._generate(identity, req, now, pid)
        elif isinstance(req, P.CancelRequest):
            self._cancel(identity, req)
        else:
            self._reply(identity, getattr(replies, req.op)(self, req.id))

    def _generate(self, identity: bytes, req: P.GenerateRequest, now: float, pid: int | None = None) -> None:
        if self.state != "ready":
            why = {"loading": "the engine is still loading; retry when health reports ready",
                   "draining": "the daemon is shutting down"}.get(self.state, f"the engine is {self.state}")
            return self._reject(identity, req.id, P.UNAVAILABLE, why)
        view = self.loop.view
        size, limit = prompt_bytes(req, view.max_prompt_bytes), view.max_prompt_bytes
        if limit is not None and size > limit:
            return self._reject(identity, req.id, P.PROMPT_TOO_LONG, f"prompt has {size} bytes; a context window "
                                f"of {view.max_model_len} tokens holds at most {limit} bytes of text for this model")
        with self.lock:
            if pid is not None:
                if self.access.is_gone(pid):  # sent before its process closed its last connection: nobody reads
                    self.counts["from_closed_processes"] += 1
                    return
                self._pids[identity] = pid
            problem = self._admission_problem(identity, req)
            route = self._route(req, problem)
            if problem and (route is None or problem[0] != P.BUSY):
                return self._reject(identity, req.id, *problem)
            rid = f"r{next(self._ids)}"
            self.routes.add(rid, identity, req.id)
            if route is not None and self.overflow.forward(rid, req, now, route):
                return
            if problem:  # the upstream cannot take it either
                self.routes.remove(rid)
                return self._reject(identity, req.id, *problem)
            self._tokenizing.add(rid)
        self.counts["requests_total"] += 1
        lane = self._lanes[0 if size <= SHORT_PROMPT_BYTES else 1]
        lane.put(identity, req.priority, Pending(rid, identity, req, now))

    def _route(self, req: P.GenerateRequest, problem: tuple[str, str] | None) -> str | None:
        """Why this request goes upstream ("prefer", "busy", "breaker", "deadline"), or None to serve it here."""
        if self.overflow is None or (problem and problem[0] != P.BUSY):
            return None
        return self.overflow.choose(req, busy=problem is not None, classes=self.loop.snapshot.get("classes"))

    # ---- the door for requests served elsewhere (in-process HTTP, upstream) ------------------
    def attach_overflow(self, overflow) -> None:
        """Send requests upstream as `overflow` decides, here and when the engine refuses one as busy."""
        self.overflow = overflow
        self.loop.divert = self._divert_job

    def _divert_job(self, job: Job) -> bool:
        """Engine thread: the scheduler refused `job` as busy; True when the upstream takes it instead."""
        if job.request.priority not in self.overflow.overflow_classes:
            return False
        with self.lock:
            return job.rid in self.routes.flights and self.overflow.forward(job.rid, job.request, job.received,
                                                                           "busy")

    def submit(self, identity: bytes, req: P.GenerateRequest) -> None:
        """Serve a request from an in-process door: replies go to local_sink(identity, payload)."""
        self._generate(identity, req, time.monotonic())

    def _process_gone(self, pid: int) -> None:
        """The access thread: client process pid closed its last connection to the daemon. Its requests are
        dropped now, their KV blocks freed: a client that left without cancelling kept them in flight until each
        final reply failed to send (an adversarial probe filled the in-flight limit with such requests for an
        hour)."""
        with self.lock:
            for identity in [i for i, p in self._pids.items() if p == pid]:
                del self._pids[identity]
                if identity in self.routes.peers:
                    self._drop_peer(identity, "closed its connection (its process closed its last one)")
            if len(self._pids) > PIDS_KEPT:  # routing ids whose requests all ended: forgotten now and then
                self._pids = {i: p for i, p in self._pids.items() if i in self.routes.peers}

    def disconnect(self, identity: bytes) -> None:
        """An in-process door's client went away: abort its requests (freeing their KV blocks)."""
        with self.lock:
            self._drop_peer(identity, "disconnected")

    def emit(self, rid: str, message: dict, last: bool) -> bool:
        """Send a reply for a request served elsewhere; False when its client is gone."""
        payload = P.pack(message)
        with self.lock:
            flight = self.routes.flights.get(rid)
            if flight is None or self._router is None or self._router.closed:
                return False
            if last:
                self.routes.remove(rid)
                self._remote.pop(rid, None)
            self._send(flight.identity, payload)
            if self._router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._wake_io()
        return True

    def track_remote(self, rid: str, cancel: Callable[[], None]) -> None:
        """Note a request now served upstream (lock held): cancel() stops it when its client goes."""
        self._remote[rid] = cancel

    def fall_back(self, rid: str, req: P.GenerateRequest, received: float, busy: bool) -> None:
        """The upstream failed before a token: answer `busy` (it was refused here) or queue it here."""
        with self.lock:
            flight = self.routes.flights.get(rid)
            self._remote.pop(rid, None)
            if flight is None:
                return
            if busy:
                self.routes.remove(rid)
                return self._reject(flight.identity, req.id, P.BUSY, "the queue is full and the upstream "
                                    "engine failed; retry later")
            self._tokenizing.add(rid)
        self._lanes[1].put(flight.identity, req.priority, Pending(rid, flight.identity, req, received))

    def _encode(self, p: Pending) -> None:
        """A lane's thread: tokenize, check the context window, hand the job to the engine loop."""
        view, req = self.loop.view, p.request
        with self.lock:
            if p.rid not in self._tokenizing:  # cancelled or its client dropped since it was queued
                return
        try:
            ids = view.encode(req.prompt, list(req.messages) if req.messages else None)
            if len(ids) >= view.max_model_len:
                raise O3Error(f"prompt has {len(ids)} tokens; the context window is {view.max_model_len}",
                              P.PROMPT_TOO_LONG)
        except Exception as exc:  # every failure is answered, with a code: the request must not stay in flight
            if isinstance(exc, O3Error):
                code, message = exc.code, exc.message
            elif isinstance(exc, (TypeError, ValueError, UnicodeError)):  # input the tokenizer cannot take
                code, message = P.INVALID_REQUEST, f"the prompt could not be tokenized: {type(exc).__name__}"
            else:
                log.exception("tokenizing request %r failed", req.id)
                code, message = P.INTERNAL, "tokenizing the prompt failed"
            with self.lock:
                if self._take_pending(p.rid):
                    self.routes.remove(p.rid)
                    self._reject(p.identity, req.id, code, message)
            return
        with self.lock:
            if self._take_pending(p.rid):  # else cancelled or its client dropped meanwhile
                deadline = p.received + req.deadline_ms / 1000 if req.deadline_ms is not None else None
                self.loop.submit(Job(p.rid, p.identity, req, ids, p.received, deadline))

    def _take_pending(self, rid: str) -> bool:
        if rid in self._tokenizing:
            self._tokenizing.discard(rid)
            return True
        return False

    def _admission_problem(self, identity: bytes, req: P.GenerateRequest) -> tuple[str, str] | None:
        if self.routes.find(identity, req.id) is not None:
            return P.INVALID_REQUEST, f"request id {req.id!r} is already in flight on this connection"
        if self.routes.count(identity) >= self.settings.max_inflight_per_client:
            return P.TOO_MANY_REQUESTS, (f"at most {self.settings.max_inflight_per_client} requests in flight "
                                         "per client")
        # The engine's scheduler bounds its waiting queue (and answers `busy` itself); this backstop
        # also bounds what is on its way there, with room for a full running batch. Past it, a request
        # still goes in while less important ones wait in the engine's queue, one each, for the
        # scheduler to displace (Scheduler.add: they are answered busy): requests whose clients have
        # gone, which stay in flight until their final reply fails to send, must not lock out the more
        # important traffic (an adversarial probe, 2026-12-05: critical requests got busy for an hour).
        limit = self.settings.queue_max_requests + self.loop.view.max_num_seqs
        past = len(self.routes) - len(self._remote) - limit + 1
        if past > 0 and past > self._displaceable(req.priority):
            return P.BUSY, f"too many requests in flight ({limit}); retry later"
        return None

    def _displaceable(self, priority: str) -> int:
        """Requests waiting in the engine's queue, by its last snapshot, in classes less important than `priority`."""
        classes, rank = self.loop.snapshot.get("classes") or {}, PRIORITY_RANK[priority]
        return sum(c.get("waiting", 0) for name, c in classes.items() if PRIORITY_RANK.get(name, -1) > rank)

    def _cancel(self, identity: bytes, req: P.CancelRequest) -> None:
        with self.lock:
            rid = self.routes.find(identity, req.target)
            if rid is not None and (self._take_pending(rid) or self._cancel_remote(rid)):  # answer it here
                for lane in self._lanes:  # a queued prompt leaves its lane now (it held its slot until here)
                    lane.remove(identity, lambda item: item.rid == rid)
                self.routes.remove(rid)
                self._reply(identity, P.error(req.target, P.CANCELLED, "cancelled by the client"))
            elif rid is not None:
                self.loop.abort(rid, P.CANCELLED, "cancelled by the client")
            self._reply(identity, P.reply("cancel", req.id, target=req.target, found=rid is not None))

    def _cancel_remote(self, rid: str) -> bool:
        cancel = self._remote.pop(rid, None)
        if cancel is not None:
            cancel()
        return cancel is not None

    # ---- sending (under the lock) -----------------------------------------------------------
    def _deliver(self) -> None:
        """Engine thread, once per step: send what the engine loop produced."""
        with self.lock:
            if self._router.closed:
                self.loop.outbox.clear()
                return
            self._forward()
            if self._router.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # our sends may have eaten ZMQ_FD's edge
                self._wake_io()

    def _forward(self) -> None:
        outbox = self.loop.outbox
        while outbox:
            kind, identity, rid, payload = outbox.popleft()
            if rid not in self.routes.flights:  # its client was dropped meanwhile
                continue
            if kind == END:
                self.routes.remove(rid)
            self._send(identity, payload)

    def _reject(self, identity: bytes, request_id: str | None, code: str, message: str) -> None:
        self.counts["rejected"] += 1
        log.debug("rejected %r from %s: %s %s", request_id, peer_ids.tag(identity), code, message)
        self._reply(identity, P.error(request_id, code, message))

    def _reply(self, identity: bytes, message: dict) -> None:
        payload = P.pack(message)
        with self.lock:
            self._send(identity, payload)

    def _send(self, identity: bytes, payload: bytes) -> None:
        if identity.startswith(LOCAL_PREFIX):
            return self.local_sink(identity, payload)
        try:
            self._router.send_multipart([identity, payload], zmq.NOBLOCK)
        except zmq.Again:
            self._drop_peer(identity, "stopped reading (send queue full)",
                            owe="cancelled by the daemon: this client stopped reading its replies (its send queue "
                                f"of {SNDHWM} messages filled); resend the request")
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                log.warning("send to %s failed: %s", peer_ids.tag(identity), exc)
            self._drop_peer(identity, "disconnected")

    def _drop_peer(self, identity: bytes, reason: str, ban_until: float | None = None, owe: str | None = None) -> None:
        """Abort a client's jobs (freeing their KV blocks) and forget it; with `owe`, each job's final
        error (that message, code `cancelled`) is sent once the client reads again."""
        client_ids = list(self.routes.peers.get(identity, {}))
        rids = self.routes.drop(identity)
        if owe is not None and client_ids:
            _, earlier = self._owed.pop(identity, (0.0, []))
            payloads = [P.pack(P.error(cid, P.CANCELLED, owe)) for cid in client_ids]
            self._owed[identity] = (time.monotonic() + OWED_TTL_S, earlier + payloads)
            while len(self._owed) > OWED_MAX_PEERS:
                self._owed.popitem(last=False)
        for lane in self._lanes:
            lane.discard(identity)
        for rid in rids:
            if not self._take_pending(rid) and not self._cancel_remote(rid):
                self.loop.abort(rid)
        if ban_until is not None:
            self.routes.ban(identity, ban_until)
        if rids or ban_until is not None:
            self.counts["dropped_peers"] += 1
            log.info("dropped client %s: it %s; aborted %d requests", peer_ids.tag(identity), reason, len(rids))

    def _pay_owed(self, now: float) -> None:
        """Send what clients that stopped reading are owed, as far as their queues have room (lock held)."""
        for identity in list(self._owed):
            until, payloads = self._owed[identity]
            while payloads and now < until:
                try:
                    self._router.send_multipart([identity, payloads[0]], zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:  # gone: its closed connection is what it sees
                    payloads.clear()
                else:
                    payloads.pop(0)
            if not payloads or now >= until:
                del self._owed[identity]

    def _fail_remaining(self) -> None:
        """At close: whatever is still in flight gets a final `unavailable`."""
        for rid in list(self.routes.flights):
            self._cancel_remote(rid)
            flight = self.routes.remove(rid)
            self._send(flight.identity, P.pack(P.error(flight.client_id, P.UNAVAILABLE, self._stop_reason)))


def prompt_bytes(req: P.GenerateRequest, limit: int | None = None) -> int:
    """UTF-8 bytes of a request's prompt text (a chat's: its messages' contents); past `limit`, any
    figure past it (a 1 MiB prompt is not encoded just to count its bytes on the I/O thread)."""
    if req.prompt is not None:
        if limit is not None and len(req.prompt) > limit:  # at least one byte per character
            return len(req.prompt)
        return len(req.prompt.encode(errors="surrogatepass"))
    return sum(len(str(m.get("content", "")).encode(errors="surrogatepass")) for m in req.messages or ())
