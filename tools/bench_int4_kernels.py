#!/usr/bin/env python3
"""Per-layer INT4 kernel timing on the GPU: fp16 cuBLAS, torch's tinygemm INT4, o3edge's Triton W4A16.

For each FFN shape of the benchmark models and each row count (decode batch or prefill tokens),
prints microseconds per call (triton.testing.do_bench, CUDA-graph replays) and the weight bytes
streamed per second. Writes JSON with --json.

  python tools/bench_int4_kernels.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from o3edge.engine.kernels.int4_matmul import int4_matmul  # noqa: E402
from o3edge.engine.quant import quantize_int4  # noqa: E402

SHAPES = {"tinyllama gate_up": (11264, 2048), "tinyllama down": (2048, 5632),
          "llama-1b gate_up": (16384, 2048), "llama-1b down": (2048, 8192)}
ROWS = (1, 8, 32, 128)
GROUP = 128


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02
        q, sz = quantize_int4(w.float().cpu(), GROUP)
        q, sz = q.cuda(), sz.cuda()
        packed = torch.ops.aten._convert_weight_to_int4pack(q, 8)
        for M in ROWS:
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            xb = x.to(torch.bfloat16)
            int4_matmul(x, q, sz, GROUP, N)  # compile outside the timed graph
            t = {"fp16 cuBLAS": do_bench_cudagraph(lambda: F.linear(x, w)),
                 "INT4 tinygemm": do_bench_cudagraph(lambda: torch.ops.aten._weight_int4pack_mm(xb, packed, GROUP, sz)),
                 "INT4 Triton": do_bench_cudagraph(lambda: int4_matmul(x, q, sz, GROUP, N))}
            row = {"shape": name, "N": N, "K": K, "M": M, **{k: v * 1e3 for k, v in t.items()}}
            rows.append(row)
            print(f"{name:18s} M={M:4d}  " + "  ".join(f"{k} {v * 1e3:7.1f} us" for k, v in t.items()), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
