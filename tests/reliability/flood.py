"""Helper process: C connections, each keeping up to K generate requests in flight, for S seconds.

    python tests/reliability/flood.py ENDPOINT --clients 4 --inflight 8 --seconds 10 --prompt-bytes N [N ...]

Prompts cycle through the given sizes (text repeated to N bytes). Prints one JSON line at the end:
requests sent, final replies by outcome (done, or the error code), and replies still missing.
"""

import argparse
import itertools
import json
import sys
import time
from collections import Counter

import msgpack
import zmq

TEXT = ("The json module encodes and decodes JSON documents. The os module talks to the operating "
        "system: files, directories, processes and the environment. ")


def prompt(n: int) -> str:
    return (TEXT * (n // len(TEXT) + 1))[:n]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("endpoint")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--prompt-bytes", type=int, nargs="+", default=[1 << 20])
    args = ap.parse_args()
    ctx = zmq.Context()
    prompts = [prompt(n) for n in args.prompt_bytes]
    socks = []
    for _ in range(args.clients):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(args.endpoint)
        socks.append(s)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    ids = itertools.count()
    inflight = {s: set() for s in socks}
    outcomes, sent = Counter(), 0
    sizes = itertools.cycle(range(len(prompts)))
    end = time.monotonic() + args.seconds
    while time.monotonic() < end or any(inflight.values()):
        if time.monotonic() < end:
            for s in socks:
                while len(inflight[s]) < args.inflight:
                    rid = f"f{next(ids)}"
                    s.send(msgpack.packb({"v": 1, "op": "generate", "id": rid, "prompt": prompts[next(sizes)],
                                          "max_tokens": args.max_tokens, "priority": "low"}))
                    inflight[s].add(rid)
                    sent += 1
        elif time.monotonic() > end + 30:
            break
        for s, _ in poller.poll(100):
            while s.poll(0):
                msg = msgpack.unpackb(s.recv(), raw=False)
                if msg["type"] in ("done", "error"):
                    inflight[s].discard(msg["id"])
                    outcomes["done" if msg["type"] == "done" else msg["code"]] += 1
    print(json.dumps({"sent": sent, "outcomes": outcomes, "missing": sum(map(len, inflight.values()))}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
