#!/usr/bin/env python3
"""Host cost of the detokenizer, a token at a time, over a long output.

Every decoding sequence pays `Detokenizer.add` once a step (engine.py `_append`): the text piece of its new
token, held back while it may be a partial character or the start of a stop string. This feeds the ids of a
long text (the package's own source, repeated) to one detokenizer on the built-in model's tokenizer and times
each slice of the output, so that a cost growing with the text shows as a rising figure.

  python tools/bench_detok.py [--tokens 16000] [--slice 4000] [--stop '...'] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from o3edge.engine import tokenizer as tok_module  # noqa: E402
from o3edge.engine.tokenizer import Detokenizer, Tokenizer  # noqa: E402
from o3edge.model_path import default_model_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16000)
    ap.add_argument("--slice", type=int, default=4000, help="tokens a timed slice")
    ap.add_argument("--stop", action="append", default=[], help="a stop string that never occurs (repeatable)")
    ap.add_argument("--window", action="store_true", help="the older library's path: two window decodes a token")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.window:
        tok_module.DecodeStream = None
    tokenizer = Tokenizer(default_model_path())
    src = os.path.join(os.path.dirname(tok_module.__file__), "router.py")
    text = open(src, encoding="utf-8").read()
    ids = tokenizer.encode(text * (1 + a.tokens * 4 // max(1, len(text))), add_special_tokens=False)[:a.tokens]
    runs = []
    for _ in range(a.repeat):
        d, slices, t = Detokenizer(tokenizer, tuple(a.stop)), [], time.perf_counter()
        for i, token in enumerate(ids, 1):
            d.add(token)
            if i % a.slice == 0:
                now = time.perf_counter()
                slices.append(round((now - t) / a.slice * 1e6, 3))
                t = now
        runs.append(slices)
    best = [min(r[i] for r in runs) for i in range(len(runs[0]))]
    out = {"tokens": len(ids), "slice": a.slice, "stop": a.stop, "window": a.window,
           "us_per_token_by_slice": best, "runs": runs}
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
