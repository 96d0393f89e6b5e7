#!/usr/bin/env python3
"""Host time of a graph decode step's metadata: DecodeGraphs.fill_meta (full precision) and
RouterDecodeGraphs.fill_meta (the router's two block tables), for B sequences of a given context; and of
a router refresh's planning (KVRouter._plan: which sealed blocks of the B sequences to demote).

On a small model the GPU finishes a decode step in a few tenths of a millisecond, so the host's work
for the next step is what the step costs (tools/profile_router_step.py --trace). This times the part
that grows with the context: turning each sequence's block table into its metadata row. No GPU needed:
the rows are the host arrays the step copies to the device.

  python tools/bench_step_meta.py [--batch 16] [--context 3840] [--block-size 32] [--against REV]

--against REV also times the two functions as they were at git revision REV (loaded from `git show`),
and checks they fill the same rows.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import random
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from o3edge.engine.cuda_graph import DecodeGraphs  # noqa: E402
from o3edge.engine.router_graph import RouterDecodeGraphs  # noqa: E402


def at_revision(rev: str, path: str, name: str):
    """The module at path as it was at git revision rev."""
    src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], capture_output=True, text=True,
                         check=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(src)
    spec = importlib.util.spec_from_file_location(name, fh.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    os.unlink(fh.name)
    return mod


def batch_of(n: int, context: int, block_size: int, num_full: int) -> list:
    """n decoding sequences of about context tokens, a third of their blocks full precision."""
    rng, batch = random.Random(0), []
    for i in range(n):
        blocks = -(-(context + i + 1) // block_size)
        table = [rng.randrange(num_full) if rng.random() < 1 / 3 else num_full + rng.randrange(4 * num_full)
                 for _ in range(blocks)]
        seq = types.SimpleNamespace(seq_id=i, num_computed_tokens=context + i, token_ids=[1] * (context + i + 1),
                                    block_table=table, table_edits=0)
        batch.append((seq, 1))
    return batch


def graphs_stub(cls, block_size: int, max_blocks: int, num_full: int, buckets: list[int]):
    """An instance of cls with what fill_meta reads (no runner, no device)."""
    g = object.__new__(cls)
    router = types.SimpleNamespace(num_full_blocks=num_full, observing_now=lambda ahead=0: False)
    g.runner = types.SimpleNamespace(router=router, scratch_slot=0)
    g.block_size, g.max_blocks, g.batch_buckets, g.mass, g.memo = block_size, max_blocks, buckets, None, {}
    g.row_made = [[None] * buckets[-1] for _ in range(2)]
    return g


def time_fill(fn, cls, batch, mb: int, width: int, a) -> tuple[float, np.ndarray]:
    """Microseconds a step of fn (cls.fill_meta or an earlier version) over batch, and its rows."""
    g = graphs_stub(cls, a.block_size, mb, 2000, [a.batch])
    meta = np.zeros((a.batch, width), dtype=np.int32)
    # as a step does: into one host buffer of two (`parity`, where fill_meta takes it: rows unchanged since that
    # buffer's last step are not written again)
    kw = {"parity": 0} if "parity" in inspect.signature(fn).parameters else {}
    for _ in range(20):
        fn(g, meta, batch, a.batch, 0, **kw)
    t = time.perf_counter()
    for _ in range(a.steps):
        fn(g, meta, batch, a.batch, 0, **kw)
    return (time.perf_counter() - t) * 1e6 / a.steps, meta


def time_plan(batch, a) -> tuple[float, int]:
    """Microseconds of KVRouter._plan over batch (each sequence routed, 30% of its sealed blocks holding a
    salient token), and the demotions it plans."""
    import torch

    from o3edge.engine.router import KVRouter, RouterConfig, SaliencyBooks

    router = KVRouter.__new__(KVRouter)  # the planning reads only these
    router.cfg, router.block_size, router.num_full_blocks = RouterConfig("int8"), a.block_size, 2000
    router.books = SaliencyBooks(8, "cpu")
    routed = [(seq, seq.num_computed_tokens + 1, router.books.row(seq.seq_id)) for seq, _ in batch]
    width = max(ctx for _, ctx, _ in routed) // a.block_size
    holds = torch.from_numpy(np.random.default_rng(0).random((len(routed), width)) < 0.3)
    for _ in range(5):
        router._plan(routed, holds, None, {})
    t = time.perf_counter()
    for _ in range(a.steps // 10):
        plans = {}
        router._plan(routed, holds, None, plans)
    return (time.perf_counter() - t) * 1e6 / (a.steps // 10), sum(map(len, plans.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=3840)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--against", help="also time the functions at this git revision")
    a = ap.parse_args()
    batch = batch_of(a.batch, a.context, a.block_size, 2000)
    mb = -(-(a.context + a.batch + 1) // a.block_size)
    cases = [("full precision", DecodeGraphs, 3 + mb, "o3edge/engine/cuda_graph.py", "DecodeGraphs"),
             ("router", RouterDecodeGraphs, 5 + 2 * mb, "o3edge/engine/router_graph.py", "RouterDecodeGraphs")]
    print(f"{a.batch} sequences of ~{a.context} tokens in {a.block_size}-token blocks, us a step:")
    for label, cls, width, path, name in cases:
        us, rows = time_fill(cls.fill_meta, cls, batch, mb, width, a)
        line = f"  {label:15s} {us:7.1f}"
        if a.against:
            old = getattr(at_revision(a.against, path, f"old_{name}"), name)
            if cls is RouterDecodeGraphs:  # its base class's helpers as at REV too (the import gives today's)
                old_base = at_revision(a.against, "o3edge/engine/cuda_graph.py", "old_DecodeGraphs").DecodeGraphs
                old.cached = old_base.cached
            old_us, old_rows = time_fill(old.fill_meta, old, batch, mb, width, a)
            line += f"   at {a.against}: {old_us:7.1f}   same rows: {bool((rows == old_rows).all())}"
        print(line, flush=True)
    us, demotions = time_plan(batch, a)
    print(f"  router's refresh plan (KVRouter._plan) {us:7.1f} us, {demotions} demotions")


if __name__ == "__main__":
    main()
