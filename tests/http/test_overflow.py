"""Overflow to an upstream engine, end to end: a second real o3edged (HTTP door on) is the upstream."""

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from o3edge.ipc.client import O3Client, RequestError
from tests.helpers import wait_for
from tests.http.conftest import HttpDaemon, free_port, start_http_daemon

POLICY = {"critical": "local", "high": "prefer-upstream", "normal": "overflow", "low": "overflow"}
ASK = dict(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_dir):
    """(device, upstream): the device runs one sequence and queues one; the rest overflows upstream."""
    directory = tmp_path_factory.mktemp("overflow")
    upstream = start_http_daemon(directory, tiny_dir, name="up.sock")
    device = start_http_daemon(directory, tiny_dir, name="dev.sock",
                               tables={"engine": {"max_num_seqs": 1}, "server": {"queue_max_requests": 1},
                                       "upstream": {"url": upstream.url, "model": "llama-tied",
                                                    "breaker_threshold": 1, "breaker_cooldown_s": 1.0},
                                       "upstream.policy": POLICY})
    state = {"upstream": upstream}
    yield device, state
    device.stop()
    state["upstream"].stop()


def flood(device, n, priority="normal"):
    """n concurrent generate requests over ZeroMQ; returns their Completions or RequestErrors."""
    def one(i):
        with O3Client(device.endpoint, timeout=60) as c:
            try:
                return c.generate(f"request {i} says", priority=priority, **ASK)
            except RequestError as exc:
                return exc
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def served_by(results):
    return [r.raw.get("served_by") if not isinstance(r, Exception) else r.code for r in results]


def upstream_stats(device):
    with O3Client(device.endpoint, timeout=10) as c:
        return c.stats()["upstream"]


def test_flood_is_served_with_zero_lost(pair):
    device, _ = pair
    results = flood(device, 12)
    where = served_by(results)
    assert where.count("local") + where.count("upstream") == 12, where
    assert where.count("upstream") >= 1 and where.count("local") >= 1
    for r in results:
        assert r.completion_tokens == 24 and len(r.text) > 0
        assert (r.energy is None) == (r.raw["served_by"] == "upstream")  # no figure invented for remote tokens
    stats = upstream_stats(device)
    assert stats["served"]["normal"] >= where.count("upstream") and stats["breaker"]["state"] == "closed"


def test_http_flood_reports_served_by(pair):
    device, _ = pair

    def one(i):
        with openai.OpenAI(base_url=device.url, api_key="unused", max_retries=0, timeout=60) as c:
            return c.chat.completions.create(model="llama-tied", messages=[{"role": "user", "content": f"hi {i}"}],
                                             max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(one, range(8)))
    where = [r.usage.model_extra["served_by"] for r in replies]
    assert "upstream" in where and all(r.usage.completion_tokens == 8 for r in replies)
    assert all((r.usage.model_extra["energy"] is None) == (w == "upstream") for r, w in zip(replies, where))
    with urllib.request.urlopen(device.base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'o3edge_served_requests_total{priority="normal",served_by="upstream"}' in text
    assert 'o3edge_served_requests_total{priority="normal",served_by="local"}' in text


def test_policy_per_class(pair):
    device, _ = pair
    with O3Client(device.endpoint, timeout=60) as c:
        assert c.generate("prefer", priority="high", **ASK).raw["served_by"] == "upstream"
    critical = served_by(flood(device, 6, priority="critical"))
    assert "upstream" not in critical and "busy" in critical  # `local`: refused here, never forwarded


def test_cancel_reaches_the_upstream(pair):
    """Cancelling a request served upstream closes the upstream request: its sequence stops there too."""
    device, state = pair
    with O3Client(device.endpoint, timeout=60) as c, O3Client(state["upstream"].endpoint, timeout=10) as up:
        stream = c.stream("a long one", priority="high", max_tokens=4000, ignore_eos=True)
        events = iter(stream)
        next(events)
        assert up.stats()["running"] == 1
        stream.cancel()
        assert wait_for(lambda: up.stats()["running"] == 0, timeout=5)
        assert upstream_stats(device)["inflight"] == 0


def test_upstream_down_then_back(pair, tiny_dir):
    """Upstream gone: what overflows gets `busy` here and the breaker opens; it closes once the upstream is back."""
    device, state = pair
    port, directory = state["upstream"].port, state["upstream"].config.rsplit("/", 1)[0]
    assert state["upstream"].stop() == 0
    where = served_by(flood(device, 8))
    assert "busy" in where and "upstream" not in where and set(where) <= {"local", "busy"}
    stats = upstream_stats(device)
    assert stats["breaker"]["state"] in ("open", "half_open") and stats["fallback"]["normal"] >= 1
    state["upstream"] = HttpDaemon(directory, tiny_dir, name="up2.sock", port=port).start()
    state["upstream"].wait_ready()
    results = flood(device, 12)
    where = served_by(results)
    assert set(where) == {"local", "upstream"}, where
    assert upstream_stats(device)["breaker"]["state"] == "closed"


def test_bad_upstream_setting_is_a_config_error(tmp_path, tiny_dir):
    d = HttpDaemon(str(tmp_path), tiny_dir, port=free_port(),
                   tables={"upstream": {"url": "http://127.0.0.1:9/v1", "model": "m", "api_key_file": "/no/such/key"}})
    d.start()
    assert d.proc.wait(30) == 78 and "api_key_file" in d.log()
    d.stop()

