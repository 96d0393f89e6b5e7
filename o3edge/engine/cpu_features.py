"""What this CPU can do, read from /proc/cpuinfo (no torch): the kernels are picked at run time."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """Every instruction-set flag of this CPU (Linux's /proc/cpuinfo; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as fh:
            line = next((ln for ln in fh if ln.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.split(":", 1)[-1].split())


def cpu_features() -> frozenset[str]:
    """The flags that matter for the kernels."""
    return cpu_flags() & {"avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8",
                          "amx_bf16"}


def cpu_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    return bool(cpu_features() & {"avx512_bf16", "amx_bf16"})
