#!/usr/bin/env python3
"""Back-to-back decode in one process: the native (or compiled) step against the eager one, same engine, alternating.

  OMP_WAIT_POLICY=... ROUNDS=3 python tools/bench_cpu_ab.py ENGINE THREADS COMPILE(0|1)

The native step (cpu_step.py) is on wherever it applies; COMPILE=1 adds the compiled step where it does
not. Prints the load average and, per mode and round, (tok/s by wall clock, tok/s by this process's CPU time)
of a 64-token greedy generation after the CPU peers' 128-token prompt (rotated per round). On a shared
machine the CPU-time figure is what the code costs, the wall-clock one what a user waits. Imports torch
before o3edge on purpose: the OpenMP wait policy is whatever the environment says.
"""

import json
import os
import sys
import time

import torch  # noqa: F401  (first: see the docstring)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from o3edge import O3Config, O3Model  # noqa: E402
from o3edge.engine.sequence import SamplingParams  # noqa: E402

PROMPT = os.environ.get("PROMPT", "/tmp/peer-cpu/models/prompt_smol-135m.json")


def gen(engine, prompt, i):
    stamps, cpu = [], []
    engine.add_request(f"r{i}", prompt[i:] + prompt[:i], SamplingParams(max_new_tokens=64, ignore_eos=True))
    while engine.has_unfinished_requests():
        for _ in engine.step()[0]:
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
    return round(63 / (stamps[-1] - stamps[0]), 1), round(63 / (cpu[-1] - cpu[0]), 1)


def main():
    path, threads, compile_ = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    prompt = json.load(open(PROMPT))
    engine = O3Model.from_config(O3Config(model_path=path, device="cpu", num_threads=threads, kv_cache_memory_mb=64,
                                          max_model_len=1024, cpu_compile=compile_, backend="torch")).engine
    cd = engine.runner.cpu_decode  # the native step (cpu_step.py) when it applies, else the compiled one if asked
    modes = [(m, n, c) for m, n, c in (("native", cd.native, None), ("compiled", None, cd.compiled),
                                       ("eager", None, None)) if m == "eager" or n or c]
    res = {m: [] for m, _, _ in modes}
    for r in range(int(os.environ.get("ROUNDS", "3"))):
        for m, n, c in modes:
            cd.native, cd.compiled = n, c
            res[m].append(gen(engine, prompt, r * 7 + 1))
    print(json.dumps({"loadavg": os.getloadavg(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                      "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"), "threads": threads, "engine": path,
                      "tok_s_wall_cpu": res}))


if __name__ == "__main__":
    main()
