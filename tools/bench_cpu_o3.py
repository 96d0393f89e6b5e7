#!/usr/bin/env python3
"""o3edge's side of the CPU peer benchmark: one engine, batch 1, greedy (or --sampling), in its own process.

  python tools/bench_cpu_o3.py ENGINE_OR_CKPT PROMPT.json [--runs 3] [--warmup 1] [--new 128] [--threads 2]
                               [--dtype auto] [--out result.json] [--profile N] [--backend native]
                               [--sampling temperature=0.7,top_p=0.9,seed=1]

The same definitions as ../shared/peers/cpu/bench_llamacpp.py, timed from outside the engine (the
caller's loop around `LLMEngine.step`): per run, t0 before `add_request`; TTFT = the first token's
arrival - t0 (prefill + first sample); decode tok/s = (new - 1) / (last token - first token). Each run
uses a distinct prompt (the peers' prompt rotated by 16 tokens per run) so no prefix-cache hit helps;
llama.cpp resets its cache between runs instead. Peak RSS = ru_maxrss of this process (interpreter,
torch where the backend loads it, and model). With --profile N, the torch profiler's top N ops of 20
decode steps go in the JSON (torch backend only). --backend native: the engine without torch
(native_runner.py); this process then never imports it (checked, and recorded as torch_loaded).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from o3edge.engine import cpu_features  # noqa: E402  (no torch: the native backend's process never imports it)

# what holds o3edge's kernels, and torch's, MKL's, oneDNN's and NumPy's, to an instruction set (recorded in each JSON)
ISA_ENV = ("O3EDGE_CPU_ISA", "O3EDGE_CPU_ATTN_ISA", "O3EDGE_CPU_KERNELS", "ATEN_CPU_CAPABILITY",
           "FBGEMM_ENABLE_INSTRUCTIONS", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "NPY_DISABLE_CPU_FEATURES")


def one_run(engine, prompt: list[int], new: int, rid: str, sampling: dict | None = None) -> dict:
    from o3edge.engine.sequence import SamplingParams

    stamps, toks = [], []
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_new_tokens=new, ignore_eos=True, **(sampling or {})))
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            stamps.append(time.perf_counter())
            toks += out.token_ids
    assert len(toks) == new, (len(toks), new)
    return dict(ttft_ms=(stamps[0] - t0) * 1e3, decode_tps=(new - 1) / (stamps[-1] - stamps[0]),
                total_ms=(stamps[-1] - t0) * 1e3, first_tokens=toks[:8])


def profile_steps(engine, prompt: list[int], top: int) -> list[dict]:
    """The top ops (self CPU time) of 20 decode steps after a 128-token prompt."""
    from torch.profiler import ProfilerActivity, profile

    from o3edge.engine.sequence import SamplingParams

    engine.add_request("profile", prompt, SamplingParams(max_new_tokens=64, ignore_eos=True))
    for _ in range(4):
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            engine.step()
    engine.abort("profile")
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [dict(op=e.key, self_ms_per_step=e.self_cpu_time_total / 20 / 1e3, calls_per_step=e.count / 20,
                 share=e.self_cpu_time_total / total) for e in events[:top]]


def step_kind(engine) -> str:
    """Which decode step the engine runs: the native backend (native_runner.py), native (cpu_step.py),
    compiled (cpu_compiled.py) or eager."""
    if engine.config.backend == "native":
        return "native backend"
    cd = getattr(engine.runner, "cpu_decode", None)
    return "eager" if cd is None else "native" if cd.native else "compiled" if cd.compiled else "eager"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("prompt")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--label", default=None)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="[engine] cpu_compile: the compiled decode step")
    ap.add_argument("--no-native", action="store_true", help="[engine] cpu_native_step = false")
    ap.add_argument("--backend", default="torch", choices=("torch", "native"), help="[engine] backend")
    ap.add_argument("--sampling", help="sampled requests, e.g. temperature=0.7,top_p=0.9,seed=1 (default greedy)")
    ap.add_argument("--out")
    a = ap.parse_args()
    sampling = {k: (int(v) if k in ("top_k", "seed") else float(v))
                for k, v in (kv.split("=") for kv in a.sampling.split(","))} if a.sampling else None
    prompt = json.load(open(a.prompt))
    load0 = os.getloadavg()
    t = time.perf_counter()
    from o3edge import O3Config, O3Model

    engine = O3Model.from_config(O3Config(model_path=a.model, device="cpu", dtype=a.dtype, num_threads=a.threads,
                                          kv_cache_memory_mb=64, max_model_len=1024, backend=a.backend,
                                          cpu_compile=a.compile, cpu_native_step=not a.no_native)).engine
    load_s = time.perf_counter() - t
    rss_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    prompts = [prompt[16 * i:] + prompt[:16 * i] for i in range(a.warmup + a.runs)]
    for i in range(a.warmup):
        one_run(engine, prompts[i], a.new, f"warmup{i}", sampling)
    runs = [one_run(engine, prompts[a.warmup + i], a.new, f"run{i}", sampling) for i in range(a.runs)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    keys = ["ttft_ms", "decode_tps", "total_ms"]
    summary = {k: dict(median=statistics.median(r[k] for r in runs), min=min(r[k] for r in runs),
                       max=max(r[k] for r in runs)) for k in keys}
    res = dict(system="o3edge", label=a.label or os.path.basename(a.model.rstrip("/")),
               model=os.path.abspath(a.model), prompt_len=len(prompt), new_tokens=a.new, threads=a.threads,
               dtype=engine.info.dtype, timing="wall clock (perf_counter) around add_request + LLMEngine.step",
               load_s=load_s, cpu_compile=a.compile, cpu_native_step=not a.no_native, step=step_kind(engine), rss_after_load_mb=rss_after_load, peak_rss_mb=peak,
               loadavg_start=load0, loadavg_end=os.getloadavg(), backend=a.backend, torch_loaded="torch" in sys.modules,
               omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"), gomp_spincount=os.environ.get("GOMP_SPINCOUNT"),
               sampling=sampling, summary=summary, runs=runs, row_kernel_isa=cpu_features.row_kernel_isa(),
               isa_env={k: os.environ.get(k) for k in ISA_ENV})
    if "torch" in sys.modules:
        import torch

        res.update(torch=torch.__version__, capability=torch.backends.cpu.get_cpu_capability())
    if a.profile and a.backend == "torch":
        res["profile"] = profile_steps(engine, prompt[::-1], a.profile)  # a prompt no run used: no cache hit
    js = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(js)
    print(js)


if __name__ == "__main__":
    main()
