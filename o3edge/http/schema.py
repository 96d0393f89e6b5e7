"""OpenAI request bodies to o3edge generate requests, and o3edge replies to OpenAI responses and chunks.

Pure mapping (no I/O), so the HTTP routes, the tests and the upstream client share one definition.
Lenient the way llama-server and vLLM are: fields that change nothing here (`user`, zero penalties,
`logprobs: false`, ...) are accepted and ignored; fields asking for something this engine cannot do
(n > 1, tools, non-zero penalties, logprobs) get a 400 naming the field, never a silent wrong answer.
OpenAI's defaults apply where they differ from the ZeroMQ protocol's: temperature 1.0, and a chat
without max_tokens runs until the model stops or the context window is full (/v1/completions: 16).
o3edge's extensions: `priority`, `deadline_ms`, `top_k`, `ignore_eos` in the body (or the
X-O3-Priority / X-O3-Deadline-Ms headers), and `energy` and `served_by` in `usage`.
"""

from __future__ import annotations

import time
from typing import Mapping

from o3edge.ipc import protocol as P
from o3edge.policy import RequestLimits

CHAT, COMPLETION = "chat", "completion"
NO_LIMIT = RequestLimits().max_new_tokens  # a chat's max_tokens when it names none: the most a request may ask
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
STATUS = {P.INVALID_REQUEST: 400, P.BAD_MESSAGE: 400, P.UNSUPPORTED_VERSION: 400, P.UNKNOWN_OP: 400,
          P.PROMPT_TOO_LONG: 400, P.BUSY: 429, P.TOO_MANY_REQUESTS: 429, P.UNAVAILABLE: 503,
          P.OUT_OF_CAPACITY: 503, P.DEADLINE_EXCEEDED: 504, P.CANCELLED: 499, P.INTERNAL: 500}
ERROR_TYPE = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
              429: "rate_limit_error", 503: "service_unavailable_error"}


class HttpError(Exception):
    """A request refused with an HTTP status and an OpenAI error body."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    def body(self) -> dict:
        return error_body(self.status, self.code, self.message, self.param)


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict:
    """OpenAI's error shape: {"error": {message, type, param, code}}."""
    kind = ERROR_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_o3_error(message: dict) -> HttpError:
    """An o3edge `error` reply as the HTTP error a client sees."""
    code = message.get("code", P.INTERNAL)
    return HttpError(STATUS.get(code, 500), code, message.get("message", ""))


# ---- requests -------------------------------------------------------------------------------

def to_generate(body: object, kind: str, request_id: str, headers: Mapping[str, str]) -> P.GenerateRequest:
    """Validate an OpenAI body into a generate request (raises HttpError 400 naming the field)."""
    if not isinstance(body, dict):
        raise HttpError(400, P.INVALID_REQUEST, "the request body must be a JSON object")
    _refuse_unsupported(body)
    msg = {"v": P.PROTOCOL_VERSION, "op": "generate", "id": request_id, "stream": True}
    if kind == CHAT:
        msg["messages"] = _messages(body.get("messages"))
    else:
        msg["prompt"] = _prompt(body.get("prompt"))
    default_max = NO_LIMIT if kind == CHAT else COMPLETIONS_DEFAULT_MAX_TOKENS
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    msg["max_tokens"] = default_max if max_tokens is None else max_tokens
    msg["temperature"] = 1.0 if body.get("temperature") is None else body["temperature"]
    for key in ("top_p", "seed", "top_k", "ignore_eos"):
        if body.get(key) is not None:
            msg[key] = body[key]
    stop = body.get("stop")
    if stop is not None:
        msg["stop"] = [stop] if isinstance(stop, str) else stop
    msg["stream"] = wants_stream(body)
    _extension(msg, body, headers, "priority", "x-o3-priority", str)
    _extension(msg, body, headers, "deadline_ms", "x-o3-deadline-ms", int)
    try:
        return P.validate(msg)
    except P.ProtocolError as exc:
        raise HttpError(400, exc.code, exc.message) from None


def wants_stream(body: dict) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HttpError(400, P.INVALID_REQUEST, "'stream' must be true or false", "stream")
    return stream


def wants_usage_chunk(body: dict) -> bool:
    options = body.get("stream_options") or {}
    return isinstance(options, dict) and options.get("include_usage") is True


def _refuse_unsupported(body: dict) -> None:
    checks = (("n", lambda v: v not in (None, 1), "only n=1 is supported"),
              ("best_of", lambda v: v not in (None, 1), "only best_of=1 is supported"),
              ("logprobs", lambda v: v not in (None, False, 0), "logprobs are not supported"),
              ("echo", lambda v: v not in (None, False), "echo is not supported"),
              ("suffix", lambda v: v not in (None, ""), "suffix is not supported"),
              ("tools", lambda v: bool(v), "tools are not supported"),
              ("functions", lambda v: bool(v), "functions are not supported"),
              ("logit_bias", lambda v: bool(v), "logit_bias is not supported"),
              ("presence_penalty", lambda v: v not in (None, 0), "presence_penalty is not supported (only 0)"),
              ("frequency_penalty", lambda v: v not in (None, 0), "frequency_penalty is not supported (only 0)"),
              ("response_format", lambda v: v not in (None, {"type": "text"}), "only the text response_format "
                                                                               "is supported"))
    for key, bad, why in checks:
        if bad(body.get(key)):
            raise HttpError(400, P.INVALID_REQUEST, why, key)


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise HttpError(400, P.INVALID_REQUEST, "'messages' must be a non-empty array", "messages")
    out = []
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise HttpError(400, P.INVALID_REQUEST, "each message must be an object with a 'role'", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content(m.get("content"))})
    return out


def _content(content) -> str:
    """A message's text: a string, null (an assistant turn without text), or an array of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise HttpError(400, P.INVALID_REQUEST, "a message's content must be a string or an array of text parts "
                                            "(this model reads text only)", "messages")


def _prompt(value) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str) or not value:
        raise HttpError(400, P.INVALID_REQUEST, "'prompt' must be a non-empty string (one prompt per request)",
                        "prompt")
    return value


def _extension(msg: dict, body: dict, headers: Mapping[str, str], key: str, header: str, kind: type) -> None:
    """An o3edge field from the body, else from its header."""
    if body.get(key) is not None:
        msg[key] = body[key]
    elif header in headers:
        text = headers[header].strip()
        try:
            msg[key] = kind(text) if kind is str else int(text, 10)
        except ValueError:
            raise HttpError(400, P.INVALID_REQUEST, f"header {header} must be an integer, got {text[:40]!r}") \
                from None


# ---- responses ------------------------------------------------------------------------------

class Shaper:
    """Builds one request's OpenAI response, or its stream's chunks, from o3edge replies."""

    def __init__(self, kind: str, request_id: str, model: str):
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == CHAT else "cmpl-") + request_id
        self.created = int(time.time())
        self.object = "chat.completion" if kind == CHAT else "text_completion"

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False) -> dict:
        """A stream chunk carrying `text` (or the assistant role, or the finish reason)."""
        if self.kind == CHAT:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {"id": self.id, "object": self.object + ".chunk" if self.kind == CHAT else self.object,
                "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self, done: dict) -> dict:
        """The last chunk when the client asked for stream_options.include_usage: no choices, the usage."""
        return {"id": self.id, "object": self.object + ".chunk" if self.kind == CHAT else self.object,
                "created": self.created, "model": self.model, "choices": [], "usage": usage(done)}

    def response(self, done: dict) -> dict:
        """The whole non-streamed response from a `done` reply (which carries the text)."""
        reason = finish_reason(done)
        if self.kind == CHAT:
            choice = {"index": 0, "message": {"role": "assistant", "content": done.get("text", "")},
                      "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": done.get("text", ""), "logprobs": None, "finish_reason": reason}
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(done)}


def finish_reason(done: dict) -> str:
    return "length" if done.get("finish_reason") == "length" else "stop"


def usage(done: dict) -> dict:
    """OpenAI usage, plus o3edge's `energy` (null when served upstream: no figure is invented) and `served_by`."""
    u = done.get("usage") or {}
    prompt, completion = u.get("prompt_tokens", 0), u.get("completion_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)},
            "energy": done.get("energy"), "served_by": done.get("served_by", "local")}
