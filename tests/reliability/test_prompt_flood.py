"""One client's large prompts must not stall everyone: before, prompts were tokenized on the I/O
thread with no size bound (~0.5 s per MiB), and with 4 connections repeating 1 MiB prompts a
normal prompt got no answer in 60 s and `health` took seconds."""

import json
import os
import subprocess
import sys
import time

import pytest

from o3edge.ipc import protocol as P
from o3edge.ipc.client import O3Client, RequestError

HERE = os.path.dirname(os.path.abspath(__file__))
FLOOD_S = 12.0
BIG = (1 << 20) - 256  # just under the default frame limit (max_message_bytes)


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_oversized_prompt_is_refused_by_size_before_tokenizing(rel_daemon):
    with O3Client(rel_daemon.endpoint, timeout=10.0) as c:
        limit = c.info()["max_prompt_bytes"]
        assert limit and limit < BIG
        t0 = time.perf_counter()
        try:
            c.generate("x" * BIG, max_tokens=1)
        except RequestError as exc:
            assert exc.code == P.PROMPT_TOO_LONG and "bytes" in str(exc)
        else:
            raise AssertionError("a 1 MiB prompt was accepted")
        assert time.perf_counter() - t0 < 0.5
        assert c.generate("The json module", max_tokens=2).completion_tokens == 2


JITTER_PROBE = """
import sys, time
end, late = time.monotonic() + float(sys.argv[1]), []
while time.monotonic() < end:
    t0 = time.perf_counter(); time.sleep(0.001); late.append((time.perf_counter() - t0 - 0.001) * 1000)
late.sort(); print(late[int(0.99 * len(late))])
"""


@pytest.mark.parametrize("kind", ["raw", "asyncio"])  # raw DEALER sockets, or AsyncO3Client connections
def test_health_and_critical_request_hold_during_a_4_client_prompt_flood(rel_daemon, figures, kind):
    """health p99 <= 10 ms, plus the wake-up delay this machine imposes on any process at the
    time (measured beside it: other people's jobs on a shared 2-core machine add tens of ms)."""
    with O3Client(rel_daemon.endpoint, timeout=30.0) as c:
        limit = c.info()["max_prompt_bytes"]
        flood = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "flood.py"), rel_daemon.endpoint, "--clients", "4", "--seconds",
             str(FLOOD_S), "--prompt-bytes", str(BIG), str(limit - 10)] + (["--asyncio"] if kind == "asyncio" else []),
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        probe = subprocess.Popen([sys.executable, "-c", JITTER_PROBE, str(FLOOD_S - 3.0)], stdout=subprocess.PIPE,
                                 text=True)
        try:
            time.sleep(1.0)  # let the flood fill the queues
            health_ms, critical, normal = [], [], []
            end = time.monotonic() + FLOOD_S - 3.0
            while time.monotonic() < end:
                t0 = time.perf_counter()
                assert c.health()["ready"]
                health_ms.append((time.perf_counter() - t0) * 1000)
                if len(health_ms) % 100 == 0:  # a critical and a normal request from this other client
                    critical.append(c.generate("The json module", max_tokens=8, priority="critical").timings)
                    normal.append(c.generate("The os module", max_tokens=8).timings)
                time.sleep(0.01)
            jitter_ms = float(probe.communicate(timeout=30)[0])
            report = json.loads(flood.communicate(timeout=60)[0])
        finally:
            for proc in (flood, probe):
                if proc.poll() is None:
                    proc.kill()
    p99 = percentile(health_ms, 0.99)
    print(f"health p50 {percentile(health_ms, 0.5):.2f} ms p99 {p99:.2f} ms over {len(health_ms)} "
          f"(machine wake-up p99 {jitter_ms:.2f} ms); critical {critical}; normal {normal}; flood {report}")
    figures("prompt_flood" + ("_asyncio" if kind == "asyncio" else ""), clients=4, seconds=FLOOD_S, prompt_bytes=[BIG, limit - 10], flood=report,
            health_samples=len(health_ms), health_p50_ms=round(percentile(health_ms, 0.5), 2),
            health_p99_ms=round(p99, 2), health_max_ms=round(max(health_ms), 2),
            machine_wakeup_p99_ms=round(jitter_ms, 2), critical=critical, normal=normal)
    assert p99 <= 10.0 + 2 * jitter_ms  # two wake-ups per round trip: the daemon's and ours
    assert critical and all(t["queue_ms"] <= 50 for t in critical)  # the critical class's wait budget
    assert all(t["queue_ms"] <= 1000 for t in normal)  # the normal class's, though one client floods
    # every flood request got its one final reply: refused by size, or tokenized and found too long
    assert report["missing"] == 0 and set(report["outcomes"]) == {P.PROMPT_TOO_LONG}
    assert sum(report["outcomes"].values()) == report["sent"] > 0
