"""Compile the CUDA decode step's Triton kernels for a GPU that is not here (default: Hopper, sm_90).

Development machines and CI have no GPU, and Triton's interpreter (which runs the kernels there) skips
everything only the compiler sees: PTX-only features such as programmatic dependent launch, register
and shared-memory limits, constexpr branches the interpreter never takes. This tool calls each kernel's
own Python wrapper on small CPU tensors, catches the launch, and compiles that exact launch (same
arguments, same constexprs) to PTX and a cubin with Triton's bundled ptxas, as the GPU machine would.

    python tools/compile_kernels.py            # compile all, print one line per kernel
    python tools/compile_kernels.py --pdl 0    # without programmatic dependent launch
    python tools/compile_kernels.py --arch 87 --pdl 0   # for a Jetson Orin (sm_87; 86: RTX 30, 89: RTX 40)

Must run without TRITON_INTERPRET (it unsets it for itself when run as a script).
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

class Launches:
    """Stands in for the GPU while a wrapper runs: kernel[grid](...) compiles instead of launching."""

    def __init__(self, target: GPUTarget):
        self.target, self.compiled = target, []

    def patch(self, module, name: str):
        kernel = getattr(module, name)
        outer = self

        class _Launch:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    outer.compile(kernel, args, kwargs)
                return launch

        setattr(module, name, _Launch())
        return kernel

    def compile(self, kernel, args, kwargs):
        """Specialize the launch as Triton's own launcher does (types, 16-byte alignment and divisibility
        of pointers and integers, constexprs), then compile it for the target."""
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        backend = make_backend(self.target)
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=self.target,
                                  options=options.__dict__)
        self.compiled.append((kernel.fn.__name__, kwargs.get("PDL"), compiled))


def _run_wrappers() -> None:
    """Every kernel family of the CUDA step, at the shapes that pick each code path."""
    from o3edge.engine.kernels.activation import silu_mul
    from o3edge.engine.kernels.argmax import float_logits_and_argmax
    from o3edge.engine.kernels.decode_attention import decode_attention
    from o3edge.engine.kernels.gemv import skinny_matmul
    from o3edge.engine.kernels.int4_matmul import dequantize
    from o3edge.engine.kernels.norm import add_rmsnorm
    from o3edge.engine.quant import quantize_int4

    h, K, N = torch.float16, 2048, 2560
    w = torch.zeros(N, K, dtype=h)
    nw = torch.zeros(K, dtype=h)
    q, sz = quantize_int4(torch.zeros(N, K), 64)
    for M in (1, 4):
        x = torch.zeros(M, K, dtype=h)
        skinny_matmul(x, w, norm_weight=nw, residual=x, eps=1e-6)
        skinny_matmul(torch.zeros(M, 2 * K, dtype=h), w, silu=True)
        skinny_matmul(torch.zeros(M, 5632, dtype=h), torch.zeros(N, 5632, dtype=h))  # split K
        skinny_matmul(x, q, scales_and_zeros=sz.to(torch.bfloat16), group_size=64, out_features=N)
    skinny_matmul(torch.zeros(1, 5632 * 2, dtype=h), torch.zeros(N, 5632, dtype=h), silu=True)  # one row: streamed
    skinny_matmul(torch.zeros(1, K, dtype=torch.bfloat16), q, scales_and_zeros=sz.to(torch.bfloat16), group_size=64,
                  out_features=N)  # INT4 one row, bfloat16 (the packed dot's other instruction set)
    dequantize(q, sz.to(torch.bfloat16), 64, K, h)
    from o3edge.engine.kernels.int8_matmul import dequantize as dequantize_int8

    q8, s8 = torch.zeros(N, K, dtype=torch.int8), torch.ones(N)
    for x in (torch.zeros(1, K, dtype=h), torch.zeros(1, K, dtype=torch.bfloat16), torch.zeros(4, K, dtype=h)):
        skinny_matmul(x, q8, scales8=s8)  # INT8: one row streamed as words of four codes (both half types), tiles
    dequantize_int8(q8, s8, h)
    H, KVH, HD, bs = 32, 4, 64, 16
    qkv = torch.zeros(2, (H + 2 * KVH) * HD, dtype=h)
    cos = torch.zeros(64, HD)
    meta = torch.zeros(2, 3 + 4, dtype=torch.int32)
    cache = torch.zeros(64, KVH, HD, dtype=h)
    for splits in (1, 4):
        decode_attention(qkv, cos, cos, meta, cache, cache, H, bs, splits)
    decode_attention(qkv, cos, cos, meta, cache, cache, H, bs, 1, torch.zeros(HD, dtype=h), torch.zeros(HD, dtype=h))
    from o3edge.engine.kernels.quant_attention import router_decode_attention
    from o3edge.engine.kv_quant import hadamard, quantize

    router_meta = torch.zeros(2, 5 + 2 * 4, dtype=torch.int32)
    for mode, rot in (("int8", None), ("int4", hadamard(HD))):
        codes, scales = quantize(torch.zeros(2, 4 * bs, KVH, HD), mode, rot)
        mass = torch.zeros(2, KVH, 2, 8 * bs)
        for splits in (1, 3):
            router_decode_attention(qkv, cos, cos, router_meta, cache, cache, codes, scales, rot, mode, H, bs, splits)
        # a refresh step: the attention kernel observes (one key split)
        router_decode_attention(qkv, cos, cos, router_meta, cache, cache, codes, scales, rot, mode, H, bs, 1, mass=mass)
    halves = os.environ.get("O3EDGE_ROUTER_HALVES")
    os.environ["O3EDGE_ROUTER_HALVES"] = "0"  # INT4's codes interleaved (O3EDGE_ROUTER_HALVES=0, to measure against)
    try:
        router_decode_attention(qkv, cos, cos, router_meta, cache, cache, codes, scales, rot, "int4", H, bs, 3)
    finally:
        if halves is None:
            del os.environ["O3EDGE_ROUTER_HALVES"]
        else:
            os.environ["O3EDGE_ROUTER_HALVES"] = halves
    float_logits_and_argmax(torch.zeros(2, 32000, dtype=h))
    from o3edge.engine.kernels.embedding import embed_rows

    embed_rows(torch.zeros(32000, K, dtype=h), meta, torch.zeros(2, dtype=torch.long))  # a launched-ahead step's input
    add_rmsnorm(torch.zeros(4, K, dtype=h), torch.zeros(4, K, dtype=h), nw, 1e-6)
    silu_mul(torch.zeros(4, 2 * K, dtype=h))


KERNELS = {
    "o3edge.engine.kernels.gemv": ["_skinny_kernel", "_row_stream_kernel"],
    "o3edge.engine.kernels.decode_attention": ["_decode_attention_kernel", "_merge_splits_kernel"],
    "o3edge.engine.kernels.argmax": ["_chunk_argmax_kernel", "_pick_chunk_kernel"],
    "o3edge.engine.kernels.embedding": ["_embed_rows_kernel"],
    "o3edge.engine.kernels.quant_attention": ["_router_decode_kernel"],
    "o3edge.engine.kernels.norm": ["_add_rmsnorm_kernel"],
    "o3edge.engine.kernels.activation": ["_silu_mul_kernel"],
    "o3edge.engine.kernels.int4_matmul": ["_dequantize_kernel"],
    "o3edge.engine.kernels.int8_matmul": ["_dequantize_kernel"],
}


def compile_all(pdl: bool = True, arch: int = 90) -> list:
    """[(kernel name, PDL, compiled kernel)] for every launch of the step's wrappers."""
    import importlib

    from o3edge.engine.kernels import pdl as pdl_module

    from o3edge.engine.kernels import gemv

    launches = Launches(GPUTarget("cuda", arch, 32))
    enabled, pdl_module.enabled = pdl_module.enabled, lambda device: pdl  # as on a GPU of that generation
    packed, gemv.packed_int4 = gemv.packed_int4, lambda x: x.dtype in (torch.float16, torch.bfloat16)
    saved = []
    for mod_name, names in KERNELS.items():
        mod = importlib.import_module(mod_name)
        saved += [(mod, n, launches.patch(mod, n)) for n in names]
    try:
        _run_wrappers()
    finally:
        for mod, n, kernel in saved:
            setattr(mod, n, kernel)
        pdl_module.enabled = enabled
        gemv.packed_int4 = packed
    return launches.compiled


def resources(compiled, arch: int = 90) -> tuple[int, int]:
    """(registers per thread, spill store bytes) of a compiled kernel, from ptxas's own report."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(compiled.asm["ptx"])
        f.flush()
        name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"  # the "a" (arch-specific) targets start at Hopper
        report = subprocess.run([str(ptxas), "-v", f"--gpu-name={name}", f.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return int(regs.group(1)) if regs else 0, int(spills.group(1)) if spills else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pdl", type=int, default=1)
    ap.add_argument("--arch", type=int, default=90)
    args = ap.parse_args(argv)
    for name, pdl, k in compile_all(bool(args.pdl), args.arch):
        regs, spills = resources(k, args.arch)
        print(f"{name:28s} PDL={pdl!s:5s} regs={regs:3d} spill bytes={spills:4d} shared={k.metadata.shared}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
