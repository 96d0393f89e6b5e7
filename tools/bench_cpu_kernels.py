#!/usr/bin/env python3
"""Low-bit linear kernels on this CPU, per layer shape: which one each CPU preset should use.

  python tools/bench_cpu_kernels.py [--shape smol-135m] [--rows 1 8 128] [--threads 2] [--json OUT]

For every linear layer shape of the model (fused qkv, o, gate_up, down, LM head) and row count,
the minimum time of: float32 (MKL), bfloat16, `_weight_int8pack_mm` (bf16 activations),
`_weight_int4pack_mm_for_cpu` g64/g128 (bf16 activations), fbgemm dynamic int8
(`quantized::linear_dynamic`, activations quantized per tensor on the fly, float32 in and out), and,
where they build (AVX-512 VNNI, AVX-VNNI or AVX2: O3EDGE_CPU_ISA), o3edge's own INT8 and INT4 g32/g64 kernels (cpu_ext.py).
Random weights; denormals flushed. Output: a Markdown table (microseconds), optionally JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {  # name -> {layer: (out_features, in_features)}
    "smol-135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                  "lm_head": (49152, 576)},
}


def timeit(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e6  # the minimum: this machine is shared, interference only adds


def kernels(n: int, k: int):
    """name -> a function of x (float32 [M, K]) for a random [n, k] weight."""
    from o3edge.engine import cpu_ext, cpu_quant
    from o3edge.engine.cpu_quant import Int8Linear, quantize_int8
    from o3edge.engine.quant import Int4Linear, quantize_int4

    w = torch.randn(n, k) * 0.02
    wb = w.bfloat16()
    out = {"fp32": lambda x: torch.nn.functional.linear(x, w),
           "bf16": lambda x: torch.nn.functional.linear(x.bfloat16(), wb).float()}
    q, s = quantize_int8(w)
    for kernel, label in (("int8pack", "int8pack (bf16 act)"), ("fbgemm", "fbgemm dyn int8")):
        m = Int8Linear(k, n, kernel)
        m.load_quantized(q, s)
        out[label] = m
    fits = cpu_quant.vnni_fits
    cpu_quant.vnni_fits = lambda *shape: False  # torch's int4pack, not o3edge's kernel
    try:
        for g in (64, 128):
            m = Int4Linear(k, n, g)
            m.load_quantized(*quantize_int4(w, g))
            out[f"int4pack g{g}"] = m
    finally:
        cpu_quant.vnni_fits = fits
    if cpu_ext.available():  # o3edge's own kernels (cpu_ext.py)
        m = Int8Linear(k, n, "vnni")
        m.load_quantized(q, s)
        out["o3edge int8"] = m
        for g in (32, 64):
            m = Int4Linear(k, n, g)
            m.load_quantized(*quantize_int4(w, g))
            out[f"o3edge int4 g{g}"] = m
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smol-135m", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 128])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    results = []
    with torch.inference_mode():
        for layer, (n, k) in SHAPES[a.shape].items():
            for name, fn in kernels(n, k).items():
                for m in a.rows:
                    x = torch.randn(m, k)
                    reps = a.reps if m * n < 10_000_000 else max(5, a.reps // 5)
                    results.append({"layer": layer, "n": n, "k": k, "rows": m, "kernel": name,
                                    "us": timeit(lambda: fn(x), reps)})
                    print(f"<!-- {results[-1]} -->", flush=True)
    names = list(dict.fromkeys(r["kernel"] for r in results))
    print(f"\n{torch.backends.cpu.get_cpu_capability()}, {a.threads} threads, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}; minimum µs per call over the repetitions\n")
    print("| layer (N×K) | rows | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for layer, (n, k) in SHAPES[a.shape].items():
        for m in a.rows:
            cells = {r["kernel"]: r["us"] for r in results if r["layer"] == layer and r["rows"] == m}
            best = min(cells.values())
            print(f"| {layer} ({n}×{k}) | {m} | " + " | ".join(
                (f"**{cells[c]:.0f}**" if cells[c] == best else f"{cells[c]:.0f}") for c in names) + " |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"capability": torch.backends.cpu.get_cpu_capability(), "threads": a.threads,
                       "torch": torch.__version__, "loadavg": os.getloadavg(), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
