#!/usr/bin/env python3
"""Compile o3edge's Triton kernels for the H200 (sm_90) on a machine without a GPU and count what they became.

GPU time is scarce; a kernel's registers, spills, shared memory, pipelined loads (cp.async) and
instruction mix can be read before any is spent. A stand-in CUDA driver reports an sm_90 target, the
kernel's own Python wrapper runs on CPU tensors (arguments are specialized as on a GPU: pointers and
strides divisible by 16), Triton compiles with its bundled ptxas, and the launch that follows fails
harmlessly. Counts are static (each instruction once, loops not unrolled), so they compare variants
of one kernel, not kernels with each other.

  python tools/kernel_sass.py gemv --rows 8 --n 11264 --k 2048 [--weights int4|int8|dense] [--env O3EDGE_INT4_ASM=0]
  python tools/kernel_sass.py router --mode int8 [--env O3EDGE_ROUTER_FAST=1]
  python tools/kernel_sass.py sampling --n 32000 --batch 8 [--env O3EDGE_TRITON_TOPK=0]
  python tools/kernel_sass.py attention --shape tinyllama-1.1b --batch 1 --splits 32 [--context 256]
  python tools/kernel_sass.py route --shape ref-long --batch 16 --context 4096
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.driver import CudaDriver, CudaLauncher  # noqa: E402
from triton.runtime import driver  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


class Sm90(CudaDriver):
    """A CUDA driver that compiles for sm_90 and has no device (launches fail after the compile)."""

    def __init__(self):  # CudaDriver's own loads libcuda
        self.launcher_cls, self.utils = CudaLauncher, None

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def report(kernel, name: str) -> dict:
    """Registers, spills, shared memory, global loads by kind and the SASS instruction mix of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        res = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", res)
    ops = collections.Counter(mm.group(1).split(".")[0] for mm in
                              re.finditer(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass))
    loads = collections.Counter(re.findall(r"(?:ld\.global|cp\.async\.c[ag])[\w.]*", kernel.asm["ptx"]))
    return dict(kernel=name, registers=int(m.group(1)) if m else None, spill_bytes=int(m.group(2)) if m else None,
                shared=kernel.metadata.shared, loads=dict(loads), instructions=sum(ops.values()),
                top=ops.most_common(16), conversions={op: n for op, n in ops.items() if op.startswith("I2F")})


def compiled(*fns) -> list:
    return [(fn.__name__, k) for fn in fns for cache in fn.device_caches.values() for k in cache[0].values()]


def gemv(a) -> list:
    import o3edge.engine.kernels as kernels
    import o3edge.engine.kernels.gemv as g
    from o3edge.engine.quant import quantize_int4

    kernels.num_sms = lambda device: 132  # the H200's
    g.packed_int4 = lambda x: os.environ.get("O3EDGE_INT4_PACKED", "1") != "0"  # as on a CUDA tensor
    g.asm_int4 = lambda x: os.environ.get("O3EDGE_INT4_ASM", "1") != "0"
    dtype = getattr(torch, a.dtype)
    x = torch.randn(a.rows, a.k, dtype=dtype)
    w = torch.randn(a.n, a.k) / 40
    try:
        config = tuple(int(v) for v in a.config.split(",")) if a.config else None
        if a.weights == "int8":
            from o3edge.engine.cpu_quant import quantize_int8

            q8, scales = quantize_int8(w)
            g.skinny_matmul(x, q8, scales8=scales, config=config)
        elif a.weights == "dense":
            g.skinny_matmul(x, w.to(dtype), config=config)
        else:
            q, sz = quantize_int4(w, a.group)
            g.skinny_matmul(x, q, scales_and_zeros=sz, group_size=a.group, out_features=a.n, config=config)
    except Exception as e:  # the launch: no device (a compile error is shown)
        if "CompilationError" in type(e).__name__ or "compil" in str(e).lower():
            print(f"compile failed: {e}", file=sys.stderr)
    return compiled(g._skinny_kernel, g._row_stream_kernel, g._rows_stream_kernel)


def router(a) -> list:
    import o3edge.engine.kernels.quant_attention as qa
    from tools.bench_attention import SHAPES, setup

    H, KVH, hd = SHAPES[a.shape]
    args = setup(a.mode, a.batch, a.context, H, KVH, hd, a.block_size, getattr(torch, a.dtype), "cpu")[:9]
    mass = torch.zeros(a.batch, KVH, 2, (args[3].shape[1] - 5) // 2 * a.block_size) if a.observe else None
    try:
        qa.router_decode_attention(*args, a.mode.split("-")[0], H, a.block_size, a.splits, mass=mass)
    except Exception:
        pass
    return compiled(qa._router_decode_kernel)


def sampling(a) -> list:
    """The graph step's draw (kernels/counter_draw.py, kernels/nucleus.py) for a batch of --batch rows over a
    vocabulary of --n, every way (RACE, TOPK, NUCLEUS, WIDE_TOPK): its kernels' launches do nothing here, so that
    each is compiled."""
    from o3edge.engine.kernels import counter_draw as cd
    from o3edge.engine.kernels import nucleus as nu
    from o3edge.engine.sampling import counter_settings
    from o3edge.engine.sequence import SamplingParams

    class Compiles:  # kernel[grid](...) compiles, and the failed launch is passed over
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                try:
                    self.fn[grid](*args, **kwargs)
                except Exception as e:
                    if "CompilationError" in type(e).__name__:
                        print(f"compile failed: {e}", file=sys.stderr)
            return launch

    fns = [(cd, cd._race_kernel), (cd, cd._block_top_kernel), (cd, cd._topk_draw_kernel), (cd, cd._filtered_kernel),
           (cd, cd._pick_kernel), (nu, nu._level_kernel), (nu, nu._resolve_kernel)]
    for module, fn in fns:
        setattr(module, fn.__name__, Compiles(fn))
    kinds = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=40), SamplingParams(top_p=0.9,
             temperature=1), SamplingParams(temperature=0.8, top_k=100)]
    cfg = torch.tensor(counter_settings((kinds * a.batch)[:a.batch], a.n), dtype=torch.float32)
    logits = torch.randn(a.batch, a.n)
    cd.draw(logits, logits.argmax(-1), cfg, torch.arange(a.batch), torch.arange(a.batch))
    for module, fn in fns:
        setattr(module, fn.__name__, fn)
    return compiled(*(fn for _, fn in fns))


def attention(a) -> list:
    """Decode attention's kernel (kernels/decode_attention.py) for --batch rows at --context tokens in
    --splits key splits, at --shape's heads (the split merge's kernel is not launched: the launch before it
    fails here)."""
    import o3edge.engine.kernels.decode_attention as da
    from tools.bench_attention import SHAPES

    H, KVH, hd = SHAPES[a.shape]
    dtype, bs = getattr(torch, a.dtype), a.block_size
    blocks = -(-(a.context + 1) // bs)
    meta = torch.zeros(a.batch, 3 + blocks, dtype=torch.int32)
    meta[:, 1], meta[:, 2] = a.context, a.context
    meta[:, 3:] = torch.arange(blocks, dtype=torch.int32)
    cache = torch.zeros(blocks * bs, KVH, hd, dtype=dtype)
    table = torch.zeros(a.context + 1, hd, dtype=dtype)
    try:
        da.decode_attention(torch.zeros(a.batch, (H + 2 * KVH) * hd, dtype=dtype), table, table, meta, cache,
                            cache.clone(), H, bs, num_splits=a.splits)
    except Exception as e:
        if "CompilationError" in type(e).__name__:
            print(f"compile failed: {e}", file=sys.stderr)
    return compiled(da._decode_attention_kernel)


def route(a) -> list:
    """A graph refresh's routing kernels (kernels/route.py) for --batch rows of a --context-token model in
    blocks of --block-size, at --shape's KV heads: each kernel launched alone (the first launch fails here,
    so route() itself would compile only the first)."""
    import o3edge.engine.kernels.route as rt
    from tools.bench_attention import SHAPES

    _, KVH, _ = SHAPES[a.shape]
    n, bs, L = a.batch, a.block_size, a.context
    W = L // bs
    entries = torch.zeros(n, W + 3, dtype=torch.long)
    mass = torch.zeros(n, KVH, 2, W * bs)
    books = torch.zeros(2 * n, L, dtype=torch.float64)
    sal = torch.zeros(n, L, dtype=torch.float64)
    order = torch.zeros(n, L, dtype=torch.long)
    held = torch.zeros(n, W, dtype=torch.int32)
    out = torch.zeros(n, W, dtype=torch.bool)
    wb, lb = triton.next_power_of_2(W), min(1024, triton.next_power_of_2(L))
    launches = [lambda: rt._observe_kernel[(n,)](entries, entries.stride(0), mass, *mass.stride()[:3], books,
                                                 books, books.stride(0), sal, sal.stride(0), 1000, W=W, L=L, KVH=KVH,
                                                 BS=bs, WB=wb, LB=lb, num_warps=8),
                lambda: rt._cover_kernel[(n,)](sal, order, sal.stride(0), entries, entries.stride(0), held,
                                               held.stride(0), out, out.stride(0), 1000, 0.85, 1, 128, W=W, L=L,
                                               BS=bs, WB=wb, LB=lb, num_warps=8)]
    for launch in launches:
        try:
            launch()
        except Exception as e:
            if "CompilationError" in type(e).__name__:
                print(f"compile failed: {e}", file=sys.stderr)
    return compiled(rt._observe_kernel, rt._cover_kernel)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("gemv", "router", "sampling", "attention", "route"))
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE set before compiling (repeatable)")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--n", type=int, default=11264)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--weights", default="int4", choices=("int4", "int8", "dense"), help="gemv: the weight kind")
    ap.add_argument("--config", help="gemv: a tiling BLOCK_N,BLOCK_K,splits,warps[,programs per SM] (default: planned)")
    ap.add_argument("--mode", default="int8", help="router: int8, int4, int8-half, int4-half")
    ap.add_argument("--shape", default="llama-1b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--splits", type=int, default=3)
    ap.add_argument("--observe", action="store_true", help="router: the observing variant (a refresh step's)")
    a = ap.parse_args()
    for kv in a.env:
        name, _, value = kv.partition("=")
        os.environ[name] = value
    driver.set_active(Sm90())
    for name, kernel in {"gemv": gemv, "router": router, "sampling": sampling, "attention": attention,
                         "route": route}[a.what](a):
        r = report(kernel, name)
        print(f"{r['kernel']}: {r['registers']} registers, {r['spill_bytes']} bytes spilled, {r['shared']} B shared, "
              f"{r['instructions']} instructions; loads {r['loads']}")
        print("  " + ", ".join(f"{op} {n}" for op, n in r["top"]) + f"; int-to-float {r['conversions'] or 0}")


if __name__ == "__main__":
    main()
