"""What this CPU can do, read from /proc/cpuinfo (no torch): the kernels are picked at run time."""

from __future__ import annotations

import functools
import logging
import os
import platform

log = logging.getLogger(__name__)

VNNI_KERNELS = {"avx512f", "avx512bw", "avx512_vnni"}  # what the AVX-512 build of the row kernels (cpu_kernels.h) uses
# the instruction sets the row kernels and the native step are built for (cpu_vec.h), widest first: AVX-512 VNNI,
# AVX-VNNI (vpdpbusd on 256-bit vectors: Alder Lake and later, Zen 5 client), built with -mbmi2 as well, and AVX2
# (the byte dot products made of vpmaddubsw and vpmaddwd: Haswell to Comet Lake, Zen 1-3)
ROW_KERNEL_NEEDS = {"avx512": VNNI_KERNELS, "avxvnni": {"avx2", "fma", "f16c", "avx_vnni", "bmi2"},
                    "avx2": {"avx2", "fma", "f16c"}}
# g++ flags of the AVX-VNNI and AVX2 builds (cpu_ext.py, native_lib.py): those instructions, not -march=native, so a
# machine with more builds exactly what one without runs
AVXVNNI_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-mavxvnni", "-mbmi2", "-DO3_AVXVNNI"]
AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c", "-DO3_AVX2"]
NARROW_FLAGS = {"avxvnni": AVXVNNI_FLAGS, "avx2": AVX2_FLAGS}  # the builds other than AVX-512's


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


def choose_isa(needs: dict[str, set[str]], env: str, fallback: str, also: tuple[str, ...] = (),
               logger: logging.Logger = log) -> str | None:
    """The instruction set one of o3edge's CPU libraries is built for: the first of `needs` (widest first) whose
    flags this CPU has, or the one the environment variable `env` names where the CPU has it; None on a machine
    that is not x86-64, with O3EDGE_CPU_KERNELS=torch, and where none fits (a value of `env` o3edge does not know,
    or this CPU lacks, is logged on `logger`, naming `fallback`, what runs instead; `also`: other values the
    caller takes, named in that log)."""
    if os.environ.get("O3EDGE_CPU_KERNELS", "auto") == "torch" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    forced = os.environ.get(env, "auto")
    have = cpu_flags()
    for isa in needs if forced == "auto" else (forced,):
        if isa in needs and needs[isa] <= have:
            return isa
    if forced != "auto":
        logger.warning("%s=%s: not one of %s, or this CPU lacks it; %s", env, forced, ", ".join([*needs, *also]),
                       fallback)
    return None


def row_kernel_isa() -> str | None:
    """The instruction set o3edge's row kernels and native step are built for: "avx512" (AVX-512 VNNI), "avxvnni"
    (AVX-VNNI) or "avx2", the widest this x86-64 CPU has, or O3EDGE_CPU_ISA's where the CPU has it; None where
    none runs (O3EDGE_CPU_KERNELS=torch, a CPU without AVX2 and FMA, not x86-64, or an O3EDGE_CPU_ISA o3edge does
    not know or this CPU lacks: logged; torch's kernels there)."""
    return choose_isa(ROW_KERNEL_NEEDS, "O3EDGE_CPU_ISA", "torch's kernels")


def why_no_vnni_kernels() -> str | None:
    """Why o3edge's VNNI kernels cannot run here (switched off, not x86-64, flags missing), or None (they run, built
    for row_kernel_isa())."""
    if os.environ.get("O3EDGE_CPU_KERNELS", "auto") == "torch":
        return "O3EDGE_CPU_KERNELS=torch"
    if platform.machine() not in ("x86_64", "AMD64"):
        return "this CPU lacks x86-64"
    if row_kernel_isa() is not None:
        return None
    forced = os.environ.get("O3EDGE_CPU_ISA", "auto")
    if forced != "auto":
        return f"O3EDGE_CPU_ISA={forced} (unknown, or this CPU lacks it)"
    missing = (", ".join(sorted(need - cpu_flags())) for need in ROW_KERNEL_NEEDS.values())
    return "this CPU lacks " + " and ".join(missing)
