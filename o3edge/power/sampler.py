"""The sampler thread: reads a meter every ~100 ms into a timeline, away from the engine loop."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from o3edge.power.meter import Meter, Reading
from o3edge.power.timeline import Timeline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnergyWindow:
    """Energy between two instants; low_confidence when too short to resolve or outside the samples."""

    joules: float
    domains: tuple[str, ...]
    low_confidence: bool
    by_domain: dict[str, float]


class EnergySampler:
    """Reads `meter` every `period_s` on its own thread and keeps `history_s` of readings.

    Nothing here raises into callers: read errors are logged (first one, then every 100th) and
    the thread keeps going. Listeners run on the sampler thread after every sample.
    """

    def __init__(self, meter: Meter, period_s: float = 0.1, history_s: float = 900.0):
        if period_s <= 0 or history_s < period_s:
            raise ValueError(f"need 0 < period_s <= history_s, got {period_s}, {history_s}")
        self.meter = meter
        self.period_s = period_s
        # A window shorter than ~2 of these cannot be resolved: the coarser of counter and sampling.
        self.resolution_s = max(period_s, meter.update_period_s)
        capacity = int(history_s / period_s) + 1
        self.timeline = Timeline(meter.domains, capacity, slope_span_ns=int(self.resolution_s * 1e9))
        self._listeners: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._num_failures = 0
        self._num_listener_failures = 0

    @property
    def domains(self) -> tuple[str, ...]:
        """The meter's domains."""
        return self.meter.domains

    @property
    def is_running(self) -> bool:
        """Whether the sampler thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> bool:
        """Start the thread (a first sample is taken at once); False if it could not start."""
        if self.is_running:
            return True
        self._stop.clear()
        try:
            self._thread = threading.Thread(target=self._run, name="o3edge-energy-sampler", daemon=True)
            self._thread.start()
        except RuntimeError as exc:
            log.error("energy sampler could not start: %s", exc)
            return False
        log.info("energy sampler started: %s every %.0f ms", self.meter.describe(), self.period_s * 1e3)
        return True

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and wait for it (at most timeout_s)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("energy sampler did not stop within %.1f s (a meter read is stuck)", timeout_s)
        self._thread = None

    def __enter__(self) -> "EnergySampler":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call `callback()` on the sampler thread after every sample."""
        self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        """Stop calling `callback`."""
        if callback in self._listeners:
            self._listeners.remove(callback)

    def sample_once(self) -> bool:
        """Read the meter now and record it; False (logged) if the read failed."""
        try:
            readings = self.meter.read()
        except Exception as exc:  # any meter/library error: serving goes on without this sample
            self._num_failures += 1
            if self._num_failures == 1 or self._num_failures % 100 == 0:
                log.warning("energy meter %s read failed (%d so far): %s", self.meter.name, self._num_failures, exc)
            return False
        if self._num_failures:
            log.info("energy meter %s reads again after %d failures", self.meter.name, self._num_failures)
            self._num_failures = 0
        self.record(readings)
        return True

    def record(self, readings: Iterable[Reading]) -> None:
        """Add readings taken elsewhere (tests, replays) to the timeline."""
        self.timeline.add(readings)

    def _notify(self) -> None:
        for callback in list(self._listeners):
            try:
                callback()
            except Exception:
                self._num_listener_failures += 1
                if self._num_listener_failures == 1 or self._num_listener_failures % 1000 == 0:
                    log.exception("energy sampler listener %r failed (%d so far)",
                                  callback, self._num_listener_failures)

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            self.sample_once()
            self._notify()
            next_t += self.period_s
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind (slow read, suspended machine): skip, don't burst
                next_t = time.monotonic()
                delay = 0.0
            self._stop.wait(delay)

    def covered_until_ns(self) -> int | None:
        """The latest instant every domain has been sampled at (None before the first sample)."""
        return self.timeline.covered_until_ns()

    def latest(self) -> list[Reading]:
        """The most recent cumulative reading of each domain."""
        return self.timeline.latest()

    def energy_between(self, t0_ns: int, t1_ns: int) -> EnergyWindow:
        """Joules between two time.monotonic_ns instants, interpolated on the timeline."""
        slack_ns = int(self.resolution_s * 1e9)
        by_domain, covered = self.timeline.window(t0_ns, t1_ns, slack_ns)
        too_short = (t1_ns - t0_ns) < 2 * slack_ns
        return EnergyWindow(sum(by_domain.values()), self.domains, too_short or not covered, by_domain)
