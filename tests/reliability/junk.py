"""Helper process: open N raw unix-socket connections to a path, each sending bytes that are not a
ZMTP greeting, and hold them open until stdin closes (or a hold time passes).

    python tests/reliability/junk.py SOCKET_PATH N [--hold S] [--payload HEX]

Prints one JSON line when done connecting: {"connected": n, "refused": m, "closed_by_peer": k}.
A connection the daemon closes within PATIENCE_S of the last connect is counted as closed_by_peer (read returns
EOF).
"""

import argparse
import json
import resource
import select
import socket
import sys
import time


PATIENCE_S = 5.0  # how long after its last connection a helper waits for the daemon to close them


def connect(path: str, patience_s: float = 5.0) -> socket.socket | None:
    """A connected unix socket, retrying while the listen backlog is full; None if refused."""
    end = time.monotonic() + patience_s
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)  # blocking: waits while the backlog is full
            return s
        except (BlockingIOError, InterruptedError):
            s.close()
        except OSError as exc:
            s.close()
            print(f"connect failed: {exc}", file=sys.stderr)
            return None
        if time.monotonic() > end:
            return None
        time.sleep(0.001)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("count", type=int)
    ap.add_argument("--hold", type=float, default=None, help="seconds to hold (default: until stdin closes)")
    ap.add_argument("--payload", default="0102030405060708090a", help="hex bytes sent on each connection")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    payload = bytes.fromhex(args.payload)
    socks, refused = [], 0
    for _ in range(args.count):
        s = connect(args.path)
        if s is None:
            refused += 1
            continue
        try:
            s.send(payload)
        except OSError:  # closed by the daemon already
            pass
        socks.append(s)
    closed, still_open = 0, socks
    for s in socks:
        s.setblocking(False)
    end = time.monotonic() + PATIENCE_S  # the daemon's closes counted as they come, for at most PATIENCE_S
    while still_open and time.monotonic() < end:
        time.sleep(0.1)
        left = []
        for s in still_open:
            try:
                if s.recv(4096) == b"":
                    closed += 1
                    continue
            except BlockingIOError:
                pass
            except OSError:
                closed += 1
                continue
            left.append(s)
        still_open = left
    print(json.dumps({"connected": len(socks), "refused": refused, "closed_by_peer": closed}), flush=True)
    if args.hold is not None:
        time.sleep(args.hold)
    else:
        select.select([sys.stdin], [], [])
        sys.stdin.read()
    return 0


if __name__ == "__main__":
    sys.exit(main())
