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
                                  [--repeat 3] [--profile] [--parts] [--window-detok] [--refresh-steps N]
                                  [--clock wall|thread] [--real-moves]

Each run also reports the median host step by kind: the router's refresh steps, the steps after them
(which plan the refresh's demotions), the steps that carry out a share of those, and the others; and a
refresh cycle's host work above as many ordinary steps (`cycle_extra_ms`). --clock thread times this
thread's CPU time instead of the wall clock: on a shared 2-core machine whole steps still vary by ~1.5x
from run to run either way, so parts are better compared alone (tools/bench_router_plan.py).

Prompts are held-out stdlib docstrings on the built-in long-context reference model (the same as
`tools/bench_router.py --gpu --shape model`). With the forward stubbed no attention is computed, so the
stubs give the router's observing steps attention of their own: a prompt's observed queries and each refresh
step's token put heavy-tailed random probabilities (a fixed seed) on the keys they see, the refresh's weighted
so that the routing works as much as a real run's (on the H200, the built-in long model at 16 x 3,840 tokens
for 128 steps: ~36% of the tokens compressed once the prompts are in, ~176 demotions at each of the four
refreshes; here 36% and ~175, printed as `compressed_after_prompts` and `demoted_per_refresh`). A demotion's
data goes through a stand-in for the router's MoveGraph (the GPU path's host work: the moves into its host
buffer), not the CPU's quantization (--real-moves: quantized on this CPU). The stubs' own time and the
refresh's device work (router_graph.py's route, one graph replay on CUDA) are timed apart and taken off each
step's: the figures are the host's part alone.

--parts adds, by kind of step, the median time of each of the engine's host functions named in PARTS (inclusive:
a function called inside another counts in both; the stubbed device work inside them is not taken off, and is
reported as `stubbed device`), so that a refresh cycle's extra host work can be laid at its parts without a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
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

CLOCK = time.perf_counter  # --clock thread: time.thread_time, this thread's CPU time (a preempted step's wait left out)
TOKEN = 300  # the token every stubbed step returns: an ordinary one (a special token decodes to nothing)
# the stubs' observed attention: U^PEAK (U uniform), heavy-tailed; a decoding query's with RECENT of it on its last 128
# keys, scaled by WEIGHT. Chosen so that the routing works as much as on the H200 (the module's docstring)
PEAK, RECENT, WEIGHT = 60, 0.5, 18.0


# --parts: the host functions timed by kind of step, (module, class, methods)
PARTS = [("o3edge.engine.cuda_graph", "DecodeGraphs", ["run"]),
         ("o3edge.engine.router_graph", "RouterDecodeGraphs", ["fill_meta", "_launch", "_continues", "_ran", "_taken",
                                                                "_observe_and_route"]),
         ("o3edge.engine.router", "KVRouter", ["end_step", "make_due", "flush_moves", "prepare_routing", "entry_rows"]),
         ("o3edge.engine.router_blocks", "RouterBlocks", ["carry_out"]),
         ("o3edge.engine.scheduler", "Scheduler", ["schedule"])]


def timed_parts(spent: dict) -> None:
    """Wrap each PARTS method so that its time (CLOCK) adds up in spent["Class.method"] (the classes' own
    definitions: a method a subclass does not define is timed where it is defined)."""
    import functools
    import importlib

    def timed(f, key):
        @functools.wraps(f)
        def call(*args, **kwargs):
            t = CLOCK()
            try:
                return f(*args, **kwargs)
            finally:
                spent[key] = spent.get(key, 0.0) + CLOCK() - t
        return call

    for module, name, methods in PARTS:
        cls = getattr(importlib.import_module(module), name)
        for method in methods:
            if method in cls.__dict__:
                setattr(cls, method, timed(cls.__dict__[method], f"{name}.{method}"))


def attention(n: int, gen: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """Stubbed attention probabilities over n keys: heavy-tailed, summing to one."""
    p = torch.rand(n, generator=gen, dtype=dtype) ** PEAK
    return p / p.sum()


class StubModel(torch.nn.Module):
    """The eager forward's place: logits that pick TOKEN for every row asked for."""

    def __init__(self, vocab: int, gen: torch.Generator):
        super().__init__()
        self.vocab, self.gen = vocab, gen

    def forward(self, input_ids, positions, cos, sin, step, kv_cache):
        routing = getattr(step, "router", None)
        if routing is not None:  # the router's prompt observations, as KVRouter._observe adds them
            books = routing.router.books
            for part in routing.parts:
                if part.observe:
                    ctx = part.start + part.rows.stop - part.rows.start
                    books.mass[part.row, :ctx] += part.observe * attention(ctx, self.gen)
                    books.count[part.row, :ctx] += part.observe
        logits = torch.zeros(len(step.logits_index), self.vocab)
        logits[:, TOKEN] = 1.0
        return logits


class StubMoves:
    """KVRouter.move_graph's place: the moves into a host buffer (the GPU path's host work), no device work."""

    def __init__(self, capacity: int = 256):
        self.host = torch.zeros(1 + 2 * capacity, dtype=torch.int64)
        self.capacity, self.moved = capacity, 0

    def move(self, moves) -> None:
        for lo in range(0, len(moves), self.capacity):
            chunk = moves[lo:lo + self.capacity]
            host, k = self.host.numpy(), len(chunk)
            host[0], host[1:1 + k], host[1 + self.capacity:1 + self.capacity + k] = k, chunk[:, 0], chunk[:, 1]
            self.moved += k


def engine_with_stubs(a):
    path, prompts, _ = bench_router.decode_checkpoint(a)
    eng = bench_router.decode_engine(path, a.setting, "cpu", "float32", 1, a, cuda_graphs=True,
                                     router_cuda_graphs=True)
    vocab, gen = eng.info.args.vocab_size, torch.Generator().manual_seed(0)
    eng.runner.model = StubModel(vocab, gen)
    graphs = bench_router.uncaptured_graphs(eng, a.batch)
    if eng.runner.router is not None and not a.real_moves:
        eng.runner.router.move_graph = StubMoves()

    # observing steps' probabilities by KV head and pool (router_graph.py's mass): heavy-tailed over every key
    # (made before the timed steps, four in turn), with RECENT of each row's mass on its last 128 full-precision
    # keys, as a decoding query's is. Device work: its time is counted apart (`device`) and taken off the steps'
    shape = graphs.mass.shape if getattr(graphs, "mass", None) is not None else None
    masses = [attention(shape.numel(), gen, torch.float32).view(shape) * shape[0] * (1 - RECENT) for _ in range(4)] \
        if shape is not None else []
    taken, device = itertools.count(), [0.0]

    def decode(B: int, observe: bool = False):  # the graph step's outputs: logits and greedy tokens
        t = CLOCK()
        if observe:
            keys = graphs.meta[:B, 3:4].long() + 1  # each row's full-precision keys, its new token's included
            at = torch.arange(shape[-1])[None, :]
            recent = ((at >= keys - 128) & (at < keys)).float() * (RECENT / 128 / shape[1])
            graphs.mass = masses[next(taken) % len(masses)].clone()
            graphs.mass[:B, :, 0] += recent[:, None, :]
            graphs.mass *= WEIGHT
        out = torch.zeros(B, vocab), torch.full((B,), TOKEN, dtype=torch.long)
        device[0] += CLOCK() - t
        return out

    if getattr(graphs, "routes", False):  # a refresh's device work (one graph replay on CUDA), counted apart
        route = graphs._route

        def timed_route(key):
            t = CLOCK()
            out = route(key)
            device[0] += CLOCK() - t
            return out

        graphs._route = timed_route
    eng.device_time = device
    graphs._decode = decode
    return eng, prompts


def run_once(a, profile: cProfile.Profile | None, spent: dict | None = None) -> dict:
    """One decode of the stubbed engine; spent (with --parts: timed_parts's totals, emptied before each step)
    adds each kind of step's median time by part."""
    eng, prompts = engine_with_stubs(a)
    for i, ids in enumerate(prompts):
        eng.add_request(str(i), ids, SamplingParams(max_new_tokens=a.steps, ignore_eos=True))
    while bench_router.prefilling(eng):
        eng.step()  # the prompts (stubbed: no attention computed)
    walls, kinds, router, kind, parts = [], {}, eng.runner.router, None, {}
    demoted_before = eng.blocks.num_demoted if router is not None else 0
    share = router.stats(eng.blocks)["kv_tokens_compressed_share"] if router is not None else 0.0
    if profile is not None:
        profile.enable()
    while eng.has_unfinished_requests():
        kind = bench_router.step_kind(router, kind)
        if spent is not None:
            spent.clear()
        t, stubbed = CLOCK(), eng.device_time[0]
        eng.step()
        walls.append((CLOCK() - t - (eng.device_time[0] - stubbed)) * 1e3)  # the host's part alone
        kinds.setdefault(kind, []).append(walls[-1])
        if spent is not None:
            parts.setdefault(kind, []).append(dict(spent, **{"stubbed device": eng.device_time[0] - stubbed}))
    if profile is not None:
        profile.disable()
    walls.sort()
    refreshes = len(kinds.get("after refresh", ()))
    demoted = eng.blocks.num_demoted - demoted_before if router is not None else 0
    ordinary = statistics.median(kinds["other"]) if kinds.get("other") else 0.0
    # a refresh cycle's host work above as many ordinary steps: the refresh, the step after it, the demoting one
    extra = sum(sum(w) - len(w) * ordinary for k, w in kinds.items() if k != "other")
    out = {"steps": len(walls), "compressed_after_prompts": round(share, 3),
            "cycle_extra_ms": round(extra / refreshes, 4) if refreshes else 0.0,
            "demoted_per_refresh": round(demoted / refreshes, 1) if refreshes else 0, "median_ms": round(statistics.median(walls), 4),
            "p90_ms": round(walls[int(0.9 * len(walls))], 4), "mean_ms": round(statistics.fmean(walls), 4),
            "launched_ahead": eng.runner.graphs.num_ahead_taken,
            "by_kind": bench_router.by_kind(kinds)}
    if spent is not None:  # each part's median ms by kind of step (0 in a step that did not call it)
        out["parts_by_kind"] = {k: {key: round(statistics.median(step.get(key, 0.0) for step in steps) * 1e3, 4)
                                    for key in sorted({key for step in steps for key in step})}
                                for k, steps in parts.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", default="router-int8", help="a tools/bench_router.py setting (off, router-int8, ...)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=3072)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile the decode steps of the last repeat")
    ap.add_argument("--parts", action="store_true",
                    help="each kind of step's median time in the host functions named in PARTS")
    ap.add_argument("--window-detok", action="store_true",
                    help="detokenize by two window decodes a token (tokenizers < 0.21's way), not DecodeStream")
    ap.add_argument("--refresh-steps", type=int, default=0,
                    help="the router's router_refresh_steps (default: its default)")
    ap.add_argument("--real-moves", action="store_true",
                    help="quantize the demoted blocks on this CPU (torch operations) rather than stub the device's part")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="time steps by the wall clock, or by this thread's CPU time (steadier on a shared machine)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.refresh_steps:
        setting = bench_router.SETTINGS[a.setting]
        bench_router.SETTINGS[a.setting] = {**setting, "router_refresh_steps": a.refresh_steps}
    if a.window_detok:
        import o3edge.engine.tokenizer

        o3edge.engine.tokenizer.DecodeStream = None
    global CLOCK
    CLOCK = time.thread_time if a.clock == "thread" else time.perf_counter
    a.shape, a.model = "model", None  # the built-in long-context reference model (decode_checkpoint)
    torch.set_num_threads(1)
    runs, spent = [], ({} if a.parts else None)
    if spent is not None:
        timed_parts(spent)
    for i in range(a.repeat):
        prof = cProfile.Profile() if a.profile and i == a.repeat - 1 else None
        runs.append(run_once(a, prof, spent))
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
