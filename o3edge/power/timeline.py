"""A bounded timeline of cumulative energy per domain, interpolated linearly between samples."""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Iterable, Sequence

from o3edge.power.meter import Reading

log = logging.getLogger(__name__)


class _Series:
    """Sample times and cumulative joules of one domain; trimmed to `capacity` in amortised O(1)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.ts: list[int] = []
        self.js: list[float] = []

    def append(self, t_ns: int, joules: float) -> bool:
        if self.ts and (t_ns <= self.ts[-1] or joules < self.js[-1]):
            return False  # meters guard their counters; this keeps the series monotonic regardless
        self.ts.append(t_ns)
        self.js.append(joules)
        if len(self.ts) > 2 * self.capacity:
            del self.ts[: -self.capacity]
            del self.js[: -self.capacity]
        return True

    def value_at(self, t_ns: int, slope_span_ns: int) -> float:
        """Cumulative joules at t: interpolated inside, clamped before, extrapolated at recent power after."""
        ts, js = self.ts, self.js
        if t_ns <= ts[0]:
            return js[0]
        if t_ns >= ts[-1]:
            if len(ts) == 1:
                return js[-1]
            ref = max(0, min(len(ts) - 2, bisect.bisect_right(ts, ts[-1] - slope_span_ns) - 1))
            watts = (js[-1] - js[ref]) / (ts[-1] - ts[ref])
            return js[-1] + watts * (t_ns - ts[-1])
        i = bisect.bisect_right(ts, t_ns) - 1  # ts[i] <= t < ts[i + 1]
        frac = (t_ns - ts[i]) / (ts[i + 1] - ts[i])
        return js[i] + frac * (js[i + 1] - js[i])


class Timeline:
    """Cumulative joules per domain over time; thread-safe (one writer, many readers).

    `slope_span_ns` is how far back the power used to extrapolate past the last sample is taken:
    about one counter update, so a counter that moves in steps is not read as zero power.
    """

    def __init__(self, domains: Sequence[str], capacity: int, slope_span_ns: int):
        self.domains = tuple(domains)
        self.slope_span_ns = slope_span_ns
        self._series = {d: _Series(capacity) for d in self.domains}
        self._lock = threading.Lock()
        self._num_dropped = 0

    def add(self, readings: Iterable[Reading]) -> None:
        """Append readings; unknown domains and out-of-order samples are dropped (logged once)."""
        with self._lock:
            for reading in readings:
                series = self._series.get(reading.domain)
                if series is None or not series.append(reading.monotonic_ns, reading.joules):
                    self._num_dropped += 1
                    if self._num_dropped == 1:
                        log.warning("timeline dropped a reading it cannot use: %s", reading)

    def covered_until_ns(self) -> int | None:
        """The latest time every domain has a sample at or after, or None before the first sample."""
        with self._lock:
            if any(not s.ts for s in self._series.values()):
                return None
            return min(s.ts[-1] for s in self._series.values())

    def latest(self) -> list[Reading]:
        """The last reading of every domain that has one."""
        with self._lock:
            return [Reading(s.ts[-1], d, s.js[-1]) for d, s in self._series.items() if s.ts]

    def window(self, t0_ns: int, t1_ns: int, slack_ns: int = 0) -> tuple[dict[str, float], bool]:
        """Joules per domain between t0 and t1, and whether both ends lie within the samples ± slack."""
        by_domain = dict.fromkeys(self.domains, 0.0)
        if t1_ns <= t0_ns:
            return by_domain, t1_ns == t0_ns
        covered = True
        with self._lock:
            for domain, series in self._series.items():
                if not series.ts:
                    covered = False
                    continue
                covered &= series.ts[0] - slack_ns <= t0_ns and t1_ns <= series.ts[-1] + slack_ns
                e0 = series.value_at(t0_ns, self.slope_span_ns)
                e1 = series.value_at(t1_ns, self.slope_span_ns)
                by_domain[domain] = max(0.0, e1 - e0)
        return by_domain, covered
