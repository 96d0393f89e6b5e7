#!/usr/bin/env python3
"""One prompt decoded twice on the CPU: once with its KV blocks consecutive in the pool, once with them
scattered (every other block of the pool taken first, as after prefix-cache hits or once the pool wraps
around): time of the whole generation, greedy tokens, largest logit difference, and which decode path
each step took (cpu_decode's span path or the generic one).

  python tools/bench_scattered_blocks.py [--model DIR] [--prompt-tokens 1500] [--new-tokens 64]
                                         [--threads 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)

import bench_router  # noqa: E402

from o3edge.engine.sequence import SamplingParams, Sequence  # noqa: E402
from o3edge.model_path import resolve_model_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint or engine directory (default: the built-in model)")
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    model = resolve_model_path(a.model)
    eng = bench_router.engine(model, "off", "cpu", "float32", a.threads)
    prompt = bench_router.held_out(eng.tokenizer, 1, a.prompt_tokens)[0][0]
    decode, paths = eng.runner.cpu_decode, {"span": 0, "generic": 0}
    prepare = decode.prepare

    def counted(batch):
        out = prepare(batch)
        paths["span" if out is not None else "generic"] += 1
        return out

    decode.prepare = counted

    def run():
        paths.update(span=0, generic=0)
        t = time.perf_counter()
        logits, tokens, _ = bench_router.run_tokens(eng, prompt, a.new_tokens)
        return {"seconds": round(time.perf_counter() - t, 3), "decode_paths": dict(paths)}, logits, tokens

    consecutive, logits_a, tokens_a = run()
    fillers, bs = [], eng.blocks.block_size
    while eng.blocks.free:  # take every block, then give every other one back
        filler = Sequence(f"f{len(fillers)}", [5 + len(fillers) % 1000] * bs, SamplingParams(max_new_tokens=1))
        eng.blocks.allocate(filler, reuse=False)
        fillers.append(filler)
    for filler in fillers[::2]:
        eng.blocks.free_seq(filler)
    scattered, logits_b, tokens_b = run()
    out = {"model": os.path.basename(model), "prompt_tokens": len(prompt), "new_tokens": a.new_tokens,
           "threads": a.threads, "consecutive": consecutive, "scattered": scattered,
           "same_tokens": tokens_a == tokens_b, "max_logit_difference": float((logits_a - logits_b).abs().max())}
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
