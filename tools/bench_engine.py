#!/usr/bin/env python3
"""Engine benchmarks: dense vs INT4-FFN against transformers, cold start, and the precision report.

  python tools/bench_engine.py decode     CKPT [--device cpu] [--tokens 32] [--variants ...]
  python tools/bench_engine.py coldstart  CKPT [--reps 2]
  python tools/bench_engine.py precision  CKPT [--groups 32 64 128] [--tokens 32]

CKPT is a Hugging Face checkpoint (tools/make_tiny_model.py --shape smol-135m /tmp/smol-135m);
engine directories are built from it into a temporary folder. Every figure comes from one run,
so each sits beside its peer measured on the same machine at the same time. Output is Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from machine_info import cpu_name  # noqa: E402 (tools/, this script's own folder)

PROMPT_LEN = 128
# name -> (source: ckpt|engine, dtype, int4 group or None)
VARIANTS = {
    "o3-fp32": ("ckpt", "float32", None),
    "o3-bf16": ("ckpt", "bfloat16", None),
    "o3-int4": ("engine", "float32", 128),  # INT4 FFN, the rest float32
    "o3-int4-bf16": ("engine", "bfloat16", 128),  # INT4 FFN, the rest bfloat16
    "hf-fp32": ("hf", "float32", None),
    "hf-bf16": ("hf", "bfloat16", None),
}


def engine_dir(ckpt: str, dtype: str, group: int | None, root: str) -> str:
    """Build (once per run) the engine directory for a variant."""
    import torch

    from o3edge.engine.engine_dir import build_engine_dir

    out = os.path.join(root, f"engine-{dtype}-{group or 'dense'}")
    if not os.path.exists(out):
        build_engine_dir(ckpt, out, getattr(torch, dtype), group)
    return out


def random_prompts(vocab: int, batch: int, seed: int) -> list[list[int]]:
    """Distinct random prompts: no prefix-cache hits between them or across repetitions."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (batch, PROMPT_LEN), generator=g).tolist()


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


# ---- o3edge ------------------------------------------------------------------------------------

def o3_run(engine, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """(seconds to every first token, decode tokens/s after it) for one batch."""
    from o3edge.engine.sequence import SamplingParams

    params = SamplingParams(max_new_tokens=new + 1, ignore_eos=True)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"b{t0}-{i}", ids, params)
    started, t1, produced = set(), None, 0
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            if out.request_id in started:
                produced += 1
            started.add(out.request_id)
        if t1 is None and len(started) == len(prompts):
            t1 = time.perf_counter()
    return t1 - t0, produced / (time.perf_counter() - t1)


def bench_o3(path: str, dtype: str, device: str, new: int, reps: int, batches: list[int]) -> dict:
    from o3edge import O3Config, O3Model

    engine = O3Model.from_config(O3Config(model_path=path, device=device, dtype=dtype)).engine
    vocab = engine.info.args.vocab_size
    o3_run(engine, random_prompts(vocab, 1, 999), 4)  # warm-up
    ttft = [o3_run(engine, random_prompts(vocab, 1, r), 0)[0] for r in range(reps)]
    decode = {b: o3_run(engine, random_prompts(vocab, b, 100 + b), new)[1] for b in batches}
    return {"ttft_ms": 1000 * statistics.median(ttft), **{f"decode_b{b}": v for b, v in decode.items()}}


# ---- transformers ------------------------------------------------------------------------------

def bench_hf(path: str, dtype: str, device: str, new: int, reps: int, batches: list[int]) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    vocab = model.config.vocab_size

    def generate(prompts, n):
        ids = torch.tensor(prompts, device=device)
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0, eos_token_id=None)
        sync(device)
        return time.perf_counter() - t0

    generate(random_prompts(vocab, 1, 999), 4)  # warm-up
    ttft = [generate(random_prompts(vocab, 1, r), 1) for r in range(reps)]
    decode = {}
    for b in batches:
        prompts = random_prompts(vocab, b, 100 + b)
        first, total = generate(prompts, 1), generate(prompts, new + 1)
        decode[f"decode_b{b}"] = b * new / (total - first)
    return {"ttft_ms": 1000 * statistics.median(ttft), **decode}


def decode_mode(a) -> None:
    import torch

    rows = {}
    with tempfile.TemporaryDirectory() as root:
        for name in a.variants:
            kind, dtype, group = VARIANTS[name]
            t0 = time.perf_counter()
            if kind == "hf":
                rows[name] = bench_hf(a.ckpt, dtype, a.device, a.tokens, a.reps, a.batches)
            else:
                path = engine_dir(a.ckpt, dtype, group, root) if kind == "engine" else a.ckpt
                rows[name] = bench_o3(path, dtype, a.device, a.tokens, a.reps, a.batches)
            print(f"<!-- {name}: {rows[name]} ({time.perf_counter() - t0:.0f} s) -->", flush=True)
    header = f"| variant | TTFT {PROMPT_LEN}-token prompt (ms) | " + " | ".join(
        f"decode b={b} (tok/s)" for b in a.batches) + " |"
    print(f"\n{machine(a.device)}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{a.tokens} new greedy tokens after a {PROMPT_LEN}-token prompt; TTFT median of {a.reps}; "
          f"load average at the end {os.getloadavg()[0]:.1f}\n")
    print(header)
    print("|" + "---|" * (2 + len(a.batches)))
    for name, r in rows.items():
        print(f"| {name} | {r['ttft_ms']:.0f} | " + " | ".join(f"{r[f'decode_b{b}']:.1f}" for b in a.batches) + " |")
    base = next((n for n in ("hf-fp32", "hf-bf16") if n in rows), None)
    if base:
        print(f"\nratios against {base} (TTFT: theirs / ours; decode: ours / theirs):\n")
        for name, r in rows.items():
            if not name.startswith("hf"):
                cells = [f"TTFT {rows[base]['ttft_ms'] / r['ttft_ms']:.2f}x"] + [
                    f"b={b} {r[f'decode_b{b}'] / rows[base][f'decode_b{b}']:.2f}x" for b in a.batches]
                print(f"- {name}: " + ", ".join(cells))


def machine(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()}"
    return f"{cpu_name()}, {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}"


# ---- cold start --------------------------------------------------------------------------------

def rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size in MiB."""
    fields = dict(ln.split(":", 1) for ln in open("/proc/self/status"))
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def child(a) -> None:
    """One cold start: import, load, warm up (a short greedy generation); report as JSON."""
    t = {"start": time.time()}
    import torch  # noqa: F401

    import o3edge  # noqa: F401
    t["import"], base = time.time(), rss_mb()[0]
    from o3edge import O3Config, O3Model

    model = O3Model.from_config(O3Config(model_path=a.ckpt, device="cpu", dtype=a.dtype, int4_ffn=a.int4,
                                         kv_cache_memory_mb=64))
    t["load"] = time.time()
    model.generate("Hello", max_new_tokens=4)
    t["ready"] = time.time()
    now, peak = rss_mb()
    print(json.dumps({**t, "rss_base_mb": base, "rss_mb": now, "peak_mb": peak}))


def coldstart_mode(a) -> None:
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as root:
        int4_fp32 = engine_dir(a.ckpt, "float32", 128, root)
        int4_bf16 = engine_dir(a.ckpt, "bfloat16", 128, root)
        dense_fp32 = engine_dir(a.ckpt, "float32", None, root)
        cases = [("checkpoint, float32", a.ckpt, "float32", False),
                 ("checkpoint, INT4 FFN quantized at load", a.ckpt, "float32", True),
                 ("engine dir, float32", dense_fp32, "auto", False),
                 ("engine dir, INT4 FFN + float32", int4_fp32, "auto", False),
                 ("engine dir, INT4 FFN + bfloat16", int4_bf16, "auto", False)]
        rows = []
        for label, path, dtype, int4 in cases:
            runs = []
            for _ in range(a.reps):
                cmd = [sys.executable, __file__, "_child", path, "--dtype", dtype] + (["--int4"] if int4 else [])
                t0 = time.time()
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                runs.append(dict(r, spawn=t0))
            rows.append((label, runs))
    print(f"\n{machine('cpu')}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; {a.reps} fresh "
          f"processes each; median shown; load average before: {load0:.1f}\n")
    print("| source | process start → ready (s) | of which import | load | warm-up | RSS after (MiB) "
          "| RSS above import (MiB) | peak RSS (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for label, runs in rows:
        def med(f):
            return statistics.median(f(r) for r in runs)

        print(f"| {label} | {med(lambda r: r['ready'] - r['spawn']):.2f} "
              f"| {med(lambda r: r['import'] - r['spawn']):.2f} "
              f"| {med(lambda r: r['load'] - r['import']):.2f} | {med(lambda r: r['ready'] - r['load']):.2f} "
              f"| {med(lambda r: r['rss_mb']):.0f} | {med(lambda r: r['rss_mb'] - r['rss_base_mb']):.0f} "
              f"| {med(lambda r: r['peak_mb']):.0f} |")


# ---- precision ---------------------------------------------------------------------------------

def precision_mode(a) -> None:
    from o3edge import O3Config
    from o3edge.engine.engine import LLMEngine
    from o3edge.engine.precision import alignment_report

    settings = dict(device=a.device, kv_cache_memory_mb=128, max_model_len=1024, cuda_graphs=False)
    ref = LLMEngine(O3Config(model_path=a.ckpt, dtype="float32", **settings), a.ckpt)
    cases = [("bfloat16", None)] + [("float32", g) for g in a.groups] + [("bfloat16", 128)]
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for dtype, group in cases:
            path = engine_dir(a.ckpt, dtype, group, root)
            eng = LLMEngine(O3Config(model_path=path, **settings), path)
            rows.append(alignment_report(ref, eng, num_new_tokens=a.tokens))
            del eng
    r0 = rows[0]
    print(f"\nreference: the float32 engine of the checkpoint; {r0.num_prompts} prompts x {a.tokens} greedy "
          f"tokens; logits over {r0.num_positions} positions; reference mean logits L2 {r0.ref_logits_l2:.3f}\n")
    print("| engine | logits L2 (ref → engine) | relative error | top-1 agreement | mean KL (nats) "
          "| greedy tokens agreeing | greedy common prefix | identical continuations |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.engine} | {r.ref_logits_l2:.3f} → {r.engine_logits_l2:.3f} | {r.relative_error:.2%} "
              f"| {r.top1_agreement:.2%} | {r.kl_mean:.4f} | {r.greedy_agreement:.1%} | {r.greedy_prefix:.1%} "
              f"| {r.greedy_identical}/{r.num_prompts} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["decode", "coldstart", "precision", "_child"])
    ap.add_argument("ckpt")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per decode measurement / report prompt")
    ap.add_argument("--reps", type=int, default=3, help="TTFT repetitions; cold starts per case")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS),
                    default=["hf-fp32", "o3-fp32", "o3-bf16", "o3-int4", "o3-int4-bf16"])
    ap.add_argument("--groups", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--int4", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    a = ap.parse_args()
    if a.threads:
        os.environ["OMP_NUM_THREADS"] = str(a.threads)  # cold-start children inherit it
        import torch

        torch.set_num_threads(a.threads)
    if a.mode != "_child":
        print(f"<!-- {time.strftime('%Y-%m-%d %H:%M')} python tools/bench_engine.py {' '.join(sys.argv[1:])} "
              f"on {platform.node()} -->")
    {"decode": decode_mode, "coldstart": coldstart_mode, "precision": precision_mode, "_child": child}[a.mode](a)


if __name__ == "__main__":
    main()
