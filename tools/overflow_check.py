#!/usr/bin/env python3
"""Flood an o3edged that has an [upstream] and count where each request was served.

    python tools/overflow_check.py --endpoint ipc:///tmp/o3.sock [--http http://127.0.0.1:8080/v1]
                                   [--requests 32] [--max-tokens 32] [--phase NAME] [--json PATH]

Sends --requests concurrent generate requests over ZeroMQ (and as many chat completions over the
HTTP door when --http is given), then prints and appends to --json one record: per door, how many
were served here, served upstream, or refused (by error code), plus the daemon's `stats.upstream`
(breaker state, counts per class). tools/overflow_llama_server.sh runs it against llama-server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from o3edge.ipc.client import O3Client, RequestError  # noqa: E402


def zmq_one(endpoint: str, i: int, max_tokens: int) -> str:
    with O3Client(endpoint, timeout=120) as c:
        try:
            done = c.generate(messages=[{"role": "user", "content": f"Request {i}: tell me about rivers."}],
                              max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        except RequestError as exc:
            return exc.code
    return done.raw.get("served_by", "local")


def http_one(url: str, i: int, max_tokens: int) -> str:
    import openai

    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as c:
        try:
            model = c.models.list().data[0].id
            r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Request {i}"}],
                                          max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
        except openai.APIStatusError as exc:
            return (exc.body or {}).get("code", str(exc.status_code))
    return r.usage.model_extra.get("served_by", "local")


def flood(fn, target: str, n: int, max_tokens: int) -> dict:
    start = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        where = list(pool.map(lambda i: fn(target, i, max_tokens), range(n)))
    return {"counts": dict(Counter(where)), "seconds": round(time.monotonic() - start, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--http", help="the daemon's OpenAI base URL, to flood the HTTP door as well")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--phase", default="run")
    ap.add_argument("--json", help="append the record (one JSON object per line)")
    args = ap.parse_args()
    record = {"phase": args.phase, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "requests": args.requests,
              "max_tokens": args.max_tokens, "zeromq": flood(zmq_one, args.endpoint, args.requests, args.max_tokens)}
    if args.http:
        record["http"] = flood(http_one, args.http, args.requests, args.max_tokens)
    with O3Client(args.endpoint, timeout=10) as c:
        record["upstream"] = c.stats().get("upstream")
    print(json.dumps(record, indent=1))
    if args.json:
        with open(args.json, "a") as fh:
            fh.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
