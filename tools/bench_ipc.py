#!/usr/bin/env python3
"""IPC latency: `health` round trip, and what a streamed token costs over the socket and over HTTP.

    python tools/bench_ipc.py [--model DIR] [--health N] [--tokens N] [--repeats N] [--threads N]
                              [--json PATH]

Three measurements, each against a separate server process on a temporary ipc:// endpoint:
  1. `health` round trips (O3Client, and a bare DEALER + msgpack), p50 / p99.
  2. Streamed tokens from a null engine (no model: a step emits one token stamped with the
     monotonic clock, paced at ~4k tokens/s so a Python reader keeps up): delivery latency from
     the end of the engine step to the decoded token in the client (engine loop bookkeeping,
     msgpack, inproc hand-over, ROUTER send, receive, decode), and the CPU time per token spent
     in the daemon and in the client.
  3. The random tiny model (or --model), greedy decode: in-process O3Model.stream against a streamed
     generate through o3edged; the difference per token is the socket's overhead under real load.
The null-engine stream and the real-model decode are also run through the HTTP door (the same
server with [http] on, an SSE stream read by a plain http.client reader), so the per-token cost
of the two doors can be compared; --json writes every figure (and the raw latency samples).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgpack  # noqa: E402
import zmq  # noqa: E402

from o3edge.ipc.client import DaemonUnavailable, O3Client, TokenEvent  # noqa: E402
from tools.daemon_process import REPO, DaemonProcess  # noqa: E402

PROMPT = "def parse_arguments(argv):\n    "
STEP_S = 0.0002


class NullEngine:
    """An engine that emits one token per request per step, instantly (measures everything but the model)."""

    def __init__(self):
        from o3edge.engine.engine import RequestOutput, StepReport
        self._out, self._report = RequestOutput, StepReport
        self.reqs: dict[str, list[int]] = {}
        self.info = SimpleNamespace(model_dir="/null", device="cpu", dtype="none", backend="null", fingerprint="null",
                                    args=SimpleNamespace(family="null", vocab_size=1000), num_kv_blocks=1,
                                    kv_block_size=16, kv_cache_bytes=0, max_model_len=1 << 20, load_seconds=0.0,
                                    cache_identity="0" * 32)
        self.tokenizer = SimpleNamespace(chat_template=None, encode_request=self.encode)

    def encode(self, prompt=None, messages=None):
        return [1, 2, 3]

    def add_request(self, rid, ids, params, priority=None, deadline=None):
        self.reqs[rid] = [params.max_new_tokens, 0]

    def abort(self, rid, reason="abort"):
        return self.reqs.pop(rid, None) is not None

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        time.sleep(STEP_S)
        t0 = time.monotonic_ns()
        report, outputs = self._report(t0, t0), []
        for rid, r in list(self.reqs.items()):
            r[1] += 1
            done = r[1] >= r[0]
            if done:
                del self.reqs[rid]
            report.tokens[rid] = (0, 1)
            outputs.append(self._out(rid, [7], str(t0), done, "length" if done else None, 3, r[1], 0, 0.0, 0.0))
        return outputs, report

    def stats(self):
        return {"waiting": 0, "running": len(self.reqs)}


def serve_null(endpoint: str, http_port: int) -> None:
    """Child process: an IPCServer over the null engine, with its HTTP door on http_port, until SIGTERM."""
    import signal

    from o3edge.http.config import HttpSettings, UpstreamSettings
    from o3edge.http.doors import Doors
    from o3edge.ipc.server import IPCServer
    from o3edge.settings import ServerSettings

    server = IPCServer(ServerSettings(endpoint=endpoint), NullEngine)
    doors = Doors(HttpSettings(enabled=True, listen=f"127.0.0.1:{http_port}"), UpstreamSettings(), server,
                  None, None)
    server.start()
    doors.start()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        time.sleep(0.1)
    server.shutdown(timeout=1.0)
    doors.close()


def start_null_server(endpoint: str, http_port: int) -> subprocess.Popen:
    """The null-engine server (HTTP door on http_port) in a child process (o3edged itself runs through
    tools/daemon_process.py)."""
    proc = subprocess.Popen([sys.executable, __file__, "--serve-null", endpoint, "--http-port", str(http_port)],
                            cwd=REPO, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        try:
            with O3Client(endpoint, timeout=5) as c:
                if c.wait_ready(120)["ready"]:
                    return proc
        except DaemonUnavailable:
            time.sleep(0.05)
    raise SystemExit(f"server at {endpoint} did not become ready")


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def bench_health(endpoint: str, n: int) -> dict:
    with O3Client(endpoint, timeout=5) as c:
        for _ in range(100):
            c.health()
        client_us = []
        for _ in range(n):
            t = time.perf_counter()
            c.health()
            client_us.append((time.perf_counter() - t) * 1e6)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    frame = msgpack.packb({"v": 1, "op": "health", "id": "h"})
    raw_us = []
    for i in range(n + 100):
        t = time.perf_counter()
        sock.send(frame)
        msgpack.unpackb(sock.recv())
        if i >= 100:
            raw_us.append((time.perf_counter() - t) * 1e6)
    sock.close()
    return {"client": client_us, "raw": raw_us}


def per_token_s(events_with_times: list[float]) -> float:
    """Seconds per token after the first (decode only), from each token's arrival time."""
    return (events_with_times[-1] - events_with_times[0]) / (len(events_with_times) - 1)


def bench_null_stream(endpoint: str, pid: int, tokens: int) -> dict:
    """Delivery latency of each token (its text is the emit time) and CPU per token on both sides."""
    import psutil

    daemon = psutil.Process(pid)
    with O3Client(endpoint, timeout=30) as c:
        c.generate(PROMPT, max_tokens=200)  # warm up
        cpu_d0, cpu_c0 = sum(daemon.cpu_times()[:2]), time.process_time()
        latency_us = []
        for e in c.stream(PROMPT, max_tokens=tokens):
            if isinstance(e, TokenEvent):
                latency_us.append((time.monotonic_ns() - int(e.text)) / 1e3)
        cpu_d, cpu_c = sum(daemon.cpu_times()[:2]) - cpu_d0, time.process_time() - cpu_c0
    return {"latency": latency_us, "daemon_cpu_us": cpu_d / tokens * 1e6, "client_cpu_us": cpu_c / tokens * 1e6}


def sse_texts(port: int, body: dict):
    """POST a streamed /v1/completions to the HTTP door; yields (arrival, monotonic ns; text) per SSE chunk."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    try:
        for line in resp:
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"]
                if choice and choice[0]["text"]:
                    yield time.monotonic_ns(), choice[0]["text"]
    finally:
        conn.close()


def bench_null_http(port: int, pid: int, tokens: int) -> dict:
    """bench_null_stream's figures through the HTTP door (each SSE chunk's text is its emit time)."""
    import psutil

    daemon = psutil.Process(pid)
    body = {"prompt": PROMPT, "temperature": 0}
    list(sse_texts(port, {**body, "max_tokens": 200}))  # warm up
    cpu_d0, cpu_c0 = sum(daemon.cpu_times()[:2]), time.process_time()
    latency_us = [(arrived - int(text)) / 1e3 for arrived, text in sse_texts(port, {**body, "max_tokens": tokens})]
    cpu_d, cpu_c = sum(daemon.cpu_times()[:2]) - cpu_d0, time.process_time() - cpu_c0
    return {"latency": latency_us, "daemon_cpu_us": cpu_d / tokens * 1e6, "client_cpu_us": cpu_c / tokens * 1e6,
            "num_chunks": len(latency_us)}


def http_decode(port: int, tokens: int) -> float:
    times = [t / 1e9 for t, _ in sse_texts(port, {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
                                            "ignore_eos": True})]
    return per_token_s(times)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def socket_decode(endpoint: str, tokens: int) -> float:
    with O3Client(endpoint, timeout=60) as c:
        times = [time.perf_counter() for e in c.stream(PROMPT, max_tokens=tokens, ignore_eos=True)
                 if isinstance(e, TokenEvent)]
    return per_token_s(times)


def inprocess_decode(model, tokens: int) -> float:
    times = [time.perf_counter() for _ in model.stream(PROMPT, max_new_tokens=tokens, ignore_eos=True)]
    return per_token_s(times)


def summary(samples: list[float]) -> dict:
    return {"p50": round(pct(samples, .5), 1), "p99": round(pct(samples, .99), 1), "n": len(samples)}


def write_json(path: str, args, model_dir: str, h: dict, t: dict, th: dict, local: list, remote: list,
               over_http: list) -> None:
    import platform

    import aiohttp

    per_token = lambda d: {"latency_us": summary(d["latency"]), "daemon_cpu_us": round(d["daemon_cpu_us"], 1),  # noqa
                           "client_cpu_us": round(d["client_cpu_us"], 1)}
    out = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "python": platform.python_version(),
           "aiohttp": aiohttp.__version__, "zmq": zmq.zmq_version(), "load_average": os.getloadavg(),
           "health_us": {"client": summary(h["client"]), "raw": summary(h["raw"])},
           "null_engine": {"tokens": args.null_tokens, "zeromq": per_token(t), "http": per_token(th),
                           "http_chunks": th["num_chunks"]},
           "decode": {"model": os.path.basename(model_dir), "tokens": args.tokens, "threads": args.threads,
                      "in_process_s_per_token": local, "zeromq_s_per_token": remote, "http_s_per_token": over_http,
                      "median_ms": {k: round(statistics.median(v) * 1e3, 3) for k, v in
                                    (("in_process", local), ("zeromq", remote), ("http", over_http))}},
           "raw_latency_us": {"zeromq": [round(x, 1) for x in t["latency"]],
                              "http": [round(x, 1) for x in th["latency"]]}}
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the random tiny model, o3edge.tiny)")
    ap.add_argument("--health", type=int, default=3000, help="health round trips")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per generation")
    ap.add_argument("--null-tokens", type=int, default=5000, help="tokens streamed from the null engine")
    ap.add_argument("--repeats", type=int, default=7, help="generations per side (the median is kept)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, in-process and in the daemon")
    ap.add_argument("--json", help="write every figure and the raw latency samples here")
    ap.add_argument("--serve-null", metavar="ENDPOINT", help=argparse.SUPPRESS)
    ap.add_argument("--http-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_null:
        return serve_null(args.serve_null, args.http_port)

    import torch

    from o3edge import O3Config, O3Model
    from o3edge.tiny import default_tiny_path

    model_dir = args.model or default_tiny_path()
    rows = []
    with tempfile.TemporaryDirectory(prefix="o3bench") as tmp:
        null_ep, null_port = f"ipc://{tmp}/null.sock", free_port()
        proc = start_null_server(null_ep, null_port)
        try:
            h = bench_health(null_ep, args.health)
            t = bench_null_stream(null_ep, proc.pid, args.null_tokens)
            th = bench_null_http(null_port, proc.pid, args.null_tokens)
        finally:
            proc.terminate()
            proc.wait()
        rows += [("health RTT, O3Client (p50 / p99)", f"{pct(h['client'], .5):.0f} / {pct(h['client'], .99):.0f} µs"),
                 ("health RTT, bare DEALER + msgpack (p50 / p99)",
                  f"{pct(h['raw'], .5):.0f} / {pct(h['raw'], .99):.0f} µs"),
                 (f"token delivery latency, null engine, {args.null_tokens} tokens (p50 / p99)",
                  f"{pct(t['latency'], .5):.0f} / {pct(t['latency'], .99):.0f} µs"),
                 ("CPU per streamed token: daemon (loop + I/O) / client",
                  f"{t['daemon_cpu_us']:.0f} / {t['client_cpu_us']:.0f} µs"),
                 (f"HTTP door: token delivery latency, null engine, {th['num_chunks']} SSE chunks (p50 / p99)",
                  f"{pct(th['latency'], .5):.0f} / {pct(th['latency'], .99):.0f} µs"),
                 ("HTTP door: CPU per streamed token: daemon / client",
                  f"{th['daemon_cpu_us']:.0f} / {th['client_cpu_us']:.0f} µs")]

        torch.set_num_threads(args.threads)
        model = O3Model.from_config(O3Config(model_path=model_dir, device="cpu", num_kv_blocks=256))
        port = free_port()
        daemon = DaemonProcess(tmp, model_dir, "o3.sock", {"engine": {"num_kv_blocks": 256},
                                                           "http": {"enabled": True, "listen": f"127.0.0.1:{port}"}},
                               env={"OMP_NUM_THREADS": str(args.threads)}, args=("--log-level", "warning"))
        local, remote, over_http = [], [], []
        try:
            daemon.start().wait_ready(120)
            for _ in range(args.repeats):  # interleaved, so load from other processes hits all alike
                local.append(inprocess_decode(model, args.tokens))
                remote.append(socket_decode(daemon.endpoint, args.tokens))
                over_http.append(http_decode(port, args.tokens))
        finally:
            daemon.stop()
        lo, ro, ho = statistics.median(local), statistics.median(remote), statistics.median(over_http)
        rows += [(f"decode, in-process O3Model.stream ({os.path.basename(model_dir)}, {args.threads} thread(s), "
                  f"median of {args.repeats})", f"{lo * 1e3:.2f} ms/token"),
                 ("decode, streamed over the ipc socket (median)", f"{ro * 1e3:.2f} ms/token"),
                 ("difference per token (socket − in-process)", f"{(ro - lo) * 1e6:+.0f} µs"),
                 ("decode, streamed over the HTTP door (median)", f"{ho * 1e3:.2f} ms/token"),
                 ("difference per token (HTTP − in-process)", f"{(ho - lo) * 1e6:+.0f} µs")]
    if args.json:
        write_json(args.json, args, model_dir, h, t, th, local, remote, over_http)
    width = max(len(k) for k, _ in rows)
    print(f"| {'measurement':<{width}} | value |\n|{'-' * (width + 2)}|-------|")
    for k, v in rows:
        print(f"| {k:<{width}} | {v} |")


if __name__ == "__main__":
    main()
