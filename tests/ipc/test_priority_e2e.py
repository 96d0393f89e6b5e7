"""Priorities through the socket: a real o3edged saturated by low-priority work still serves critical
requests within their class budget; queued deadlines, a full queue and open breakers answer at once.

The budget is measured, not guessed: under the saturating load (and a few critical requests, so
that preemptions and recomputes happen as they will), the daemon's step is timed as the 90th
percentile of the gaps between a low stream's tokens; the critical class's max_wait_ms becomes
max(50 ms, 4 steps) by a SIGHUP reload, and only then are critical requests measured. One waits
for the step in progress, then is admitted (preempting a low one) and prefilled in the next step;
the rest is the daemon's threads waiting for a core. Other jobs share this machine: if it got
slower during the measurement (the step's p90 grew by half) and the budget was missed, the test
calibrates and measures once more.
"""

import asyncio
import contextlib
import signal
import statistics
import time

import pytest

from conftest import DaemonProcess, wait_for
from o3edge.ipc import protocol as P
from o3edge.ipc.aio import AsyncO3Client
from o3edge.ipc.client import O3Client, RequestError, TokenEvent

MAX_NUM_SEQS = 8
QUEUE_MAX = 24
LOW_CLIENTS, LOW_PER_CLIENT, LOW_TOKENS = 4, 6, 64  # 24 low streams for 8 batch slots
NUM_CRITICAL = 30
LOW_PROMPT = "import os\nimport sys\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n"
CRITICAL_PROMPT = "# Copyright"


class Daemon(DaemonProcess):
    """o3edged on one torch thread, with [engine]/[server]/[scheduler.*] settings given as dicts."""

    def __init__(self, directory, model_dir, name, engine: dict, server: dict, scheduler: dict):
        super().__init__(directory, model_dir, name, env={"OMP_NUM_THREADS": "1"})
        self.configure(engine=engine, server=server, scheduler=scheduler)

    def configure(self, engine: dict | None = None, server: dict | None = None, scheduler: dict | None = None):
        """(Re)write the config file; on a running daemon, follow with reload()."""
        tables = {"engine": engine or {}, "server": server or {}}
        super().configure({**tables, **{f"scheduler.{k}": v for k, v in (scheduler or {}).items()}})

    def reload(self) -> None:
        """SIGHUP, and wait until the daemon says it applied the file."""
        done = self.log().count("reloaded settings")
        self.proc.send_signal(signal.SIGHUP)
        assert wait_for(lambda: self.log().count("reloaded settings") > done, timeout=10), self.log()
        time.sleep(0.2)  # the engine thread applies class limits between two steps


@pytest.fixture(scope="module")
def busy_daemon(tmp_path_factory, tiny_dir):
    """Small batch and bounded queue; low tolerates long waits (its breaker must not shed the load)."""
    d = Daemon(str(tmp_path_factory.mktemp("prio")), tiny_dir, "prio.sock",
               engine={"max_num_seqs": MAX_NUM_SEQS},
               server={"max_inflight_per_client": 64, "queue_max_requests": QUEUE_MAX},
               scheduler={"critical": {"max_wait_ms": 1000},
                          "low": {"max_wait_ms": 600_000, "breaker_threshold": 1000}}).start()
    d.wait_ready()
    yield d
    d.stop()


class LowLoad:
    """LOW_CLIENTS connections, each keeping LOW_PER_CLIENT long low-priority streams in flight."""

    def __init__(self, endpoint: str):
        self.endpoint, self.stop = endpoint, asyncio.Event()
        self.ttfts: list[float] = []  # ms
        self.gaps: list[float] = []  # ms between two tokens of one stream: the daemon's step

    async def run(self) -> None:
        await asyncio.gather(*(self._client() for _ in range(LOW_CLIENTS)))

    async def _client(self) -> None:
        async with AsyncO3Client(self.endpoint, timeout=60) as c:
            await asyncio.gather(*(self._streams(c) for _ in range(LOW_PER_CLIENT)))

    async def _streams(self, c: AsyncO3Client) -> None:
        while not self.stop.is_set():
            last = time.monotonic()
            async for event in c.stream(LOW_PROMPT, max_tokens=LOW_TOKENS, ignore_eos=True, priority="low"):
                now = time.monotonic()
                if isinstance(event, TokenEvent):
                    (self.gaps if event.index else self.ttfts).append((now - last) * 1000)
                last = now


async def critical_requests(c: AsyncO3Client, n: int) -> tuple[list[float], list[float]]:
    """n short critical requests, one at a time, at irregular intervals: TTFT at the client, at the daemon (ms)."""
    client, server = [], []
    for i in range(n):
        await asyncio.sleep(0.02 + 0.04 * (i % 3))
        t0, first = time.monotonic(), None
        async for event in c.stream(CRITICAL_PROMPT, max_tokens=2, ignore_eos=True, priority="critical"):
            first = first or time.monotonic()
        client.append((first - t0) * 1000)
        server.append(event.timings["ttft_ms"])
    return client, server


def quantile(values, q):
    return sorted(values)[max(0, -(-len(values) * round(q * 100) // 100) - 1)]


def p95(values):
    return quantile(values, 0.95)


async def wait_saturated(c: AsyncO3Client) -> dict:
    end = time.monotonic() + 20
    while time.monotonic() < end:
        stats = await c.stats()
        if stats["running"] == MAX_NUM_SEQS and stats["queue_depth"] >= 8:
            break
        await asyncio.sleep(0.02)
    return stats


async def calibrate(daemon: Daemon, c: AsyncO3Client, load: LowLoad) -> tuple[float, int]:
    """The daemon's step under this load (90th percentile of token gaps, with critical ones preempting
    and low ones recomputing as they will), and the critical budget set from it: max(50 ms, 4 steps)."""
    load.gaps.clear()
    await critical_requests(c, 10)
    step_ms = quantile(load.gaps, 0.9)
    budget_ms = max(50, round(4 * step_ms))
    await asyncio.to_thread(daemon.configure, scheduler={"critical": {"max_wait_ms": budget_ms}})
    await asyncio.to_thread(daemon.reload)
    return step_ms, budget_ms


def test_critical_ttft_stays_within_budget_under_low_priority_saturation(busy_daemon):
    async def main():
        load = LowLoad(busy_daemon.endpoint)
        running = asyncio.create_task(load.run())
        async with AsyncO3Client(busy_daemon.endpoint, timeout=10) as c:
            saturated = await wait_saturated(c)
            for attempt in (1, 2):
                step_ms, budget_ms = await calibrate(busy_daemon, c, load)
                before = (await c.stats())["classes"]["critical"]["breaker"]
                load.gaps.clear()
                client, server = await critical_requests(c, NUM_CRITICAL)
                # one more try only if the shared machine got slower than it was when calibrated
                if p95(server) < budget_ms or quantile(load.gaps, 0.9) < 1.5 * step_ms:
                    break
            stats = await c.stats()
        load.stop.set()
        await running
        return saturated, stats, before, attempt, step_ms, budget_ms, load.ttfts, client, server

    saturated, stats, before, attempt, step_ms, budget_ms, low, client, server = asyncio.run(main())
    summary = (f"attempt {attempt}: step p90 {step_ms:.1f} ms, critical budget {budget_ms} ms; critical TTFT "
               f"p50/p95 at the daemon {statistics.median(server):.1f}/{p95(server):.1f} ms, at the client "
               f"{statistics.median(client):.1f}/{p95(client):.1f} ms; low TTFT p50 {statistics.median(low):.0f} ms "
               f"({len(low)} requests)")
    print(summary)
    assert saturated["running"] == MAX_NUM_SEQS and saturated["queue_depth"] >= 8
    assert stats["classes"]["low"]["waiting"] > 0  # still saturated when the last critical one finished
    assert len(server) == NUM_CRITICAL
    assert p95(server) < budget_ms, summary  # read by the daemon -> first token made
    assert p95(client) < 2 * budget_ms, summary  # the client process shares the two cores too
    assert statistics.median(low) > 5 * budget_ms, summary  # the low ones did wait: the load was real
    breaker = stats["classes"]["critical"]["breaker"]
    assert breaker["times_opened"] == before["times_opened"], summary  # no run of critical waits overran
    assert stats["preemptions"] > 0  # critical ones took batch slots from running low ones


async def fill_batch_with_long_low(c: AsyncO3Client) -> list[asyncio.Task]:
    """MAX_NUM_SEQS low streams that will not finish for seconds, running."""
    async def long_one():
        async for _ in c.stream(LOW_PROMPT, max_tokens=1500, ignore_eos=True, priority="low"):
            pass
    tasks = [asyncio.create_task(long_one()) for _ in range(MAX_NUM_SEQS)]
    end = time.monotonic() + 20
    while (await c.stats())["running"] < MAX_NUM_SEQS and time.monotonic() < end:
        await asyncio.sleep(0.02)
    return tasks


async def outcome(c: AsyncO3Client, **params) -> tuple[str, float]:
    """('token' or the error code, seconds until that first reply)."""
    t0 = time.monotonic()
    try:
        async with contextlib.aclosing(c.stream(LOW_PROMPT, max_tokens=1500, ignore_eos=True, **params)) as events:
            async for _ in events:
                return "token", time.monotonic() - t0
    except RequestError as exc:
        return exc.code, time.monotonic() - t0


async def first_then_hold(c: AsyncO3Client, priority: str, first: asyncio.Future) -> None:
    """A long stream: `first` gets 'token' at its first token (or the error code), and it goes on until cancelled."""
    try:
        async for _ in c.stream(LOW_PROMPT, max_tokens=1500, ignore_eos=True, priority=priority):
            if not first.done():
                first.set_result("token")
    except RequestError as exc:
        if not first.done():
            first.set_result(exc.code)


async def cancel_all(c: AsyncO3Client, tasks) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    end = time.monotonic() + 10
    while (await c.stats())["requests_in_flight"] and time.monotonic() < end:
        await asyncio.sleep(0.02)


def test_deadline_passing_in_the_queue_is_answered_deadline_exceeded(busy_daemon):
    async def main():
        async with AsyncO3Client(busy_daemon.endpoint, timeout=30) as c:
            running = await fill_batch_with_long_low(c)
            try:
                t0 = time.monotonic()
                with pytest.raises(RequestError) as err:
                    async for _ in c.stream(LOW_PROMPT, max_tokens=8, priority="low", deadline_ms=300):
                        pytest.fail("a request whose deadline passed in the queue must not run")
                return err.value, time.monotonic() - t0, await c.stats()
            finally:
                await cancel_all(c, running)

    err, elapsed, stats = asyncio.run(main())
    assert err.code == P.DEADLINE_EXCEEDED and "before the request ran" in str(err)
    assert 0.3 <= elapsed < 2.0
    assert stats["running"] == MAX_NUM_SEQS  # the running ones were not disturbed


def test_full_queue_answers_busy_at_once(busy_daemon):
    extra = 6

    async def main():
        async with AsyncO3Client(busy_daemon.endpoint, timeout=30) as c:
            running = await fill_batch_with_long_low(c)
            queued = [asyncio.create_task(outcome(c, priority="low")) for _ in range(QUEUE_MAX + extra)]
            try:
                await asyncio.sleep(1.0)
                return [t.result() if t.done() else ("queued", None) for t in queued], await c.stats()
            finally:
                await cancel_all(c, running + queued)

    outcomes, stats = asyncio.run(main())
    codes = [code for code, _ in outcomes]
    assert codes == ["queued"] * QUEUE_MAX + [P.BUSY] * extra
    assert all(t < 0.5 for code, t in outcomes if code == P.BUSY)
    assert stats["queue_depth"] == QUEUE_MAX


def test_a_full_flight_takes_more_important_requests_by_displacing_queued_ones(busy_daemon):
    """With the batch running and the queue full of low requests, every request in flight counts against the
    server's backstop (queue + batch); a critical or high one still goes in, and the scheduler displaces a queued
    low one for it (answered busy), where the backstop used to answer it busy: requests whose clients vanished
    stay in flight until their final reply, and must not lock out the more important classes. Another low one is
    still refused at once."""
    async def main():
        async with AsyncO3Client(busy_daemon.endpoint, timeout=30) as c:
            running = await fill_batch_with_long_low(c)
            queued = [asyncio.create_task(outcome(c, priority="low")) for _ in range(QUEUE_MAX)]
            end = time.monotonic() + 20
            while (await c.stats())["classes"]["low"]["waiting"] < QUEUE_MAX and time.monotonic() < end:
                await asyncio.sleep(0.02)
            firsts, held = [], []
            try:
                for priority in ("critical", "high"):  # each kept streaming: in flight until the end
                    firsts.append(asyncio.get_running_loop().create_future())
                    held.append(asyncio.create_task(first_then_hold(c, priority, firsts[-1])))
                    await asyncio.wait_for(firsts[-1], 20)
                late_low = await outcome(c, priority="low")
                await asyncio.sleep(0.5)
                return ([f.result() for f in firsts], late_low,
                        [t.result() if t.done() else ("queued", None) for t in queued])
            finally:
                await cancel_all(c, running + queued + held)

    important, late_low, queued = asyncio.run(main())
    assert important == ["token", "token"]
    assert late_low[0] == P.BUSY and late_low[1] < 0.5
    assert [code for code, _ in queued].count(P.BUSY) == 2


def test_breakers_open_on_timeouts_show_in_stats_and_degrade(tmp_path, tiny_dir):
    """max_wait_ms 0: every queue wait overruns. High demotes to normal when open; low refuses with busy."""
    d = Daemon(str(tmp_path), tiny_dir, "brk.sock", engine={}, server={},
               scheduler={"high": {"max_wait_ms": 0, "breaker_threshold": 2},
                          "low": {"max_wait_ms": 0, "breaker_threshold": 1}}).start()
    try:
        d.wait_ready()
        with O3Client(d.endpoint, timeout=20) as c:
            classes = c.stats()["classes"]
            assert {name: cls["breaker"]["state"] for name, cls in classes.items()} == dict.fromkeys(
                ("critical", "high", "normal", "low"), "closed")
            c.generate(CRITICAL_PROMPT, max_tokens=2, priority="high")
            assert c.stats()["classes"]["high"]["breaker"]["consecutive_timeouts"] == 1
            c.generate(CRITICAL_PROMPT, max_tokens=2, priority="high")
            high = c.stats()["classes"]["high"]["breaker"]
            assert (high["state"], high["times_opened"]) == ("open", 1)
            assert c.generate(CRITICAL_PROMPT, max_tokens=2, priority="high").completion_tokens == 2
            high = c.stats()["classes"]["high"]["breaker"]
            assert high["consecutive_timeouts"] == 2  # served as normal: high's budget was not in play
            c.generate(CRITICAL_PROMPT, max_tokens=2, priority="low")
            assert c.stats()["classes"]["low"]["breaker"]["state"] == "open"
            t0 = time.monotonic()
            with pytest.raises(RequestError) as err:
                c.generate(CRITICAL_PROMPT, max_tokens=2, priority="low")
            assert err.value.code == P.BUSY and "circuit breaker open" in str(err.value)
            assert time.monotonic() - t0 < 1.0
            assert c.stats()["classes"]["critical"]["breaker"]["state"] == "closed"
    finally:
        status = d.stop()
    assert status == 0, d.log()
