#!/usr/bin/env python3
"""CPU: the ONNX export run by ONNX Runtime beside the torch engine, same checkpoint, same run.

Batch 1, a 128-token prompt and 64 greedy tokens, whole generations timed from outside; distinct
prompts for every run. ONNX Runtime decodes with the graph's own KV outputs (no paging, no prefix
reuse). Writes JSON with --json.

  python tools/bench_onnx.py [--shape smol-135m] [--threads 2] [--runs 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from o3edge import O3Config, O3Model  # noqa: E402
from o3edge.engine.sequence import SamplingParams  # noqa: E402
from o3edge.export.onnx_export import export_onnx  # noqa: E402
from tools.make_tiny_model import SHAPES  # noqa: E402

PROMPT, NEW = 128, 64


def prompt(seed: int, vocab: int) -> list[int]:
    return torch.randint(100, vocab - 1, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()


def bench_torch(path, threads, runs, vocab, int4):
    m = O3Model.from_config(O3Config(model_path=path, device="cpu", dtype="float32", num_threads=threads,
                                     int4_ffn=int4, int4_group_size=64, kv_cache_memory_mb=64, max_model_len=512))
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    m.generate_batch([prompt(0, vocab)], params)
    rows = []
    for i in range(runs):
        t0 = time.perf_counter()
        r = m.generate_batch([prompt(100 + i, vocab)], params)[0]
        wall = time.perf_counter() - t0
        rows.append((r.ttft_s, (NEW - 1) / (wall - r.ttft_s)))
    return rows


def bench_ort(onnx_dir, threads, runs, vocab):
    from o3edge.export.ort_engine import OrtDecoder

    dec = OrtDecoder(onnx_dir, ["CPUExecutionProvider"], threads)
    dec.greedy([prompt(0, vocab)], 4)
    rows = []
    for i in range(runs):
        ids = prompt(100 + i, vocab)
        t0 = time.perf_counter()
        logits, past = dec.forward(ids, 0, dec.empty_past())
        tok = int(logits[-1].argmax())
        ttft = time.perf_counter() - t0
        for n in range(1, NEW):
            logits, past = dec.forward([tok], PROMPT + n - 1, past)
            tok = int(logits[-1].argmax())
        rows.append((ttft, (NEW - 1) / (time.perf_counter() - t0 - ttft)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smol-135m", choices=sorted(SHAPES))
    ap.add_argument("--model", help="checkpoint to use (default: a random one of --shape)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    name = os.path.basename(os.path.normpath(a.model)) if a.model else a.shape
    root = os.path.join(tempfile.gettempdir(), f"o3edge-onnx-bench-{name}")
    path = a.model or os.path.join(root, "ckpt")
    if not os.path.exists(os.path.join(path, "config.json")):
        from o3edge.tiny import make_checkpoint

        make_checkpoint(path, **SHAPES[a.shape])
    with open(os.path.join(path, "config.json")) as fh:
        vocab = json.load(fh)["vocab_size"]
    for name, group in (("fp32", 0), ("int4", 64)):
        if not os.path.exists(os.path.join(root, name, "onnx.json")):
            export_onnx(path, os.path.join(root, name), int4_group=group)
    res = {"shape": a.shape, "model": path, "threads": a.threads, "date": time.strftime("%Y-%m-%d %H:%M"),
           "load_avg": os.getloadavg(), "command": " ".join(sys.argv), "rows": {}}
    variants = [("torch fp32", lambda: bench_torch(path, a.threads, a.runs, vocab, False)),
                ("onnxruntime fp32", lambda: bench_ort(os.path.join(root, "fp32"), a.threads, a.runs, vocab)),
                ("torch INT4-FFN g64", lambda: bench_torch(path, a.threads, a.runs, vocab, True)),
                ("onnxruntime INT4-FFN g64 (MatMulNBits)",
                 lambda: bench_ort(os.path.join(root, "int4"), a.threads, a.runs, vocab))]
    print(f"| {a.shape}, {a.threads} threads | TTFT 128 (ms) | decode tok/s |\n|---|---:|---:|")
    for name, fn in variants:
        rows = fn()
        r = {"ttft_ms": statistics.median(t for t, _ in rows) * 1e3, "tok_s": statistics.median(s for _, s in rows)}
        res["rows"][name] = r
        print(f"| {name} | {r['ttft_ms']:.0f} | {r['tok_s']:.1f} |", flush=True)
    res["load_avg_after"] = os.getloadavg()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
