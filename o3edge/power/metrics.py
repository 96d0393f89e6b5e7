"""Prometheus metrics for energy on a private registry, and an atomic textfile writer."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from o3edge.power.accountant import EnergyAccountant
from o3edge.power.sampler import EnergySampler

log = logging.getLogger(__name__)


def new_registry() -> CollectorRegistry:
    """A registry of our own (not the process-global one); other parts add their metrics to it."""
    return CollectorRegistry(auto_describe=True)


class EnergyCollector(Collector):
    """Reads the sampler and accountant at scrape time, so nothing has to push updates."""

    def __init__(self, sampler: EnergySampler, accountant: EnergyAccountant | None = None, prefix: str = "o3edge"):
        self.sampler = sampler
        self.accountant = accountant
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        """Energy per domain, and (with an accountant) tokens, idle/active joules and tokens/J."""
        p, meter = self.prefix, self.sampler.meter
        info = GaugeMetricFamily(f"{p}_energy_meter_info", "The energy meter in use (value 1)",
                                 labels=["meter", "domains", "is_estimate"])
        info.add_metric([meter.name, ",".join(meter.domains), str(meter.is_estimate).lower()], 1.0)
        yield info
        energy = CounterMetricFamily(f"{p}_energy_joules", "Energy read by the meter since it started",
                                     labels=["meter", "domain"])
        for reading in self.sampler.latest():
            energy.add_metric([meter.name, reading.domain], reading.joules)
        yield energy
        if self.accountant is not None:
            yield from self._accounted(p)

    def _accounted(self, p: str) -> Iterator[Metric]:
        totals = self.accountant.totals()
        tokens = CounterMetricFamily(f"{p}_tokens", "Tokens processed by engine steps", labels=["kind"])
        tokens.add_metric(["prompt"], totals.prompt_tokens)
        tokens.add_metric(["generated"], totals.tokens)
        yield tokens
        split = GaugeMetricFamily(f"{p}_energy_attributed_joules",
                                  "Energy during engine steps (active) and between them (idle)", labels=["kind"])
        split.add_metric(["active"], totals.active_joules)
        split.add_metric(["idle"], totals.idle_joules)
        yield split
        estimate = str(self.sampler.meter.is_estimate).lower()  # an estimate is always labelled as one
        tpj = GaugeMetricFamily(f"{p}_tokens_per_joule", "Generated tokens per joule (NaN before any energy)",
                                labels=["scope", "window", "is_estimate"])
        for window_s in (None,) + self.accountant.windows_s:
            t = totals if window_s is None else self.accountant.totals(window_s)
            window = "all" if window_s is None else f"{window_s:g}s"
            tpj.add_metric(["active", window, estimate], _or_nan(t.active_tokens_per_joule))
            tpj.add_metric(["with_idle", window, estimate], _or_nan(t.tokens_per_joule))
        yield tpj


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


def register_energy_metrics(registry: CollectorRegistry, sampler: EnergySampler,
                            accountant: EnergyAccountant | None = None) -> EnergyCollector:
    """Add the energy collector to `registry` and return it."""
    collector = EnergyCollector(sampler, accountant)
    registry.register(collector)
    return collector


def render(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus text format (for an HTTP exporter or a `stats` reply)."""
    return generate_latest(registry)


def write_textfile(registry: CollectorRegistry, path: str | Path) -> bool:
    """Write the registry for node_exporter's textfile collector (temp file + rename); False on failure."""
    try:
        write_to_textfile(str(path), registry)
    except OSError as exc:
        log.warning("metrics textfile %s not written: %s", path, exc)
        return False
    return True
