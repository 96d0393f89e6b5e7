#!/usr/bin/env python3
"""First-token time of the first and second request of each sampling kind in a fresh engine.

A request whose kernels were never launched in the process pays their compile (Triton compiles at first
launch): that is a first request's time after every daemon start. This loads one engine and sends, for each
kind (greedy; T 1.0; top-k 40; top-p 0.9 alone; top-k 100), one 64-token prompt twice, and reports each
request's first-token time and the engine's load time. Run it with an empty Triton cache (rm -rf
~/.triton/cache) to see a first start.

  python tools/first_requests.py [--model DIR] [--device cuda] [--dtype float16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from o3edge.api import O3Model  # noqa: E402
from o3edge.config import O3Config  # noqa: E402
from o3edge.engine.sequence import SamplingParams  # noqa: E402
from o3edge.model_path import SHIPPED_MODEL  # noqa: E402

KINDS = {"greedy": dict(), "T 1.0": dict(temperature=1.0), "top-k 40": dict(temperature=0.7, top_k=40),
         "top-p 0.9": dict(temperature=0.7, top_p=0.9), "top-k 100": dict(temperature=0.8, top_k=100)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=SHIPPED_MODEL)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--json")
    a = ap.parse_args()
    t = time.perf_counter()
    m = O3Model.from_config(O3Config(model_path=a.model, device=a.device, dtype=a.dtype, max_model_len=1024))
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "load_s": time.perf_counter() - t}
    g = torch.Generator().manual_seed(0)
    for name, kind in KINDS.items():
        for i in range(2):
            ids = torch.randint(100, 1000, (64,), generator=g).tolist()
            r = m.generate_batch([ids], SamplingParams(max_new_tokens=4, seed=1, **kind))[0]
            out[f"{name} #{i + 1} ttft_ms"] = round(r.ttft_s * 1e3, 1)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
