"""tools/bench_demotions.py: a refresh's demotions (books, then the data's flush) timed on their own."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_planned_demotion_is_carried_out_and_timed(tmp_path):
    """The tool asserts each run demoted exactly what it planned and flushed every move; the JSON has a
    time for the books and for the flush (on this machine the flush is torch's: no CUDA)."""
    out_json = tmp_path / "demotions.json"
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_demotions.py"), "--device", "cpu",
                          "--dtype", "float32", "--batch", "3", "--context", "320", "--demotions", "12",
                          "--repeat", "2", "--json", str(out_json)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out_json.read_text())
    assert result["demotions"] == 12 and result["flush"] == "torch operations"
    times = result["median_ms"]
    assert 0 < times["books"] and 0 < times["flush host"] <= times["flush total"]


def test_a_flush_timed_step_by_step_writes_what_the_routers_flush_writes():
    """flush_steps (--profile's in-place parts of a flush by the kernel, Triton's interpreter here) leaves the same
    codes and scales as the router's own flush of the same moves, so its times are a real flush's (the kernel under
    Triton's interpreter, as tests/conftest.py sets it)."""
    import argparse
    import random

    import torch

    sys.path.insert(0, os.path.join(REPO, "tools"))
    import bench_demotions as bench

    a = argparse.Namespace(device="cpu", mode="int8", batch=2, context=256, block_size=32, demotions=6, layers=2,
                           kv_heads=2, head_dim=64, dtype="float32", repeat=1, torch_moves=False)
    kv = bench.kv_cache(a)
    results = []
    for stepwise in (False, True):
        router = bench.make_router(a, kv.clone())
        router.move_kernel = True
        books, router, seqs, plans = bench.setup(a, random.Random(0), router)
        router.plans = plans
        for seq in seqs:
            books.carry_out(seq)
        assert len(router.moves) == 6
        if stepwise:
            moves, router.moves = router.moves, []
            times = bench.flush_steps(router, moves)
            assert set(times) == {"moves as an array", "ids to device", "kernel launch", "index copies"}
        else:
            router.flush_moves()
        results.append((router.codes.clone(), router.scales.clone()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
