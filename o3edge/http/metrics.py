"""Prometheus metrics of the upstream overflow: requests by outcome and class, served here vs upstream, breaker."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from o3edge.http.overflow import Overflow
    from o3edge.ipc.metrics import RequestCounter

LOCAL_SUCCESS = ("stop", "length")  # finish reasons of requests the engine here completed


class UpstreamCollector(Collector):
    """o3edge_upstream_* and o3edge_served_requests{served_by, priority}."""

    def __init__(self, overflow: "Overflow", requests: "RequestCounter", prefix: str = "o3edge"):
        self.overflow, self.requests, self.prefix = overflow, requests, prefix

    def collect(self) -> Iterator[Metric]:
        p, stats = self.prefix, self.overflow.stats()
        outcomes = CounterMetricFamily(f"{p}_upstream_requests", "Requests sent upstream, by outcome "
                                       "(forwarded, served, fallback, failed, cancelled) and priority class",
                                       labels=["outcome", "priority"])
        served = CounterMetricFamily(f"{p}_served_requests", "Requests completed, by where (local, upstream) "
                                     "and priority class", labels=["served_by", "priority"])
        for (outcome, priority), n in sorted(self.overflow.counts.copy().items()):
            outcomes.add_metric([outcome, priority], n)
            if outcome == "served":
                served.add_metric(["upstream", priority], n)
        local: dict[str, int] = {}
        for (outcome, priority), n in self.requests.counts().items():
            if outcome in LOCAL_SUCCESS:
                local[priority] = local.get(priority, 0) + n
        for priority, n in sorted(local.items()):
            served.add_metric(["local", priority], n)
        yield outcomes
        yield served
        yield GaugeMetricFamily(f"{p}_upstream_inflight", "Requests being served upstream now",
                                value=stats["inflight"])
        yield GaugeMetricFamily(f"{p}_upstream_breaker_open", "1 while the upstream's breaker is not closed",
                                value=float(stats["breaker"]["state"] != "closed"))
