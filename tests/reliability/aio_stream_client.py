"""Helper process: stream one long generation through the asyncio client and report how it ended.

    python tests/reliability/aio_stream_client.py ENDPOINT MAX_TOKENS

As stream_client.py (the blocking client), through AsyncO3Client: prints `started` after the first token
(the test then SIGSTOPs it), and at the end one JSON line {"tokens": n, "final": "done" | "error:<code>" |
"unavailable", "message": ..., "finals": count}, where finals counts every final reply (done or error) that
reached the client for the generation, the one the stream raised or returned included, in the second after it
ended as well (the client drops replies to a request it is done with; more than one would be a daemon bug).
"""

import asyncio
import json
import sys
from collections import Counter

import msgpack

from o3edge.ipc.aio import AsyncO3Client
from o3edge.ipc.client import Completion, DaemonUnavailable, RequestError


async def main() -> int:
    endpoint, max_tokens = sys.argv[1], int(sys.argv[2])
    tokens, final, message = 0, None, ""
    finals: Counter = Counter()  # request id -> final replies that reached the client
    async with AsyncO3Client(endpoint, timeout=30.0) as client:
        file = client._file

        def counted(frame: bytes) -> None:  # every reply frame the reader task hands out, seen first
            msg = msgpack.unpackb(frame, raw=False)
            if isinstance(msg, dict) and msg.get("type") in ("done", "error"):
                finals[msg.get("id")] += 1
            file(frame)

        client._file = counted
        try:
            async for event in client.stream("The json module", max_tokens=max_tokens, ignore_eos=True):
                if isinstance(event, Completion):
                    final = "done"
                    continue
                tokens += len(event.token_ids)
                if tokens == len(event.token_ids):
                    print("started", flush=True)
        except RequestError as exc:
            final, message = f"error:{exc.code}", exc.args[0]
        except DaemonUnavailable as exc:
            final, message = "unavailable", str(exc)
        await asyncio.sleep(1.0)  # anything more for the generation would be a second final reply
    count = finals["a1"]  # the generation is the client's first request
    print(json.dumps({"tokens": tokens, "final": final, "message": message, "finals": count}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
