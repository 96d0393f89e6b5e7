#!/usr/bin/env python3
"""Paged prefill attention for a short chunk over a long cached prefix, with and without key splits.

The suffix of a prefix-cache or cold-tier hit (16 new tokens after 4,096 or 16,384 cached ones) is
one sequence, one 16-query tile per head: 32 programs for `llama-1b`'s 32 heads. This times the
kernel (kernels/prefill_attention.py) for one layer at such shapes, with the key splits the kernel
picks by default and with none, and checks the two agree. Times are CUDA-event medians.

  python tools/bench_prefill_attention.py --prefix 4096,16384 --new 16 --json OUT

(On a CPU it runs under Triton's interpreter with TRITON_INTERPRET=1: a check that it runs, not a
measurement.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from o3edge.engine.kernels.prefill_attention import num_key_splits, prefill_attention  # noqa: E402


def case(prefix: int, new: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype, device):
    """q [new, H, hd], caches holding prefix + new keys in shuffled blocks, seqs and the block table."""
    g = torch.Generator().manual_seed(prefix + new)
    blocks = -(-(prefix + new) // block_size)
    table = torch.randperm(blocks + 8, generator=g)[:blocks].to(torch.int32)[None].to(device)
    slots = (blocks + 8) * block_size
    k = torch.randn(slots, kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(slots, kv_heads, head_dim, generator=g).to(device, dtype)
    q = torch.randn(new, heads, head_dim, generator=g).to(device, dtype)
    seqs = torch.tensor([[0, new, prefix]], dtype=torch.int32, device=device)
    return q, k, v, seqs, table


def timed(fn, reps: int, device) -> float:
    """Median seconds of fn() over reps runs (CUDA events on a GPU, the host clock elsewhere)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", default="4096,16384", help="comma-separated cached prefix lengths")
    ap.add_argument("--new", type=int, default=16, help="new tokens in the chunk")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype) if device.type == "cuda" else torch.float32
    tiles = -(-a.new // (16 if a.new <= 16 else 64))
    auto = num_key_splits(a.heads * tiles, device)
    rows = []
    print(f"{'prefix':>7} {'no split (us)':>14} {f'{auto} splits (us)':>16} {'speed-up':>9} {'max |diff|':>11}")
    for prefix in [int(x) for x in a.prefix.split(",")]:
        q, k, v, seqs, table = case(prefix, a.new, a.heads, a.kv_heads, a.head_dim, a.block_size, dtype, device)
        run = lambda s: prefill_attention(q, k, v, seqs, table, a.new, a.block_size, num_splits=s)  # noqa: E731
        diff = (run(1).float() - run(auto).float()).abs().max().item()
        one, split = timed(lambda: run(1), a.reps, device), timed(lambda: run(auto), a.reps, device)
        rows.append({"prefix": prefix, "new": a.new, "splits": auto, "no_split_us": round(one * 1e6, 2),
                     "split_us": round(split * 1e6, 2), "speedup": round(one / split, 2), "max_abs_diff": diff})
        print(f"{prefix:>7} {one * 1e6:>14.1f} {split * 1e6:>16.1f} {one / split:>8.2f}x {diff:>11.2e}", flush=True)
    if a.json:
        info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
                "torch": torch.__version__, "dtype": str(dtype), "heads": a.heads, "kv_heads": a.kv_heads,
                "head_dim": a.head_dim, "block_size": a.block_size, "rows": rows}
        with open(a.json, "w") as fh:
            json.dump(info, fh, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
