#!/usr/bin/env python3
"""One decode query's attention on the CPU, as the exact forward runs it (cpu_decode.span_attention): torch's
scaled_dot_product_attention over one sequence's keys, in float32, bfloat16 and float16, and in those two types
widened to float32 for the call (what span_attention does since 2026-12-04). Microseconds a call, median of
--repeat timings of 100 calls each.

  python tools/bench_cpu_attention.py [--heads 8] [--kv-heads 2] [--head-dim 64] [--keys 1500] [--threads 2]
                                      [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F


def time_us(fn, calls: int = 100, repeat: int = 5) -> float:
    for _ in range(10):
        fn()
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(runs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--keys", type=int, default=1500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(1, h, n, a.head_dim, generator=g)
            for h, n in ((a.heads, 1), (a.kv_heads, a.keys), (a.kv_heads, a.keys))]
    rows = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q, k, v = (t.to(dtype) for t in base)
        name = str(dtype).removeprefix("torch.")
        rows[name] = time_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), repeat=a.repeat)
        if dtype != torch.float32:
            rows[name + " widened"] = time_us(
                lambda: F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True).to(dtype),
                repeat=a.repeat)
    for name, us in rows.items():
        print(f"{name:18s} {us:8.1f} us")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(args=vars(a), torch=torch.__version__, machine=platform.machine(),
                           processor=platform.processor(), us=rows), fh, indent=1)


if __name__ == "__main__":
    main()
