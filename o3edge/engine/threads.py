"""How many threads a CPU step runs on: the default count, and the probe that drops to one thread when
other processes hold the cores."""

from __future__ import annotations

import os


def default_num_threads(limit: int = 8) -> int:
    """Physical cores this process may run on, at most `limit`: decode streams weights from memory, so
    SMT siblings add barrier waits, not bandwidth, and past ~8 cores memory is the limit anyway."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as fh:
                cores.add(fh.read().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, min(limit, len(cores)))


class ThreadProbe:
    """The thread count for the next native decode step.

    The native step's threads meet at ~150 barriers a step, so when another process holds a core, each
    barrier can wait out a scheduler time slice and a step slows 10-100x (llama.cpp's threads do the same).
    So steps are timed: every PROBE_EVERY steps, or at once when a step takes over twice the fastest one,
    the other thread count (one thread: no barriers) runs one step, and whichever is faster is kept.
    Use: n = probe.pick(); run the step on n threads; probe.timed(n, seconds)."""

    PROBE_EVERY = 64

    def __init__(self, threads: int):
        self.threads = threads
        self.use = threads  # thread count of the steps between probes
        self.ema: dict[int, float] = {}  # seconds a step, per thread count
        self.fastest = float("inf")
        self.since_probe = 0

    def pick(self) -> int:
        n = self.use
        slow = self.since_probe >= 4 and self.ema.get(n, 0.0) > 2 * self.fastest
        if self.threads > 1 and (self.since_probe >= self.PROBE_EVERY or slow):
            n = 1 if self.use != 1 else self.threads
        return n

    def timed(self, n: int, seconds: float) -> None:
        if n != self.use:  # a probe: switch when the other count is clearly faster now
            self.since_probe = 0
            self.ema[n] = seconds
            if seconds < 0.8 * self.ema.get(self.use, float("inf")):
                self.use, self.fastest = n, seconds
            return
        self.since_probe += 1
        ema = self.ema.get(n)
        self.ema[n] = seconds if ema is None else 0.7 * ema + 0.3 * seconds
        self.fastest = min(self.fastest * 1.001, self.ema[n])  # forgets slowly: contexts grow
