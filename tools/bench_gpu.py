#!/usr/bin/env python3
"""GPU benchmark: o3edge against Hugging Face transformers in the same run, same checkpoint.

Measures time to first token for a 128-token prompt and decode tokens/s at batch 1, 8 and 32
(128 new greedy tokens), with NVML board energy (tokens per joule) when pynvml is present.

  python tools/bench_gpu.py --shape llama-1b [--dtype bfloat16] [--skip-hf] [--json OUT]
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
from tools.make_tiny_model import SHAPES  # noqa: E402

PROMPT_LEN, NEW = 128, 128


class Energy:
    """NVML board energy counter (mJ); None when unavailable."""

    def __init__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self.h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            self.read = lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(self.h) / 1000.0
            self.read()
        except Exception:
            self.read = None

    def joules(self, fn, min_seconds: float = 3.0):
        """Repeat fn for at least min_seconds; return (calls, joules, seconds).

        The counter advances in ~100 ms steps, so a window of 3 s keeps its edge error near 3%.
        """
        torch.cuda.synchronize()
        e0, t0, calls = (self.read() if self.read else None), time.perf_counter(), 0
        while calls == 0 or time.perf_counter() - t0 < min_seconds:
            fn()
            calls += 1
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        return calls, (self.read() - e0 if e0 is not None else None), secs


def prompts(vocab: int, batch: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 30000), (batch, PROMPT_LEN), generator=g).tolist()


def bench_o3(path, dtype, batches, energy, int4=False):
    model = O3Model.from_config(O3Config(model_path=path, device="cuda", dtype=dtype, max_model_len=1024,
                                         max_num_seqs=max(batches), kv_cache_memory_mb=4096, int4_ffn=int4))
    e = model.engine
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    model.generate_batch(prompts(e.info.args.vocab_size, 2, seed=99), params)  # warm-up
    ttfts = []
    for i in range(5):
        ids = prompts(e.info.args.vocab_size, 1, seed=10 + i)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e.add_request(f"ttft{i}", ids[0], SamplingParams(max_new_tokens=1))
        while e.has_unfinished_requests():
            e.step()
        ttfts.append(time.perf_counter() - t0)
    rows = {"ttft_ms": statistics.median(ttfts) * 1e3}
    for B in batches:
        ps = prompts(e.info.args.vocab_size, B, seed=B)
        steps = []

        def generate():
            """Prefill (untimed for tok/s) then decode; energy covers both."""
            for i, p in enumerate(ps):
                e.add_request(f"b{B}-{len(steps)}-{i}", p, params)
            e.step()
            while e.has_unfinished_requests():
                t = time.perf_counter()
                e.step()
                steps.append(time.perf_counter() - t)
        calls, joules, _ = energy.joules(generate)
        step_s = statistics.median(steps)
        rows[f"b{B}"] = dict(tok_s=B / step_s, step_ms=step_s * 1e3,
                             tok_j=(calls * B * NEW / joules) if joules else None)
    return rows


def bench_hf(path, dtype, batches, energy):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).cuda().eval()
    vocab = model.config.vocab_size

    def gen(ids, n):
        x = torch.tensor(ids, device="cuda")
        with torch.no_grad():
            return model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    gen(prompts(vocab, 1), 4)
    ttfts = []
    for i in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen(prompts(vocab, 1, seed=10 + i), 1)
        torch.cuda.synchronize()
        ttfts.append(time.perf_counter() - t0)
    rows = {"ttft_ms": statistics.median(ttfts) * 1e3}
    for B in batches:
        ps = prompts(vocab, B, seed=B)
        c1, _, s1 = energy.joules(lambda: gen(ps, 1), min_seconds=0)
        calls, joules, sn = energy.joules(lambda: gen(ps, NEW), min_seconds=0)
        step_s = (sn / calls - s1 / c1) / (NEW - 1)  # decode time per step, prefill taken off
        rows[f"b{B}"] = dict(tok_s=B / step_s, step_ms=step_s * 1e3,
                             tok_j=(calls * B * NEW / joules) if joules else None)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--int4", action="store_true", help="also run o3edge with INT4 FFN weights")
    ap.add_argument("--model", help="existing checkpoint dir (default: make one with random weights)")
    ap.add_argument("--json")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    path = a.model
    if path is None:
        from o3edge.tiny import make_checkpoint

        path = os.path.join(tempfile.gettempdir(), f"o3edge-bench-{a.shape}")
        if not os.path.exists(os.path.join(path, "config.json")):
            print(f"making {a.shape} checkpoint in {path}", flush=True)
            make_checkpoint(path, **SHAPES[a.shape])
    energy = Energy()
    results = {"shape": a.shape, "dtype": a.dtype, "gpu": torch.cuda.get_device_name(),
               "date": time.strftime("%Y-%m-%d"), "o3edge": bench_o3(path, a.dtype, batches, energy)}
    print("o3edge", json.dumps(results["o3edge"]), flush=True)
    if a.int4:
        torch.cuda.empty_cache()
        results["o3edge INT4-FFN"] = bench_o3(path, a.dtype, batches, energy, int4=True)
        print("o3edge INT4-FFN", json.dumps(results["o3edge INT4-FFN"]), flush=True)
    if not a.skip_hf:
        torch.cuda.empty_cache()
        results["transformers"] = bench_hf(path, a.dtype, batches, energy)
        print("transformers", json.dumps(results["transformers"]), flush=True)
    print(table(results))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)


def table(r) -> str:
    lines = [f"{r['shape']} {r['dtype']} on {r['gpu']} ({r['date']})", "",
             "| system | TTFT 128 (ms) | " + " | ".join(f"{k} tok/s (step ms, tok/J)" for k in r["o3edge"]
                                                         if k != "ttft_ms") + " |",
             "|---|---|" + "---|" * (len(r["o3edge"]) - 1)]
    for name in ("o3edge", "o3edge INT4-FFN", "transformers"):
        if name not in r:
            continue
        row = r[name]
        cells = [f"{v['tok_s']:.0f} ({v['step_ms']:.2f}, {v['tok_j']:.2f})" if v["tok_j"] else
                 f"{v['tok_s']:.0f} ({v['step_ms']:.2f}, n/a)" for k, v in row.items() if k != "ttft_ms"]
        lines.append(f"| {name} | {row['ttft_ms']:.1f} | " + " | ".join(cells) + " |")
    if "transformers" in r:
        ratios = [f"{k}: {r['o3edge'][k]['tok_s'] / r['transformers'][k]['tok_s']:.1f}x" for k in r["o3edge"]
                  if k != "ttft_ms"]
        lines.append("")
        lines.append("o3edge / transformers decode: " + ", ".join(ratios))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
