#!/usr/bin/env python3
"""Load generator for o3edged: ramps offered load over the ZeroMQ socket and reports latency per class.

    python tools/loadgen.py --spawn-daemon --model DIR [--qps 0.5,1,2] [--step-seconds 30]
    python tools/loadgen.py --endpoint ipc:///run/o3edge/o3edge.sock --qps 1,2,4 --mix critical=1,low=3

Each offered-load level (--qps) runs on its own: Poisson arrivals at that rate for --step-seconds,
then a drain (at most --drain-seconds; what is left is cancelled and counted `unfinished`). Each
request draws its priority class from --mix (relative shares), its prompt length and output
length from the given ranges (uniform; ignore_eos, so the output length is what was asked), and
an optional per-class deadline. Requests go out round-robin over --clients connections from one
asyncio loop. The run is bounded: --max-requests in all and --time-limit of wall time, after
which everything in flight is cancelled. Loopback only: an ipc:// endpoint or tcp:// on a
loopback address.

Reported per level and class: requests sent, completed, rejected (`busy`), expired
(`deadline_exceeded`), other errors; TTFT and end-to-end latency p50/p95/p99 as the client saw
them (send -> first token, send -> done); throughput (completed requests/s and completion
tokens/s over the level's wall time, arrivals to last reply). Output: a rich table on stdout,
--json (everything, with the daemon's `stats` after each level) and --plot (PNG: latency against
offered QPS per class). Progress lines go to stderr every --progress-seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from o3edge.ipc import protocol as P  # noqa: E402
from o3edge.ipc.aio import AsyncO3Client  # noqa: E402
from o3edge.ipc.client import DaemonUnavailable, RequestError, TokenEvent  # noqa: E402
from tools.daemon_process import DaemonProcess  # noqa: E402
from tools.loadgen_report import (CLASSES, Record, markdown_table, plot, print_table, table_rows,  # noqa: E402
                                  write_json)

WORDS = ("def class return import self value list dict parse config token model cache block queue "
         "request stream error result default module function argument buffer thread socket engine "
         "batch step prefill decode latency budget deadline priority window memory device").split()


# ---- the load ----------------------------------------------------------------------------------

class LoadGen:
    """Sends requests at Poisson arrival times over several connections and records what happens."""

    def __init__(self, args: argparse.Namespace, clients: list[AsyncO3Client]):
        self.args, self.clients = args, clients
        self.rng = random.Random(args.seed)
        self.records: list[Record] = []
        self.tasks: set[asyncio.Task] = set()
        self.end_of_run = time.monotonic() + args.time_limit

    def out_of_budget(self) -> bool:
        return len(self.records) >= self.args.max_requests or time.monotonic() >= self.end_of_run

    async def run_level(self, level: int, qps: float) -> tuple[float, float]:
        """Arrivals at `qps` for step_seconds, then the drain; returns (start, end) of the level."""
        start = time.monotonic()
        end_arrivals = min(start + self.args.step_seconds, self.end_of_run)
        next_at = start + self.rng.expovariate(qps)
        progress = asyncio.create_task(self._progress(level, qps, start))
        while next_at < end_arrivals and not self.out_of_budget():
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            self._launch(level)
            next_at += self.rng.expovariate(qps)
        await self._drain(min(time.monotonic() + self.args.drain_seconds, self.end_of_run))
        progress.cancel()
        return start, time.monotonic()

    def _launch(self, level: int) -> None:
        cls = self.rng.choices(CLASSES, weights=[self.args.mix.get(c, 0.0) for c in CLASSES])[0]
        prompt = " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(*self.args.prompt_len)))
        params = {"max_tokens": self.rng.randint(*self.args.output_len), "priority": cls, "ignore_eos": True}
        if cls in self.args.deadline:
            params["deadline_ms"] = self.args.deadline[cls]
        record = Record(level, cls, time.monotonic())
        self.records.append(record)
        client = self.clients[len(self.records) % len(self.clients)]
        task = asyncio.create_task(self._request(client, record, prompt, params))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _request(self, client: AsyncO3Client, record: Record, prompt: str, params: dict) -> None:
        try:
            async for event in client.stream(prompt, **params):
                if isinstance(event, TokenEvent):
                    record.first = record.first or time.monotonic()
                else:
                    record.done, record.outcome = time.monotonic(), "ok"
                    record.prompt_tokens, record.completion_tokens = event.prompt_tokens, event.completion_tokens
                    record.server_ttft_ms = event.timings.get("ttft_ms")
        except RequestError as exc:
            record.done, record.outcome = time.monotonic(), exc.code
        except DaemonUnavailable:
            record.done, record.outcome = time.monotonic(), "unavailable"
        except asyncio.CancelledError:
            record.outcome = "unfinished"
            raise

    async def _drain(self, until: float) -> None:
        while self.tasks and time.monotonic() < until:
            await asyncio.wait(list(self.tasks), timeout=max(0.0, until - time.monotonic()))
        for task in list(self.tasks):  # the stream's cleanup sends `cancel` to the daemon
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _progress(self, level: int, qps: float, start: float) -> None:
        while True:
            await asyncio.sleep(self.args.progress_seconds)
            mine = [r for r in self.records if r.level == level]
            count = lambda outcome: sum(r.outcome == outcome for r in mine)  # noqa: E731
            try:
                s = await self.clients[0].stats()
                daemon = (f"daemon: running {s['running']}, queue {s['queue_depth']}, "
                          f"{s['tokens_per_s']:.1f} tok/s, breakers open: "
                          f"{','.join(c for c in CLASSES if s['classes'][c]['breaker']['state'] == 'open') or '-'}")
            except Exception as exc:  # progress must never end the run
                daemon = f"daemon: stats failed ({exc})"
            log(f"[{level + 1}/{len(self.args.qps)} {qps:g} qps] {time.monotonic() - start:5.1f}s sent {len(mine)} "
                f"ok {count('ok')} busy {count(P.BUSY)} expired {count(P.DEADLINE_EXCEEDED)} "
                f"in flight {sum(r.outcome == 'pending' for r in mine)} | {daemon}")


async def run(args: argparse.Namespace) -> dict:
    clients = [AsyncO3Client(args.endpoint, timeout=args.request_timeout) for _ in range(args.clients)]
    try:
        health = await clients[0].health()
        if not health["ready"]:
            raise SystemExit(f"the daemon at {args.endpoint} is {health['status']}, not ready")
        info = await clients[0].info()
        gen = LoadGen(args, clients)
        for _ in range(args.warmup):  # not recorded: first-request costs stay out of the figures
            await clients[0].generate("warm up " * 8, max_tokens=4, ignore_eos=True)
        levels = []
        for level, qps in enumerate(args.qps):
            if gen.out_of_budget():
                log(f"budget spent (--max-requests {args.max_requests} / --time-limit {args.time_limit:g} s): "
                    f"skipping {qps:g} qps and above")
                break
            log(f"level {level + 1}/{len(args.qps)}: {qps:g} qps for {args.step_seconds:g} s")
            start, end = await gen.run_level(level, qps)
            levels.append({"qps": qps, "start": start, "end": end, "stats": await clients[0].stats()})
        return {"info": info, "levels": levels, "records": gen.records}
    finally:
        for c in clients:
            await c.close()


# ---- a daemon of our own -----------------------------------------------------------------------

def spawn_daemon(args: argparse.Namespace) -> tuple[DaemonProcess, str]:
    """o3edged on a temporary ipc:// endpoint with the model, device and --set values given."""
    directory = tempfile.mkdtemp(prefix="o3edge-loadgen-")
    tables = {"engine": {"model_path": os.path.abspath(args.model), "device": args.device},
              "server": {"max_inflight_per_client": 1024}}
    for key, value in args.set:
        section, _, name = key.rpartition(".")
        tables.setdefault(section, {})[name] = value
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    return DaemonProcess(directory, args.model, "o3edge.sock", tables, env).start(), directory


# ---- command line ------------------------------------------------------------------------------

def log(line: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def _shares(text: str) -> dict:
    """'critical=1,low=3' -> {class: value}; unknown classes are an error."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in CLASSES:
            raise argparse.ArgumentTypeError(f"unknown class {name!r}; classes are {', '.join(CLASSES)}")
        out[name] = float(value)
    return out


def _setting(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    if "." not in key or not value:
        raise argparse.ArgumentTypeError(f"--set needs section.key=value, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def check_loopback(endpoint: str) -> None:
    """Refuse anything but ipc:// and tcp:// on a loopback address."""
    if endpoint.startswith("ipc://"):
        return
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    try:
        ok = endpoint.startswith("tcp://") and (host == "localhost" or ipaddress.ip_address(host).is_loopback)
    except ValueError:
        ok = False
    if not ok:
        raise SystemExit(f"loopback only: use ipc:// or tcp://127.0.0.1:PORT, got {endpoint!r}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_argument_group("daemon")
    where.add_argument("--endpoint", help="an existing daemon (default $O3EDGE_ENDPOINT or the system socket)")
    where.add_argument("--spawn-daemon", action="store_true", help="start an o3edged of our own for the run")
    where.add_argument("--model", help="model or engine directory for --spawn-daemon")
    where.add_argument("--device", default="cpu", help="device for --spawn-daemon (default cpu)")
    where.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the spawned daemon")
    where.add_argument("--set", type=_setting, action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="a setting of the spawned daemon, e.g. scheduler.low.max_wait_ms=20000 (repeatable)")
    load = ap.add_argument_group("load")
    load.add_argument("--qps", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1.0, 2.0],
                      help="offered load levels, requests/s (default 0.5,1,2)")
    load.add_argument("--step-seconds", type=float, default=30.0, help="arrivals per level (default 30)")
    load.add_argument("--drain-seconds", type=float, default=30.0, help="wait after a level's arrivals (default 30)")
    load.add_argument("--mix", type=_shares, default={"critical": 1, "high": 2, "normal": 4, "low": 3},
                      help="class shares (default critical=1,high=2,normal=4,low=3)")
    load.add_argument("--deadline", type=_shares, default={},
                      help="per-class deadline_ms, e.g. low=20000,normal=10000 (default none)")
    load.add_argument("--prompt-len", type=_range, default=(48, 96),
                      help="prompt length in words, MIN-MAX (default 48-96; the JSON has token counts)")
    load.add_argument("--output-len", type=_range, default=(16, 48), help="max_tokens, MIN-MAX (default 16-48)")
    load.add_argument("--clients", type=int, default=4, help="connections (default 4)")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--warmup", type=int, default=2, help="unrecorded requests first (default 2)")
    bounds = ap.add_argument_group("bounds")
    bounds.add_argument("--max-requests", type=int, default=2000, help="requests in all (default 2000)")
    bounds.add_argument("--time-limit", type=float, default=600.0, help="wall seconds in all (default 600)")
    bounds.add_argument("--request-timeout", type=float, default=120.0, help="longest wait for one reply (s)")
    out = ap.add_argument_group("output")
    out.add_argument("--json", help="write the results (with per-request records) to this file")
    out.add_argument("--plot", help="write a PNG of latency against offered QPS to this file")
    out.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    out.add_argument("--progress-seconds", type=float, default=5.0)
    args = ap.parse_args(argv)
    args.deadline = {k: int(v) for k, v in args.deadline.items()}
    if args.spawn_daemon and not args.model:
        ap.error("--spawn-daemon needs --model")
    if args.spawn_daemon and args.endpoint:
        ap.error("--endpoint and --spawn-daemon exclude each other")
    if not any(args.mix.values()) or min(args.qps) <= 0:
        ap.error("--mix needs a positive share and --qps positive rates")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    daemon = None
    if args.spawn_daemon:
        started = time.monotonic()
        daemon, directory = spawn_daemon(args)
        args.endpoint = daemon.endpoint
    else:
        args.endpoint = args.endpoint or os.environ.get("O3EDGE_ENDPOINT") or P.DEFAULT_ENDPOINT
    check_loopback(args.endpoint)
    try:
        if daemon:
            try:
                daemon.wait_ready(120)
            except AssertionError as exc:
                raise SystemExit(str(exc)[-4000:]) from None
            log(f"spawned o3edged ready in {time.monotonic() - started:.1f} s on {args.endpoint}")
        result = asyncio.run(run(args))
    finally:
        if daemon:
            daemon.stop(timeout=30)
            shutil.rmtree(directory, ignore_errors=True)
    rows = table_rows(result, args)
    info = result["info"]
    title = f"o3edged {info.get('model')} ({info.get('dtype')}, {info.get('device')}): load ramp"
    print_table(rows, title)
    if args.markdown:
        print(markdown_table(rows))
    if args.plot:
        plot(rows, args.plot, title)
    if args.json:
        write_json(args.json, args, result, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
