"""o3edge's native CPU step (cpu_core.cpp) without torch: compiled with g++ on first use, called through ctypes.

The step is the one the torch backend's DecodeModel runs (cpu_step.cpp binds the same cpu_core.cpp), so a
process that serves a quantized engine this way never imports torch (~218 MB of resident memory). The library
is built for cpu_features.row_kernel_isa(), with `g++ -O3 -march=native -fopenmp` on AVX-512 VNNI, or for
AVX-VNNI or AVX2 with cpu_features.NARROW_FLAGS' (O3EDGE_CPU_ISA picks one), into <XDG cache or ~/.cache>/o3edge/native/
<hash of sources, flags and CPU>/libo3core.so, a few seconds once; later processes load it in milliseconds. Where the
CPU has none of them, no compiler is found, the build fails, or O3EDGE_CPU_KERNELS=torch, `available()` is False.

A step releases the GIL while it runs (ctypes); its threads are OpenMP's (threads <= 0: OMP_NUM_THREADS, else
the CPUs this process may run on). Two steps must not write one KV cache at once.

Also here: the weight packers of the VNNI layouts (cpu_kernels.h) in NumPy, equal to the torch operators
int4_pack_rows16 and int8_pack_rows16 and to cpu_quant.group_sums. Only numpy, ctypes and the standard library:
importing this module must not import torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from o3edge.engine.cpu_features import NARROW_FLAGS, cpu_flags, row_kernel_isa, why_no_vnni_kernels
from o3edge.paths import user_cache_dir

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCE = _HERE / "cpu_core.cpp"
SOURCES = [SOURCE, _HERE / "cpu_core.h", _HERE / "cpu_kernels.h", _HERE / "cpu_vec.h"]  # in the build's hash
_CFLAGS = ["-O3", "-fopenmp", "-std=c++17", "-shared", "-fPIC"]
if os.environ.get("O3EDGE_CPU_PROFILE") == "1":  # the step's phase timers (as cpu_ext.py)
    _CFLAGS.append("-DO3_PROFILE")
ISA_FLAGS = {"avx512": ["-march=native"], **NARROW_FLAGS}  # per instruction set (row_kernel_isa)
_ERR_BYTES = 512


def build_flags(isa: str | None = None) -> list[str]:
    """g++ flags of the library for isa (None: row_kernel_isa(), or the AVX-512 VNNI ones where that is None)."""
    return _CFLAGS + ISA_FLAGS[isa or row_kernel_isa() or "avx512"]


def build_path(isa: str | None = None) -> Path:
    """<XDG cache or ~/.cache>/o3edge/native/<hash>/libo3core.so: one build per source, flags (so per instruction
    set) and CPU (-march=native: a cache shared with another kind of CPU must not hand it instructions it lacks)."""
    flags = " ".join(build_flags(isa) + sorted(cpu_flags()))
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + flags.encode())
    return user_cache_dir() / "native" / key.hexdigest()[:16] / "libo3core.so"


def _build(lib: Path, flags: list[str]) -> None:
    """Compile cpu_core.cpp into lib: to a temporary name, then renamed, so a concurrent process never loads
    half a file."""
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++) found")
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".libo3core-", suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        done = subprocess.run([cxx, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def _lib() -> ctypes.CDLL | None:
    """The loaded library (built first where no build is cached), or None where it cannot run here."""
    why = why_no_vnni_kernels()
    if why is not None:
        log.info("o3edge native step off: %s", why)
        return None
    isa = row_kernel_isa()
    try:
        path = build_path(isa)
        if not path.exists():
            _build(path, build_flags(isa))
        lib = ctypes.CDLL(str(path))
    except Exception as exc:  # no compiler, a build error, an unloadable library
        log.warning("o3edge native step unavailable: %s", str(exc)[:2000])
        return None
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.o3_check_model.argtypes = [ctypes.POINTER(_Model), ctypes.c_char_p, i64]
    lib.o3_check_model.restype = c_int
    lib.o3_step.argtypes = [ctypes.POINTER(_Model), i64, p, p, p, p, i64, i64, p, p, i64, p, i64, i64, p, p, c_int,
                            ctypes.c_char_p, i64]
    lib.o3_step.restype = c_int
    log.info("o3edge native step built for %s", isa)
    return lib


@functools.cache
def available() -> bool:
    """Whether the native step runs here (builds or loads the library on first call; False, logged, if not)."""
    return _lib() is not None


# ---- the C structs of cpu_core.h ---------------------------------------------------------------------------

class _Linear(ctypes.Structure):
    _fields_ = [("int4", ctypes.c_int32), ("w", ctypes.c_void_p), ("a", ctypes.c_void_p), ("b", ctypes.c_void_p),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("Kp", ctypes.c_int64), ("G", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear),
                ("down", _Linear)]


class _Model(ctypes.Structure):
    _fields_ = [("L", ctypes.c_int64), ("H", ctypes.c_int64), ("KVH", ctypes.c_int64), ("hd", ctypes.c_int64),
                ("D", ctypes.c_int64), ("I", ctypes.c_int64), ("V", ctypes.c_int64), ("eps", ctypes.c_double),
                ("embed", ctypes.c_void_p), ("norm", ctypes.c_void_p), ("layers", ctypes.POINTER(_Layer)),
                ("lm_head", _Linear)]


@dataclass
class Linear:
    """One quantized layer (W [N, K]) in the packed layouts of cpu_kernels.h, C-contiguous NumPy arrays.
    int8: w int8 [N/16, K/4, 64], a = wsum int32 [K/G, N], b = scales float32 [N], Kp = K, G = activation group.
    int4: w uint8 [N/16, Kp/8, 64], a = scales, b = zeros: bf16 bits (uint16) [Kp/G, N], G = weight group."""

    int4: bool
    w: np.ndarray
    a: np.ndarray
    b: np.ndarray
    N: int
    K: int
    Kp: int
    G: int


ALIGN = 64  # bytes: the kernels load weights and scales 64 bytes at a time


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on a 64-byte boundary. NumPy's own large arrays start
    16 bytes into a page (glibc's chunk header), so every 64-byte load of the kernels would straddle two cache
    lines: decode ran 5-13% slower than the torch backend's step on the same weights (torch aligns to 64)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def aligned(a: np.ndarray) -> np.ndarray:
    """a itself when C-contiguous and 64-byte aligned, else an aligned copy."""
    if a.flags.c_contiguous and a.ctypes.data % ALIGN == 0:
        return a
    out = aligned_empty(a.shape, a.dtype)
    out[...] = a
    return out


def _array(a: np.ndarray, dtype, size: int, what: str) -> np.ndarray:
    """a as a C-contiguous array of dtype and `size` elements (bf16 bits may come as int16), else ValueError."""
    a = np.asarray(a)
    if dtype == np.uint16 and a.dtype == np.int16:
        a = a.view(np.uint16)
    if a.dtype != dtype or a.size != size:
        raise ValueError(f"{what}: {a.dtype} of {a.size} elements, expected {np.dtype(dtype)} of {size}")
    return np.ascontiguousarray(a)


class Model:
    """A quantized llama-family decoder for the native step. The arrays are referenced, not copied (the C structs
    hold their addresses): keep them unchanged while the model lives."""

    def __init__(self, embed: np.ndarray, norm: np.ndarray, layers: list[dict], lm_head: Linear, H: int, KVH: int,
                 hd: int, eps: float):
        lib = _lib()
        if lib is None:
            raise RuntimeError("the native step is unavailable here (see native_lib.available)")
        self._lib, self._keep = lib, []
        embed = np.asarray(embed)
        if embed.ndim != 2:
            raise ValueError(f"embed must be [V, D], got shape {embed.shape}")
        V, D = embed.shape
        self.V, self.D, self.L, self.H, self.KVH, self.hd = V, D, len(layers), H, KVH, hd
        I = layers[0]["down"].K if layers else 1
        self._layers = (_Layer * max(1, len(layers)))()
        for i, spec in enumerate(layers):
            norms = [self._floats(spec.get(k), n, f"layer {i} {k}") for k, n in
                     (("input_norm", D), ("post_norm", D), ("q_norm", hd), ("k_norm", hd))]
            self._layers[i] = _Layer(*norms, *(self._linear(spec[k], f"layer {i} {k}")
                                               for k in ("qkv", "o", "gate_up", "down")))
        self._model = _Model(len(layers), H, KVH, hd, D, I, V, float(eps),
                             self._floats(embed, V * D, "embed"), self._floats(norm, D, "norm"),
                             ctypes.cast(self._layers, ctypes.POINTER(_Layer)), self._linear(lm_head, "lm_head"))
        err = ctypes.create_string_buffer(_ERR_BYTES)
        if lib.o3_check_model(ctypes.byref(self._model), err, _ERR_BYTES) != 0:
            raise ValueError(err.value.decode(errors="replace"))

    @property
    def nbytes(self) -> int:
        """Bytes of the model's arrays (the embedding counted whole, though only rows that are read are resident
        when it is a view of the engine file)."""
        return sum(a.nbytes for a in self._keep)

    def _floats(self, a: np.ndarray | None, size: int, what: str) -> int | None:
        """The address of a float32 array (kept alive), None for None."""
        if a is None:
            return None
        a = _array(a, np.float32, size, what)
        self._keep.append(a)
        return a.ctypes.data

    def _linear(self, l: Linear, what: str) -> _Linear:
        if l.N <= 0 or l.Kp <= 0 or l.G <= 0 or l.Kp % l.G:
            raise ValueError(f"{what}: bad shape N={l.N} Kp={l.Kp} G={l.G}")
        groups = l.Kp // l.G * l.N
        if l.int4:
            w = _array(l.w, np.uint8, l.N * l.Kp // 2, what + " weight")
            a, b = _array(l.a, np.uint16, groups, what + " scales"), _array(l.b, np.uint16, groups, what + " zeros")
        else:
            w = _array(l.w, np.int8, l.N * l.K, what + " weight")
            a, b = _array(l.a, np.int32, groups, what + " wsum"), _array(l.b, np.float32, l.N, what + " scales")
        w, a, b = aligned(w), aligned(a), aligned(b)  # the packers' outputs already are: no copy for those
        self._keep += [w, a, b]
        return _Linear(int(bool(l.int4)), w.ctypes.data, a.ctypes.data, b.ctypes.data, l.N, l.K, l.Kp, l.G)

    def step(self, ids, positions, slots, tables, block_size: int, cos: np.ndarray, sin: np.ndarray,
             kv_cache: np.ndarray, logit_rows, threads: int = 0, out: np.ndarray | None = None) -> np.ndarray:
        """One step of B rows (cpu_core.h's o3_step): ids, positions, slots int64 [B], tables int64 [B, width],
        cos, sin float32 [rope_len, hd], kv_cache float32 [L, 2, S, KVH, hd] (written) -> logits float32
        [R, V] of the rows logit_rows [R] (None: every row; into `out` when given). ValueError for input out
        of range."""
        ids, positions, slots = _int64s(ids, "ids"), _int64s(positions, "positions"), _int64s(slots, "slots")
        B = len(ids)
        rows = np.arange(B, dtype=np.int64) if logit_rows is None else _int64s(logit_rows, "logit_rows")
        R = len(rows)
        tables = np.ascontiguousarray(tables, dtype=np.int64)
        if len(positions) != B or len(slots) != B or tables.ndim != 2 or tables.shape[0] != B:
            raise ValueError(f"step: {B} ids, {len(positions)} positions, {len(slots)} slots, tables "
                             f"{tables.shape}: expected [B] each and tables [B, width]")
        for name, t in (("cos", cos), ("sin", sin)):
            if t.dtype != np.float32 or t.ndim != 2 or t.shape[1] != self.hd or not t.flags.c_contiguous:
                raise ValueError(f"{name}: expected C-contiguous float32 [rope_len, {self.hd}]")
        if sin.shape != cos.shape:
            raise ValueError("cos and sin differ in shape")
        kv = kv_cache
        if (kv.dtype != np.float32 or kv.ndim != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4])
                != (self.L, 2, self.KVH, self.hd) or not kv.flags.c_contiguous or not kv.flags.writeable):
            raise ValueError(f"kv_cache: expected writable C-contiguous float32 [{self.L}, 2, S, {self.KVH}, "
                             f"{self.hd}], got {kv.dtype} {kv.shape}")
        if out is None:
            out = np.empty((R, self.V), dtype=np.float32)
        elif (out.dtype != np.float32 or out.shape != (R, self.V) or not out.flags.c_contiguous
              or not out.flags.writeable):
            raise ValueError(f"out: expected writable C-contiguous float32 [{R}, {self.V}]")
        err = ctypes.create_string_buffer(_ERR_BYTES)
        rc = self._lib.o3_step(ctypes.byref(self._model), B, ids.ctypes.data, positions.ctypes.data,
                               slots.ctypes.data, tables.ctypes.data, tables.shape[1], block_size, cos.ctypes.data,
                               sin.ctypes.data, cos.shape[0], kv.ctypes.data, kv.shape[2], R, rows.ctypes.data,
                               out.ctypes.data, threads, err, _ERR_BYTES)
        if rc != 0:
            raise ValueError(err.value.decode(errors="replace"))
        return out


def _int64s(a, what: str) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.int64)
    if a.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D int64 array, got shape {a.shape}")
    return a


# ---- packers: the VNNI layouts of cpu_kernels.h, from the engine file's quantized weights ------------------

def pack_int4_rows16(qweight: np.ndarray, chunk_bytes: int = 1 << 22) -> np.ndarray:
    """qweight uint8 [N, Kp/2] (column 2i the high nibble, 2i+1 the low) -> rows16 uint8 [N/16, Kp/8, 64]:
    byte r*4+j of block (rb, o) = q[rb*16+r][8o+j] | q[rb*16+r][8o+4+j] << 4 (torch's int4_pack_rows16)."""
    N, half = qweight.shape
    Kp = half * 2
    if N % 16 or Kp % 8:
        raise ValueError(f"pack_int4_rows16: N ({N}) must be a multiple of 16 and Kp ({Kp}) of 8")
    out = aligned_empty((N // 16, Kp // 8, 64), np.uint8)
    step = max(16, chunk_bytes // max(1, Kp) // 16 * 16)  # rows a chunk: the unpacked copy stays ~chunk_bytes
    for n0 in range(0, N, step):
        rows = np.asarray(qweight[n0:n0 + step], dtype=np.uint8)
        n = rows.shape[0]
        q = np.empty((n, Kp), dtype=np.uint8)  # one nibble a byte
        q[:, 0::2] = rows >> 4
        q[:, 1::2] = rows & 0x0F
        q = q.reshape(n // 16, 16, Kp // 8, 8)
        packed = q[..., :4] | (q[..., 4:] << 4)  # [n/16, 16, Kp/8, 4]
        out[n0 // 16:(n0 + n) // 16] = packed.transpose(0, 2, 1, 3).reshape(n // 16, Kp // 8, 64)
    return out


def pack_int8_rows16(q: np.ndarray) -> np.ndarray:
    """q int8 [N, K] -> int8 [N/16, K/4, 64]: byte r*4+j of block (rb, o) = q[rb*16+r][4o+j]."""
    N, K = q.shape
    if N % 16 or K % 4:
        raise ValueError(f"pack_int8_rows16: N ({N}) must be a multiple of 16 and K ({K}) of 4")
    blocks = np.asarray(q, dtype=np.int8).reshape(N // 16, 16, K // 4, 4).transpose(0, 2, 1, 3)
    out = aligned_empty((N // 16, K // 4, 64), np.int8)
    out.reshape(N // 16, K // 4, 16, 4)[...] = blocks
    return out


def group_sums(q: np.ndarray, group: int, chunk: int = 4096) -> np.ndarray:
    """q int8 [N, K] -> int32 [K / group, N]: each row's weight sum per group of columns (a few rows at a time,
    as cpu_quant.group_sums)."""
    N, K = q.shape
    out = aligned_empty((K // group, N), np.int32)
    for i in range(0, N, chunk):
        out[:, i:i + chunk] = q[i:i + chunk].reshape(-1, K // group, group).sum(-1, dtype=np.int32).T
    return out


def activation_group(in_features: int) -> int:
    """Input columns per int8 activation scale: 32 where K allows, else 16, 8, 4 (0: none fits)."""
    return next((g for g in (32, 16, 8, 4) if in_features % g == 0), 0)
