"""The daemon's answers to `health`, `stats` and `info` (docs/protocol.md §4.4-4.6), and its STATUS line.

Built on the I/O thread from what the engine loop publishes (its EngineView once loaded, its
figures after each iteration), so they are answered at once even while the engine is loading or busy.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import o3edge
from o3edge.ipc import protocol as P
from o3edge.memory import rss_breakdown

if TYPE_CHECKING:
    from o3edge.ipc.server import IPCServer

log = logging.getLogger(__name__)


def health(server: "IPCServer", request_id: str) -> dict:
    state = server.state
    return P.reply("health", request_id, status=state, live=True, ready=state == "ready",
                   uptime_s=_uptime(server), version=o3edge.__version__)


def stats(server: "IPCServer", request_id: str) -> dict:
    snap = dict(server.loop.snapshot)
    snap.pop("jobs", None)
    extra = {}
    if server.hooks.stats is not None:
        try:
            extra = server.hooks.stats() or {}
        except Exception:
            log.exception("stats hook failed")
    if server.overflow is not None:
        extra = {**extra, "upstream": server.overflow.stats()}
    return P.reply("stats", request_id, state=server.state, uptime_s=_uptime(server),
                   queue_depth=snap.pop("waiting", 0), running=snap.pop("running", 0),
                   requests_in_flight=len(server.routes), clients=server.routes.num_clients,
                   connections={"open": sum(server.access.open_by_uid.values()), **server.access.counts},
                   **snap, **server.counts, **extra)


def info(server: "IPCServer", request_id: str) -> dict:
    s = server.settings
    base = {"state": server.state, "version": o3edge.__version__, "protocol_version": P.PROTOCOL_VERSION,
            "pid": os.getpid(), "max_message_bytes": s.max_message_bytes,
            "max_inflight_per_client": s.max_inflight_per_client}
    view = server.loop.view
    model = {"max_prompt_bytes": view.max_prompt_bytes, **view.model} if view else {"max_prompt_bytes": None,
                                                                                     "model": None}
    return P.reply("info", request_id, **base, **model, **server.about, memory=memory_info(server))


def memory_info(server: "IPCServer") -> dict:
    """What the daemon's resident memory is made of, in MiB."""
    mib = lambda n: round(n / 2**20, 1)  # noqa: E731
    out = {k.replace("_bytes", "_mib"): mib(v) for k, v in rss_breakdown().items()}
    if server.loop.view is not None:
        out.update(server.loop.view.memory_mib)
    out["trims"] = server.trimmer.num_trims
    return out


def status_line(server: "IPCServer") -> str:
    """One line for systemd's STATUS= and logs."""
    if server.state != "ready":
        return server.state
    s = server.loop.snapshot
    return (f"ready: {len(server.routes)} requests, {s.get('running', 0)} running, "
            f"{s.get('tokens_per_s', 0.0):.1f} tokens/s, KV {s.get('kv_blocks_used', 0)}/"
            f"{s.get('kv_blocks_total', 0)} blocks")


def _uptime(server: "IPCServer") -> float:
    return round(time.monotonic() - server.started_at, 3)
