"""o3edge-cli: talk to a running o3edged.

    o3edge-cli prompt "Why is the sky blue?" [--max-tokens N] [--temperature T] [--top-p P] [--top-k K]
                      [--seed S] [--priority critical|high|normal|low] [--deadline-ms MS]
                      [--system "..."] [--stop S ...] [--raw] [--ignore-eos] [--json]
    o3edge-cli health | stats | info [--json]      (health --wait S: wait until ready)
    common: [--endpoint ipc:///run/o3edge/o3edge.sock] [--timeout SECONDS] [--wait SECONDS]
    o3edge-cli energy [--log PATH] [--by hour|priority] [--plot out.png] [--json]

The endpoint defaults to $O3EDGE_ENDPOINT, then $O3EDGE_SERVER_ENDPOINT (the daemon's own
variable), then ipc:///run/o3edge/o3edge.sock.

`prompt` streams the answer to stdout as it is generated, then one summary line on stderr.
`energy` reads the energy log (no daemon needed): generated tokens per joule per hour and priority
class (or per hour, or per class, with --by), and with --plot a PNG of tokens/J over time. The log
defaults to [power] energy_log in the settings (file, then O3EDGE_* variables), else
/var/lib/o3edge/energy.jsonl.

Exit status: 0 success (for `health`: the engine is ready); 1 the daemon refused or failed the
request (the error code is printed), `health` found it not ready, or `energy` found no log; 2 bad command line;
3 no daemon is running at the endpoint, or it stopped answering; 4 permission denied on the
socket; 130 interrupted (the request is cancelled).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

from o3edge.errors import ConfigError
from o3edge.ipc import protocol as P
from o3edge.ipc.client import Completion, DaemonUnavailable, O3Client, PermissionDenied, RequestError, \
    TokenEvent, default_endpoint
from o3edge.settings import flatten

EXIT_OK, EXIT_REQUEST, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_PERMISSION, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130


def summary(done: Completion) -> str:
    """The one-line summary after a streamed answer."""
    t, u = done.timings, done.usage
    parts = [f"{u['prompt_tokens']} prompt + {u['completion_tokens']} completion tokens",
             f"TTFT {t['ttft_ms']:.0f} ms", f"{t['tokens_per_s']:.1f} tokens/s"]
    if done.tokens_per_joule is not None:
        parts.append(tokens_per_joule_text(done.energy))
    if u.get("cached_tokens"):
        cold = f" ({u['cold_tokens']} from the cold tier)" if u.get("cold_tokens") else ""
        parts.append(f"{u['cached_tokens']} cached{cold}")
    return f"[{' · '.join(parts)} · {done.finish_reason}]"


def tokens_per_joule_text(energy: dict) -> str:
    """A request's tokens/J as a reader should take it: labelled when estimated, rough when too short."""
    tpj, labels = energy["tokens_per_joule"], []
    if energy.get("is_estimate"):
        labels.append("estimated")
    if energy.get("low_confidence"):  # too short for the meter: one significant figure, flagged
        labels.append("low confidence: too short to measure")
        figure = f"~{float(f'{tpj:.1g}'):g}"
    else:
        figure = f"{tpj:.2f}"
    return f"{figure} tokens/J" + (f" ({', '.join(labels)})" if labels else "")


def cmd_prompt(client: O3Client, args) -> int:
    health = client.health()
    if health["status"] == "loading":
        print("o3edge-cli: waiting for the engine to load...", file=sys.stderr)
        health = client.wait_ready(max(args.wait, args.timeout))
    if not health["ready"]:
        raise DaemonUnavailable(f"o3edged at {client.endpoint} is {health['status']}")
    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  seed=args.seed, priority=args.priority, deadline_ms=args.deadline_ms, stop=args.stop or None,
                  ignore_eos=args.ignore_eos or None)
    if args.raw or not client.info().get("has_chat_template"):
        if args.system:
            raise RequestError(P.INVALID_REQUEST, "--system needs a chat model (this model has no chat template) "
                                                  "and cannot be combined with --raw")
        stream = client.stream(args.text, **params)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": args.text}]
        stream = client.stream(messages=messages, **params)
    wrote, tokens = False, 0
    try:
        for event in stream:
            if isinstance(event, TokenEvent):
                tokens += len(event.token_ids)
            wrote = _show_event(event, args.json) or wrote
    except BaseException as exc:
        if wrote:  # end the partial answer's line before the error message
            sys.stdout.write("\n")
            sys.stdout.flush()
        if isinstance(exc, RequestError) and tokens:  # it ran, then stopped: not a refusal
            print(f"o3edge-cli: the request stopped after {tokens} tokens: {exc}", file=sys.stderr)
            return EXIT_REQUEST
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
    if args.command == "health" and args.wait > 0 and not reply["ready"]:
        try:  # --wait on health: wait for ready (or a state that will not become ready)
            reply = client.wait_ready(args.wait)
        except DaemonUnavailable:
            reply = client.health()
    body = {k: v for k, v in reply.items() if k not in ("v", "type", "id")}
    if args.json:
        print(json.dumps(body))
    else:
        flat = flatten(body)
        width = max(map(len, flat), default=0)
        for key, value in flat.items():
            print(f"{key:<{width}}  {value}")
        if isinstance(body.get("energy"), dict):
            print(energy_line(body["energy"]))
    return EXIT_OK if args.command != "health" or reply["ready"] else EXIT_REQUEST


def energy_line(energy: dict) -> str:
    """The `stats` reply's energy figures in one line: tokens/J active and with idle, per window."""
    def pair(figures: dict) -> str:
        f = lambda x: "-" if x is None else f"{x:.4g}"  # noqa: E731
        return f"{f(figures.get('active_tokens_per_joule'))} active / {f(figures.get('tokens_per_joule'))} with idle"
    windows = [(k.removeprefix("last_"), v) for k, v in energy.items() if k.startswith("last_") and isinstance(v, dict)]
    parts = [f"all time {pair(energy.get('all') or {})}"] + [f"last {k} {pair(v)}" for k, v in windows]
    kind = "ESTIMATE" if energy.get("is_estimate") else "measured"
    return (f"tokens/J: {'; '.join(parts)} — {energy.get('meter')} [{','.join(energy.get('domains') or [])}], "
            f"{kind}")


def cmd_energy(args) -> int:
    """Summarise the energy log; optionally plot tokens/J over time. No daemon needed."""
    from o3edge.energy_service import default_energy_log
    from o3edge.power.energy_log import rotated_paths
    from o3edge.power.summary import group_rows, plot_tokens_per_joule, read_log, summarise

    path = args.log or str(default_energy_log())
    if not any(p.exists() for p in rotated_paths(path, 5)):
        print(f"o3edge-cli: no energy log at {path} (set [power] energy_log or pass --log)", file=sys.stderr)
        return EXIT_REQUEST
    try:
        records = list(read_log(path))
    except PermissionError as exc:
        print(f"o3edge-cli: cannot read the energy log: {exc}", file=sys.stderr)
        return EXIT_PERMISSION
    rows = group_rows(summarise(records), args.by) if args.by else summarise(records)
    if args.plot:
        try:
            plot_tokens_per_joule(records, args.plot)
        except (ImportError, OSError) as exc:
            print(f"o3edge-cli: no plot: {exc}", file=sys.stderr)
            return EXIT_REQUEST
        print(f"o3edge-cli: wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows]))
    else:
        _print_energy_rows(rows)
    return EXIT_OK


def _print_energy_rows(rows: list) -> None:
    header = ("hour", "priority", "requests", "prompt", "generated", "joules", "tokens/J", "low-conf", "meter")
    table = [header] + [(r.hour, r.priority, r.requests, r.prompt_tokens, r.completion_tokens, f"{r.joules:.3f}",
                         "-" if r.tokens_per_joule is None else f"{r.tokens_per_joule:.3f}", r.low_confidence,
                         r.meters) for r in rows]
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    for line in table:
        print("  ".join(str(v).ljust(w) if i in (0, 1, 8) else str(v).rjust(w)
                        for i, (v, w) in enumerate(zip(line, widths))).rstrip())
    generated, joules = sum(r.completion_tokens for r in rows), sum(r.joules for r in rows)
    overall = f"{generated / joules:.3f} tokens/J" if joules > 0 else "no energy measured"
    print(f"total: {sum(r.requests for r in rows)} requests, {generated} generated tokens, {joules:.3f} J, {overall}")


def _text(value: str) -> str:
    """An argument that is text: one a terminal gave in another encoding than UTF-8 arrives with its bytes escaped,
    which no message can carry."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("not valid UTF-8 text") from None
    return value


def _seconds(positive: bool):
    """A number of seconds: finite, and above 0 (positive) or at least 0."""
    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {value!r}") from None
        if not math.isfinite(x) or x < 0 or (positive and x == 0):
            raise argparse.ArgumentTypeError(f"must be a finite number {'above' if positive else 'of at least'} 0")
        return x
    return parse


def _integer(value: str) -> int:
    """An integer a message can carry (msgpack: -2**63 .. 2**64 - 1); the daemon checks the field's own range."""
    try:
        x = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if not -2**63 <= x < 2**64:
        raise argparse.ArgumentTypeError(f"{value} is out of range")
    return x


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--endpoint", type=_text, default=None, help="daemon endpoint (default $O3EDGE_ENDPOINT, "
                        f"$O3EDGE_SERVER_ENDPOINT or {P.DEFAULT_ENDPOINT})")
    common.add_argument("--timeout", type=_seconds(True), default=30.0,
                        help="seconds to wait for the daemon's next message (default 30)")
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    common.add_argument("--wait", type=_seconds(False), default=0.0, metavar="SECONDS",
                        help="wait up to SECONDS for a daemon that is still starting, and with `health` "
                             "until it is ready (default 0)")
    ap = argparse.ArgumentParser(prog="o3edge-cli", description="Client for the o3edged inference daemon.",
                                 epilog="exit status: 0 ok, 1 request failed / not ready, 2 usage, "
                                        "3 daemon not running, 4 permission denied, 130 interrupted")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prompt", parents=[common], help="generate an answer, streamed")
    p.add_argument("text", type=_text)
    p.add_argument("--max-tokens", type=_integer, default=None,
                   help="most tokens to generate (default: the daemon's, 128)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=_integer)
    p.add_argument("--seed", type=_integer)
    p.add_argument("--priority", choices=P.PRIORITIES)
    p.add_argument("--deadline-ms", type=_integer)
    p.add_argument("--system", type=_text, help="system prompt (chat models)")
    p.add_argument("--stop", type=_text, action="append", help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the text as a plain completion prompt, no chat template")
    p.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens tokens even past end-of-text")
    for name, text in (("health", "is the daemon live and ready?"), ("stats", "queue, batch, KV cache, speed"),
                       ("info", "model, device, limits, version")):
        sub.add_parser(name, parents=[common], help=text)
    e = sub.add_parser("energy", help="summarise the energy log: tokens per joule per hour and priority class")
    e.add_argument("--log", help="the JSON-lines energy log (default: [power] energy_log, else "
                   "/var/lib/o3edge/energy.jsonl)")
    e.add_argument("--by", choices=("hour", "priority"), help="one row per hour, or per priority class "
                   "(default: per hour and class)")
    e.add_argument("--plot", metavar="OUT.png", help="also draw tokens/J over time to this PNG (needs matplotlib)")
    e.add_argument("--json", action="store_true", help="print JSON instead of text")
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
    try:
        return _main(argv)
    except BrokenPipeError:  # `o3edge-cli stats | head`: the reader has all it wants
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
        return EXIT_OK


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if args.command == "energy":
        return cmd_energy(args)
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
