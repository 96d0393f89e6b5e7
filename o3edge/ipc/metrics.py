"""Prometheus metrics of the service: requests by outcome and class, the queue, the batch, the KV cache.

Read at scrape time from the figures the engine loop publishes after each iteration (the same ones
`stats` answers from), so nothing on the engine thread has to push updates.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from o3edge.ipc.server import IPCServer

UNKNOWN = "unknown"


class RequestCounter:
    """Finished requests by (outcome, priority class); admit() remembers each request's class until it ends."""

    def __init__(self):
        self._lock = threading.Lock()  # finish() on the engine thread, counts() on a scrape thread
        self._priority: dict[str, str] = {}
        self._counts: Counter[tuple[str, str]] = Counter()

    def admit(self, request_id: str, priority: str) -> None:
        """Remember a request's priority class."""
        with self._lock:
            self._priority[request_id] = priority

    def finish(self, request_id: str, outcome: str) -> str:
        """Count a request under its outcome and class; returns the class ("unknown" if never admitted)."""
        with self._lock:
            priority = self._priority.pop(request_id, UNKNOWN)
            self._counts[(outcome, priority)] += 1
        return priority

    def counts(self) -> dict[tuple[str, str], int]:
        """{(outcome, priority): requests} so far."""
        with self._lock:
            return dict(self._counts)


def server_figures(server: "IPCServer") -> dict:
    """The engine's last published figures plus the server's own counters (what `stats` shows)."""
    return {**server.loop.snapshot, **server.counts, "requests_in_flight": len(server.routes),
            "ready": server.state == "ready"}


class ServiceCollector(Collector):
    """Request, queue, batch and KV-cache metrics from `figures()` and a RequestCounter."""

    def __init__(self, figures: Callable[[], dict], requests: RequestCounter, prefix: str = "o3edge"):
        self.figures = figures
        self.requests = requests
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        """Every metric; engine figures are left out until the engine has published some."""
        p = self.prefix
        finished = CounterMetricFamily(f"{p}_requests", "Requests ended, by outcome (finish reason or error "
                                       "code) and priority class", labels=["finish_reason", "priority"])
        for (outcome, priority), n in sorted(self.requests.counts().items()):
            finished.add_metric([outcome, priority], n)
        yield finished
        figures = self.figures() or {}
        if "ready" in figures:
            yield _gauge(f"{p}_ready", "1 when the engine is loaded and serving", float(figures["ready"]))
        yield from self._server(p, figures)
        if "kv_blocks_total" in figures:
            yield from self._engine(p, figures)

    def _server(self, p: str, f: dict) -> Iterator[Metric]:
        for key, name, text in (("requests_total", "requests_admitted", "Generate requests admitted"),
                                ("rejected", "requests_rejected", "Messages refused before admission"),
                                ("preemptions", "preemptions", "Sequences preempted to free KV blocks"),
                                ("bad_messages", "bad_messages", "Undecodable or invalid messages, those dropped unread "
                                 "included"),
                                ("dropped_peers", "clients_dropped", "Client connections dropped: vanished, not "
                                 "reading, broke the framing, or their process closed"),
                                ("reserved_ids", "reserved_id_messages", "Messages dropped unread from a routing id a "
                                 "client chose in the space reserved for generated ones"),
                                ("from_closed_processes", "closed_process_requests", "Generate requests dropped unread: "
                                 "their client process had closed its connections")):
            if key in f:
                yield CounterMetricFamily(f"{p}_{name}", text, value=f[key])
        if "requests_in_flight" in f:
            yield _gauge(f"{p}_requests_in_flight", "Admitted requests not yet finished", f["requests_in_flight"])

    def _engine(self, p: str, f: dict) -> Iterator[Metric]:
        yield _gauge(f"{p}_queue_depth", "Requests waiting for a place in the batch", f.get("waiting", 0))
        yield _gauge(f"{p}_running", "Sequences in the running batch", f.get("running", 0))
        classes = f.get("classes") or {}
        for key, name, text in (("waiting", "class_queue_depth", "Requests waiting, by priority class"),
                                ("running", "class_running", "Sequences running, by priority class")):
            family = GaugeMetricFamily(f"{p}_{name}", text, labels=["priority"])
            for priority, c in sorted(classes.items()):
                family.add_metric([priority], c.get(key, 0))
            yield family
        breaker = GaugeMetricFamily(f"{p}_breaker_open", "1 while a class's circuit breaker is not closed",
                                    labels=["priority"])
        for priority, c in sorted(classes.items()):
            breaker.add_metric([priority], float((c.get("breaker") or {}).get("state", "closed") != "closed"))
        yield breaker
        blocks = GaugeMetricFamily(f"{p}_kv_blocks", "KV-cache blocks held by sequences (used) or free",
                                   labels=["state"])
        blocks.add_metric(["used"], f.get("kv_blocks_used", 0))
        blocks.add_metric(["free"], f.get("kv_blocks_free", 0))
        yield blocks
        yield _gauge(f"{p}_kv_blocks_cached", "Free KV blocks still holding a reusable prefix",
                     f.get("kv_blocks_cached", 0))
        yield _gauge(f"{p}_prefix_hit_rate", "Share (0-1) of prompt tokens found in the prefix cache",
                     f.get("prefix_hit_rate", 0.0))
        yield CounterMetricFamily(f"{p}_prefix_hit_tokens", "Prompt tokens found in the prefix cache",
                                  value=f.get("prefix_hit_tokens", 0))
        if "cold_blocks" in f:
            yield from self._cold_tier(p, f)
        yield CounterMetricFamily(f"{p}_generated_tokens", "Tokens generated by the engine",
                                  value=f.get("generated_tokens", 0))
        yield _gauge(f"{p}_generation_tokens_per_second", "Tokens generated per second over the last 10 s",
                     f.get("tokens_per_s", 0.0))


    def _cold_tier(self, p: str, f: dict) -> Iterator[Metric]:
        """The KV cold tier (only while it is on)."""
        yield _gauge(f"{p}_kv_cold_blocks", "KV blocks held in the shared-memory cold tier", f["cold_blocks"])
        yield _gauge(f"{p}_kv_cold_bytes", "Bytes of KV held in the cold tier", f.get("cold_bytes", 0))
        for key, name, text in (
                ("cold_hit_tokens", "kv_cold_hit_tokens", "Prompt tokens copied in from the cold tier"),
                ("cold_restored_blocks", "kv_cold_restored_blocks", "Blocks copied in from the cold tier"),
                ("cold_offloaded_blocks", "kv_cold_offloaded_blocks", "Blocks copied out to the cold tier"),
                ("cold_checksum_failures", "kv_cold_checksum_failures",
                 "Cold blocks refused on load (checksum, tokens or header) and recomputed"),
                ("cold_evicted", "kv_cold_evicted_blocks", "Cold blocks evicted (LRU) to make room")):
            yield CounterMetricFamily(f"{p}_{name}", text, value=f.get(key, 0))
        for key, name, text in (("cold_offload_gb_per_s", "kv_cold_offload_gb_per_second",
                                 "Offload bandwidth so far (copy and checksum), GB/s"),
                                ("cold_restore_gb_per_s", "kv_cold_restore_gb_per_second",
                                 "Restore bandwidth so far (verify and copy), GB/s")):
            yield _gauge(f"{p}_{name}", text, f.get(key, 0.0))


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)
