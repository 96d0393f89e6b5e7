"""Helper process: stream one long generation and report how it ended.

    python tests/reliability/stream_client.py ENDPOINT MAX_TOKENS

Prints `started` after the first token (the test then SIGSTOPs it), and at the end one JSON line:
{"tokens": n, "final": "done" | "error:<code>" | "unavailable", "message": ..., "finals": count}.
"""

import json
import sys

import msgpack

from o3edge.ipc.client import Completion, DaemonUnavailable, O3Client, RequestError


def main() -> int:
    endpoint, max_tokens = sys.argv[1], int(sys.argv[2])
    tokens, final, message, finals = 0, None, "", 0
    with O3Client(endpoint, timeout=30.0) as client:
        stream = client.stream("The json module", max_tokens=max_tokens, ignore_eos=True)
        try:
            for event in stream:
                if isinstance(event, Completion):
                    final, finals = "done", finals + 1
                    continue
                tokens += len(event.token_ids)
                if tokens == len(event.token_ids):
                    print("started", flush=True)
        except RequestError as exc:
            final, message, finals = f"error:{exc.code}", exc.args[0], finals + 1
        except DaemonUnavailable as exc:
            final, message = "unavailable", str(exc)
        while client._sock.poll(1000):  # anything more for this request would be a second final reply
            reply = msgpack.unpackb(client._sock.recv(), raw=False)
            if reply.get("id") == stream.request_id and reply.get("type") in ("done", "error"):
                finals += 1
    print(json.dumps({"tokens": tokens, "final": final, "message": message, "finals": finals}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
