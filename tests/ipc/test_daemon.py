"""A real o3edged process: answers equal the in-process engine's, isolation, cancel, vanished clients."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, DaemonProcess, clean_env, wait_for
from o3edge import O3Config, O3Model
from o3edge.engine.sequence import SamplingParams
from o3edge.ipc import protocol as P
from o3edge.ipc.aio import AsyncO3Client
from o3edge.ipc.client import Completion, O3Client, RequestError, TokenEvent

PROMPTS = ["def main():\n    ", "import os\nimport sys\n", "class Parser:\n    def __init__(self", "# Copyright"]


@pytest.fixture(scope="module")
def local(tiny_dir):
    return O3Model.from_config(O3Config(model_path=tiny_dir, device="cpu", num_kv_blocks=64))


def test_streamed_answer_equals_in_process_generate(client, local):
    expected = local.generate(PROMPTS[0], max_new_tokens=24)
    events = list(client.stream(PROMPTS[0], max_tokens=24))
    tokens, done = events[:-1], events[-1]
    assert all(isinstance(e, TokenEvent) for e in tokens) and isinstance(done, Completion)
    assert [t for e in tokens for t in e.token_ids] == expected.token_ids
    assert "".join(e.text for e in tokens) == expected.text == done.text
    assert [e.index for e in tokens] == list(range(len(tokens)))
    assert done.finish_reason == expected.finish_reason
    assert done.usage == {"prompt_tokens": expected.prompt_tokens, "completion_tokens": len(expected.token_ids),
                          "cached_tokens": done.usage["cached_tokens"], "cold_tokens": 0}
    assert done.timings["ttft_ms"] <= done.timings["total_ms"] and "energy" in done.raw


def test_chat_messages_match_in_process(client, local):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is os.path?"}]
    expected = local.generate(messages=messages, max_new_tokens=12)
    assert client.generate(messages=messages, max_tokens=12).token_ids == expected.token_ids


def test_concurrent_clients_each_get_their_own_answer(daemon, local):
    alone = SamplingParams(max_new_tokens=16, ignore_eos=True)
    expected = [local.generate_batch([local.engine.encode(p)], alone)[0].token_ids for p in PROMPTS]
    got = [None] * len(PROMPTS)

    def ask(i):
        with O3Client(daemon.endpoint, timeout=30) as c:
            got[i] = c.generate(PROMPTS[i], max_tokens=16, ignore_eos=True).token_ids

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == expected


def test_cancel_ends_the_stream_and_frees_blocks(client):
    baseline = client.stats()["kv_blocks_used"]
    stream = client.stream(PROMPTS[1], max_tokens=1500, ignore_eos=True)
    it = iter(stream)
    next(it), next(it)
    assert client.stats()["kv_blocks_used"] > baseline
    assert stream.cancel() is True
    with pytest.raises(RequestError) as err:
        list(it)
    assert err.value.code == P.CANCELLED
    assert wait_for(lambda: client.stats()["kv_blocks_used"] == baseline, timeout=3)
    assert client.cancel("no-such-request") is False


CLIENT = """
import sys
from o3edge.ipc.client import O3Client
c = O3Client(sys.argv[1], timeout=30)
for event in c.stream("while True:", max_tokens=1500, ignore_eos=True):
    print("token", flush=True)
"""


def test_killed_client_has_its_generation_aborted_and_blocks_freed(client, daemon):
    baseline = client.stats()["kv_blocks_used"]
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, daemon.endpoint], cwd=REPO, env=clean_env(),
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"token\n"
        assert client.stats()["requests_in_flight"] == 1
    finally:
        proc.kill()
        proc.wait()
    killed = time.monotonic()
    freed = wait_for(lambda: (s := client.stats())["requests_in_flight"] == 0 and s["running"] == 0 and
                     s["kv_blocks_used"] == baseline, timeout=3, interval=0.005)
    assert freed and time.monotonic() - killed < 1.0  # about one token's time on an idle machine


def test_prompt_longer_than_the_context_window(client):
    with pytest.raises(RequestError) as err:
        client.generate("x " * 5000, max_tokens=4)
    assert err.value.code == P.PROMPT_TOO_LONG
    assert client.health()["ready"]


def test_health_stats_info(client):
    health = client.health()
    assert (health["type"], health["status"], health["live"], health["ready"]) == ("health", "ready", True, True)
    stats = client.stats()
    for key in ("queue_depth", "running", "kv_blocks_used", "kv_blocks_free", "prefix_hit_rate", "tokens_per_s",
                "uptime_s"):
        assert key in stats
    info = client.info()
    assert (info["device"], info["dtype"], info["max_context"], info["kv_block_size"]) == ("cpu", "float32", 2048, 32)
    assert info["version"] == "0.1.0" and info["protocol_version"] == 1


def test_async_client(daemon, local):
    expected = local.generate(PROMPTS[2], max_new_tokens=10)

    async def main():
        async with AsyncO3Client(daemon.endpoint, timeout=30) as c:
            health, done = await asyncio.gather(c.health(), c.generate(PROMPTS[2], max_tokens=10))
            events = [e async for e in c.stream(PROMPTS[2], max_tokens=10)]
            with pytest.raises(RequestError) as err:
                await c.generate(PROMPTS[2], max_tokens=0)
            return health, done, events, err.value.code

    health, done, events, code = asyncio.run(main())
    assert health["ready"] and done.token_ids == expected.token_ids == events[-1].token_ids
    assert code == P.INVALID_REQUEST


def test_second_daemon_on_the_same_endpoint_exits_with_a_clear_error(daemon, tiny_dir, tmp_path):
    second = DaemonProcess(os.path.dirname(daemon.socket_path), tiny_dir, name="o3.sock")
    second.log_path, second.config = str(tmp_path / "second.log"), daemon.config
    second.start()
    assert second.proc.wait(60) == 73
    assert f"another o3edged (pid {daemon.proc.pid}) already serves {daemon.endpoint}" in second.log()
    second.stop()
    with O3Client(daemon.endpoint, timeout=5) as c:  # the first one keeps its socket
        assert c.health()["ready"]


def test_sighup_reloads_limits_and_sigterm_drains_and_exits_zero(tmp_path, tiny_dir):
    d = DaemonProcess(str(tmp_path), tiny_dir).start()
    d.wait_ready()
    with open(d.config) as fh:
        text = fh.read()
    with open(d.config, "w") as fh:  # one setting that applies at once, one that needs a restart
        fh.write(text.replace("num_kv_blocks = 256", "num_kv_blocks = 128") + "queue_max_requests = 7\n")
    d.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: "reloaded settings" in d.log(), timeout=5)
    assert "applied server.queue_max_requests; need a restart: engine.num_kv_blocks" in d.log()
    with O3Client(d.endpoint, timeout=20) as c:
        stream = iter(c.stream("def f():", max_tokens=12, ignore_eos=True))
        next(stream)
        d.proc.send_signal(signal.SIGTERM)
        assert list(stream)[-1].completion_tokens == 12  # the running request finished during the drain
    assert d.stop() == 0
    assert not os.path.exists(d.socket_path)
    assert "draining" in d.log()


def test_broken_model_exits_78_with_the_reason(tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    d = DaemonProcess(str(tmp_path), str(broken)).start()
    assert d.proc.wait(60) == 78
    d.stop()
    assert "engine failed to load" in d.log() and "config.json" in d.log()
    assert not os.path.exists(d.socket_path)


def test_deadline_cuts_a_long_generation(client):
    with pytest.raises(RequestError) as err:
        client.generate(PROMPTS[3], max_tokens=1500, ignore_eos=True, deadline_ms=300, priority="low")
    assert err.value.code == P.DEADLINE_EXCEEDED
    stats = client.stats()
    assert stats["classes"]["low"]["running"] == 0 and wait_for(lambda: client.stats()["kv_blocks_used"] == 0)
