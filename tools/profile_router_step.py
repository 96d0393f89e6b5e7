#!/usr/bin/env python3
"""Where a token-router decode step's time goes on the GPU: graph replay, the observation's books,
routing, and the rest of the engine step, for refresh steps and ordinary ones.

  python tools/profile_router_step.py [--setting router-int8] [--shape llama-1b] [--context 4096]
                                      [--batch 16] [--steps 128] [--trace | --replays N | --prompts] [--json OUT]

Same engine and prompts as `tools/bench_router.py --gpu`. Each part is wrapped with a timer that
synchronizes the device before and after it, so the parts do not overlap as they do in a normal run
(launch ahead is off here): the figures say what each part costs, not what a step costs.

With --prompts the prompt steps are profiled instead: one prompt a step, beside the sequences already
decoding (a new arrival's step), each step's wall time, and the host operations and GPU kernels with the
most time of their own.

With --replays N, once the decode is over, the step's graph (and the router's observing one) is replayed
N times back to back under torch.profiler, as `tools/bench_router.py --gpu` times it (graph_replay_ms): the
GPU's step alone, with the host out of the way. It reports each graph's span a replay, the kernels' busy time
inside it (the rest: gaps between kernels), and each kernel's time a replay, so that two settings' GPU steps
can be compared kernel by kernel (`--setting off` too).

With --trace the steps run as in a normal run (launched ahead, no timers) under torch.profiler, and each
engine step reports how long the GPU sat idle while the host was in that step (what the host's work
left it waiting for), by kind: refresh steps, the step after each, the others; the host operations with
the most time of their own in each kind of step; and the GPU's time a decode step by kernel over the whole
run (a refresh step's own kernels count once in `router_refresh_steps` steps, 32 by default). `--setting
off` traces full precision's steps for comparison. `TRITON_INTERPRET=1 ... --trace --device cpu --shape
tiny --context 64 --batch 2 --steps 20` runs it on the CPU (Triton's interpreter: no GPU figures, a check
that it runs). `--shape model` runs the
built-in long-context reference model (or --model) on held-out stdlib docstrings, as bench_router.py does.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import itertools
import json
import os
import statistics
import sys
import time

import torch

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)

import bench_router  # noqa: E402

from o3edge.engine.router import KVRouter  # noqa: E402
from o3edge.engine.router_graph import RouterDecodeGraphs  # noqa: E402
from o3edge.engine.sequence import SamplingParams  # noqa: E402

TIMES: dict[str, list[float]] = collections.defaultdict(list)


def timed(cls, name: str, label: str) -> None:
    """Wrap cls.name with a synchronizing timer recorded under label."""
    fn = getattr(cls, name)

    def wrapper(self, *args, **kw):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(self, *args, **kw)
        torch.cuda.synchronize()
        TIMES[label].append((time.perf_counter() - t) * 1e3)
        return out

    setattr(cls, name, wrapper)


def labelled(cls, name: str) -> None:
    """Wrap cls.name in a torch.profiler range of its own name (no synchronization)."""
    from torch.profiler import record_function

    fn = getattr(cls, name)

    def wrapper(self, *args, **kw):
        with record_function(f"{cls.__name__}.{name}"):
            return fn(self, *args, **kw)

    setattr(cls, name, wrapper)


def busy_union(spans: list[tuple[float, float]]) -> float:
    """The length of the union of sorted (start, end) spans."""
    busy, last = 0.0, float("-inf")
    for k0, k1 in spans:
        lo = max(k0, last)
        if k1 > lo:
            busy, last = busy + k1 - lo, k1
    return busy


def trace(eng, a) -> dict:
    """The decode steps under torch.profiler, launched ahead as in a normal run: per engine step, the GPU's
    idle time inside the step's host window; medians by kind, and the refresh steps' busiest host ops."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = a.device == "cuda"
    from o3edge.engine.cuda_graph import DecodeGraphs
    from o3edge.engine.router_blocks import RouterBlocks
    from o3edge.engine.scheduler import Scheduler

    for cls, name in ((RouterDecodeGraphs, "_ran"), (RouterDecodeGraphs, "_taken"),
                      (KVRouter, "observed_in_graph"), (KVRouter, "prepare_routing"), (KVRouter, "end_step"),
                      (RouterDecodeGraphs, "_observe_and_route"),
                      (KVRouter, "flush_moves"), (DecodeGraphs, "run"),
                      (DecodeGraphs, "fill_meta"), (RouterDecodeGraphs, "fill_meta"), (Scheduler, "schedule"),
                      (RouterBlocks, "mark_computed")):
        labelled(cls, name)  # their host time of their own shows under their names
    kinds, router = [], eng.runner.router
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        while eng.has_unfinished_requests():
            kind = bench_router.step_kind(router, kinds[-1] if kinds else None)
            with record_function(f"engine step {len(kinds)}"):
                eng.step()
            kinds.append(kind)
        if cuda:
            torch.cuda.synchronize()
    events = prof.events()
    windows = sorted((e.time_range.start, e.time_range.end, int(e.name.rsplit(" ", 1)[1])) for e in events
                     if e.name.startswith("engine step "))
    gpu = sorted((e.time_range.start, e.time_range.end) for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    rows = collections.defaultdict(lambda: collections.defaultdict(list))
    host_ops: dict = collections.defaultdict(collections.Counter)
    starts = [k0 for k0, _ in gpu]
    for start, end, i in windows:  # the kernels' union inside the window
        near = itertools.takewhile(lambda k: k[0] < end, gpu[bisect.bisect_left(starts, start - 100_000):])
        busy = busy_union([(max(k0, start), min(k1, end)) for k0, k1 in near])
        rows[kinds[i]]["wall_ms"].append((end - start) / 1e3)
        rows[kinds[i]]["gpu_idle_ms"].append((end - start - busy) / 1e3)
    host = sorted((e.time_range.start, e.name, e.self_cpu_time_total) for e in events
                  if e.device_type == torch.autograd.DeviceType.CPU and not e.name.startswith("engine step "))
    host_starts = [t for t, _, _ in host]
    for start, end, i in windows:  # each step's host operations, by their own time
        for _, name, own in host[bisect.bisect_left(host_starts, start):bisect.bisect_left(host_starts, end)]:
            host_ops[kinds[i]][name] += own / 1e3
    kernels: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in events:  # GPU time by kernel over the whole decode (refresh steps' own kernels run once in 32 by default)
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name][0] += 1
            kernels[e.name][1] += (e.time_range.end - e.time_range.start) / 1e3
    n_steps = {kind: max(1, kinds.count(kind)) for kind in set(kinds)}
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:20]
    return {"setting": a.setting, "shape": a.shape, "context": a.context, "batch": a.batch, "device": a.device,
            "launch_ahead": True, "steps": len(kinds),
            "steps_launched_ahead": eng.runner.graphs.num_ahead_taken,
            "by_kind_median_ms": {kind: {**{k: round(statistics.median(v), 3) for k, v in r.items()},
                                         "n": len(r["wall_ms"])} for kind, r in rows.items()},
            "host_ops_ms_per_step": {kind: {name: round(ms / n_steps[kind], 3) for name, ms in ops.most_common(15)}
                                     for kind, ops in host_ops.items()},
            "gpu_kernels_per_decode_step": {name[:90]: {"calls": round(n / len(kinds), 2),
                                                        "ms": round(ms / len(kinds), 4)} for name, (n, ms) in top},
            "gpu_ms_per_decode_step": round(sum(ms for _, ms in kernels.values()) / len(kinds), 3)}


def replays(eng, a) -> dict:
    """The decode's last graph step (and the router's observing one) replayed a.replays times back to back
    under torch.profiler: each graph's span a replay (first kernel's start to last kernel's end, over the
    replays), the kernels' busy time inside it, and each kernel's time and calls a replay."""
    from torch.profiler import ProfilerActivity, profile

    graphs = eng.runner.graphs
    B = next(b for b in graphs.batch_buckets if b >= a.batch)
    out = {"setting": a.setting, "shape": a.shape, "context": a.context, "batch": a.batch, "bucket": B,
           "device": torch.cuda.get_device_name() if a.device == "cuda" else a.device, "replays": a.replays,
           "timed_by_events": bench_router.replay_ms(graphs, a.batch)}
    for name, table in (("graph", graphs.graphs), ("observing graph", getattr(graphs, "observe_graphs", {}))):
        if (B, 0) not in table:
            continue
        graph = table[(B, 0)][0]
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.replays):
                graph.replay()
            torch.cuda.synchronize()
        gpu = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
        kernels: dict = collections.defaultdict(lambda: [0, 0.0])
        for k0, k1, kname in gpu:
            kernels[kname][0] += 1
            kernels[kname][1] += (k1 - k0) / 1e3
        n = a.replays
        out[name] = {"span_ms": round((max(k1 for _, k1, _ in gpu) - gpu[0][0]) / 1e3 / n, 4),
                     "busy_ms": round(busy_union([(k0, k1) for k0, k1, _ in gpu]) / 1e3 / n, 4),
                     "kernels": {kname[:90]: {"calls": round(c / n, 2), "ms": round(ms / n, 4)}
                                 for kname, (c, ms) in sorted(kernels.items(), key=lambda kv: -kv[1][1])}}
    return out


def prompt_steps(eng, a) -> dict:
    """The prompt steps (each one prompt, beside the sequences already decoding) under torch.profiler, after
    the first four (Triton's first compilations): wall time of each, and the host operations and GPU
    kernels with the most time of their own, per step."""
    from torch.profiler import ProfilerActivity, profile

    walls, n = [], 0
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device == "cuda" else []))
    while bench_router.prefilling(eng):
        if n == 4:
            prof.start()
        t = time.perf_counter()
        eng.step()  # returns the prompt's first token to the host: the step is done
        walls.append(round((time.perf_counter() - t) * 1e3, 3))
        n += 1
    prof.stop()
    traced = max(1, n - 4)
    host, gpu = collections.Counter(), collections.Counter()
    for ev in prof.key_averages():
        host[ev.key] += ev.self_cpu_time_total / 1e3 / traced
        gpu[ev.key] += getattr(ev, "self_device_time_total", 0) / 1e3 / traced
    return {"setting": a.setting, "shape": a.shape, "context": a.context, "batch": a.batch, "prompt_steps_ms": walls,
            "traced_steps": traced,
            "host_self_ms_per_step": {k: round(v, 3) for k, v in host.most_common(25)},
            "gpu_ms_per_step": {k: round(v, 3) for k, v in gpu.most_common(15) if v > 0}}


def _median(xs: list[float]) -> float | None:
    """The median in ms to 3 decimals; None without any (a setting with no refresh steps, such as uniform INT8)."""
    return round(statistics.median(xs), 3) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", default="router-int8")
    ap.add_argument("--shape", default="llama-1b", help="a make_tiny_model.py shape, or model: --model's checkpoint")
    ap.add_argument("--model", default=None, help="--shape model: checkpoint (default: the built-in reference model)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--workdir", default="/tmp/o3edge-bench-router")
    ap.add_argument("--json")
    ap.add_argument("--replays", type=int, default=0,
                    help="once the decode is over, its graph step replayed this many times under the profiler")
    ap.add_argument("--trace", action="store_true", help="launch ahead on, no timers: the GPU's idle time by step")
    ap.add_argument("--prompts", action="store_true",
                    help="profile the prompt steps instead (one prompt a step beside the sequences decoding)")
    ap.add_argument("--device", default="cuda", help="--trace: cuda, or cpu for a check under the interpreter")
    a = ap.parse_args()
    if a.setting == "off" and not (a.trace or a.replays):  # no router: its steps are DecodeGraphs'
        ap.error("--setting: a router setting (router-int8, router-int4, ...); off has no router steps")
    path, prompts, _ = bench_router.decode_checkpoint(a)  # as bench_router.py --gpu makes them
    bench_router.SETTINGS.update(bench_router.FLOOR_GPU)
    dtype = "bfloat16" if a.device == "cuda" else "float32"
    eng = bench_router.decode_engine(path, a.setting, a.device, dtype, None, a, cuda_graphs=True,
                                     router_cuda_graphs=True)
    if a.device != "cuda":
        bench_router.uncaptured_graphs(eng, a.batch)
    eng.runner.graphs.launch_ahead = a.trace
    for i, ids in enumerate(prompts):
        eng.add_request(str(i), ids, SamplingParams(max_new_tokens=a.steps, ignore_eos=True))
    if a.prompts:
        return report(prompt_steps(eng, a), a.json)
    while bench_router.prefilling(eng):
        eng.step()
    if a.trace:
        return report(trace(eng, a), a.json)
    if a.replays:
        eng.runner.graphs.launch_ahead = True
        while eng.has_unfinished_requests():
            eng.step()
        return report(replays(eng, a), a.json)
    timed(RouterDecodeGraphs, "_step", "graph step (replay)")
    timed(KVRouter, "observed_in_graph", "observation's books")
    timed(KVRouter, "prepare_routing", "routing's saliency read (prepare_routing)")
    timed(RouterDecodeGraphs, "_observe_and_route", "observation's books and routing in one graph")
    timed(KVRouter, "end_step", "routing (end_step)")
    steps = []
    while eng.has_unfinished_requests():
        refresh = eng.runner.router.observing_now()
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        steps.append(((time.perf_counter() - t) * 1e3, refresh))
    # the parts come in step order: observation books only on refresh steps
    kinds = [r for _, r in steps]
    out = {"setting": a.setting, "shape": a.shape, "context": a.context, "batch": a.batch,
           "device": torch.cuda.get_device_name(), "parts_ms": {}}
    for label, xs in TIMES.items():
        if label in ("observation's books", "observation's books and routing in one graph"):
            out["parts_ms"][label] = {"refresh": round(statistics.median(xs), 3), "n": len(xs)}
            continue
        ref = [x for x, k in zip(xs, kinds) if k]
        other = [x for x, k in zip(xs, kinds) if not k]
        out["parts_ms"][label] = {"refresh": _median(ref), "other": _median(other), "n": len(xs)}
    out["engine_step_ms"] = {"refresh": _median([x for x, k in steps if k]),
                             "other": _median([x for x, k in steps if not k]),
                             "refresh_steps": sum(kinds), "steps": len(steps)}
    report(out, a.json)


def report(out: dict, path: str | None) -> None:
    """Print out as JSON, and write it to path when given."""
    print(json.dumps(out, indent=1))
    if path:
        with open(path, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
