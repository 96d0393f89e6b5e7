"""OpenAI bodies to generate requests: OpenAI's defaults, o3edge's extensions, refusals that name the field."""

import pytest

from o3edge.http import schema as S
from o3edge.errors import ConfigError
from o3edge.http.config import HttpSettings, UpstreamSettings
from o3edge.ipc import protocol as P
from o3edge.policy import RequestLimits
from o3edge.settings import load_settings

USER = [{"role": "user", "content": "hi"}]


def test_openai_defaults_not_the_zeromq_ones():
    chat = S.to_generate({"messages": USER}, S.CHAT, "a", {})
    assert chat.temperature == 1.0 and chat.max_tokens == S.NO_LIMIT == RequestLimits().max_new_tokens and chat.stream is False
    done = S.to_generate({"prompt": "x"}, S.COMPLETION, "b", {})
    assert done.max_tokens == 16 and done.prompt == "x"


def test_fields_map_to_the_request():
    r = S.to_generate({"messages": [{"role": "developer", "content": [{"type": "text", "text": "be "},
                                                                      {"type": "text", "text": "brief"}]},
                                    {"role": "assistant", "content": None, "name": "x"}, *USER],
                       "max_completion_tokens": 5, "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "END",
                       "stream": True, "user": "u", "logprobs": False, "presence_penalty": 0},
                      S.CHAT, "c", {})
    assert r.messages[0] == {"role": "system", "content": "be brief"} and r.messages[1]["content"] == ""
    assert (r.max_tokens, r.temperature, r.top_p, r.seed, r.stop, r.stream) == (5, 0.0, 0.5, 3, ("END",), True)


def test_extensions_from_body_or_headers():
    r = S.to_generate({"prompt": "x"}, S.COMPLETION, "d", {"x-o3-priority": "high", "x-o3-deadline-ms": "250"})
    assert r.priority == "high" and r.deadline_ms == 250
    r = S.to_generate({"prompt": "x", "priority": "low"}, S.COMPLETION, "e", {"x-o3-priority": "high"})
    assert r.priority == "low"  # the body wins over the header
    with pytest.raises(S.HttpError, match="x-o3-deadline-ms"):
        S.to_generate({"prompt": "x"}, S.COMPLETION, "f", {"x-o3-deadline-ms": "soon"})


@pytest.mark.parametrize("field,value", [("n", 2), ("tools", [{"type": "function"}]), ("logprobs", True),
                                         ("frequency_penalty", 0.5), ("response_format", {"type": "json_object"})])
def test_unsupported_asks_are_refused_by_name(field, value):
    with pytest.raises(S.HttpError) as e:
        S.to_generate({"messages": USER, field: value}, S.CHAT, "g", {})
    assert e.value.status == 400 and e.value.param == field


def test_bad_values_are_400_with_the_protocols_message():
    for body in ({"messages": []}, {"messages": [{"content": "no role"}]},
                 {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, {"messages": USER, "top_p": 0},
                 {"messages": USER, "stop": ["a"] * 17}):
        with pytest.raises(S.HttpError) as e:
            S.to_generate(body, S.CHAT, "h", {})
        assert e.value.status == 400
    with pytest.raises(S.HttpError):
        S.to_generate({"prompt": ["a", "b"]}, S.COMPLETION, "i", {})


def test_error_codes_map_to_statuses():
    assert S.from_o3_error(P.error("x", P.BUSY, "full")).status == 429
    assert S.from_o3_error(P.error("x", P.UNAVAILABLE, "draining")).status == 503
    assert S.from_o3_error(P.error("x", P.PROMPT_TOO_LONG, "long")).status == 400
    assert S.error_body(429, P.BUSY, "full") == {"error": {"message": "full", "type": "rate_limit_error",
                                                           "param": None, "code": "busy"}}


def test_settings_are_checked():
    assert HttpSettings().is_loopback and not HttpSettings(listen="0.0.0.0:80").is_loopback
    assert HttpSettings(listen="[::1]:8080").is_loopback
    for bad in ("8080", "localhost:http", "127.0.0.1:70000"):
        with pytest.raises(ConfigError, match="http.listen"):
            HttpSettings(listen=bad)
    with pytest.raises(ConfigError, match="upstream.model"):
        UpstreamSettings(url="http://x/v1")
    with pytest.raises(ConfigError, match="upstream.url"):
        UpstreamSettings(url="x:8000", model="m")
    with pytest.raises(ConfigError, match="upstream.policy.normal"):
        load_settings(None, {"O3EDGE_UPSTREAM_POLICY_NORMAL": "sometimes"}, {})


def test_overflow_sends_a_request_whose_deadline_the_queue_cannot_meet_upstream():
    """With the overflow policy, a request goes upstream when its class's estimated queue wait (the
    scheduler's stats) is past its deadline_ms; without a deadline, or with time to spare, it stays."""
    from o3edge.http.config import UpstreamSettings
    from o3edge.http.overflow import Overflow
    from o3edge.ipc import protocol as P

    overflow = Overflow(UpstreamSettings(url="http://127.0.0.1:9/v1", model="m"), server=None, aio=None)
    classes = {"normal": {"waiting": 3, "running": 1, "est_wait_ms": 900.0, "breaker": {"state": "closed"}}}
    req = lambda **kw: P.GenerateRequest(id="x", prompt="hi", **kw)  # noqa: E731
    assert overflow.choose(req(deadline_ms=500), busy=False, classes=classes) == "deadline"
    assert overflow.choose(req(deadline_ms=5000), busy=False, classes=classes) is None
    assert overflow.choose(req(), busy=False, classes=classes) is None
    assert overflow.choose(req(deadline_ms=500), busy=True, classes=classes) == "busy"
