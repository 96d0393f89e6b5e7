"""The CPU's name, as the benchmarks record where they ran."""

from __future__ import annotations

import platform


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (elsewhere: what platform knows)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()
