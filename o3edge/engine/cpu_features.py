"""What this CPU can do, read from /proc/cpuinfo (no torch): the kernels are picked at run time."""

from __future__ import annotations

import functools
import os
import platform

VNNI_KERNELS = {"avx512f", "avx512bw", "avx512_vnni"}  # what o3edge's CPU kernels (cpu_kernels.h) use


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


def why_no_vnni_kernels() -> str | None:
    """Why o3edge's VNNI kernels cannot run here (switched off, not x86-64, flags missing), or None."""
    if os.environ.get("O3EDGE_CPU_KERNELS", "auto") == "torch":
        return "O3EDGE_CPU_KERNELS=torch"
    missing = VNNI_KERNELS - cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or missing:
        return "this CPU lacks " + (", ".join(sorted(missing)) or "x86-64")
    return None
