"""Overflow: which requests go to the upstream engine, serving them there, and falling back here.

Per priority class ([upstream.policy]): `local` never forwards; `overflow` forwards a request the
daemon would refuse as `busy` (its admission backstop, or the scheduler's full queue, or a request
displaced from it before its first token) and any request while the class's own breaker is open;
`prefer-upstream` forwards every request. The upstream has its own breaker (o3edge.engine.breaker:
`breaker_threshold` failures in a row open it, one request probes it after `breaker_cooldown_s`)
and a cap on requests in flight; while it is open or full, requests are served here as if there
were no upstream. An upstream that fails before its first token falls back to the local answer:
`busy` for a request that was refused here, a place in the local queue otherwise. One that fails
after some tokens ends the request with `unavailable`. Forwarded replies reach the client through
the IPC server (ZeroMQ or HTTP alike) with `served_by: "upstream"` and `energy: null` in `done`:
no energy figure is invented for tokens computed elsewhere.

choose() and forward() run under the IPC server's lock (I/O, tokenizer or engine thread); the
forwarded request itself runs on the HTTP loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

from o3edge.engine.breaker import OPEN, Breaker
from o3edge.http.config import UpstreamSettings
from o3edge.http.loop_thread import LoopThread
from o3edge.http.upstream import UpstreamClient, UpstreamError
from o3edge.ipc import protocol as P

if TYPE_CHECKING:
    from o3edge.ipc.server import IPCServer

log = logging.getLogger(__name__)


class Overflow:
    """Forwards requests to one upstream engine for one IPC server."""

    def __init__(self, settings: UpstreamSettings, server: "IPCServer", aio: LoopThread):
        self.settings, self.server, self.aio = settings, server, aio
        self.client = UpstreamClient(settings)
        self.policy = {name: getattr(settings.policy, name) for name in P.PRIORITIES}
        self.overflow_classes = frozenset(c for c, p in self.policy.items() if p != "local")
        self.breaker = Breaker(settings.breaker_threshold, settings.breaker_cooldown_s)
        self.counts: Counter[tuple[str, str]] = Counter()  # (outcome, class): forwarded, served, fallback, ...
        self.inflight = 0
        self._lock = threading.Lock()  # breaker, counts, inflight: several threads

    # ---- decisions (IPC server lock held) -----------------------------------------------------
    def choose(self, req: P.GenerateRequest, busy: bool, classes: dict | None) -> str | None:
        """Why `req` should go upstream ("prefer", "busy", "breaker", "deadline": the queue's own wait
        estimate for its class is past its deadline), or None to serve it here."""
        policy = self.policy[req.priority]
        if policy == "local":
            return None
        if policy == "prefer-upstream":
            return "prefer"
        if busy:
            return "busy"
        figures = (classes or {}).get(req.priority) or {}
        if (figures.get("breaker") or {}).get("state") == OPEN:
            return "breaker"
        late = req.deadline_ms is not None and figures.get("est_wait_ms", 0.0) >= req.deadline_ms
        return "deadline" if late else None

    def forward(self, rid: str, req: P.GenerateRequest, received: float, reason: str) -> bool:
        """Start serving `req` upstream; False (serve it here) while the breaker is open or the cap is reached."""
        with self._lock:
            if self.inflight >= self.settings.max_inflight or self.breaker.current(time.monotonic()) == OPEN:
                return False
            self.inflight += 1
            self.counts[("forwarded", req.priority)] += 1
        task = asyncio.run_coroutine_threadsafe(self._serve(rid, req, received, reason), self.aio.loop)
        task.add_done_callback(lambda f: self._ended(req.priority, f.cancelled()))
        self.server.track_remote(rid, task.cancel)
        return True

    def _ended(self, priority: str, cancelled: bool) -> None:
        """Any thread: a forwarded request is over (even one cancelled before it started)."""
        with self._lock:
            self.inflight -= 1
            if cancelled:  # its client cancelled or went away
                self.counts[("cancelled", priority)] += 1

    # ---- serving (HTTP loop thread) -----------------------------------------------------------
    async def _serve(self, rid: str, req: P.GenerateRequest, received: float, reason: str) -> None:
        deadline = received + req.deadline_ms / 1000 if req.deadline_ms is not None else None
        sent = [0]
        try:
            await self._relay(rid, req, received, deadline, sent)
            outcome = "served"
        except UpstreamError as exc:
            outcome = self._failed(rid, req, received, reason, sent[0], exc)
        with self._lock:
            self.counts[(outcome, req.priority)] += 1

    async def _relay(self, rid: str, req: P.GenerateRequest, received: float, deadline: float | None,
                     sent: list[int]) -> None:
        text: list[str] = []
        first = None
        async for event in self.client.stream(req, deadline):
            if event[0] == "text":
                first = first or time.monotonic()
                if req.stream and not self.server.emit(rid, P.token(req.id, sent[0], event[1], []), last=False):
                    return  # the client is gone: leaving the stream closes the upstream request
                text.append(event[1])
                sent[0] += 1
                continue
            self._record(success=True)
            extra = {} if req.stream else {"text": "".join(text), "token_ids": []}
            self.server.emit(rid, P.done(req.id, event[1], _usage(event[2]), _timings(received, first),
                                         None, served_by="upstream", **extra), last=True)

    def _failed(self, rid: str, req: P.GenerateRequest, received: float, reason: str, num_sent: int,
                exc: UpstreamError) -> str:
        self._record(success=False)
        log.warning("upstream failed request %s (%s, %d chunks sent): %s", rid, req.priority, num_sent, exc)
        if num_sent:
            self.server.emit(rid, P.error(req.id, P.UNAVAILABLE, f"the upstream engine failed mid-answer: {exc}"),
                             last=True)
            return "failed"
        self.server.fall_back(rid, req, received, busy=reason == "busy")
        return "fallback"

    def _record(self, success: bool) -> None:
        with self._lock:
            was = self.breaker.state
            if success:
                self.breaker.record_success(time.monotonic())
            else:
                self.breaker.record_timeout(time.monotonic())
            if self.breaker.state != was:
                log.warning("upstream breaker %s -> %s", was, self.breaker.state)

    # ---- figures ------------------------------------------------------------------------------
    def stats(self) -> dict:
        """The `stats` reply's `upstream` map: breaker, in flight, and counts by outcome and class."""
        with self._lock:
            by_outcome: dict[str, dict[str, int]] = {}
            for (outcome, cls), n in sorted(self.counts.items()):
                by_outcome.setdefault(outcome, {})[cls] = n
            return {"url": self.settings.url, "model": self.settings.model, "inflight": self.inflight,
                    "breaker": self.breaker.stats(time.monotonic()), "policy": dict(self.policy), **by_outcome}

    async def close(self) -> None:
        await self.client.close()


def _usage(upstream: dict) -> dict:
    details = upstream.get("prompt_tokens_details") or {}
    return {"prompt_tokens": upstream.get("prompt_tokens", 0),
            "completion_tokens": upstream.get("completion_tokens", 0),
            "cached_tokens": details.get("cached_tokens") or 0, "cold_tokens": 0}


def _timings(received: float, first: float | None) -> dict:
    now = time.monotonic()
    ms = lambda t: round((t - received) * 1000, 3)  # noqa: E731
    return {"queue_ms": 0.0, "ttft_ms": ms(first or now), "total_ms": ms(now), "tokens_per_s": 0.0}
