"""o3edge's own CPU kernels (cpu_kernels.cpp), built for this machine on first use and cached.

Kernels for the CPU presets, written for AVX-512 VNNI (`vpdpbusd`: 64 int8 products a
instruction): `int8_linear` and `int4_linear` (weight-only INT8 per row / INT4 per group, activations
quantized per group of columns to int8 on entry; weights laid out 16 rows at a time, so one 64-byte
load feeds 16 output rows) and `span_attention` (a decode step's KV write and attention over each
sequence's live prefix, no Python per call), and `router_decode_attention` (cpu_router.cpp: the token router's
decoding queries over full-precision and compressed keys at once). They are torch operators (`torch.ops.o3edge_cpu.*`) with
shape functions, so torch.compile traces them into the compiled decode step. The same library holds the
native decode step (cpu_step.cpp, `torch.classes.o3edge_cpu.DecodeModel`, see cpu_step.py), which runs the
row kernels of cpu_kernels.h for a whole step.

The library is compiled with g++ (-O3 -march=native) by torch.utils.cpp_extension (ninja) into
<user cache>/o3edge/cpu_ext/<hash of source and torch version>, about 30 s once; later processes load
it in milliseconds. Where the CPU lacks AVX-512 VNNI, or no compiler is found, or
O3EDGE_CPU_KERNELS=torch, `available()` is False and the engines keep torch's kernels (fbgemm, int4pack).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
from pathlib import Path

import torch

from o3edge.engine.cpu_features import why_no_vnni_kernels
from o3edge.paths import user_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
# the step: cpu_step.cpp binds cpu_core.cpp (which native_lib.py also builds without torch) for cpu_step.py
SOURCES = [SOURCE, SOURCE.with_name("cpu_step.cpp"), SOURCE.with_name("cpu_core.cpp"), SOURCE.with_name("cpu_core.h"),
           SOURCE.with_name("cpu_kernels.h"), SOURCE.with_name("cpu_router.cpp"), SOURCE.with_name("cpu_attend.h")]
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
if os.environ.get("O3EDGE_CPU_PROFILE") == "1":  # the native step's phase timers (tools/profile_cpu_step.py)
    _CFLAGS.append("-DO3_PROFILE")


def build_dir() -> Path:
    """<XDG cache or ~/.cache>/o3edge/cpu_ext/<hash>: one build per source, torch version and flags."""
    source = b"".join(p.read_bytes() for p in SOURCES)
    key = hashlib.sha256(source + torch.__version__.encode() + " ".join(_CFLAGS).encode())
    return user_cache_dir() / "cpu_ext" / key.hexdigest()[:16]


def reads_cache(kv_cache: torch.Tensor) -> bool:
    """Whether o3edge's C++ decode attention (cpu_attend.h: span_attention, router_decode_attention) reads this
    cache: a CPU tensor of float32, bfloat16 or float16 whose head_dim its 16-float vectors tile (at most 256),
    where the kernels build."""
    head_dim = kv_cache.shape[-1]
    return (kv_cache.device.type == "cpu" and kv_cache.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and head_dim % 16 == 0 and head_dim <= 256 and available())


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the kernels; False where they cannot run here."""
    why = why_no_vnni_kernels()
    if why is not None:
        log.info("o3edge CPU kernels off: %s", why)
        return False
    try:
        from torch.utils.cpp_extension import load

        path = build_dir()
        path.mkdir(parents=True, exist_ok=True)
        with open(path / "build.lock", "w") as guard:
            # o3edge's processes build one at a time under a lock the kernel drops when its holder dies; torch's own
            # lock file, which a process killed mid-build leaves behind (every later load then waited on it for
            # ever), is only ever a dead builder's here and is removed
            fcntl.flock(guard, fcntl.LOCK_EX)
            (path / "lock").unlink(missing_ok=True)
            load(name="o3edge_cpu_" + path.name, sources=[str(p) for p in SOURCES if p.suffix == ".cpp"],
                 build_directory=str(path), extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"], is_python_module=False,
                 verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: torch's kernels still work
        log.warning("o3edge CPU kernels unavailable (%s); using torch's kernels", str(exc).splitlines()[0][:200])
        return False
    _register_fakes()
    return True


_FAKES: list[bool] = []


def _register_fakes() -> None:
    """Output shapes of the operators, for torch.compile's tracing (once per process)."""
    if _FAKES:
        return
    _FAKES.append(True)

    @torch.library.register_fake("o3edge_cpu::span_attention")
    def _(q, k, v, kv_cache, layer, slots, positions):
        return torch.empty_like(q)

    @torch.library.register_fake("o3edge_cpu::int8_linear")
    def _(x, packed, wsum, scales, group_size):
        return x.new_empty(*x.shape[:-1], packed.shape[0] * 16, dtype=torch.float32)

    @torch.library.register_fake("o3edge_cpu::int4_linear")
    def _(x, packed, scales, zeros, group_size, out_features):
        return x.new_empty(*x.shape[:-1], out_features, dtype=torch.float32)


def activation_group(in_features: int) -> int:
    """The group of input columns that share one int8 activation scale: 32 where K allows, else 16, 8, 4."""
    return next((g for g in (32, 16, 8, 4) if in_features % g == 0), 0)
