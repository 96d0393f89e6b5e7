"""What every energy meter exposes: cumulative joules per domain since the meter started."""

from __future__ import annotations

import abc
from typing import NamedTuple

from o3edge.errors import O3Error

METER_CHOICES = ("auto", "nvml", "rapl", "jetson", "estimate")  # [power] meter; auto: the best one found


class Reading(NamedTuple):
    """One cumulative reading: joules used in `domain` from the meter's start to `monotonic_ns`."""

    monotonic_ns: int
    domain: str
    joules: float


class MeterUnavailable(O3Error):
    """A meter cannot read its source here; the message says why (missing, permission, ...)."""

    code = "meter_unavailable"


class Meter(abc.ABC):
    """A source of cumulative energy readings, one per domain.

    Domains of one meter never overlap, so their sum is the meter's total. Constructors read
    the source once and raise MeterUnavailable when it cannot be read; `read()` may raise
    OSError (or the library's error) later, which the sampler logs and survives.
    """

    name: str = "meter"
    is_estimate: bool = False
    update_period_s: float = 0.1  # how often the underlying counter changes

    @property
    @abc.abstractmethod
    def domains(self) -> tuple[str, ...]:
        """The domains this meter reports, e.g. ("gpu0",) or ("cpu-package-0", "cpu-dram-0")."""

    @abc.abstractmethod
    def read(self) -> list[Reading]:
        """Cumulative joules per domain since the meter started, stamped with time.monotonic_ns."""

    def close(self) -> None:
        """Release the source (a no-op for file-based meters)."""

    def describe(self) -> str:
        """A one-line description naming the meter and its domains."""
        kind = "estimate" if self.is_estimate else "measured"
        return f"{self.name} ({kind}): {', '.join(self.domains)}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"
