#!/usr/bin/env python3
"""Resident memory of a CPU engine by stage (import torch, o3edge, the kernel library, engine load, two
128-token generations) and the largest mappings at the end: python tools/rss_stages.py ENGINE_DIR [PROMPT_JSON]
(PROMPT_JSON: the CPU peers' prompt token ids, default /tmp/peer-cpu/models/prompt_smol-135m.json)."""
import os, sys, resource, json
sys.path.insert(0, os.getcwd())
def rss(tag):
    d = {}
    for line in open("/proc/self/smaps_rollup"):
        k, *v = line.split()
        if k in ("Rss:", "Anonymous:", "Pss_File:", "Shared_Clean:", "Private_Clean:"):
            d[k[:-1]] = int(v[0]) // 1024
    print(f"{tag:28s} maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB  {d}", flush=True)
rss("start")
import torch  # noqa: F401, E402 (a stage of its own)
rss("import torch")
from o3edge import O3Config, O3Model
rss("import o3edge")
from o3edge.engine import cpu_ext; cpu_ext.available()
rss("cpu_ext loaded")
engine = O3Model.from_config(O3Config(model_path=sys.argv[1], device="cpu", num_threads=2, kv_cache_memory_mb=64,
                                      backend="torch",
                                      max_model_len=1024, cpu_compile=os.environ.get("COMPILE") == "1")).engine
rss("engine loaded")
from o3edge.engine.sequence import SamplingParams
prompt = json.load(open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/peer-cpu/models/prompt_smol-135m.json"))
for i in range(2):
    engine.add_request(f"r{i}", prompt[16*i:] + prompt[:16*i], SamplingParams(max_new_tokens=128, ignore_eos=True))
    while engine.has_unfinished_requests(): engine.step()
    rss(f"after run {i}")
cur = None; rows = []
for line in open("/proc/self/smaps"):
    parts = line.split()
    if "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
        cur = [line.strip()[:150], 0, 0]; rows.append(cur)
    elif parts[0] == "Rss:": cur[1] = int(parts[1]) // 1024
    elif parts[0] == "Anonymous:": cur[2] = int(parts[1]) // 1024
for r in sorted(rows, key=lambda r: -r[1])[:14]: print(r[1], "MB anon", r[2], r[0])
