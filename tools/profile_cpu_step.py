#!/usr/bin/env python3
"""Where the native CPU decode step's time goes, per phase (issue 13).

  python tools/profile_cpu_step.py ENGINE_DIR [--position 192] [--steps 600] [--threads 2]

Loads the engine with o3edge's kernel library built with phase timers (O3EDGE_CPU_PROFILE=1 adds
-DO3_PROFILE: a build of its own in the kernel cache; the timers are off in the normal build) and runs
the native step for STEPS decode steps of one sequence whose new token is at POSITION (keys 0..POSITION).
The library prints, every 200 steps, thread 0's wall time per phase (its barrier wait included); this
prints the step's median and minimum.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ["O3EDGE_CPU_PROFILE"] = "1"  # read when the kernel library is built and loaded

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from o3edge import O3Config, O3Model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", help="a cpu-int4 or cpu-int8 engine directory")
    ap.add_argument("--position", type=int, default=192)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    engine = O3Model.from_config(O3Config(model_path=a.engine, device="cpu", num_threads=a.threads, backend="torch",
                                          kv_cache_memory_mb=64, max_model_len=1024)).engine
    runner = engine.runner
    if runner.cpu_decode is None or runner.cpu_decode.native is None:
        print("the native step does not apply to this engine (or the kernels are unavailable here)")
        return 1
    step, bs, P = runner.cpu_decode.native.native, runner.cpu_decode.block_size, a.position
    ids, pos, slots = torch.tensor([5]), torch.tensor([P]), torch.tensor([P])
    tables = torch.arange(P // bs + 1)[None]  # blocks 0.. in order: slot P is position P
    times = []
    with torch.inference_mode():
        for _ in range(a.steps):
            t = time.perf_counter()
            step.step(ids, pos, slots, tables, bs, runner.cos, runner.sin, runner.kv_cache, 0)
            times.append(time.perf_counter() - t)
    print(f"step median {statistics.median(times) * 1e3:.3f} min {min(times) * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
