#!/usr/bin/env python3
"""Decode attention alone on the GPU: the full-precision kernel against the router's two-pool kernel,
at one batch and context, over tilings and key splits (which is faster, and how near the bandwidth).

    python tools/bench_attention.py [--shape llama-1b] [--batch 16] [--context 4096] [--grid] [--json out.json]
                                    [--observe --splits 1]   # a refresh step's observing attention

Cases: `off` (kernels/decode_attention.py over bf16 K/V), `int8` and `int4` (kernels/quant_attention.py
with every sealed block compressed, as uniform INT8/INT4 KV), `int8-half` (half the blocks compressed,
as the router with half its tokens salient; `int8-0.73`: that share, as the trained model's at 16 x 3,840),
`int8-none` (the router's kernel with nothing compressed, as on random weights or early in a sequence: the
same bytes as `off`). Block tables are shuffled as a long-running pool's are.
Each case is timed as a CUDA graph of 50 calls replayed 10 times (µs a call, median of 5 replays), and
its bytes (K/V read, codes and scales) over that time give GB/s. Without --grid, each case runs at
the engine's planned tiling and splits (cuda_graph.attention_splits: eight programs per SM for the
full-precision kernel, at most four (INT8) or three (INT4) for the router's, as router_graph.py plans
them); with it, also over key splits and tilings, so a better plan shows up beside the planned one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# H, KVH, hd; ref-long: the built-in long-context reference model (o3edge/models/o3edge-ref-long-int4)
SHAPES = {"llama-1b": (32, 8, 64), "tinyllama-1.1b": (32, 4, 64), "qwen-1.5b": (12, 2, 128), "ref-long": (8, 2, 64)}


def setup(case: str, B: int, ctx: int, H: int, KVH: int, hd: int, bs: int, dtype, device: str):
    """The kernel's inputs for `case`: (qkv, cos, sin, meta, k_cache, v_cache, codes, scales, rotation,
    bytes read a call)."""
    from o3edge.engine.kv_quant import bytes_per_vector, hadamard, quantize

    g = torch.Generator().manual_seed(0)
    per_seq = -(-(ctx + 1) // bs)
    full_blocks = B * per_seq
    qkv = torch.randn(B, (H + 2 * KVH) * hd, generator=g).to(device, dtype)
    freqs = torch.arange(ctx + 1)[:, None] / 10000 ** (torch.arange(0, hd, 2) / hd)
    cos = torch.cat((freqs, freqs), -1).cos().to(device)
    sin = torch.cat((freqs, freqs), -1).sin().to(device)
    k_cache = torch.randn(full_blocks * bs, KVH, hd, generator=g).to(device, dtype)
    v_cache = torch.randn(full_blocks * bs, KVH, hd, generator=g).to(device, dtype)
    order = torch.randperm(full_blocks, generator=g).to(torch.int32)
    if case == "off":
        meta = torch.zeros(B, 3 + per_seq, dtype=torch.int32)
        for b in range(B):
            table = order[b * per_seq:(b + 1) * per_seq]
            meta[b, :3] = torch.tensor([1, ctx, int(table[ctx // bs]) * bs + ctx % bs])
            meta[b, 3:] = table
        read = B * ctx * KVH * hd * 2 * k_cache.element_size()
        return qkv, cos, sin, meta.to(device), k_cache, v_cache, None, None, None, read
    mode = case.split("-")[0]
    share = compressed_share(case)
    n_comp = int(ctx // bs * share)
    n_full = ctx - n_comp * bs
    rot = hadamard(hd, device=device) if mode == "int4" else None
    comp = torch.randperm(B * n_comp, generator=g).to(torch.int32)
    codes, scales = quantize(torch.randn(2, max(1, B * n_comp) * bs, KVH, hd, generator=g).to(device), mode, rot)
    mb = per_seq
    meta = torch.zeros(B, 5 + 2 * mb, dtype=torch.int32)
    for b in range(B):
        table = order[b * per_seq:(b + 1) * per_seq]
        meta[b, :5] = torch.tensor([1, ctx, int(table[n_full // bs]) * bs + n_full % bs, n_full, n_comp])
        meta[b, 5:5 + mb] = table
        meta[b, 5 + mb:5 + mb + n_comp] = comp[b * n_comp:(b + 1) * n_comp]
    read = B * KVH * (n_full * hd * 2 * k_cache.element_size()
                      + n_comp * bs * 2 * (bytes_per_vector(mode, hd)))
    return qkv, cos, sin, meta.to(device), k_cache, v_cache, codes, scales, rot, read


def compressed_share(case: str) -> float:
    """The share of a router case's sealed blocks that are compressed: `int8` every one, `-half` half, `-none`
    none, `-0.73` (a number) that share, as the trained model's 73% at 16 x 3,840 tokens."""
    tail = case.split("-")[-1] if "-" in case else ""
    named = {"half": 0.5, "none": 0.0, "": 1.0}
    return named[tail] if tail in named else float(tail)


def time_call(fn, calls: int = 50, replays: int = 10) -> float:
    """µs a call: fn captured `calls` times in a CUDA graph (bench_gemv.time_graph), replayed `replays`
    times; the median of 5 timings."""
    from bench_gemv import time_graph

    return statistics.median(time_graph(lambda _: fn(), [None] * calls, replays) for _ in range(5))


def run_case(case: str, a, H: int, KVH: int, hd: int, configs) -> list[dict]:
    from o3edge.engine.kernels.decode_attention import decode_attention
    from o3edge.engine.kernels.quant_attention import router_decode_attention

    dtype = getattr(torch, a.dtype)
    qkv, cos, sin, meta, kc, vc, codes, scales, rot, read = setup(case, a.batch, a.context, H, KVH, hd,
                                                                   a.block_size, dtype, "cuda")
    rows = []
    mass = None
    if a.observe and case != "off":  # an observing refresh step's saliency rows (router_graph.py)
        mass = torch.zeros(a.batch, KVH, 2, (meta.shape[1] - 5) // 2 * a.block_size, device="cuda")
    for splits, config in configs:
        if case == "off":
            fn = lambda: decode_attention(qkv, cos, sin, meta, kc, vc, H, a.block_size, splits, config=config)  # noqa: E731
        else:
            mode = case.split("-")[0]
            fn = lambda: router_decode_attention(qkv, cos, sin, meta, kc, vc, codes, scales, rot, mode, H,  # noqa: E731
                                                 a.block_size, splits, config=config, mass=mass)
        try:
            us = time_call(fn)
        except Exception as exc:  # a tiling the compiler refuses (shared memory): recorded, not fatal
            rows.append(dict(case=case, splits=splits, config=config, error=str(exc).splitlines()[0][:160]))
            continue
        rows.append(dict(case=case, splits=splits, config=config, us=round(us, 2), bytes=read,
                         gb_s=round(read / us / 1e3, 1), observe=mass is not None))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def plot(result: dict, path: str) -> None:
    """µs a layer against key splits: one panel per case, one line per tiling (the engine's plan: None)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 3.6), squeeze=False)
    for ax, case in zip(axes[0], cases):
        rows = [r for r in result["rows"] if r["case"] == case and "us" in r]
        for config in dict.fromkeys(str(r["config"]) for r in rows):
            pts = sorted((r["splits"], r["us"]) for r in rows if str(r["config"]) == config)
            label = "as planned then" if config == "None" else config
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-" if len(pts) > 1 else "s", label=label)
        ax.set_title(case)
        ax.set_xlabel("key splits")
        ax.set_ylabel("µs a layer")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=6)
    fig.suptitle(f"decode attention, {result['shape']}, {result['batch']} x {result['context']} tokens, "
                 f"{result['gpu']} (config: BLOCK_N, [compressed keys a tile,] warps, stages)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cases", default="off,int8,int4,int8-half,int8-none")
    ap.add_argument("--grid", action="store_true")
    ap.add_argument("--splits", default=None, help="also these key splits at the planned tiling (comma-separated)")
    ap.add_argument("--configs", default=None,
                    help="also these tilings at the planned splits, a JSON list of [BLOCK_N, compressed keys a "
                         "tile, warps, stages] (router cases) or [BLOCK_N, warps, stages] (off)")
    ap.add_argument("--observe", action="store_true",
                    help="router cases observe saliency as a refresh step does: in one key split (--splits 1) "
                         "a second pass over the keys; in several, scores stored and observed after them")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG of µs a layer against key splits, one line per tiling")
    ap.add_argument("--from-json", default=None, help="plot an earlier --json instead of measuring")
    a = ap.parse_args()
    if a.from_json:
        with open(a.from_json) as fh:
            plot(json.load(fh), a.plot)
        return
    from o3edge.engine.cuda_graph import DecodeGraphs, attention_splits
    from o3edge.engine.router_graph import router_attention_per_sm
    from o3edge.engine.kernels import num_sms

    H, KVH, hd = SHAPES[a.shape]
    sms = num_sms("cuda")
    full_splits = attention_splits(a.batch, KVH, sms, DecodeGraphs.ATTENTION_PER_SM)
    router_splits = {mode: attention_splits(a.batch, KVH, sms, router_attention_per_sm(mode), True)
                     for mode in ("int8", "int4")}
    result = dict(shape=a.shape, batch=a.batch, context=a.context, block_size=a.block_size, dtype=a.dtype,
                  gpu=torch.cuda.get_device_name(), planned_splits=full_splits, router_splits=router_splits,
                  rows=[])
    for case in a.cases.split(","):
        planned = full_splits if case == "off" else router_splits[case.split("-")[0]]
        configs = [(planned, None)] + [(int(x), None) for x in (a.splits or "").split(",") if x]
        if a.configs:  # off: (BLOCK_N, warps, stages); the router's kernel: (BLOCK_N, compressed tile, warps, stages)
            configs += [(planned, tuple(c)) for c in json.loads(a.configs) if len(c) == (3 if case == "off" else 4)]
        if a.grid:
            splits = sorted({planned, 2 * planned, 4 * planned})
            if case == "off":
                tilings = [(bn, 4, st) for bn, st in itertools.product((32, 64), (2, 3))]
            else:
                tilings = [(32, ct, 4, st) for ct, st in itertools.product((64, 128), (2, 3))]
            configs += [(s, t) for s in splits for t in tilings]
        result["rows"] += run_case(case, a, H, KVH, hd, configs)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(result, fh, indent=1)
    if a.plot:
        plot(result, a.plot)
    for case in a.cases.split(","):
        ok = [r for r in result["rows"] if r["case"] == case and "us" in r]
        if ok:
            best = min(ok, key=lambda r: r["us"])
            print(f"{case}: planned {ok[0]['us']} us ({ok[0]['gb_s']} GB/s); best {best['us']} us "
                  f"({best['gb_s']} GB/s) at splits {best['splits']}, config {best['config']}")


if __name__ == "__main__":
    main()
