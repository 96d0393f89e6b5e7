"""Turn raw hardware figures into cumulative joules: energy counters (wrap, reset) and power samples."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class CounterAccumulator:
    """Cumulative joules from a raw energy counter that may wrap or reset.

    `scale` converts counter units to joules (1e-3 for NVML's mJ, 1e-6 for RAPL's µJ).
    With `wrap_range` set, a smaller value is a wrap and adds `wrap_range`; without it, a
    smaller value means the counter was reset (driver reload): the accumulator re-baselines,
    logs it, and reports no energy for that interval rather than a negative or bogus figure.
    """

    def __init__(self, first_raw: int | float, scale: float, name: str, wrap_range: int | float | None = None):
        self.name = name
        self.scale = scale
        self.wrap_range = wrap_range if wrap_range else None
        self.num_wraps = 0
        self.num_resets = 0
        self._last_raw = first_raw
        self._joules = 0.0

    @property
    def joules(self) -> float:
        """Joules accumulated since the first raw value."""
        return self._joules

    def update(self, raw: int | float) -> float:
        """Feed the latest raw counter value; returns the cumulative joules."""
        delta = raw - self._last_raw
        if delta < 0:
            if self.wrap_range is not None and -delta <= self.wrap_range:
                delta += self.wrap_range
                self.num_wraps += 1
            else:
                self.num_resets += 1
                log.warning(
                    "energy counter %s went backwards (%s -> %s): reset or driver reload; re-baselined, "
                    "interval not counted",
                    self.name, self._last_raw, raw,
                )
                delta = 0
        self._last_raw = raw
        self._joules += delta * self.scale
        return self._joules


class PowerIntegrator:
    """Cumulative joules from instantaneous power samples, by the trapezoid rule.

    Accuracy depends on how often `update` is called: the sampler calls it every period.
    """

    def __init__(self, name: str, max_gap_s: float = 5.0):
        self.name = name
        self.max_gap_s = max_gap_s
        self._last: tuple[int, float] | None = None
        self._joules = 0.0
        self._warned_gap = False

    @property
    def joules(self) -> float:
        """Joules integrated so far."""
        return self._joules

    def update(self, t_ns: int, watts: float) -> float:
        """Add a power sample taken at monotonic time `t_ns`; returns the cumulative joules."""
        if watts < 0:
            log.debug("negative power %.3f W on %s read as 0", watts, self.name)
            watts = 0.0
        if self._last is not None:
            t_prev, w_prev = self._last
            dt_s = (t_ns - t_prev) / 1e9
            if dt_s < 0:
                return self._joules  # out of order: keep the later sample as the reference
            if dt_s > self.max_gap_s and not self._warned_gap:
                self._warned_gap = True
                log.warning("power on %s sampled after a %.1f s gap: energy over it is a guess", self.name, dt_s)
            self._joules += 0.5 * (w_prev + watts) * dt_s
        self._last = (t_ns, watts)
        return self._joules
