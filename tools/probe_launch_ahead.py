#!/usr/bin/env python3
"""Which decode steps the engine takes from the launch-ahead queue (cuda_graph.DecodeGraphs), step by step.

    python tools/probe_launch_ahead.py [--device cuda] [--seqs 16] [--prompt-tokens 96] [--new-tokens 20]
                                       [--shape llama-1b] [--router int8]

Prints one letter a decode step: `T` taken from the queue, `t` taken less the rows of sequences that
finished, `x` a queued step that did not match the batch (dropped), `-` nothing was queued; then taken
/ steps. Only the first decode step, those after a sequence joined and the last one should miss. On
the H200, `tools/bench_router.py --gpu` counted 63 of 127 steps taken (docs/benchmarks.md, seventh
round): its prompts are prefilled one a step, so its 16 sequences cross 32-token block boundaries at 16
different steps of every 32, and a step was not queued while any sequence lacked the block of its next
token, nor before a sequence's last. Sequences are now given that block one step early
(BlockManager.reserve_next) and a queued step serves the sequences left after others finished. On the
CPU the decode graphs run uncaptured under Triton's interpreter (a small model is best there); on CUDA
the engine captures them as it does in service.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=20)
    ap.add_argument("--shape", default="tiny", help="make_tiny_model.py shape (random weights)")
    ap.add_argument("--router", default="off", help="off, int8 or int4 ([kv] router, with router_cuda_graphs)")
    ap.add_argument("--prefill-tokens", type=int, default=0,
                    help="max_num_batched_tokens (default: one prompt a step, as tools/bench_router.py --gpu does: "
                         "the sequences then sit at different places in their blocks)")
    a = ap.parse_args()
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from make_tiny_model import SHAPES

    from o3edge import O3Config
    from o3edge.engine.engine import LLMEngine
    from o3edge.engine.sequence import SamplingParams
    from o3edge.tiny import make_checkpoint

    path = os.path.join(tempfile.gettempdir(), f"o3edge-probe-{a.shape}")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_checkpoint(path, **SHAPES[a.shape])
    dtype = "bfloat16" if a.device.startswith("cuda") else "float32"
    eng = LLMEngine(O3Config(model_path=path, device=a.device, dtype=dtype, kv_block_size=32, max_num_seqs=a.seqs,
                             max_model_len=a.prompt_tokens + a.new_tokens + 64, kv_router=a.router,
                             max_num_batched_tokens=a.prefill_tokens or a.prompt_tokens,
                             router_cuda_graphs=a.router != "off"), path)
    runner = eng.runner
    if runner.graphs is None:  # off CUDA: the decode graphs' logic, uncaptured
        from o3edge.engine.cuda_graph import DecodeGraphs
        from o3edge.engine.router_graph import RouterDecodeGraphs

        kind = RouterDecodeGraphs if runner.router is not None else DecodeGraphs
        runner.graphs = kind(runner, a.seqs, capture=False, launch_ahead=True)
    graphs, marks = runner.graphs, []
    is_ahead = graphs._is_ahead

    def watched(batch):
        queued = graphs.ahead is not None
        rows = is_ahead(batch)
        marks.append("-" if not queued else "x" if rows is None else "T" if len(rows) == len(batch) else "t")
        return rows

    graphs._is_ahead = watched
    g = torch.Generator().manual_seed(0)
    vocab = eng.info.args.vocab_size
    for i in range(a.seqs):
        eng.add_request(str(i), torch.randint(1, vocab, (a.prompt_tokens,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=a.new_tokens, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    print("".join(marks))
    print(f"{graphs.num_ahead_taken} of {graphs.num_steps} decode steps taken from the launch-ahead queue")


if __name__ == "__main__":
    main()
