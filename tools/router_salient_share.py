#!/usr/bin/env python3
"""How concentrated a model's attention is: the share of a sequence's tokens, and of its KV blocks, that
the token router's salient set takes at several thresholds.

  python tools/router_salient_share.py [--model DIR] [--prompts 3] [--prompt-tokens 1500]
                                       [--decode 40] [--thresholds 0.85,0.7,0.5] [--json OUT]

Each held-out documentation prompt (tools/reference_corpus.py) runs with the INT8 router at its
defaults; after --decode generated tokens, the sequence's observed saliency (router.py: attention mass
over observer count) gives, per threshold, the smallest set of tokens covering that share of the
total (`salient_rows`) and the sealed blocks holding at least one of them (`holding_blocks`). The
router keeps those blocks at full precision (beside the sinks and the recent window): the block
share bounds what block granularity can save, the token share what token granularity could.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TOOLS)

import bench_router  # noqa: E402

from o3edge.engine.router import holding_blocks, salient_rows  # noqa: E402
from o3edge.engine.sequence import SamplingParams  # noqa: E402
from o3edge.model_path import resolve_model_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--decode", type=int, default=40)
    ap.add_argument("--thresholds", default="0.85,0.7,0.5")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    model = resolve_model_path(a.model)
    thresholds = [float(x) for x in a.thresholds.split(",")]
    eng = bench_router.engine(model, "router-int8", "cpu", "float32", a.threads)
    prompts, _ = bench_router.held_out(eng.tokenizer, a.prompts, a.prompt_tokens)
    rows = []
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, SamplingParams(max_new_tokens=a.decode + 1, ignore_eos=True))
        seq = None
        while eng.has_unfinished_requests():
            seq = eng.scheduler.running[0] if eng.scheduler.running else seq
            if seq is not None and seq.num_output_tokens == a.decode:
                break
            eng.step()
        ctx = seq.num_computed_tokens
        sal = eng.runner.router.seqs[seq.seq_id].saliency(ctx)
        for t in thresholds:
            keep = salient_rows([sal], t)[0]
            holds = holding_blocks([sal], t, eng.blocks.block_size)[0]
            rows.append({"prompt": i, "context": ctx, "threshold": t,
                         "salient_tokens": round(float(keep.float().mean()), 4),
                         "blocks_holding_one": round(sum(holds) / len(holds), 4)})
            print(rows[-1], flush=True)
        eng.abort(str(i))
    summary = {}
    for t in thresholds:
        mine = [r for r in rows if r["threshold"] == t]
        summary[str(t)] = {k: round(sum(r[k] for r in mine) / len(mine), 4)
                           for k in ("salient_tokens", "blocks_holding_one")}
    out = {"model": os.path.basename(model), "prompts": a.prompts, "prompt_tokens": a.prompt_tokens,
           "decode": a.decode, "block_size": eng.blocks.block_size, "rows": rows, "mean": summary}
    print(json.dumps(summary))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
