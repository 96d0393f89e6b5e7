#!/usr/bin/env python3
"""GPU benchmark: o3edge beside llama.cpp and transformers, same checkpoint, same run.

Every figure is a whole generation timed from outside the engine: B distinct random 128-token
prompts (a new set for every generation, so prefix reuse never helps), 128 new greedy tokens each
(--sampled: also sampled ones, seeded: T 1.0; T 0.7, top-p 0.9, top-k 40; T 0.7, top-p 0.9).
  decode tok/s = B * 127 / (end of generation - the moment the last first token arrived)
  TTFT         = one 128-token prompt alone, request in to first token out (sampled kinds: drawn so)
  tokens/J     = generated tokens / NVML board energy over repeated whole generations (>= 3 s)
llama.cpp figures are parsed from the logs of `.peer/run.sh` (tools/bench_gpu_vs_llamacpp.sh runs it
in the same device call); transformers runs in this process.

  python tools/bench_gpu.py --shape tinyllama-1.1b --dtype float16 --int4 [--int4-all] [--int4-head] [--int8] [--int4-int8]
         [--sampled [--sampled-only TEXT]] [--model DIR]
         [--llamacpp BENCH_LOG,ENERGY_LOG] [--skip-hf] [--skip-base] [--json OUT] [--plot OUT.png]
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e peak; the floor is weight bytes / this


class Energy:
    """NVML board energy counter (J); read is None when unavailable."""

    def __init__(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            self.read = lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0
            self.read()
        except Exception:
            self.read = None


class Prompts:
    """A fresh set of distinct random prompts for every call."""

    def __init__(self, vocab: int):
        self.vocab, self.seed = vocab, 1000

    def __call__(self, n: int) -> list[list[int]]:
        self.seed += 1
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(100, min(self.vocab, 30000), (n, PROMPT_LEN), generator=g).tolist()


# --sampled: what chat clients send: the HTTP door's default (temperature 1.0, no filter), a common chat setting
# with top-k (the 64 largest logits suffice), and top-p alone (its cut selected over the whole vocabulary)
SAMPLED = {"o3edge sampled (T 1.0)": dict(temperature=1.0),
           "o3edge sampled (T 0.7, top-p 0.9, top-k 40)": dict(temperature=0.7, top_p=0.9, top_k=40),
           "o3edge sampled (T 0.7, top-p 0.9)": dict(temperature=0.7, top_p=0.9)}


def generation(model: O3Model, prompts: list[list[int]], sampling: dict | None = None) -> dict:
    """One whole generation, timed from outside: wall time, and decode rate after the last first token.
    sampling: SamplingParams fields for sampled requests (seeded); greedy without."""
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, **(dict(sampling, seed=1) if sampling else {}))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = model.generate_batch(prompts, params)
    wall = time.perf_counter() - t0
    last_first = max(r.ttft_s for r in results)
    B = len(prompts)
    assert all(len(r.token_ids) == NEW for r in results)
    return dict(wall_s=wall, decode_tok_s=B * (NEW - 1) / (wall - last_first), e2e_tok_s=B * NEW / wall)


ALL = "o3edge INT4 (all linears)"
HEAD = "o3edge INT4-FFN + INT4 LM head"
INT8 = "o3edge INT8 (all linears)"
INT4_INT8 = "o3edge INT4-FFN + INT8"
# each o3edge variant's weights: (attention projections, FFN, LM head) as "dense", "int4" or "int8"
WEIGHTS = {"o3edge INT4-FFN": ("dense", "int4", "dense"), HEAD: ("dense", "int4", "int4"),
           ALL: ("int4", "int4", "int4"), INT8: ("int8", "int8", "int8"), INT4_INT8: ("int8", "int4", "int8")}


def bench_o3(path, dtype, batches, energy, int4=False, kv_mb=8192, int4_all=False, int4_head=False,
             sampling: dict | None = None, int8=False):
    model = O3Model.from_config(O3Config(model_path=path, device="cuda", dtype=dtype, max_model_len=2048,
                                         max_num_seqs=max(batches), kv_cache_memory_mb=kv_mb, int4_ffn=int4,
                                         int4_all=int4_all, int4_lm_head=int4_head, int8_weights=int8,
                                         max_num_batched_tokens=max(2048, PROMPT_LEN * max(batches))))
    prompts = Prompts(model.engine.info.args.vocab_size)
    generation(model, prompts(2), sampling)  # warm-up, of the kind measured (a first draw of its kind compiles)
    ttfts = []
    params = SamplingParams(max_new_tokens=1, **(dict(sampling, seed=1) if sampling else {}))
    for _ in range(7):
        ttfts.append(model.generate_batch(prompts(1), params)[0].ttft_s)
    rows = {"ttft_ms": statistics.median(ttfts) * 1e3, "load_s": model.engine.info.load_seconds}
    graphs = model.engine.runner.graphs
    for B in batches:
        if graphs is not None:
            graphs.num_steps = graphs.num_ahead_taken = 0
        runs, e0, t0 = [], energy.read() if energy.read else None, time.perf_counter()
        while len(runs) < 3 or time.perf_counter() - t0 < 3.0:
            runs.append(generation(model, prompts(B), sampling))
        joules = energy.read() - e0 if e0 is not None else None
        rows[f"b{B}"] = dict(tok_s=statistics.median(r["decode_tok_s"] for r in runs),
                             e2e_tok_s=statistics.median(r["e2e_tok_s"] for r in runs),
                             tok_j=len(runs) * B * NEW / joules if joules else None, runs=len(runs))
        if graphs is not None:  # decode steps taken from the launch-ahead queue (cuda_graph.DecodeGraphs)
            rows[f"b{B}"].update(graph_steps=graphs.num_steps, steps_launched_ahead=graphs.num_ahead_taken)
    del model
    torch.cuda.empty_cache()
    return rows


def bench_hf(path, dtype, batches, energy):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).cuda().eval()
    prompts = Prompts(model.config.vocab_size)

    def gen(ids, n):
        with torch.no_grad():
            return model.generate(torch.tensor(ids, device="cuda"), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0)

    gen(prompts(1), 4)
    ttfts = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen(prompts(1), 1)
        torch.cuda.synchronize()
        ttfts.append(time.perf_counter() - t0)
    rows = {"ttft_ms": statistics.median(ttfts) * 1e3}
    for B in batches:
        ids = prompts(B)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gen(ids, 1)
        torch.cuda.synchronize()
        t1, e0 = time.perf_counter(), energy.read() if energy.read else None
        gen(ids, NEW)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t1
        joules = energy.read() - e0 if e0 is not None else None
        rows[f"b{B}"] = dict(tok_s=B * (NEW - 1) / (wall - (t1 - t0)), e2e_tok_s=B * NEW / wall,
                             tok_j=B * NEW / joules if joules else None, runs=1)
    return rows


def parse_llamacpp(bench_log: str, energy_log: str | None) -> dict:
    """llama-batched-bench rows (decode S_TG t/s per parallel streams) and tokens/J of run.sh energy."""
    out: dict = {}
    section = bench = None
    for line in open(bench_log):
        m = re.match(r"== (batched-bench|llama-bench) (\S+)", line)
        if m:
            bench, section = m.group(1), m.group(2)
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if bench == "batched-bench" and len(cells) >= 10 and cells[0].isdigit():
            b = int(cells[2])
            out.setdefault(f"llama.cpp {section}", {})[f"b{b}"] = dict(tok_s=float(cells[7]), tok_j=None)
        elif bench == "llama-bench" and len(cells) >= 8 and cells[5] == "1" and cells[6] == "pp128":
            # TTFT: the prompt's prefill (flash attention on, mean of llama-bench's runs)
            out.setdefault(f"llama.cpp {section}", {})["ttft_ms"] = 128 / float(cells[7].split()[0]) * 1e3
        m = re.match(r"hf bs=(\d+) ttft_ms=([\d.]+) tok_s=([\d.]+) tok_per_J=([\d.]+)", line)
        if m:  # transformers run by the peer script: whole generate() incl. prefill
            row = out.setdefault("transformers (peer script)", {})
            row[f"b{m.group(1)}"] = dict(tok_s=float(m.group(3)), tok_j=float(m.group(4)))
            if m.group(1) == "1":
                row["b1"]["ttft_ms"] = float(m.group(2))
    if energy_log and os.path.exists(energy_log):
        load_j, current = None, None
        for line in open(energy_log):
            m = re.match(r"== energy (\S+) npl=(\d+) ntg=(\d+)", line)
            if m:
                current = (m.group(1), int(m.group(2)), int(m.group(3)))
            elif line.startswith("== energy: load only"):
                current = "load"
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if isinstance(current, tuple) and len(cells) >= 10 and cells[0].isdigit():
                # the energy run's own batched-bench row: its decode speed, where no bench log gave one
                out.setdefault(f"llama.cpp {current[0]}", {}).setdefault(f"b{current[1]}", {}).setdefault(
                    "tok_s", float(cells[7]))
            m = re.search(r"ENERGY joules=([\d.]+)", line)
            if m and current == "load":
                load_j = float(m.group(1))
            elif m and current:
                q, npl, ntg = current
                out.setdefault(f"llama.cpp {q}", {}).setdefault(f"b{npl}", {})["_joules"] = (float(m.group(1)), npl * ntg)
        for row in out.values():
            for cell in row.values():
                if "_joules" in cell:
                    j, toks = cell.pop("_joules")
                    cell["tok_j"] = toks / (j - (load_j or 0.0))
    hf = out.get("transformers (peer script)", {})
    if "b1" in hf:
        hf["ttft_ms"] = hf["b1"].pop("ttft_ms", None)
    return {k: v for k, v in out.items() if any(key.startswith("b") for key in v)}


def weight_bytes(model_path: str, dtype: str, weights: tuple[str, str, str] = ("dense",) * 3) -> float:
    """Bytes one decode step must read: every weight once, the attention projections, the FFN and the LM head
    each dense, INT4 (4.25 bits with group scales) or INT8 (a float32 scale a row)."""
    from o3edge.engine.checkpoint import read_model_args

    a = read_model_args(model_path)
    per = {"dense": 4 if dtype == "float32" else 2, "int4": 0.5 + 4 / 128, "int8": 1 + 4 / a.hidden_size}
    attn = a.hidden_size * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim + a.num_heads * a.head_dim * a.hidden_size
    ffn = 3 * a.hidden_size * a.intermediate_size
    head = a.vocab_size * a.hidden_size
    return a.num_layers * (attn * per[weights[0]] + ffn * per[weights[1]]) + head * per[weights[2]]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tinyllama-1.1b", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-base", action="store_true", help="only the quantized systems asked for (not o3edge at "
                    "--dtype itself)")
    ap.add_argument("--int4", action="store_true", help="also run o3edge with INT4 FFN weights")
    ap.add_argument("--int4-all", action="store_true", help="also run o3edge with every linear in INT4")
    ap.add_argument("--int4-head", action="store_true", help="also run o3edge with INT4 FFN and LM head")
    ap.add_argument("--int8", action="store_true",
                    help="also run o3edge with INT8 weights: every linear, and beside INT4 FFN the rest")
    ap.add_argument("--int4-int8", action="store_true",
                    help="also run o3edge with INT4 FFN and INT8 weights for the rest (without --int8's every linear)")
    ap.add_argument("--sampled", action="store_true",
                    help="also run o3edge with sampled requests (seeded): T 1.0; T 0.7, top-p 0.9, top-k 40; "
                         "T 0.7, top-p 0.9")
    ap.add_argument("--sampled-only", metavar="TEXT", help="--sampled: only the kinds whose name holds TEXT, "
                    "e.g. 'top-p 0.9)' for top-p alone")
    ap.add_argument("--model", help="existing checkpoint dir (default: make one with random weights)")
    ap.add_argument("--llamacpp", help="BENCH_LOG[,ENERGY_LOG] of .peer/run.sh from this same call")
    ap.add_argument("--reuse", help="o3edge figures from an earlier --json of this run (skip re-measuring)")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    if a.reuse:  # figures measured earlier in this same call: only add the peers' and re-render
        r = json.load(open(a.reuse))
        r["systems"] = {k: v for k, v in r["systems"].items() if k.startswith("o3edge")}
    else:
        r = measure(a, batches)
    if a.llamacpp:
        logs = a.llamacpp.split(",")
        r["systems"].update(parse_llamacpp(logs[0], logs[1] if len(logs) > 1 else None))
    print(table(r, batches))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(r, fh, indent=1)
    if a.plot:
        plot(r, batches, a.plot)


def measure(a, batches) -> dict:
    """o3edge (and optionally transformers) on this GPU."""
    path = a.model
    if path is None:
        from o3edge.tiny import make_checkpoint

        path = os.path.join(tempfile.gettempdir(), f"o3edge-bench-{a.shape}")
        if not os.path.exists(os.path.join(path, "config.json")):
            print(f"making {a.shape} checkpoint in {path}", flush=True)
            make_checkpoint(path, **SHAPES[a.shape])
    energy = Energy()
    r = {"shape": a.shape, "model": path, "dtype": a.dtype, "gpu": torch.cuda.get_device_name(),
         "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "systems": {}}
    if not a.skip_base:
        r["systems"]["o3edge"] = bench_o3(path, a.dtype, batches, energy)
        print("o3edge", json.dumps(r["systems"]["o3edge"]), flush=True)
    if a.int4:
        r["systems"]["o3edge INT4-FFN"] = bench_o3(path, a.dtype, batches, energy, int4=True)
        print("o3edge INT4-FFN", json.dumps(r["systems"]["o3edge INT4-FFN"]), flush=True)
    for name, sampling in SAMPLED.items() if a.sampled else ():
        if a.sampled_only and a.sampled_only not in name:
            continue
        r["systems"][name] = bench_o3(path, a.dtype, batches, energy, sampling=sampling)
        print(name, json.dumps(r["systems"][name]), flush=True)
    if a.int4_head:
        r["systems"][HEAD] = bench_o3(path, a.dtype, batches, energy, int4=True, int4_head=True)
        print(HEAD, json.dumps(r["systems"][HEAD]), flush=True)
    if a.int4_all:
        r["systems"][ALL] = bench_o3(path, a.dtype, batches, energy, int4=True, int4_all=True)
        print(ALL, json.dumps(r["systems"][ALL]), flush=True)
    if a.int8:
        r["systems"][INT8] = bench_o3(path, a.dtype, batches, energy, int8=True)
        print(INT8, json.dumps(r["systems"][INT8]), flush=True)
    if a.int8 or a.int4_int8:
        r["systems"][INT4_INT8] = bench_o3(path, a.dtype, batches, energy, int4=True, int8=True)
        print(INT4_INT8, json.dumps(r["systems"][INT4_INT8]), flush=True)
    if not a.skip_hf:
        r["systems"]["transformers"] = bench_hf(path, a.dtype, batches, energy)
        print("transformers", json.dumps(r["systems"]["transformers"]), flush=True)
    r["floor_ms"] = {k: weight_bytes(path, a.dtype, WEIGHTS.get(k, ("dense",) * 3)) / HBM_BYTES_PER_S * 1e3
                     for k in r["systems"] if k.startswith("o3edge")}
    return r


def table(r, batches) -> str:
    head = "| system | TTFT 128 (ms) | " + " | ".join(f"b={b} decode tok/s (tok/J)" for b in batches) + " |"
    lines = [f"{r['shape']} {r['dtype']} on {r['gpu']} ({r['date']})", "", head,
             "|---|---:|" + "---:|" * len(batches)]
    for name, row in r["systems"].items():
        cells = []
        for b in batches:
            c = row.get(f"b{b}")
            cells.append("—" if not c else f"{c['tok_s']:,.0f} ({c['tok_j']:.1f})" if c.get("tok_j") else
                         f"{c['tok_s']:,.0f}")
        ttft = row.get("ttft_ms")
        lines.append(f"| {name} | {ttft:.1f} | " if ttft else f"| {name} | — | ")
        lines[-1] += " | ".join(cells) + " |"
    peers = [k for k in ("llama.cpp Q4_0", "llama.cpp F16", "transformers") if k in r["systems"]]
    for ours in (k for k in r["systems"] if k.startswith("o3edge")):
        for peer in peers:
            ratios = [f"b={b} {r['systems'][ours][f'b{b}']['tok_s'] / r['systems'][peer][f'b{b}']['tok_s']:.2f}x"
                      for b in batches if f"b{b}" in r["systems"][peer]]
            lines.append(f"- {ours} / {peer}: " + ", ".join(ratios))
            joules = [f"b={b} {r['systems'][ours][f'b{b}']['tok_j'] / r['systems'][peer][f'b{b}']['tok_j']:.2f}x"
                      for b in batches if (r["systems"][peer].get(f"b{b}") or {}).get("tok_j")
                      and (r["systems"][ours].get(f"b{b}") or {}).get("tok_j")]
            if joules:
                lines.append(f"- {ours} / {peer}, tokens per joule: " + ", ".join(joules))
        b1 = r["systems"][ours].get("b1")
        if b1:
            step = 1e3 / b1["tok_s"]
            lines.append(f"- {ours} batch-1 step {step:.3f} ms = {r['floor_ms'][ours] / step:.0%} of the "
                         f"bandwidth floor ({r['floor_ms'][ours]:.3f} ms)")
    return "\n".join(lines)


def plot(r, batches, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, row) in enumerate(r["systems"].items()):
        xs = [b for b in batches if f"b{b}" in row]
        a1.plot(xs, [row[f"b{b}"]["tok_s"] for b in xs], marker="o", label=name, color=f"C{i}")
        ys = [row[f"b{b}"].get("tok_j") for b in xs]
        if all(ys):
            a2.plot(xs, ys, marker="o", label=name, color=f"C{i}")
    for ax, t in ((a1, "decode tokens/s"), (a2, "tokens per joule")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (parallel streams)")
        ax.set_title(t)
        ax.grid(True, alpha=0.3)
    a1.legend(fontsize=8)
    fig.suptitle(f"{r['shape']} {r['dtype']}, {r['gpu']}, {r['date']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
