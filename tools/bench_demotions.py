#!/usr/bin/env python3
"""Host time of a token-router refresh's demotions: the block books (RouterBlocks.carry_out) and the data
(KVRouter.flush_moves: quantize the demoted blocks into the compressed pool), as a demoting decode step
pays them.

On a small model both the GPU's step and the host's are ~0.35 ms (tools/profile_router_step.py --trace), so
the ~170 demotions a refresh of the built-in long model makes (16 sequences of 3,840 tokens) cost the
host's time directly. This sets up that case alone: B sequences of --context tokens in a RouterBlocks whose
demoter is a real KVRouter over a KV cache of the model's shape, plans --demotions blocks spread over the
sequences, and times carrying them out and flushing their data, --repeat times; on CUDA the device is
synchronized after each flush, and `flush host` is the time the call took before that (what the step's
host waits for), `flush total` the time until the device was done. `--torch-moves` flushes by torch
operations instead of the kernel (kernels/kv_quantize.py), to measure against. `--profile` adds the flush's host operations
under torch.profiler, then on CUDA its kernel path's parts with the device idle before each, and the same parts
in place as a flush takes them after the books (the flush's host time on the H200's host was 0.83 ms against 0.14
for the parts: docs/benchmarks.md). On CUDA the flush replays the router's MoveGraph
(kernels/kv_quantize.py); O3EDGE_ROUTER_MOVE_GRAPH=0 launches the kernel each flush instead.

  python tools/bench_demotions.py [--device cuda] [--mode int8] [--batch 16] [--context 3840]
                                  [--demotions 170] [--layers 8 --kv-heads 2 --head-dim 64] [--repeat 50]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from o3edge.engine.router import KVRouter, RouterConfig  # noqa: E402
from o3edge.engine.router_blocks import RouterBlocks  # noqa: E402
from o3edge.engine.sequence import SamplingParams, Sequence  # noqa: E402


def kv_cache(a) -> torch.Tensor:
    """The KV cache all runs share, made once (as the engine's is): [L, 2, slots, KV heads, head_dim]."""
    num_blocks = a.batch * (-(-a.context // a.block_size) + 1) + 8
    return torch.randn(a.layers, 2, (num_blocks + 1) * a.block_size, a.kv_heads, a.head_dim, device=a.device,
                       dtype=getattr(torch, a.dtype))


def make_router(a, kv: torch.Tensor) -> KVRouter:
    """The router all runs share (as the engine's is: its pinned buffer and first launches made once)."""
    router = KVRouter(RouterConfig(a.mode), kv, kv.shape[2] // a.block_size - 1, a.block_size, 1)
    router.move_kernel = router.move_kernel and not a.torch_moves
    return router


def setup(a, rng: random.Random, router: KVRouter):
    """(books, router, sequences, plans): fresh block books over router's pools, every sequence's prompt
    computed, its blocks named; plans spread a.demotions demotions over the sequences' sealed blocks
    (seq_id -> [(table index, block id)])."""
    bs, num_blocks = a.block_size, router.num_full_blocks
    books = RouterBlocks(num_blocks, bs, "bench", True, router.per_host)
    books.demoter = router
    seqs, plans = [], {}
    for k in range(a.batch):
        seq = Sequence(f"r{k}", [rng.randrange(1000) for _ in range(a.context)], SamplingParams())
        seq.num_prompt_tokens = a.context
        books.allocate(seq)
        books.mark_computed(seq, a.context)
        seqs.append(seq)
    sealed = a.context // bs
    picks = rng.sample([(k, i) for k in range(a.batch) for i in range(1, sealed - 2)], a.demotions)
    for k, i in sorted(picks):
        plans.setdefault(seqs[k].seq_id, []).append((i, seqs[k].block_table[i]))
    return books, router, seqs, plans


def kernel_parts(router: KVRouter, a) -> dict:
    """Host ms of each part of kv_quantize.move_blocks for a.demotions moves, the device synchronized between
    parts (flush_steps with sync), median of a.repeat: the moves as an array, the ids' copy to the device
    (kv_quantize.PinnedStage), the kernel's launch, the two index copies."""
    import numpy as np

    moves = np.stack([np.arange(a.demotions), np.arange(a.demotions)], axis=1).tolist()
    parts = collections.defaultdict(list)
    for _ in range(a.repeat):
        for key, ms in flush_steps(router, moves, sync=True).items():
            parts[key].append(ms)
    return {k: round(statistics.median(v), 4) for k, v in parts.items()}


def flush_steps(router: KVRouter, moves: list, sync: bool = False) -> dict:
    """Host ms of each step of one flush by the kernel as KVRouter._quantize_moves takes them: the moves as an
    array, the ids through the pinned stage, the kernel's launch (its scratch made), the two index copies. Timed in
    place with no sync between them, or with sync (kernel_parts) the device idle before each."""
    import numpy as np

    from o3edge.engine.kernels.kv_quantize import quantize_blocks

    bs, times = router.block_size, {}
    start = time.perf_counter()

    def done(name: str) -> None:
        nonlocal start
        times[name] = (time.perf_counter() - start) * 1e3
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()

    if sync:
        torch.cuda.synchronize()
        start = time.perf_counter()
    with torch.inference_mode():
        arr = np.array(moves, dtype=np.int64)
        done("moves as an array")
        n = len(arr)
        ids = np.concatenate([arr[:, 0], (arr[:, 1, None] * bs + np.arange(bs)).reshape(-1)])
        ids = router.stage.to_device(ids) if router.stage is not None else torch.from_numpy(ids).to(router.device)
        done("ids to device")
        c, s = quantize_blocks(router.kv_cache, ids[:n], bs, router.cfg.mode, router.rotation)
        done("kernel launch")
        router.codes.index_copy_(2, ids[n:], c)
        router.scales.index_copy_(2, ids[n:], s)
        done("index copies")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mode", default="int8", choices=["int8", "int4"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=3840)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--demotions", type=int, default=170)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--torch-moves", action="store_true", help="flush by torch operations, not the kernel")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed runs, one more under torch.profiler: the flush's host operations")
    ap.add_argument("--json")
    a = ap.parse_args()
    cuda = a.device.startswith("cuda")
    rng, times = random.Random(0), {"books": [], "flush host": [], "flush total": []}
    router = make_router(a, kv_cache(a))
    for r in range(a.repeat + 3):  # the first three warm up (allocations, the kernel's first launch)
        books, router, seqs, plans = setup(a, rng, router)
        if cuda:
            torch.cuda.synchronize()
        router.plans = plans
        t0 = time.perf_counter()
        for seq in seqs:
            books.carry_out(seq)
        t1 = time.perf_counter()
        router.flush_moves()
        t2 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        t3 = time.perf_counter()
        assert books.num_demoted == a.demotions and not router.moves
        if r >= 3:
            for key, dt in (("books", t1 - t0), ("flush host", t2 - t1), ("flush total", t3 - t1)):
                times[key].append(dt * 1e3)
    flush = "graph" if router.move_graph is not None else "kernel" if router.move_kernel else "torch operations"
    if a.profile:  # the flush's host operations by their own time
        from torch.profiler import ProfilerActivity, profile

        books, router, seqs, plans = setup(a, rng, router)
        router.plans = plans
        for seq in seqs:
            books.carry_out(seq)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            router.flush_moves()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
        if router.move_kernel:  # the kernel path's parts, host time of each, --repeat times
            print(json.dumps({"kernel path parts, median host ms": kernel_parts(router, a)}))
            steps = collections.defaultdict(list)  # the same parts in place, as a flush after the books takes them
            for _ in range(a.repeat):
                books, router, seqs, plans = setup(a, rng, router)
                router.plans = plans
                for seq in seqs:
                    books.carry_out(seq)
                if cuda:
                    torch.cuda.synchronize()
                moves, router.moves = router.moves, []
                for key, ms in flush_steps(router, moves).items():
                    steps[key].append(ms)
            print(json.dumps({"a flush's steps in place, median host ms": {k: round(statistics.median(v), 4)
                                                                             for k, v in steps.items()}}))
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "mode": a.mode, "flush": flush,
              "batch": a.batch, "context": a.context, "demotions": a.demotions, "repeat": a.repeat,
              "shape": [a.layers, a.kv_heads, a.head_dim, a.dtype],
              "median_ms": {k: round(statistics.median(v), 4) for k, v in times.items()}}
    print(json.dumps(result))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
