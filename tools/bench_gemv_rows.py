#!/usr/bin/env python3
"""INT4 matmuls of a few rows on the GPU: the ways of running them, side by side.

For each INT4 layer of a decode step (gate/up, down, LM head; tinyllama-1.1b and llama-1b shapes) at
--rows activation rows, times the skinny matmul (kernels/gemv.py, the planned kernel and tiling, op
before not fused, as the decode step calls it above one row) in these ways:
  default  as the engine calls it: M rows, M a runtime argument;
  nospec   M never specialized (Triton treats an integer argument divisible by 16 as such: at 16 rows
           `default` compiles another kernel than at 2-8);
  pad16    the same M rows padded with zero rows to 16 (the kernel sees M = 16);
  cap128   as called, with O3EDGE_INT4_MAXNREG=1 (registers capped at 128: four programs an SM);
  rows     as called, with O3EDGE_INT4_ROWS=16: 2-16 rows streamed without the tensor cores (rows_int4),
           the rows in a loop (O3EDGE_INT4_ROWS_UNROLL=0); rows-BNxBKxWxP the same on a given tiling
           (BLOCK_N, BLOCK_K, warps, programs per SM);
  unroll   as `rows`, the row loop unrolled (the default at 2 rows; unroll-BNxBKxWxP on a tiling);
  tiles    as called, with O3EDGE_INT4_ROWS=0: never streamed (the tensor-core tiles);
  cublas   the same layer's dense weight on cuBLAS (F.linear), for scale.
Each timing replays a CUDA graph over >= 512 MB of weight copies (tools/bench_gemv.py time_graph), so
nothing is served from L2.

  python tools/bench_gemv_rows.py [--rows 2,8,16] [--json OUT]
         [--variants default,nospec,pad16,cap128,rows,unroll,tiles,cublas]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tools.bench_gemv as bg  # noqa: E402
from o3edge.engine.kernels import gemv  # noqa: E402

VARIANTS = ("default", "nospec", "pad16", "cap128", "rows", "unroll", "tiles", "cublas")


def time_variant(case: bg.Case, variant: str) -> float | None:
    """µs a call of one way of running case's layer (None: not applicable at case.M)."""
    import triton

    N, M = case.N, case.M
    x = case.op(case.x)  # the op before runs as its own kernel above one row: outside the timing
    if variant == "pad16":
        if M >= 16:
            return None
        x = torch.cat([x, x.new_zeros(16 - M, x.shape[1])])
    if variant == "cublas":
        dense = torch.randn(N, x.shape[1], device="cuda", dtype=x.dtype)
        copies = [dense.clone() for _ in range(max(1, bg.ROTATE_BYTES // dense.nbytes))]
        return bg.time_graph(lambda w: F.linear(x, w), copies)
    original = gemv._skinny_kernel
    if variant == "nospec":
        gemv._skinny_kernel = triton.jit(do_not_specialize=["M"])(original.fn)
    if variant == "cap128":
        os.environ["O3EDGE_INT4_MAXNREG"] = "1"
    config = None
    if variant == "tiles":
        os.environ["O3EDGE_INT4_ROWS"] = "0"
    if variant.startswith(("rows", "unroll")):
        if M > 16:
            return None
        os.environ["O3EDGE_INT4_ROWS"] = "16"
        os.environ["O3EDGE_INT4_ROWS_UNROLL"] = "1" if variant.startswith("unroll") else "0"
        if "-" in variant:  # rows-BNxBKxWxP
            bn, bk, warps, per_sm = (int(v) for v in variant.split("-")[1].split("x"))
            config = (bn, bk, 1, warps, per_sm)
    try:
        return bg.time_graph(lambda w: gemv.skinny_matmul(x, w[0], scales_and_zeros=w[1], group_size=bg.GROUP,
                                                          out_features=N, config=config), case.weights)
    finally:
        gemv._skinny_kernel = original
        os.environ.pop("O3EDGE_INT4_MAXNREG", None)
        os.environ.pop("O3EDGE_INT4_ROWS", None)
        os.environ.pop("O3EDGE_INT4_ROWS_UNROLL", None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-1b,tinyllama-1.1b")
    ap.add_argument("--rows", default="2,8,16")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for model in a.shapes.split(","):
        for name, N, K, pro in bg.layers(model):
            if name not in ("gate_up", "down", "lm_head"):
                continue
            for M in (int(r) for r in a.rows.split(",")):
                case = bg.Case(N, K, pro, M, bg.MODELS[model][4], "int4")
                for variant in a.variants.split(","):
                    us = time_variant(case, variant)
                    if us is None:
                        continue
                    rows.append(dict(model=model, layer=name, M=M, variant=variant, us=us))
                    print(f"{model:15s} {name:8s} M={M:2d} {variant:8s} {us:7.1f} us", flush=True)
                del case
                torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
