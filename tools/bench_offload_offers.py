#!/usr/bin/env python3
"""The engine thread's cost of offloading: 8 blocks offered to the KV cold tier, then one flush, per step.

  python tools/bench_offload_offers.py [--steps 200] [--offers 8]

A CPU KVOffloader over a real shared-memory tier (in /dev/shm; llama-1b's KV head layout, 2 layers to keep
the pool small), fresh block names every step, distinct hot blocks (no offer meets its own earlier copy),
a 2 ms pause between steps so the copier thread keeps up. Prints the median microseconds of the offers and
of the flush: what the engine thread spends, not the copies (those run on the copier thread).
"""

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import o3edge.engine.cold_tier as ct  # noqa: E402
from o3edge.engine.block_manager import chain_hash  # noqa: E402
from o3edge.engine.kv_offload import KVOffloader  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--offers", type=int, default=8)
    a = ap.parse_args()
    L, bs, H, D, blocks = 2, 16, 8, 64, 2048
    kv = torch.zeros(L, 2, blocks * bs, H, D, dtype=torch.bfloat16)
    payload = L * 2 * bs * H * D * 2
    shm = tempfile.mkdtemp(dir="/dev/shm")
    tier = ct.ColdTier(shm, b"\x07" * 16, ct.ColdTier.size_for(4096, bs, payload), bs, payload)
    off = KVOffloader(tier, kv, bs, verify_threads=2)
    rng = random.Random(0)
    offer_s, flush_s = [], []
    try:
        for step in range(a.steps):
            names = []
            for _ in range(a.offers):
                tokens, parent = tuple(rng.randrange(3, 1000) for _ in range(bs)), rng.randbytes(16)
                names.append((chain_hash(parent, tokens), parent, tokens))
            t0 = time.perf_counter()
            for j, name in enumerate(names):
                off.offer((step * a.offers + j) % blocks, *name)
            t1 = time.perf_counter()
            off.flush()
            flush_s.append(time.perf_counter() - t1)
            offer_s.append(t1 - t0)
            time.sleep(0.002)
    finally:
        off.close()
        shutil.rmtree(shm, ignore_errors=True)
    print(f"{a.offers} offers: {statistics.median(offer_s) * 1e6:.1f} us, "
          f"flush: {statistics.median(flush_s) * 1e6:.1f} us (medians of {a.steps} steps)")


if __name__ == "__main__":
    main()
