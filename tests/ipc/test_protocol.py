"""The wire schema: defaults, every bound, and the error code each kind of bad message gets."""

import math

import msgpack
import pytest

from o3edge.ipc import protocol as P

LIMIT = 1 << 20


def frame(**fields):
    return msgpack.packb({"v": 1, "op": "generate", "id": "r1", "prompt": "hi", **fields})


def code_of(raw: bytes) -> str:
    with pytest.raises(P.ProtocolError) as err:
        P.parse(raw, LIMIT)
    return err.value.code


def test_generate_defaults():
    req = P.parse(frame(), LIMIT)
    assert req == P.GenerateRequest(id="r1", prompt="hi")
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed, req.stop, req.priority,
            req.deadline_ms, req.stream, req.ignore_eos) == (128, 0.0, 1.0, 0, None, (), "normal", None, True, False)


def test_full_generate_and_other_ops():
    req = P.parse(msgpack.packb({"v": 1, "op": "generate", "id": "x", "messages": [{"role": "user", "content": "q"}],
                                 "max_tokens": 5, "temperature": 1, "top_p": 0.5, "top_k": 3, "seed": 7,
                                 "stop": ["\n"], "priority": "critical", "deadline_ms": 100, "stream": False}), LIMIT)
    assert req.messages == ({"role": "user", "content": "q"},) and req.temperature == 1.0 and not req.stream
    assert P.parse(msgpack.packb({"v": 1, "op": "cancel", "id": "c", "target": "x"}), LIMIT) == \
        P.CancelRequest("c", "x")
    for op in ("health", "stats", "info"):
        assert P.parse(msgpack.packb({"v": 1, "op": op, "id": "h"}), LIMIT) == P.Request(op, "h")


@pytest.mark.parametrize("fields", [
    {"max_tokens": 0}, {"max_tokens": -1}, {"max_tokens": 2**64 - 1}, {"max_tokens": True}, {"max_tokens": 1.5},
    {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": -0.1}, {"temperature": "hot"},
    {"top_p": 0.0}, {"top_p": 1.01}, {"top_p": -math.inf}, {"top_k": -1}, {"seed": -5}, {"seed": 2**63},
    {"stop": "x"}, {"stop": [""]}, {"stop": ["a"] * 17}, {"stop": [1]}, {"priority": "urgent"}, {"priority": 1},
    {"deadline_ms": 0}, {"deadline_ms": 10**12}, {"stream": 1}, {"ignore_eos": "yes"}, {"prompt": ""},
    {"prompt": 5}, {"messages": [{"role": "user", "content": "x"}]}, {"extra": 1}, {"id": ""}, {"id": "x" * 65},
    {"id": 3},
])
def test_invalid_fields_are_invalid_request(fields):
    assert code_of(frame(**fields)) == P.INVALID_REQUEST


@pytest.mark.parametrize("messages", [[], "hi", [{"role": "user"}], [{"role": "", "content": "x"}],
                                      [{"role": "user", "content": 1}], [{"role": "u", "content": "x", "name": "n"}]])
def test_bad_chat_messages(messages):
    raw = msgpack.packb({"v": 1, "op": "generate", "id": "r", "messages": messages})
    assert code_of(raw) == P.INVALID_REQUEST


def test_version_op_and_id_errors_carry_the_id_when_readable():
    with pytest.raises(P.ProtocolError) as err:
        P.parse(msgpack.packb({"v": 2, "op": "health", "id": "abc"}), LIMIT)
    assert (err.value.code, err.value.request_id) == (P.UNSUPPORTED_VERSION, "abc")
    assert code_of(msgpack.packb({"v": 1, "op": "launch", "id": "a"})) == P.UNKNOWN_OP
    assert code_of(msgpack.packb({"op": "health", "id": "a"})) == P.INVALID_REQUEST
    assert code_of(msgpack.packb({"v": 1, "op": "cancel", "id": "a"})) == P.INVALID_REQUEST


@pytest.mark.parametrize("raw", [
    b"", b"\xc1", frame()[:-3], frame() + b"\x00", b"\x91" * 100_000, b"\xdd" + (300_000).to_bytes(4, "big") +
    b"\x90" * 300_000, b"\xdc\x04\x00" + (b"\xdc\x04\x00" + b"\x90" * 1024) * 1024, b"\xdf" +
    (1_000_000).to_bytes(4, "big") + b"\xa1a\x00", msgpack.packb({1: 2}), b"\x82\xa1a\x01\xa1a\x02",
    b"\x81\xa2id\xa2\xff\xfe", msgpack.packb(msgpack.ExtType(1, b"x")), msgpack.packb({"t": msgpack.Timestamp(1)}),
    msgpack.packb({"b": b"bin"}), msgpack.packb([1, 2]), msgpack.packb("str"), msgpack.packb(None),
])
def test_undecodable_or_non_map_frames_are_bad_message(raw):
    assert code_of(raw) == P.BAD_MESSAGE


def test_oversized_frame_is_refused_before_decoding():
    with pytest.raises(P.ProtocolError, match="exceeds"):
        P.parse(b"\x90" * 2048, 1024)
