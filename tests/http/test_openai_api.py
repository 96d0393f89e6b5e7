"""The OpenAI-compatible door, driven by the real `openai` client against a real o3edged."""

import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from o3edge.ipc.client import O3Client
from tests.helpers import wait_for

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


def post(url: str, data: bytes, headers: dict | None = None) -> tuple[int, dict]:
    """A raw POST (for bodies the openai client cannot send); returns (status, JSON body)."""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_chat_matches_the_zeromq_door(oai, model_name, http_daemon):
    """Greedy chat over HTTP gives the same text and token counts as the same request over ZeroMQ."""
    r = oai.chat.completions.create(model=model_name, messages=CHAT, max_tokens=12, temperature=0)
    with O3Client(http_daemon.endpoint, timeout=30) as c:
        ref = c.generate(messages=CHAT, max_tokens=12, temperature=0.0)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason == "length"
    assert r.usage.prompt_tokens == ref.prompt_tokens and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    extra = r.usage.model_extra
    assert extra["served_by"] == "local" and extra["energy"]["tokens"] == 12 and extra["energy"]["joules"] > 0


def test_chat_stream_with_usage(oai, model_name):
    """Streamed chunks add up to the non-streamed text; the last chunk carries usage when asked."""
    whole = oai.chat.completions.create(model=model_name, messages=CHAT, max_tokens=16, temperature=0, seed=1)
    chunks = list(oai.chat.completions.create(model=model_name, messages=CHAT, max_tokens=16, temperature=0,
                                              seed=1, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_stream_and_not(oai, model_name):
    prompt = "The quick brown fox"
    whole = oai.completions.create(model=model_name, prompt=prompt, max_tokens=10, temperature=0)
    parts = list(oai.completions.create(model=model_name, prompt=prompt, max_tokens=10, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert whole.usage.completion_tokens == 10 and whole.choices[0].finish_reason == "length"
    default = oai.completions.create(model=model_name, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


def test_seeded_sampling_repeats(oai, model_name):
    """temperature + top_p + seed: the same seed gives the same text."""
    a, b = (oai.completions.create(model=model_name, prompt="Once", max_tokens=12, temperature=0.9, top_p=0.9,
                                   seed=7) for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


def test_stop_string_ends_the_answer(oai, model_name):
    """A stop string taken from the greedy answer cuts it there, without the stop string."""
    full = oai.completions.create(model=model_name, prompt="Hello there", max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    # a 3-character piece from the second half whose first occurrence is not at the start (a random
    # model's answer may repeat itself), so the cut answer is not empty
    stop = next((full[i:i + 3] for i in range(len(full) // 2, len(full) - 2) if full.index(full[i:i + 3]) > 0), "")
    assert stop
    for stream in (False, True):
        r = oai.completions.create(model=model_name, prompt="Hello there", max_tokens=24, temperature=0,
                                   stop=[stop], stream=stream, extra_body={"ignore_eos": True})
        parts = list(r) if stream else [r]
        text = "".join(p.choices[0].text for p in parts)
        assert text == full[:full.index(stop)]
        assert parts[-1].choices[0].finish_reason == "stop"


def test_errors_in_openai_shape(oai, model_name, http_daemon):
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="no-such-model", messages=CHAT)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model_name, messages=CHAT, n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model_name, messages=CHAT, max_tokens=0)
    assert "max_tokens" in e.value.body["message"]
    status, body = post(http_daemon.url + "/chat/completions", b'{"messages": [')
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "JSON" in body["error"]["message"]
    status, body = post(http_daemon.url + "/chat/completions", b'{"x": "' + b"a" * (2 << 20) + b'"}')
    assert status == 413 and "limit" in body["error"]["message"]
    status, body = post(http_daemon.url + "/chat/completions", json.dumps({"messages": CHAT}).encode(),
                        {"X-O3-Priority": "urgent"})
    assert status == 400 and "priority" in body["error"]["message"]
    status, body = post(http_daemon.base + "/v2/nothing", b"{}")
    assert status == 404 and body["error"]["code"] == "not_found"


def test_lone_surrogates_and_deep_nesting_are_400_and_the_daemon_serves_on(oai, model_name, http_daemon):
    """A lone UTF-16 surrogate escape anywhere in a body (a chat role's left its request unanswered and in flight; a
    prompt's was a 500) and JSON nested 100,000 deep (a 500) are each a 400 invalid_request; nothing stays in flight."""
    url = http_daemon.url
    bodies = [b'{"model": "%s", "messages": [{"role": "\\ud800", "content": "hi"}], "max_tokens": 2}',
              b'{"model": "%s", "messages": [{"role": "user", "content": "a \\udc00 b"}], "max_tokens": 2}',
              b'{"model": "%s", "prompt": "x\\ud800", "max_tokens": 2}']
    for path, body in zip(("/chat/completions", "/chat/completions", "/completions"), bodies):
        status, reply = post(url + path, body.replace(b"%s", model_name.encode()))
        assert status == 400 and reply["error"]["code"] == "invalid_request", reply
        assert "surrogate" in reply["error"]["message"]
    status, reply = post(url + "/completions", b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "nests too deeply" in reply["error"]["message"]
    status, reply = post(url + "/chat/completions", json.dumps({"model": model_name, "max_tokens": 2, "messages": [
        {"role": "user", "content": "pair: \U0001F600"}]}).encode())  # a surrogate pair is text
    assert status == 200, reply
    with O3Client(http_daemon.endpoint, timeout=30) as c:
        assert wait_for(lambda: c.stats()["requests_in_flight"] == 0, timeout=10)


def test_deadline_header_reaches_the_scheduler(http_daemon, model_name):
    """X-O3-Deadline-Ms: a deadline that cannot be met ends the request with deadline_exceeded (504)."""
    body = {"model": model_name, "prompt": "x " * 200, "max_tokens": 2000}
    status, reply = post(http_daemon.url + "/completions", json.dumps({**body, "ignore_eos": True}).encode(),
                         {"X-O3-Deadline-Ms": "1"})
    assert status == 504 and reply["error"]["code"] == "deadline_exceeded"


def test_health_models_metrics(http_daemon, oai, model_name):
    with urllib.request.urlopen(http_daemon.base + "/health", timeout=10) as r:
        assert json.loads(r.read()) == {"status": "ready"}
    assert [m.id for m in oai.models.list().data] == [model_name]
    oai.completions.create(model=model_name, prompt="count me", max_tokens=2)
    with urllib.request.urlopen(http_daemon.base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'o3edge_requests_total{finish_reason="length",priority="normal"}' in text
    assert "o3edge_energy_joules_total" in text


def test_disconnect_cancels_and_frees_kv(oai, model_name, http_daemon):
    """Closing a streamed response aborts the generation: its KV blocks are freed at once."""
    with O3Client(http_daemon.endpoint, timeout=30) as c:
        base = c.stats()["kv_blocks_used"]
        stream = oai.completions.create(model=model_name, prompt="tell me a long story " * 20, max_tokens=1500,
                                        temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        next(iter(stream))
        assert c.stats()["kv_blocks_used"] > base
        stream.close()
        closed = time.monotonic()
        assert wait_for(lambda: c.stats()["kv_blocks_used"] == base, timeout=5.0, interval=0.005)
        freed_s = time.monotonic() - closed
        assert c.stats()["running"] == 0
    assert freed_s < 0.1, f"KV freed {freed_s * 1000:.0f} ms after the disconnect"
