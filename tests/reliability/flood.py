"""Helper process: C connections, each keeping up to K generate requests in flight, for S seconds.

    python tests/reliability/flood.py ENDPOINT --clients 4 --inflight 8 --seconds 10 --prompt-bytes N [N ...]
                                      [--asyncio]

Prompts cycle through the given sizes (text repeated to N bytes). Prints one JSON line at the end:
requests sent, final replies by outcome (done, or the error code), and replies still missing. By default
each connection is a raw DEALER socket; with --asyncio each is an AsyncO3Client (o3edge/ipc/aio.py) whose K
tasks each await one generate() after another, so the client's own multiplexing is under the flood too (a
request that raised DaemonUnavailable, its reply never handed to it, counts as missing).
"""

import argparse
import asyncio
import itertools
import json
import sys
import time
from collections import Counter

import msgpack
import zmq

from o3edge.ipc.aio import AsyncO3Client
from o3edge.ipc.client import DaemonUnavailable, RequestError

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
    ap.add_argument("--asyncio", action="store_true", help="each connection an AsyncO3Client")
    args = ap.parse_args()
    prompts = [prompt(n) for n in args.prompt_bytes]
    if args.asyncio:
        sent, outcomes, missing = asyncio.run(flood_asyncio(args, prompts))
        print(json.dumps({"sent": sent, "outcomes": outcomes, "missing": missing}), flush=True)
        return 0
    ctx = zmq.Context()
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


async def flood_asyncio(args, prompts: list[str]) -> tuple[int, Counter, int]:
    """The flood through AsyncO3Client: (requests sent, final replies by outcome, requests left unanswered)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + args.seconds
    outcomes, sizes, sent, missing = Counter(), itertools.cycle(prompts), 0, 0

    async def task(client: AsyncO3Client) -> None:
        nonlocal sent, missing
        while loop.time() < end:
            sent += 1
            try:
                await client.generate(next(sizes), max_tokens=args.max_tokens, priority="low")
                outcomes["done"] += 1
            except RequestError as exc:
                outcomes[exc.code] += 1
            except DaemonUnavailable:
                missing += 1

    clients = [AsyncO3Client(args.endpoint, timeout=30.0) for _ in range(args.clients)]
    try:
        await asyncio.gather(*(task(c) for c in clients for _ in range(args.inflight)))
    finally:
        for c in clients:
            await c.close()
    return sent, outcomes, missing


if __name__ == "__main__":
    sys.exit(main())
