"""The daemon's answers to `health`, `stats` and `info` (docs/protocol.md §4.4-4.6), and its STATUS line.

Built on the I/O thread from figures the engine loop publishes after each iteration, so they are
answered at once even while the engine is loading or busy.
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
    from o3edge.engine.engine import LLMEngine
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
            "max_inflight_per_client": s.max_inflight_per_client, "max_prompt_bytes": server.max_prompt_bytes}
    model = engine_info(server.loop.engine) if server.loop.state == "ready" else {"model": None}
    return P.reply("info", request_id, **base, **model, **server.about, memory=memory_info(server))


def memory_info(server: "IPCServer") -> dict:
    """What the daemon's resident memory is made of, in MiB."""
    mib = lambda n: round(n / 2**20, 1)  # noqa: E731
    out = {k.replace("_bytes", "_mib"): mib(v) for k, v in rss_breakdown().items()}
    engine = server.loop.engine if server.loop.state == "ready" else None
    if engine is not None:
        out["kv_cache_mib"] = mib(engine.info.kv_cache_bytes)
        model = getattr(getattr(engine, "runner", None), "model", None)
        if model is not None:
            out["weights_mib"] = mib(sum(t.numel() * t.element_size() for t in model.state_dict().values()))
    out["trims"] = server.trimmer.num_trims
    return out


def engine_info(engine: "LLMEngine") -> dict:
    i = engine.info
    return {"model": os.path.basename(os.path.normpath(i.model_dir)), "model_path": i.model_dir,
            "architecture": i.args.family, "dtype": i.dtype, "device": i.device, "max_context": i.max_model_len,
            "vocab_size": i.args.vocab_size, "kv_block_size": i.kv_block_size, "num_kv_blocks": i.num_kv_blocks,
            "kv_cache_bytes": i.kv_cache_bytes, "fingerprint": i.fingerprint,
            "has_chat_template": bool(engine.tokenizer.chat_template), "load_seconds": round(i.load_seconds, 3),
            "cache_identity": i.cache_identity, "cold_tier": cold_tier_path(engine)}


def cold_tier_path(engine: "LLMEngine") -> str | None:
    """The KV cold tier's shared-memory segment, None when the tier is off."""
    offloader = getattr(engine, "offloader", None)
    return offloader.tier.path if offloader is not None else None


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
