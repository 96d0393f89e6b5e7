#!/usr/bin/env python3
"""Decode-size matmuls on the GPU: o3edge's fused skinny kernels against cuBLAS (and tinygemm INT4).

For each linear layer of a decode step (tinyllama-1.1b and llama-1b shapes) and each batch size, times
  - unfused: the op before (add_rmsnorm / silu_mul) + cuBLAS F.linear (today's step), or INT4 tinygemm;
  - fused:   the decode step's way: at one row kernels/gemv.py with the op fused in; above, the op and
             the skinny kernel; INT4 above 64 rows (prefill), kernels/int4_matmul.py's way (dequantize + cuBLAS,
             or tiles: gemv.prefill_tiling); for its planned tiling and (--grid) a grid of alternatives (at
             prefill sizes, INT4 tiles);
and reports microseconds per call and weight GB/s. Each timing replays a CUDA graph that runs the layer
over enough distinct weight copies (>= 512 MB) that nothing is served from L2, as in a real step where
the whole model streams by. Compiles run first in parallel processes (Triton's disk cache).

  python tools/bench_gemv.py [--json OUT] [--grid] [--shapes tinyllama-1.1b,llama-1b] [--rows 1,8]
                             [--layers gate_up,down] [--weights dense|int4|int8|both|all]

INT8 weights (W8A16, per-row scales) are timed against cuBLAS on the dense weight they came from. With
GRID_SPLITS=1,2,4 the one-row grid times streamed rows split along K in those many work items (stream_splits).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from o3edge.engine.kernels.activation import silu_mul  # noqa: E402
from o3edge.engine.kernels.gemv import MAX_ROWS, asm_int4, plan, prefill_tiling, skinny_matmul  # noqa: E402
from o3edge.engine.kernels.int4_matmul import int4_matmul  # noqa: E402
from o3edge.engine.kernels.int8_matmul import int8_matmul  # noqa: E402
from o3edge.engine.cpu_quant import quantize_int8  # noqa: E402
from o3edge.engine.kernels.norm import add_rmsnorm  # noqa: E402
from o3edge.engine.quant import quantize_int4  # noqa: E402

# name: (hidden, intermediate, qkv rows, vocab, dtype)
MODELS = {"tinyllama-1.1b": (2048, 5632, 2560, 32000, torch.float16),
          "llama-1b": (2048, 8192, 3072, 128256, torch.bfloat16)}
GROUP = 128
ROTATE_BYTES = 512 << 20


def layers(model: str) -> list[tuple[str, int, int, str]]:
    """(layer, N, K, prologue) of one decode step."""
    D, I, QKV, V, _ = MODELS[model]
    return [("qkv", QKV, D, "norm"), ("o", D, D, "none"), ("gate_up", 2 * I, D, "norm"),
            ("down", D, I, "silu"), ("lm_head", V, D, "norm")]


def grid(M: int, weights: str) -> list[tuple[int, ...]]:
    """Tilings (BLOCK_N, BLOCK_K, splits, warps[, programs per SM: streamed, one row of dense weights[, software
    pipeline stages]])."""
    int4 = weights == "int4"
    if M == 1 and os.environ.get("GRID_SPLITS"):  # streamed rows split along K (stream_splits): GRID_SPLITS=1,2,3
        splits = tuple(int(v) for v in os.environ["GRID_SPLITS"].split(","))
        return list(itertools.product((4, 8, 16), (1024, 2048), splits, (4, 8), (4, 8)))
    if M == 1 and weights == "int8":  # streamed like dense, tiles of half the bytes: wider ones too
        return list(itertools.product((8, 16, 32), (1024, 2048), (1,), (4, 8), (4, 6, 8)))
    if M == 1:
        if int4 and os.environ.get("O3EDGE_INT4_STREAM") != "0":  # streamed row blocks, as dense (stream_int4);
            # on dp4a (dp4a_int4) ~70 registers a thread, not ~125: 6 programs per SM too
            return list(itertools.product((4, 8, 16, 32), (1024, 2048), (1,), (4, 8), (2, 4, 6, 8)))
        if int4:
            return list(itertools.product((4, 8, 16), (512, 1024), (1, 2), (4, 8)))
        return list(itertools.product((4, 8, 16), (1024, 2048), (1,), (4, 8), (4, 6, 8)))
    if M > MAX_ROWS:  # prefill: INT4 tiles dequantized in registers (asm_int4, swapped) against dequantize + cuBLAS
        return [(n, k, s, w, 0, 3) for n, k, s, w in itertools.product((64, 128), (64, 128), (1, 4), (4, 8))
                if int4 and not (n == 128 and w == 4)]
    if weights == "int8":  # tiles dequantized in registers, as INT4's (asm_int4): stages tried too
        return [(n, k, s, w, 0, st) for n, k, s, w, st in itertools.product(
            (32, 64, 128), (128, 256), (1, 4, 8), (4, 8), (3, 4)) if not (n == 128 and w == 4)]
    if int4 and os.environ.get("O3EDGE_INT4_ASM") != "0":  # packed dequantize: pipelined loads, stages tried too
        # 16-row slices and 8 splits: more programs for the narrow layers (tinyllama's down at 32 rows: 256)
        return [(n, k, s, w, 0, st) for n, k, s, w, st in itertools.product(
            (16, 32, 64, 128), (128, 256), (1, 2, 4, 8), (4, 8), (3, 4)) if not (n == 128 and w == 4)]
    if int4 and os.environ.get("O3EDGE_INT4_SWAP") == "1":  # (with O3EDGE_INT4_ASM=0) W @ x.T: 64 rows a warp group
        return (list(itertools.product((32, 64, 128), (64, 128, 256), (1, 2, 4), (4,)))
                + list(itertools.product((128,), (64, 128, 256), (1, 2, 4), (8,))))
    return list(itertools.product((16, 32, 64), (128, 256, 512), (1, 2), (4,)))


class Case:
    """One layer at one batch size: inputs and weight copies on the GPU, and its ways of running."""

    def __init__(self, N, K, pro, M, dtype, weights, copies=None):
        g = torch.Generator(device="cuda").manual_seed(N + K)
        self.N, self.K, self.pro, self.M, self.kind = N, K, pro, M, weights
        self.int4 = int4 = weights == "int4"
        self.x = torch.randn(M, 2 * K if pro == "silu" else K, device="cuda", dtype=dtype, generator=g)
        self.res = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
        self.nw = torch.ones(K, device="cuda", dtype=dtype)
        w = torch.randn(N, K, device="cuda", dtype=dtype, generator=g) * K ** -0.5
        if int4:
            q, sz = quantize_int4(w.float(), GROUP)
            packed = torch.ops.aten._convert_weight_to_int4pack(q, 8)
            one = (q, sz, packed)
            nbytes = q.numel() + sz.numel() * 2
        elif weights == "int8":
            q, scales = quantize_int8(w.float())
            one = (q, scales, w)  # the dense weight: cuBLAS's copy to compare with
            nbytes = q.numel() + scales.numel() * 4
        else:
            one, nbytes = (w,), w.numel() * w.element_size()
        self.bytes = nbytes
        n = copies or max(1, ROTATE_BYTES // nbytes)
        self.weights = [tuple(t.clone() for t in one) for _ in range(n)]

    def fused(self, config, w):
        """The decode step's way: one row with the op fused in; more rows: the op, then the skinny kernel
        (INT4 above MAX_ROWS: int4_matmul's dequantize + cuBLAS)."""
        kw = dict(config=config)
        if self.int4:
            kw.update(scales_and_zeros=w[1], group_size=GROUP, out_features=self.N)
        if self.kind == "int8":
            kw.update(scales8=w[1])
        if self.M == 1:
            if self.pro == "norm":
                kw.update(norm_weight=self.nw, residual=self.res, eps=1e-5)
            return skinny_matmul(self.x, w[0], silu=self.pro == "silu", **kw)
        x = self.op(self.x)
        if self.M > MAX_ROWS and config is None:
            return int8_matmul(x, w[0], w[1]) if self.kind == "int8" else int4_matmul(x, w[0], w[1], GROUP, self.N)
        return skinny_matmul(x, w[0], **kw)

    def op(self, x):
        if self.pro == "norm":
            return add_rmsnorm(x, self.res, self.nw, 1e-5)
        return silu_mul(x) if self.pro == "silu" else x

    def unfused(self, w):
        x = self.op(self.x)
        if self.int4:
            return torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16), w[2], GROUP, w[1])
        return F.linear(x, w[2] if self.kind == "int8" else w[0])


def time_graph(fn, weights, reps: int = 5) -> float:
    """Microseconds per call of fn(w), replayed from a CUDA graph over every weight copy."""
    for w in weights[:2]:
        fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(weights))


def jobs(models, rows, with_grid, only=None, kinds=("dense", "int4")):
    """Every (model, layer, M, weights, config) to time; config None = planned tiling."""
    out = []
    for model in models:
        for (name, N, K, pro), M, weights in itertools.product(layers(model), rows, kinds):
            attention = name in ("qkv", "o")  # INT4 only with o3edge build --int4-all: when asked for by --layers
            if ((weights == "int4" and attention and not only) or (M > MAX_ROWS and weights == "dense")
                    or (only and name not in only)):
                continue
            configs = [None] + (grid(M, weights) if with_grid else [])
            out += [(model, name, N, K, pro, M, weights, c) for c in configs]
    return out


def compile_some(batch):
    for model, name, N, K, pro, M, weights, config in batch:
        case = Case(N, K, pro, M, MODELS[model][4], weights, copies=1)
        try:
            case.fused(config, case.weights[0])
        except Exception as e:  # a tiling the compiler refuses (shared memory, registers) is skipped later
            print(f"compile failed {name} M={M} {config}: {str(e)[:120]}", flush=True)
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--grid", action="store_true", help="also time a grid of tilings")
    ap.add_argument("--shapes", default="tinyllama-1.1b,llama-1b")
    ap.add_argument("--rows", default="1,4,8,16,32,128")
    ap.add_argument("--layers", help="only these layers (e.g. gate_up,down)")
    ap.add_argument("--weights", choices=("dense", "int4", "int8", "both", "all"), default="both")
    ap.add_argument("--procs", type=int, default=12)
    a = ap.parse_args()
    models, rows = a.shapes.split(","), [int(r) for r in a.rows.split(",")]
    kinds = {"both": ("dense", "int4"), "all": ("dense", "int4", "int8")}.get(a.weights, (a.weights,))
    todo = jobs(models, rows, a.grid, a.layers and a.layers.split(","), kinds)
    t0 = time.time()
    with mp.get_context("spawn").Pool(a.procs) as pool:  # compile in parallel into the disk cache
        pool.map(compile_some, [todo[i::a.procs] for i in range(a.procs)])
    print(f"compiled {len(todo)} variants in {time.time() - t0:.0f} s", flush=True)
    results, cases = [], {}
    for model, name, N, K, pro, M, weights, config in todo:
        int4 = weights == "int4"
        key = (model, name, M, weights)
        if key not in cases:
            cases.clear()
            case = cases[key] = Case(N, K, pro, M, MODELS[model][4], weights)
            base = time_graph(case.unfused, case.weights)
            results.append(dict(model=model, layer=name, M=M, int4=int4, weights=weights,
                                kernel="tinygemm" if int4 else "cuBLAS", us=base, GBps=case.bytes / base / 1e3))
        case = cases[key]
        try:
            us = time_graph(lambda w: case.fused(config, w), case.weights)
        except Exception as e:
            print(f"skip {name} M={M} {config}: {str(e)[:100]}")
            continue
        cfg = config or (plan(M, N, K, int4, torch.cuda.get_device_properties(0).multi_processor_count,
                              int4 and M > 1 and asm_int4(case.x), weights == "int8")
                         if M <= MAX_ROWS else (int4 and prefill_tiling(M, N, K)) or "dequantize+cuBLAS")
        results.append(dict(model=model, layer=name, M=M, int4=int4, weights=weights, kernel="fused",
                            planned=config is None, config=cfg if isinstance(cfg, str) else list(cfg), us=us,
                            GBps=case.bytes / us / 1e3))
        if config is None:
            print(f"{model:15s} {name:8s} M={M:2d} {weights}: {results[-2]['kernel']} "
                  f"{base:7.1f} us  fused {us:7.1f} us ({case.bytes / us / 1e3:6.0f} GB/s) {cfg}", flush=True)
        else:  # a grid's tiling, as it is timed (a run cut short keeps what it measured)
            print(f"grid {model} {name} M={M} {weights} {us:.2f} us {list(cfg)}", flush=True)
    best = {}
    for r in results:
        if r["kernel"] == "fused":
            k = (r["model"], r["layer"], r["M"], r["weights"])
            if k not in best or r["us"] < best[k]["us"]:
                best[k] = r
    for r in best.values():
        print(f"best {r['model']:15s} {r['layer']:8s} M={r['M']:2d} {r['weights']:5s} "
              f"{r['us']:7.1f} us {r['GBps']:6.0f} GB/s {r['config']}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(0), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
