#!/usr/bin/env python3
"""How the token router's routing settles over a decode: the share of the KV tokens compressed once the prompts
are in, and after each decode refresh, with the blocks each refresh demoted.

  python tools/router_settling.py [--batch 4] [--context 3840] [--steps 128] [--setting router-int8]
                                  [--pinned-out] [--json OUT]

B windows of held-out stdlib docstrings of --context tokens each on the built-in long-context model (the prompts
of `tools/bench_router.py --gpu --shape model`), on this CPU, greedy. A refresh's demotions are what the GPU
path's refresh cycles carry out (docs/benchmarks.md: their host work is most of what the router loses to full
precision on this model). --pinned-out is an experiment, not the router's rule: the threshold is covered by the
saliency of the tokens outside the sinks and the recent window alone (those stay full precision anyway), to see
how much of the compression comes from the recent tokens' share of the total.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)
sys.path.insert(0, os.path.dirname(TOOLS))

import torch  # noqa: E402

import bench_router  # noqa: E402

from o3edge.engine import router as router_mod  # noqa: E402
from o3edge.engine.sequence import SamplingParams  # noqa: E402


def pinned_out(cfg) -> None:
    """SaliencyBooks.saliency with the sinks' and the recent window's saliency taken out (--pinned-out)."""
    saliency = router_mod.SaliencyBooks.saliency

    def without_pinned(self, rows, ctxs):
        sal = saliency(self, rows, ctxs)
        at = torch.arange(sal.shape[1], device=sal.device)[None, :]
        ends = torch.tensor(ctxs, device=sal.device)[:, None]
        return sal.masked_fill((at < cfg.sink_tokens) | (at >= ends - cfg.recent_tokens), 0.0)

    router_mod.SaliencyBooks.saliency = without_pinned


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=3840)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--setting", default="router-int8", help="a tools/bench_router.py setting")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pinned-out", action="store_true",
                    help="experiment: cover the threshold with the saliency outside the sinks and recent window")
    ap.add_argument("--json")
    a = ap.parse_args()
    a.shape, a.model, a.workdir = "model", None, "/tmp/o3edge-bench-router"
    torch.set_num_threads(a.threads)
    path, prompts, _ = bench_router.decode_checkpoint(a)
    eng = bench_router.decode_engine(path, a.setting, "cpu", "float32", a.threads, a)
    router = eng.runner.router
    if a.pinned_out:
        pinned_out(router.cfg)
    for i, ids in enumerate(prompts):
        eng.add_request(str(i), ids, SamplingParams(max_new_tokens=a.steps, ignore_eos=True))
    start = time.perf_counter()
    while bench_router.prefilling(eng):
        eng.step()

    def share() -> float:
        return router.stats(eng.blocks)["kv_tokens_compressed_share"]

    points = [{"step": 0, "demoted": eng.blocks.num_demoted, "compressed_share": share()}]
    print(f"prompts in: {points[0]['compressed_share']:.1%} of the tokens compressed", flush=True)
    step, last = 0, eng.blocks.num_demoted
    while eng.has_unfinished_requests():
        eng.step()
        step += 1
        if eng.blocks.num_demoted != last:
            points.append({"step": step, "demoted": eng.blocks.num_demoted - last, "compressed_share": share()})
            last = eng.blocks.num_demoted
            print(f"step {step}: {points[-1]['demoted']} blocks demoted, {points[-1]['compressed_share']:.1%} "
                  "compressed", flush=True)
    out = {"setting": a.setting, "batch": a.batch, "context": a.context, "steps": a.steps,
           "pinned_out": a.pinned_out, "refresh_steps": router.cfg.refresh_steps, "points": points,
           "seconds": round(time.perf_counter() - start, 1)}
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
