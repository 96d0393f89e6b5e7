"""An energy estimate from this process's CPU time, for machines where no counter is readable."""

from __future__ import annotations

import logging
import os
import time

import psutil

from o3edge.power.meter import Meter, Reading

log = logging.getLogger(__name__)

DEFAULT_WATTS_PER_CORE = 10.0  # a busy modern x86 or Arm big core; o3edged uses this (no setting)


class EstimateMeter(Meter):
    """CPU-seconds of one process × a configured watts per busy core: an estimate, never a measurement.

    It sees only this process's CPU work: accelerators, memory, idle draw and other processes are
    not in it, so its tokens/J are not comparable with a measured meter's.
    """

    name = "estimate"
    is_estimate = True
    update_period_s = 0.01

    def __init__(self, watts_per_core: float = DEFAULT_WATTS_PER_CORE, pid: int | None = None):
        if watts_per_core <= 0:
            raise ValueError(f"watts_per_core must be positive, got {watts_per_core}")
        self.watts_per_core = watts_per_core
        self._process = psutil.Process(pid)
        # this process: the kernel's per-process CPU clock (ns); another one: /proc's clock ticks (10 ms),
        # too coarse for a request that takes a few milliseconds of CPU
        self._own = pid is None or pid == os.getpid()
        self._cpu_s0 = self._cpu_seconds()
        log.info("energy is ESTIMATED from CPU time at %.1f W per busy core (no meter readable)", watts_per_core)

    def _cpu_seconds(self) -> float:
        if self._own:
            return time.process_time()
        times = self._process.cpu_times()
        return times.user + times.system

    @property
    def domains(self) -> tuple[str, ...]:
        """A single domain, "cpu-estimate"."""
        return ("cpu-estimate",)

    def cpu_seconds(self) -> float:
        """CPU-seconds the process used since the meter started."""
        return self._cpu_seconds() - self._cpu_s0

    def read(self) -> list[Reading]:
        """Estimated cumulative joules since the meter started."""
        cpu_s = self.cpu_seconds()
        return [Reading(time.monotonic_ns(), "cpu-estimate", cpu_s * self.watts_per_core)]
