"""o3edge's own CPU kernels, built for this machine on first use and cached: two libraries.

The row kernels (cpu_kernels.cpp), written for VNNI (`vpdpbusd`: int8 products summed four to an int32 lane):
`int8_linear` and `int4_linear` (weight-only INT8 per row / INT4 per group, activations quantized per group of
columns to int8 on entry; weights laid out 16 rows at a time, so one 64-byte load feeds 16 output rows). The same
library holds the native decode step (cpu_step.cpp, `torch.classes.o3edge_cpu.DecodeModel`, see cpu_step.py),
which runs the row kernels of cpu_kernels.h for a whole step. Built for cpu_features.row_kernel_isa(): AVX-512
VNNI (for this machine, -march=native), else AVX-VNNI (the same code on two 256-bit halves, cpu_vec.h; compiled
for Alder Lake's instructions, not for this machine), else AVX2 (the halves again, vpdpbusd's byte products made of
vpmaddubsw and vpmaddwd; compiled for Haswell's instructions); O3EDGE_CPU_ISA=avx512|avxvnni|avx2 picks one where
the CPU has it. `available()`: where one of them builds and runs.

The decode attention (cpu_span.cpp, cpu_router.cpp, their loops in cpu_attend.h): `span_attention` (a decode
step's KV write and attention over each sequence's live prefix, no Python per call) and `router_decode_attention`
(the token router's decoding queries over full-precision and compressed keys at once). They need no VNNI, only
ATen's vectors, and are built for the widest this CPU has: AVX-512 or AVX2 (`attention_isa()`;
`attention_available()`), so an AVX2-only machine runs them too. O3EDGE_CPU_ATTN_ISA=avx2|avx512 builds that
width instead, where the CPU has it (avx2 for any x86-64 CPU with AVX2 and FMA, compiled for Haswell, not for
this machine: what an AVX2-only machine runs), =off keeps torch's operations.

All are torch operators (`torch.ops.o3edge_cpu.*`) with shape functions, so torch.compile traces them into the
compiled decode step. Each library is compiled with g++ (-O3) by torch.utils.cpp_extension (ninja) into
<user cache>/o3edge/cpu_ext/<hash of source, torch version and flags>, 10-30 s once; later processes load it in
milliseconds. Where a library cannot build or run here (the CPU lacks its instructions, no compiler, or
O3EDGE_CPU_KERNELS=torch), the engines keep torch's kernels (fbgemm, int4pack) and operations.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

from o3edge.engine.cpu_features import NARROW_FLAGS, choose_isa, row_kernel_isa, why_no_vnni_kernels
from o3edge.paths import user_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# the step: cpu_step.cpp binds cpu_core.cpp (which native_lib.py also builds without torch) for cpu_step.py
SOURCES = [SOURCE, SOURCE.with_name("cpu_step.cpp"), SOURCE.with_name("cpu_core.cpp"), SOURCE.with_name("cpu_core.h"),
           SOURCE.with_name("cpu_kernels.h"), SOURCE.with_name("cpu_vec.h")]
ATTENTION_SOURCES = [SOURCE.with_name("cpu_span.cpp"), SOURCE.with_name("cpu_router.cpp"),
                     SOURCE.with_name("cpu_attend.h")]
# ATen's vectors take their width from CPU_CAPABILITY_*
_AVX512 = ["-O3", "-march=native", "-fopenmp", "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
_PROFILE = ["-DO3_PROFILE"] if os.environ.get("O3EDGE_CPU_PROFILE") == "1" else []  # tools/profile_cpu_step.py
ISA_NEEDS = {"avx512": {"avx512f"}, "avx2": {"avx2", "fma"}}  # what each attention build runs on


def row_flags(isa: str | None) -> list[str]:
    """g++ flags of the row kernels and the step for row_kernel_isa()'s isa (None: the AVX-512 VNNI ones)."""
    if isa in NARROW_FLAGS:
        return ["-O3", "-fopenmp", *NARROW_FLAGS[isa], "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2", *_PROFILE]
    return [*_AVX512, *_PROFILE]


def build_dir(sources: list[Path] = SOURCES, flags: list[str] | None = None) -> Path:
    """<XDG cache or ~/.cache>/o3edge/cpu_ext/<hash>: one build per source, torch version and flags (None: the row
    library's for row_kernel_isa(), so one build per instruction set)."""
    if flags is None:
        flags = row_flags(row_kernel_isa())
    source = b"".join(p.read_bytes() for p in sources)
    key = hashlib.sha256(source + torch.__version__.encode() + " ".join(flags).encode())
    return user_cache_dir() / "cpu_ext" / key.hexdigest()[:16]


def attention_isa() -> str | None:
    """The vector width the attention library is built for: "avx512" or "avx2" (the widest this x86-64 CPU has,
    or O3EDGE_CPU_ATTN_ISA's where the CPU has it), None where it is not built (O3EDGE_CPU_ATTN_ISA=off,
    O3EDGE_CPU_KERNELS=torch, a CPU with neither width, or not x86-64: torch's operations there)."""
    if os.environ.get("O3EDGE_CPU_ATTN_ISA") == "off":
        return None
    return choose_isa(ISA_NEEDS, "O3EDGE_CPU_ATTN_ISA", "torch's operations", also=("off",), logger=log)


def attention_flags(isa: str) -> list[str]:
    """g++ flags of the attention library for isa: the widest is built for this machine (-march=native), AVX2 for
    any x86-64 CPU with AVX2 and FMA (Haswell's instructions: on a machine with more, exactly what an AVX2-only
    one runs)."""
    if isa == "avx512":
        return _AVX512
    return ["-O3", "-march=haswell", "-fopenmp", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]


def reads_cache(kv_cache: torch.Tensor) -> bool:
    """Whether o3edge's C++ decode attention (cpu_attend.h: span_attention, router_decode_attention) reads this
    cache: a CPU tensor of float32, bfloat16 or float16 whose head_dim its vectors tile (a multiple of 16, at most
    256), where the attention library builds (attention_available)."""
    head_dim = kv_cache.shape[-1]
    return (kv_cache.device.type == "cpu" and kv_cache.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and head_dim % 16 == 0 and head_dim <= 256 and attention_available())


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the VNNI row kernels and the native step; False where they cannot run
    here."""
    why = why_no_vnni_kernels()
    if why is not None:
        log.info("o3edge CPU kernels off: %s", why)
        return False
    isa = row_kernel_isa()
    if not _build("o3edge_cpu_", SOURCES, row_flags(isa)):
        return False
    log.info("o3edge CPU kernels built for %s", isa)
    _register_fakes()
    return True


@functools.cache
def attention_available() -> bool:
    """Build (or load the cached build of) the decode attention for attention_isa(); False where it is not built
    or cannot build."""
    isa = attention_isa()
    if isa is None:
        log.info("o3edge CPU attention off (O3EDGE_CPU_ATTN_ISA, O3EDGE_CPU_KERNELS=torch, no AVX2, or not x86-64): "
                 "torch's operations")
        return False
    if not _build("o3edge_cpu_attn_", ATTENTION_SOURCES, attention_flags(isa)):
        return False
    log.info("o3edge CPU attention built for %s", isa)
    _register_attention_fakes()
    return True


def _build(prefix: str, sources: list[Path], flags: list[str]) -> bool:
    """Load the library of sources built with flags (building it first, once per machine); False on a build error."""
    try:
        from torch.utils.cpp_extension import load

        path = build_dir(sources, flags)
        path.mkdir(parents=True, exist_ok=True)
        with open(path / "build.lock", "w") as guard:
            # o3edge's processes build one at a time under a lock the kernel drops when its holder dies; torch's own
            # lock file, which a process killed mid-build leaves behind (every later load then waited on it for
            # ever), is only ever a dead builder's here and is removed
            fcntl.flock(guard, fcntl.LOCK_EX)
            (path / "lock").unlink(missing_ok=True)
            load(name=prefix + path.name, sources=[str(p) for p in sources if p.suffix == ".cpp"],
                 build_directory=str(path), extra_cflags=flags, extra_ldflags=["-fopenmp"], is_python_module=False,
                 verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: torch's kernels still work
        log.warning("o3edge CPU kernels unavailable (%s); using torch's kernels", str(exc).splitlines()[0][:200])
        return False
    return True


_FAKES: list[bool] = []


def _register_fakes() -> None:
    """Output shapes of the operators, for torch.compile's tracing (once per process)."""
    if _FAKES:
        return
    _FAKES.append(True)

    @torch.library.register_fake("o3edge_cpu::int8_linear")
    def _(x, packed, wsum, scales, group_size):
        return x.new_empty(*x.shape[:-1], packed.shape[0] * 16, dtype=torch.float32)

    @torch.library.register_fake("o3edge_cpu::int4_linear")
    def _(x, packed, scales, zeros, group_size, out_features):
        return x.new_empty(*x.shape[:-1], out_features, dtype=torch.float32)


def _register_attention_fakes() -> None:
    """span_attention's output shape, for torch.compile's tracing (attention_available: once per process)."""

    @torch.library.register_fake("o3edge_cpu::span_attention")
    def _(q, k, v, kv_cache, layer, slots, positions):
        return torch.empty_like(q)


def activation_group(in_features: int) -> int:
    """The group of input columns that share one int8 activation scale: 32 where K allows, else 16, 8, 4."""
    return next((g for g in (32, 16, 8, 4) if in_features % g == 0), 0)
