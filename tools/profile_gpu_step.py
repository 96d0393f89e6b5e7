#!/usr/bin/env python3
"""Profile one decode step on the GPU: kernels per layer, GPU time, and the graph's step time.

Runs the step several ways on the same engine and context (128-token prompt plus a few decoded tokens):
the eager model (the pre-fusion path: gather + SDPA + separate norms, RoPE and activations), the fused
decode step run eagerly (to count its kernels), the same step without the skinny matmuls (norm and
SiLU·mul as kernels of their own, projections on cuBLAS), and the captured graphs of both replayed back
to back (the step time the engine sees, without host work; also under other settings, --variants, such as
without programmatic dependent launch: kernels/pdl.py), against the floor: the bytes of the
weights over the GPU's memory bandwidth (--bandwidth, H200: 4.8 TB/s).

  python tools/profile_gpu_step.py --shape llama-1b --dtype bfloat16 [--int4] [--batch 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from functools import partial

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from o3edge import O3Config, O3Model  # noqa: E402
from o3edge.engine.cuda_graph import capture_graphs  # noqa: E402
from o3edge.engine.decode_step import decode_forward  # noqa: E402
from o3edge.engine.kernels import pdl  # noqa: E402
from o3edge.engine.sequence import SamplingParams  # noqa: E402
from tools.make_tiny_model import SHAPES  # noqa: E402


def kernels(fn, reps=5):
    """(kernels per call, GPU microseconds per call, top kernels) of fn under the profiler."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by = collections.Counter()
    t = collections.Counter()
    for e in evs:
        by[e.name[:60]] += 1
        t[e.name[:60]] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    total = sum(t.values()) / reps
    top = [(name, by[name] / reps, t[name] / reps) for name, _ in t.most_common(8)]
    return len(evs) / reps, total, top


def replay_ms(graph, reps: int = 200) -> float:
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--int4", action="store_true")
    ap.add_argument("--int4-all", action="store_true", help="with --int4: every linear in INT4")
    ap.add_argument("--int4-head", action="store_true", help="with --int4: the LM head in INT4 too")
    ap.add_argument("--int8", action="store_true", help="INT8 weights for every linear not in INT4 (int8_weights)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--model")
    ap.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s of the GPU's memory (H200)")
    ap.add_argument("--json")
    ap.add_argument("--variants", default="O3EDGE_PDL=0",
                    help="';'-separated environments (NAME=V,NAME=V) to capture and replay the step under too")
    a = ap.parse_args()
    path = a.model or os.path.join(tempfile.gettempdir(), f"o3edge-bench-{a.shape}")
    if not os.path.exists(os.path.join(path, "config.json")):
        from o3edge.tiny import make_checkpoint

        make_checkpoint(path, **SHAPES[a.shape])
    m = O3Model.from_config(O3Config(model_path=path, device="cuda", dtype=a.dtype, max_model_len=2048,
                                     max_num_seqs=max(32, a.batch), kv_cache_memory_mb=4096, int4_ffn=a.int4,
                                     int4_all=a.int4_all, int4_lm_head=a.int4_head, int8_weights=a.int8))
    e, r = m.engine, m.engine.runner
    g = torch.Generator().manual_seed(0)
    for i in range(a.batch):
        e.add_request(f"p{i}", torch.randint(100, 30000, (128,), generator=g).tolist(),
                      SamplingParams(max_new_tokens=1000, ignore_eos=True))
    for _ in range(4):
        e.step()
    batch = [(s, 1) for s in e.scheduler.running]
    graphs = r.graphs
    n = len(batch)
    B = next(b for b in graphs.batch_buckets if b >= n)
    graphs._launch(batch, B)  # the step's metadata in place (and the step run once)
    ids, pos, step = r.prepare(batch)
    out = {"shape": a.shape, "dtype": a.dtype, "int4": a.int4, "int4_all": a.int4_all, "int4_head": a.int4_head,
           "int8": a.int8, "batch": n, "layers": e.info.args.num_layers,
           "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M")}
    unfused = partial(decode_forward, r.model, graphs.meta[:B], r.cos, r.sin, r.kv_cache, graphs.block_size,
                      graphs.splits[B], fused=False)
    with torch.inference_mode():
        for name, fn in (("eager model (pre-fusion path)", lambda: r.model(ids, pos, r.cos, r.sin, step, r.kv_cache)),
                         ("fused decode step, uncaptured", lambda: graphs._forward((B, 0))),
                         ("decode step without skinny matmuls, uncaptured", unfused)):
            count, gpu_us, top = kernels(fn)
            out[name] = dict(kernels=count, kernels_per_layer=count / e.info.args.num_layers, gpu_us=gpu_us, top=top)
        out["graph_replay_ms"] = replay_ms(graphs.graphs[(B, 0)][0])  # a step's graph, its copies included
        out["pdl"] = pdl.enabled("cuda")
        out["variants"] = {}
        for variant in (a.variants.split(";") if a.variants else []):  # the same step captured again
            saved = dict(os.environ)
            os.environ.update(dict(kv.split("=") for kv in variant.split(",")))
            pdl.reload()
            out["variants"][variant] = replay_ms(capture_graphs([(B, 0)], graphs._forward, variant,
                                                                error_mode="thread_local")[(B, 0)][0])
            os.environ.clear()
            os.environ.update(saved)
            pdl.reload()
        plain = torch.cuda.CUDAGraph()
        with torch.cuda.graph(plain):
            unfused()
        out["graph_replay_ms_without_skinny"] = replay_ms(plain)
    weight_bytes = sum(t.numel() * t.element_size() for t in (*r.model.parameters(), *r.model.buffers()))
    if r.model.lm_head is not None:  # an embedding apart from the head (untied, or tied behind a quantized copy):
        # one row read a token
        weight_bytes -= r.model.embed.weight.numel() * r.model.embed.weight.element_size()
    out["weight_bytes"] = weight_bytes
    out["floor_ms"] = weight_bytes / a.bandwidth * 1e3
    out["floor_fraction"] = out["floor_ms"] / out["graph_replay_ms"]
    for k, v in out.items():
        if isinstance(v, dict) and "kernels" in v:
            print(f"{k}: {v['kernels']:.0f} kernels ({v['kernels_per_layer']:.1f} a layer), "
                  f"{v['gpu_us']:.0f} us of kernel time")
            for name, c, us in v["top"]:
                print(f"    {c:6.1f} x {us:8.1f} us  {name}")
    print(f"graph replay, back to back: {out['graph_replay_ms']:.3f} ms a step "
          f"(without skinny matmuls {out['graph_replay_ms_without_skinny']:.3f}"
          + "".join(f", {k} {v:.3f}" for k, v in out["variants"].items()) + f"); floor {out['floor_ms']:.3f} ms "
          f"({weight_bytes / 1e9:.2f} GB), {100 * out['floor_fraction']:.0f}% of the floor's speed")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
