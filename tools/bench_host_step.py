#!/usr/bin/env python3
"""The host's part of a graph decode step, measured on the CPU with the device's part stubbed out.

When a model is small the GPU finishes a decode step in a few tenths of a millisecond and the host's
work for the next step (scheduling, the step's metadata, the router's books, the tokens' way back,
detokenizing) is what a step costs: launch ahead hides it only under a longer GPU step. This runs the
engine's real host path for B sequences of --context tokens (the CUDA-graph decode path, uncaptured,
with launch ahead, as on the GPU) but with the model's forward and the graph step replaced by stubs
that return a fixed token, so that what is timed is the host alone: wall time of each engine.step()
over the decode, and with --profile the functions that take it (py-spy's raw stacks, when py-spy is
installed, are better: cProfile slows small functions most).

  python tools/bench_host_step.py [--setting off|router-int8|...] [--batch 16] [--context 3072] [--steps 512]
                                  [--repeat 3] [--profile] [--window-detok] [--refresh-steps N]

Each run also reports the median host step by kind: the router's refresh steps, the steps after them
(which plan the refresh's demotions), the steps that carry out a share of those, and the others.

Prompts are held-out stdlib docstrings on the built-in long-context reference model (the same as
`tools/bench_router.py --gpu --shape model`). With the forward stubbed no attention is observed, so a
router demotes every block it may at its first routing: its refresh steps carry more demotions than a
real run's, and on the CPU a demotion's data is copied and quantized by the host.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)
sys.path.insert(0, os.path.dirname(TOOLS))

import bench_router  # noqa: E402

from o3edge.engine.sequence import SamplingParams  # noqa: E402

TOKEN = 300  # the token every stubbed step returns: an ordinary one (a special token decodes to nothing)


class StubModel(torch.nn.Module):
    """The eager forward's place: logits that pick TOKEN for every row asked for."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids, positions, cos, sin, step, kv_cache):
        logits = torch.zeros(len(step.logits_index), self.vocab)
        logits[:, TOKEN] = 1.0
        return logits


def engine_with_stubs(a):
    path, prompts, _ = bench_router.decode_checkpoint(a)
    eng = bench_router.decode_engine(path, a.setting, "cpu", "float32", 1, a, cuda_graphs=True,
                                     router_cuda_graphs=True)
    vocab = eng.info.args.vocab_size
    eng.runner.model = StubModel(vocab)
    graphs = bench_router.uncaptured_graphs(eng, a.batch)

    def decode(B: int, observe: bool = False):  # the graph step's outputs: logits and greedy tokens
        return torch.zeros(B, vocab), torch.full((B,), TOKEN, dtype=torch.long)

    graphs._decode = decode
    return eng, prompts


def run_once(a, profile: cProfile.Profile | None) -> dict:
    eng, prompts = engine_with_stubs(a)
    for i, ids in enumerate(prompts):
        eng.add_request(str(i), ids, SamplingParams(max_new_tokens=a.steps, ignore_eos=True))
    while bench_router.prefilling(eng):
        eng.step()  # the prompts (stubbed: no attention computed)
    walls, kinds, router, kind = [], {}, eng.runner.router, None
    if profile is not None:
        profile.enable()
    while eng.has_unfinished_requests():
        kind = bench_router.step_kind(router, kind)
        t = time.perf_counter()
        eng.step()
        walls.append((time.perf_counter() - t) * 1e3)
        kinds.setdefault(kind, []).append(walls[-1])
    if profile is not None:
        profile.disable()
    walls.sort()
    return {"steps": len(walls), "median_ms": round(statistics.median(walls), 4),
            "p90_ms": round(walls[int(0.9 * len(walls))], 4), "mean_ms": round(statistics.fmean(walls), 4),
            "launched_ahead": eng.runner.graphs.num_ahead_taken,
            "by_kind": bench_router.by_kind(kinds)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", default="router-int8", help="a tools/bench_router.py setting (off, router-int8, ...)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=3072)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile the decode steps of the last repeat")
    ap.add_argument("--window-detok", action="store_true",
                    help="detokenize by two window decodes a token (tokenizers < 0.21's way), not DecodeStream")
    ap.add_argument("--refresh-steps", type=int, default=0,
                    help="the router's router_refresh_steps (default: its default)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.refresh_steps:
        setting = bench_router.SETTINGS[a.setting]
        bench_router.SETTINGS[a.setting] = {**setting, "router_refresh_steps": a.refresh_steps}
    if a.window_detok:
        import o3edge.engine.tokenizer

        o3edge.engine.tokenizer.DecodeStream = None
    a.shape, a.model = "model", None  # the built-in long-context reference model (decode_checkpoint)
    torch.set_num_threads(1)
    runs = []
    for i in range(a.repeat):
        prof = cProfile.Profile() if a.profile and i == a.repeat - 1 else None
        runs.append(run_once(a, prof))
        print(f"{a.setting}: {runs[-1]}", flush=True)
        if prof is not None:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    out = {"setting": a.setting, "window_detok": a.window_detok, "batch": a.batch, "context": a.context, "steps": a.steps, "runs": runs,
           "median_ms": statistics.median(r["median_ms"] for r in runs)}
    print(f"{a.setting}: host step median {out['median_ms']:.3f} ms over {a.repeat} runs")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
