#!/usr/bin/env python3
"""What the graph step's draw of sampled tokens costs on the GPU, by method and by part.

Each variant is captured in a CUDA graph, as in the decode step, and replayed; the figure is µs a replay
(CUDA events over --replays replays, the median of --repeat). Logits are random float32 [B, V], of standard
deviation --scale (1: a flat row, whose nucleus is most of it). Variants: the whole draw
(sampling.counter_sample) for a batch whose rows are all RACE (no filter), all TOPK (top-k 40, top-p 0.9), all
NUCLEUS (top-p 0.9 alone: its cut by selection, kernels/nucleus.py) or all WIDE_TOPK (top-k 100, and with top-p
0.9: the k-th largest selected, then the cut), each with the kernels its sampling graph runs; and its parts
alone (torch.topk of TOP_K_CAP, torch.sort of the row, the greedy argmax every step already has). The
draw's top-k is Triton's unless O3EDGE_TRITON_TOPK=0 (torch.topk's, as before; the JSON's "top_k_by" says
which).

  [O3EDGE_TRITON_TOPK=0] python tools/bench_sampling.py [--batches 1,8,32] [--vocab 32000] [--scale 3] [--json OUT]

--numpy: the native CPU backend's sampler instead (sampling_np.sample, one row, ms a draw; the sampler of
--against REV beside it, that revision's sampling_np.py read from git):
  python tools/bench_sampling.py --numpy --vocab 49152 [--scale 3] [--against f726b27] [--json OUT]
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

from o3edge.engine.sampling import TOP_K_CAP, counter_sample, counter_settings, ways_needed  # noqa: E402
from o3edge.engine.sequence import SamplingParams  # noqa: E402

KINDS = {"race (T 1.0)": SamplingParams(temperature=1.0), "topk (T 0.7, top-k 40, top-p 0.9)":
         SamplingParams(temperature=0.7, top_k=40, top_p=0.9), "nucleus (T 0.7, top-p 0.9)":
         SamplingParams(temperature=0.7, top_p=0.9), "wide top-k (T 0.8, top-k 100)": SamplingParams(
             temperature=0.8, top_k=100), "wide top-k (T 0.8, top-k 100, top-p 0.9)": SamplingParams(
             temperature=0.8, top_k=100, top_p=0.9)}


def replay_us(fn, replays: int, repeat: int) -> float:
    """µs a replay of fn captured in a CUDA graph (warmed up first, as capture_graphs does)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays)
    return statistics.median(times)


def numpy_ms(a) -> dict:
    """ms a draw of one row of --vocab logits by sampling_np.sample (and --against's), for each kind."""
    import subprocess
    import types

    import numpy as np

    from o3edge.engine import sampling_np

    samplers = {"now": sampling_np}
    if a.against:
        old = types.ModuleType("sampling_np_old")
        src = subprocess.run(["git", "show", f"{a.against}:o3edge/engine/sampling_np.py"], capture_output=True,
                             text=True, check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        exec(compile(src.stdout, "sampling_np_old", "exec"), old.__dict__)
        samplers[a.against] = old
    logits = (np.random.default_rng(0).standard_normal((1, a.vocab)) * a.scale).astype(np.float32)
    out = {}
    for name, params in KINDS.items():
        if name.startswith("wide"):  # the CPU sampler has no such way
            continue
        for label, module in samplers.items():
            rngs = [module.make_rng(params, 1)]
            times = []
            for _ in range(a.repeat):
                t = time.perf_counter()
                for _ in range(a.replays // 4):
                    module.sample(logits, [params], rngs)
                times.append((time.perf_counter() - t) / (a.replays // 4) * 1e3)
            out[f"{name}, {label}"] = round(statistics.median(times), 3)
            print(f"{name}, {label}: {out[f'{name}, {label}']} ms", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--numpy", action="store_true", help="the native CPU backend's sampler (ms a draw)")
    ap.add_argument("--against", help="--numpy: also the sampler of this git revision")
    ap.add_argument("--scale", type=float, default=3.0,
                    help="the logits' standard deviation (1: a flat row, whose nucleus is most of it)")
    a = ap.parse_args()
    if a.numpy:
        out = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "vocab": a.vocab, "scale": a.scale,
               "ms": numpy_ms(a)}
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    dev = torch.device("cuda")
    out = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "command": " ".join(sys.argv), "vocab": a.vocab, "scale": a.scale,
           "top_k_by": "torch.topk" if os.environ.get("O3EDGE_TRITON_TOPK") == "0" else "triton", "us": {}}
    for B in [int(b) for b in a.batches.split(",")]:
        logits = torch.randn(B, a.vocab, device=dev) * a.scale
        greedy = logits.argmax(-1)
        seeds, counters = torch.arange(B, device=dev), torch.full((B,), 7, device=dev)
        row = {"greedy argmax": replay_us(lambda: logits.argmax(-1), a.replays, a.repeat),
               f"torch.topk {TOP_K_CAP}": replay_us(lambda: torch.topk(logits, TOP_K_CAP, dim=-1), a.replays, a.repeat),
               "torch.sort": replay_us(lambda: torch.sort(logits, dim=-1, descending=True), a.replays, a.repeat)}
        race = torch.tensor(counter_settings([KINDS["race (T 1.0)"]] * B, a.vocab), dtype=torch.float32, device=dev)
        row["draw race alone (no top-k, no cut)"] = replay_us(
            lambda: counter_sample(logits, greedy, race, seeds, counters, topk=False, nucleus=False, wide=False),
            a.replays, a.repeat)
        for name, params in KINDS.items():
            rows = counter_settings([params] * B, a.vocab)
            cfg = torch.tensor(rows, dtype=torch.float32, device=dev)
            ways = dict(ways_needed(rows), topk=True)  # what the decode step's sampling graph runs for them
            fn = (lambda c=cfg, w=ways: counter_sample(logits, greedy, c, seeds, counters, **w))
            row[f"draw {name}"] = replay_us(fn, a.replays, a.repeat)
        out["us"][B] = {k: round(v, 2) for k, v in row.items()}
        print(f"B={B}", json.dumps(out["us"][B]), flush=True)
    print("\n| part (µs a replay) | " + " | ".join(f"B={b}" for b in out["us"]) + " |")
    print("|---|" + "---:|" * len(out["us"]))
    for k in next(iter(out["us"].values())):
        print(f"| {k} | " + " | ".join(f"{out['us'][b][k]:.1f}" for b in out["us"]) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
