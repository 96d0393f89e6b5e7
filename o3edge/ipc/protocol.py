"""The wire protocol: versioned msgpack maps, bounded decoding, validation into typed requests.

One request is one ZeroMQ frame holding one msgpack map; docs/protocol.md is the full
specification. Everything here is pure (no sockets), so the server, the clients and the tests
share one definition of every field, range and error code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgpack

from o3edge.errors import O3Error
from o3edge.policy import CLASSES, RequestLimits

PROTOCOL_VERSION = 1
DEFAULT_ENDPOINT = "ipc:///run/o3edge/o3edge.sock"
OPS = ("generate", "cancel", "health", "stats", "info")
PRIORITIES = CLASSES

# Error codes (stable; clients branch on them).
INVALID_REQUEST = "invalid_request"
BAD_MESSAGE = "bad_message"
UNSUPPORTED_VERSION = "unsupported_version"
UNKNOWN_OP = "unknown_op"
PROMPT_TOO_LONG = "prompt_too_long"
BUSY = "busy"
UNAVAILABLE = "unavailable"
DEADLINE_EXCEEDED = "deadline_exceeded"
CANCELLED = "cancelled"
TOO_MANY_REQUESTS = "too_many_requests"
INTERNAL = "internal"
OUT_OF_CAPACITY = "out_of_capacity"
ERROR_CODES = (INVALID_REQUEST, BAD_MESSAGE, UNSUPPORTED_VERSION, UNKNOWN_OP, PROMPT_TOO_LONG, BUSY,
               UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, TOO_MANY_REQUESTS, INTERNAL, OUT_OF_CAPACITY)

# Limits on what a client may send (the frame size itself is server.max_message_bytes; how much one
# request may ask for is the engine's policy, o3edge.policy.RequestLimits, passed to parse()).
MAX_FRAMES = 8  # a message with more frames than this gets its peer dropped
MAX_ID_CHARS = 64
MAX_MESSAGES = 256
MAX_ROLE_CHARS = 32
MAX_DEADLINE_MS = 86_400_000
MAX_ARRAY_LEN = 1024
MAX_MAP_LEN = 64
MAX_CONTAINERS = 4096  # arrays + maps in one message: 1 MiB of empty arrays must not become 50 MiB
MAX_ITEMS = 65536  # array elements + map entries in one message (each is a Python object)

_COMMON = {"v", "op", "id"}
_GENERATE = _COMMON | {"prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                       "priority", "deadline_ms", "stream", "ignore_eos"}
_FIELDS = {"generate": _GENERATE, "cancel": _COMMON | {"target"}, "health": _COMMON, "stats": _COMMON,
           "info": _COMMON}


class ProtocolError(O3Error):
    """A message that cannot be served; `request_id` is the client's id when it could be read."""

    def __init__(self, code: str, message: str, request_id: str | None = None):
        super().__init__(message, code)
        self.request_id = request_id


@dataclass(frozen=True)
class Request:
    """A health, stats or info request (no fields beyond the common ones)."""

    op: str
    id: str


@dataclass(frozen=True)
class CancelRequest:
    id: str
    target: str
    op: str = "cancel"


@dataclass(frozen=True)
class GenerateRequest:
    id: str
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    priority: str = "normal"
    deadline_ms: int | None = None
    stream: bool = True
    ignore_eos: bool = False
    op: str = "generate"


# ---- decoding ------------------------------------------------------------------------------

class _Budget:
    """Counts containers while unpacking and rejects duplicate and non-string map keys."""

    def __init__(self):
        self.containers, self.items = MAX_CONTAINERS, MAX_ITEMS

    def _spend(self, num_items: int) -> None:
        self.containers -= 1
        self.items -= num_items
        if self.containers < 0 or self.items < 0:
            raise ValueError(f"more than {MAX_CONTAINERS} arrays and maps or {MAX_ITEMS} elements in one message")

    def on_list(self, items: list) -> list:
        self._spend(len(items))
        return items

    def on_pairs(self, pairs: list) -> dict:
        self._spend(len(pairs))
        out = {}
        for key, value in pairs:
            if not isinstance(key, str):
                raise ValueError(f"map keys must be strings, got {type(key).__name__}")
            if key in out:
                raise ValueError(f"duplicate map key {key[:40]!r}")
            out[key] = value
        return out


def decode(frame: bytes, max_bytes: int) -> object:
    """Unpack one frame with every size bounded; any failure is a bad_message ProtocolError."""
    if len(frame) == 0:
        raise ProtocolError(BAD_MESSAGE, "empty frame: a request is one msgpack map")
    if len(frame) > max_bytes:
        raise ProtocolError(BAD_MESSAGE, f"frame of {len(frame)} bytes exceeds the {max_bytes}-byte limit")
    budget = _Budget()
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True,
                               list_hook=budget.on_list, object_pairs_hook=budget.on_pairs,
                               max_str_len=max_bytes, max_bin_len=0, max_array_len=MAX_ARRAY_LEN,
                               max_map_len=MAX_MAP_LEN, max_ext_len=0)
    except msgpack.StackError:
        raise ProtocolError(BAD_MESSAGE, "msgpack nesting too deep") from None
    except UnicodeDecodeError:
        raise ProtocolError(BAD_MESSAGE, "a msgpack string is not valid UTF-8") from None
    except msgpack.ExtraData:
        raise ProtocolError(BAD_MESSAGE, "trailing bytes after the msgpack map") from None
    except Exception as exc:  # OutOfData, FormatError, the limits' ValueError, our hooks
        detail = str(exc)[:200] or type(exc).__name__
        raise ProtocolError(BAD_MESSAGE, f"undecodable msgpack: {detail}") from None


def parse(frame: bytes, max_bytes: int, limits: RequestLimits = RequestLimits()
          ) -> Request | CancelRequest | GenerateRequest:
    """Decode and validate one request frame into a typed request, or raise ProtocolError."""
    return validate(decode(frame, max_bytes), limits)


def validate(msg: object, limits: RequestLimits = RequestLimits()) -> Request | CancelRequest | GenerateRequest:
    """Validate one decoded request map (from a frame, or built by the HTTP door) into a typed request."""
    if not isinstance(msg, dict):
        raise ProtocolError(BAD_MESSAGE, f"a request must be a msgpack map, got {_kind(msg)}")
    rid = msg.get("id")
    rid = rid if isinstance(rid, str) and 0 < len(rid) <= MAX_ID_CHARS else None
    try:
        return _validate(msg, rid, limits)
    except ProtocolError as exc:
        exc.request_id = rid
        raise


def _validate(msg: dict, rid: str | None, limits: RequestLimits):
    version = msg.get("v")
    if not _is_int(version):
        raise ProtocolError(INVALID_REQUEST, "'v' (the protocol version, an integer) is required")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(UNSUPPORTED_VERSION, f"protocol version {version} is not supported; "
                                                 f"this daemon speaks version {PROTOCOL_VERSION}")
    op = msg.get("op")
    if not isinstance(op, str):
        raise ProtocolError(INVALID_REQUEST, "'op' (a string) is required")
    if op not in OPS:
        raise ProtocolError(UNKNOWN_OP, f"unknown op {op[:40]!r}; ops are {', '.join(OPS)}")
    if rid is None:
        raise ProtocolError(INVALID_REQUEST, f"'id' must be a string of 1-{MAX_ID_CHARS} characters")
    unknown = sorted(set(msg) - _FIELDS[op])
    if unknown:
        raise ProtocolError(INVALID_REQUEST, f"unknown field(s) for {op}: {', '.join(k[:40] for k in unknown)}")
    if op == "generate":
        return _generate(msg, rid, limits)
    if op == "cancel":
        target = msg.get("target")
        if not isinstance(target, str) or not 0 < len(target) <= MAX_ID_CHARS:
            raise ProtocolError(INVALID_REQUEST, "cancel needs 'target': the id of a generate request")
        return CancelRequest(rid, target)
    return Request(op, rid)


def _generate(msg: dict, rid: str, limits: RequestLimits) -> GenerateRequest:
    prompt, messages = msg.get("prompt"), msg.get("messages")
    if (prompt is None) == (messages is None):
        raise ProtocolError(INVALID_REQUEST, "generate needs exactly one of 'prompt' or 'messages'")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise ProtocolError(INVALID_REQUEST, "'prompt' must be a non-empty string")
    return GenerateRequest(
        id=rid, prompt=prompt, messages=None if messages is None else _messages(messages),
        max_tokens=_int(msg, "max_tokens", 128, 1, limits.max_new_tokens),
        temperature=_number(msg, "temperature", 0.0, 0.0, limits.max_temperature),
        top_p=_number(msg, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=_int(msg, "top_k", 0, 0, limits.max_top_k),
        seed=_int(msg, "seed", None, 0, (1 << 63) - 1),
        stop=_stop(msg.get("stop"), limits),
        priority=_choice(msg, "priority", "normal", PRIORITIES),
        deadline_ms=_int(msg, "deadline_ms", None, 1, MAX_DEADLINE_MS),
        stream=_bool(msg, "stream", True),
        ignore_eos=_bool(msg, "ignore_eos", False))


def _messages(value) -> tuple[dict, ...]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_MESSAGES:
        raise ProtocolError(INVALID_REQUEST, f"'messages' must be an array of 1-{MAX_MESSAGES} maps")
    out = []
    for m in value:
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise ProtocolError(INVALID_REQUEST, "each message must be a map with exactly 'role' and 'content'")
        role, content = m["role"], m["content"]
        if not isinstance(role, str) or not 0 < len(role) <= MAX_ROLE_CHARS or not isinstance(content, str):
            raise ProtocolError(INVALID_REQUEST, f"a message's 'role' must be a string of 1-{MAX_ROLE_CHARS} "
                                                 "characters and its 'content' a string")
        out.append({"role": role, "content": content})
    return tuple(out)


def _stop(value, limits: RequestLimits) -> tuple[str, ...]:
    if value is None:
        return ()
    ok = isinstance(value, list) and len(value) <= limits.max_stop and all(
        isinstance(s, str) and 0 < len(s) <= limits.max_stop_chars for s in value)
    if not ok:
        raise ProtocolError(INVALID_REQUEST, f"'stop' must be an array of at most {limits.max_stop} non-empty "
                                             f"strings of at most {limits.max_stop_chars} characters")
    return tuple(value)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(msg: dict, key: str, default, low: int, high: int):
    value = msg.get(key)
    if value is None:
        return default
    if not _is_int(value) or not low <= value <= high:
        raise ProtocolError(INVALID_REQUEST, f"'{key}' must be an integer in [{low}, {high}], got {_show(value)}")
    return value


def _number(msg: dict, key: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = msg.get(key)
    if value is None:
        return default
    in_range = (_is_int(value) or isinstance(value, float)) and math.isfinite(value) and (
        low < value <= high if low_open else low <= value <= high)
    if not in_range:
        interval = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ProtocolError(INVALID_REQUEST, f"'{key}' must be a finite number in {interval}, got {_show(value)}")
    return float(value)


def _bool(msg: dict, key: str, default: bool) -> bool:
    value = msg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProtocolError(INVALID_REQUEST, f"'{key}' must be true or false, got {_show(value)}")
    return value


def _choice(msg: dict, key: str, default: str, choices: tuple[str, ...]) -> str:
    value = msg.get(key)
    if value is None:
        return default
    if not isinstance(value, str) or value not in choices:
        raise ProtocolError(INVALID_REQUEST, f"'{key}' must be one of {', '.join(choices)}, got {_show(value)}")
    return value


def _kind(x) -> str:
    return {list: "an array", str: "a string", bytes: "binary", bool: "a boolean", int: "an integer",
            float: "a float", type(None): "nil"}.get(type(x), type(x).__name__)


def _show(x) -> str:
    return repr(x)[:40] if isinstance(x, (int, float, str)) else _kind(x)


# ---- replies -------------------------------------------------------------------------------

def pack(message: dict) -> bytes:
    """Encode one reply (or request) map."""
    return msgpack.packb(message, use_bin_type=True)


def reply(kind: str, request_id: str | None, **fields) -> dict:
    """A reply map: {v, type, id, ...fields}."""
    return {"v": PROTOCOL_VERSION, "type": kind, "id": request_id, **fields}


def error(request_id: str | None, code: str, message: str) -> dict:
    return reply("error", request_id, code=code, message=message)


def token(request_id: str, index: int, text: str, token_ids: list[int]) -> dict:
    return reply("token", request_id, index=index, text=text, token_ids=token_ids)


def done(request_id: str, finish_reason: str, usage: dict, timings: dict, energy: dict | None = None,
         **extra) -> dict:
    """The final message of a successful generate; `extra` holds text/token_ids when not streaming."""
    return reply("done", request_id, finish_reason=finish_reason, usage=usage, timings=timings,
                 energy=energy, **extra)
