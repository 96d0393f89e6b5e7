"""o3edge-cli: talk to a running o3edged.

    o3edge-cli prompt "Why is the sky blue?" [--max-tokens N] [--temperature T] [--top-p P] [--top-k K]
                      [--seed S] [--priority critical|high|normal|low] [--deadline-ms MS]
                      [--system "..."] [--stop S ...] [--raw] [--json]
    o3edge-cli health | stats | info [--json]
    common: [--endpoint ipc:///run/o3edge/o3edge.sock] [--timeout SECONDS] [--wait SECONDS]

The endpoint defaults to $O3EDGE_ENDPOINT, then $O3EDGE_SERVER_ENDPOINT (the daemon's own
variable), then ipc:///run/o3edge/o3edge.sock.

`prompt` streams the answer to stdout as it is generated, then one summary line on stderr.

Exit status: 0 success (for `health`: the engine is ready); 1 the daemon refused or failed the
request (the error code is printed), or `health` found it not ready; 2 bad command line;
3 no daemon is running at the endpoint, or it stopped answering; 4 permission denied on the
socket; 130 interrupted (the request is cancelled).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from o3edge.errors import ConfigError
from o3edge.ipc import protocol as P
from o3edge.ipc.client import Completion, DaemonUnavailable, O3Client, PermissionDenied, RequestError, \
    TokenEvent, default_endpoint

EXIT_OK, EXIT_REQUEST, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_PERMISSION, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130


def summary(done: Completion) -> str:
    """The one-line summary after a streamed answer."""
    t, u = done.timings, done.usage
    parts = [f"{u['prompt_tokens']} prompt + {u['completion_tokens']} completion tokens",
             f"TTFT {t['ttft_ms']:.0f} ms", f"{t['tokens_per_s']:.1f} tokens/s"]
    if done.tokens_per_joule is not None:
        parts.append(f"{done.tokens_per_joule:.2f} tokens/J")
    if u.get("cached_tokens"):
        parts.append(f"{u['cached_tokens']} cached")
    return f"[{' · '.join(parts)} · {done.finish_reason}]"


def cmd_prompt(client: O3Client, args) -> int:
    health = client.health()
    if health["status"] == "loading":
        print("o3edge-cli: waiting for the engine to load...", file=sys.stderr)
        health = client.wait_ready(max(args.wait, args.timeout))
    if not health["ready"]:
        raise DaemonUnavailable(f"o3edged at {client.endpoint} is {health['status']}")
    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  seed=args.seed, priority=args.priority, deadline_ms=args.deadline_ms, stop=args.stop or None)
    if args.raw or not client.info().get("has_chat_template"):
        if args.system:
            raise RequestError(P.INVALID_REQUEST, "--system needs a chat model (this model has no chat template) "
                                                  "and cannot be combined with --raw")
        stream = client.stream(args.text, **params)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": args.text}]
        stream = client.stream(messages=messages, **params)
    wrote = False
    try:
        for event in stream:
            wrote = _show_event(event, args.json) or wrote
    except BaseException:
        if wrote:  # end the partial answer's line before the error message
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    return EXIT_OK


def _show_event(event: TokenEvent | Completion, as_json: bool) -> bool:
    """Print one stream event; True if answer text went to stdout."""
    if isinstance(event, TokenEvent):
        if not as_json and event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
            return True
        return False
    if as_json:
        out = {"text": event.text, "token_ids": event.token_ids, "finish_reason": event.finish_reason,
               "usage": event.usage, "timings": event.timings, "energy": event.energy}
        print(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(summary(event), file=sys.stderr)
    return False


def cmd_show(client: O3Client, args) -> int:
    reply = getattr(client, args.command)()
    body = {k: v for k, v in reply.items() if k not in ("v", "type", "id")}
    if args.json:
        print(json.dumps(body))
    else:
        flat = _flatten(body)
        width = max(map(len, flat), default=0)
        for key, value in flat.items():
            print(f"{key:<{width}}  {value}")
    return EXIT_OK if args.command != "health" or reply["ready"] else EXIT_REQUEST


def _flatten(table: dict, prefix: str = "") -> dict:
    """{"classes": {"low": {"running": 0}}} -> {"classes.low.running": 0}, for text output."""
    flat = {}
    for key, value in table.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--endpoint", default=None, help="daemon endpoint (default $O3EDGE_ENDPOINT, "
                        f"$O3EDGE_SERVER_ENDPOINT or {P.DEFAULT_ENDPOINT})")
    common.add_argument("--timeout", type=float, default=30.0,
                        help="seconds to wait for the daemon's next message (default 30)")
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    common.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                        help="wait up to SECONDS for a daemon that is still starting (default 0)")
    ap = argparse.ArgumentParser(prog="o3edge-cli", description="Client for the o3edged inference daemon.",
                                 epilog="exit status: 0 ok, 1 request failed / not ready, 2 usage, "
                                        "3 daemon not running, 4 permission denied, 130 interrupted")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prompt", parents=[common], help="generate an answer, streamed")
    p.add_argument("text")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--priority", choices=P.PRIORITIES)
    p.add_argument("--deadline-ms", type=int)
    p.add_argument("--system", help="system prompt (chat models)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the text as a plain completion prompt, no chat template")
    for name, text in (("health", "is the daemon live and ready?"), ("stats", "queue, batch, KV cache, speed"),
                       ("info", "model, device, limits, version")):
        sub.add_parser(name, parents=[common], help=text)
    return ap.parse_args(argv)


def connect(endpoint: str, args) -> O3Client:
    """A client; with --wait, keep trying while no daemon listens yet (one just started)."""
    end = time.monotonic() + args.wait
    while True:
        try:
            return O3Client(endpoint, timeout=args.timeout)
        except DaemonUnavailable:
            if time.monotonic() >= end:
                raise
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    endpoint = args.endpoint or default_endpoint()
    try:
        with connect(endpoint, args) as client:
            return cmd_prompt(client, args) if args.command == "prompt" else cmd_show(client, args)
    except DaemonUnavailable as exc:
        print(f"o3edge-cli: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except PermissionDenied as exc:
        print(f"o3edge-cli: {exc}", file=sys.stderr)
        return EXIT_PERMISSION
    except RequestError as exc:
        print(f"o3edge-cli: the daemon refused the request: {exc}", file=sys.stderr)
        return EXIT_REQUEST
    except KeyboardInterrupt:
        print("o3edge-cli: interrupted; request cancelled", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ConfigError as exc:  # a malformed --endpoint
        print(f"o3edge-cli: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
