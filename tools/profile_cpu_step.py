#!/usr/bin/env python3
"""Where the native CPU decode step's time goes, per phase (issue 13).

  python tools/profile_cpu_step.py ENGINE_DIR [POSITION] [STEPS]

Builds o3edge's kernel library once more with -DO3_PROFILE (phase timers in cpu_step.cpp; under /tmp) and
runs the native step of the engine for STEPS decode steps of one sequence at POSITION (keys 0..POSITION).
Prints, every 200 steps, thread 0's wall time per phase (its barrier wait included), then the step's
median and minimum. The timers are off in the normal build.
"""
import os, sys, time, statistics
sys.path.insert(0, os.getcwd())
import torch
from torch.utils.cpp_extension import load
from o3edge.engine import cpu_ext
os.environ["O3EDGE_CPU_KERNELS"] = "auto"
d = "/tmp/cpu3/prof_ext_" + cpu_ext.build_dir().name; os.makedirs(d, exist_ok=True)
load(name="o3edge_cpu_prof_" + cpu_ext.build_dir().name, sources=[str(p) for p in cpu_ext.SOURCES if p.suffix == ".cpp"], build_directory=d,
     extra_cflags=cpu_ext._CFLAGS + ["-DO3_PROFILE"], extra_ldflags=["-fopenmp"], is_python_module=False)
cpu_ext.available.cache_clear() if hasattr(cpu_ext.available, "cache_clear") else None
cpu_ext._register_fakes()
import functools
cpu_ext.available = functools.cache(lambda: True)
from o3edge import O3Config, O3Model
from o3edge.engine import cpu_step
engine = O3Model.from_config(O3Config(model_path=sys.argv[1], device="cpu", num_threads=2,
                                      kv_cache_memory_mb=64, max_model_len=1024, cpu_native_step=False)).engine
r = engine.runner
nat = cpu_step.build(r.model, r.kv_cache)
P = int(sys.argv[2]) if len(sys.argv) > 2 else 192
ids = torch.tensor([5]); pos = torch.tensor([P]); slots = torch.tensor([P]); tables = torch.arange(P // 16 + 1)[None]
ts = []
with torch.inference_mode():
    for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 600):
        t = time.perf_counter(); nat.step(ids, pos, slots, tables, 16, r.cos, r.sin, r.kv_cache, 0); ts.append(time.perf_counter() - t)
print("step median %.3f min %.3f ms" % (statistics.median(ts) * 1e3, min(ts) * 1e3))
