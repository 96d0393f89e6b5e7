"""IPCServer in this process over real sockets, driving a fake engine: lifecycle, limits, faults."""

import os
import socket
import stat
import threading
import time

import pytest
import zmq

from conftest import FakeEngine, wait_for
from o3edge.errors import InvalidRequest
from o3edge.ipc import protocol as P
from o3edge.ipc import server as server_mod
from o3edge.ipc.client import Completion, O3Client, RequestError
from o3edge.ipc.endpoint import EndpointInUse
from o3edge.ipc.engine_loop import Hooks
from o3edge.ipc.server import IPCServer
from o3edge.settings import ServerSettings


@pytest.fixture
def serve(tmp_path):
    """serve(load=FakeEngine, hooks=None, **server settings) -> a started IPCServer; closed afterwards."""
    servers = []

    def make(load=FakeEngine, hooks=None, **settings):
        settings.setdefault("endpoint", f"ipc://{tmp_path}/s{len(servers)}.sock")
        server = IPCServer(ServerSettings(**settings), load, hooks, idle_wake_s=0.05)
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


def connect(server, timeout=5.0):
    return O3Client(server.settings.endpoint, timeout=timeout)


def test_health_is_live_while_loading_then_ready(serve):
    release = threading.Event()

    def slow_load():
        release.wait(10)
        return FakeEngine()

    server = serve(slow_load)
    with connect(server) as c:
        health = c.health()
        assert health["live"] and not health["ready"] and health["status"] == "loading"
        with pytest.raises(RequestError) as err:
            c.generate("too early")
        assert err.value.code == P.UNAVAILABLE
        assert c.info()["model"] is None
        release.set()
        assert c.wait_ready(5)["ready"]
        assert c.generate("now it works", max_tokens=3).text == "<0><1><2>"
        assert c.info()["model"] == "model"


def test_socket_is_group_only_and_a_second_server_is_refused(serve, tmp_path):
    server = serve()
    path = server.settings.endpoint.removeprefix("ipc://")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    second = IPCServer(ServerSettings(endpoint=server.settings.endpoint), FakeEngine)
    with pytest.raises(EndpointInUse, match=str(os.getpid())):
        second.start()
    second.close()  # must not remove the first server's socket
    assert os.path.exists(path)
    with connect(server) as c:
        assert c.health()["ready"] or c.wait_ready(5)["ready"]


def test_drain_refuses_new_work_and_lets_running_requests_finish(serve):
    server = serve(lambda: FakeEngine(step_s=0.005))
    with connect(server) as c:
        c.wait_ready(5)
        stream = iter(c.stream("long", max_tokens=100))
        next(stream)
        server.drain()
        with connect(server) as other:
            with pytest.raises(RequestError) as err:
                other.generate("refused")
            assert err.value.code == P.UNAVAILABLE
            assert other.health()["status"] == "draining"
        events = list(stream)
        assert isinstance(events[-1], Completion) and events[-1].completion_tokens == 100
        assert server.wait_idle(5)


def test_shutdown_fails_unfinished_requests_with_unavailable(serve):
    server = serve(lambda: FakeEngine(step_s=0.01))
    with connect(server) as c:
        c.wait_ready(5)
        stream = iter(c.stream("endless", max_tokens=100000))
        next(stream)
        server.shutdown(timeout=0.1)
        with pytest.raises(RequestError) as err:
            list(stream)
        assert err.value.code == P.UNAVAILABLE


def test_client_that_stops_reading_is_dropped_and_its_job_aborted(serve, monkeypatch):
    monkeypatch.setattr(server_mod, "SNDHWM", 8)
    server = serve()
    with connect(server) as c:
        c.wait_ready(5)
        ctx = zmq.Context.instance()
        stalled = ctx.socket(zmq.DEALER)
        stalled.setsockopt(zmq.RCVHWM, 1)
        stalled.setsockopt(zmq.RCVBUF, 4096)
        stalled.connect(server.settings.endpoint)
        stalled.send(P.pack({"v": 1, "op": "generate", "id": "x", "prompt": "a", "max_tokens": 1 << 20}))
        try:
            stats = wait_for(lambda: (s := c.stats())["dropped_peers"] >= 1 and s, timeout=20)
            assert stats, "the stalled reader was never dropped"
            assert wait_for(lambda: c.stats()["kv_blocks_used"] == 0)
            assert c.stats()["requests_in_flight"] == 0
        finally:
            stalled.close(linger=0)


def test_per_client_limit_and_full_queue(serve):
    server = serve(lambda: FakeEngine(step_s=0.01), max_inflight_per_client=2, queue_max_requests=3)
    with connect(server) as a, connect(server) as b:
        a.wait_ready(5)
        streams = [iter(a.stream("x", max_tokens=10000)) for _ in range(2)]
        for s in streams:
            next(s)
        with pytest.raises(RequestError) as err:
            a.generate("third from a")
        assert err.value.code == P.TOO_MANY_REQUESTS
        first_b = iter(b.stream("y", max_tokens=10000))
        next(first_b)
        with pytest.raises(RequestError) as err:
            b.generate("queue is full")
        assert err.value.code == P.BUSY
        for s in streams + [first_b]:
            s.close()
        assert wait_for(lambda: a.stats()["requests_in_flight"] == 0)
        assert b.generate("room again", max_tokens=2).text == "<0><1>"


def test_deadline_passes_mid_generation(serve):
    server = serve(lambda: FakeEngine(step_s=0.01))
    with connect(server) as c:
        c.wait_ready(5)
        with pytest.raises(RequestError) as err:
            c.generate("slow", max_tokens=100000, deadline_ms=100)
        assert err.value.code == P.DEADLINE_EXCEEDED
        assert wait_for(lambda: c.stats()["kv_blocks_used"] == 0)


class FlakyEngine(FakeEngine):
    """Rejects the prompt 'bad' and fails one step when asked to."""

    fail_next_step = False

    def add_request(self, rid, ids, params, priority=None, deadline=None):
        if len(ids) == 3:
            raise InvalidRequest("three-word prompts are refused")
        super().add_request(rid, ids, params)

    def step(self):
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("simulated device error")
        return super().step()


def test_request_errors_do_not_take_the_server_down(serve):
    engine = FlakyEngine()
    server = serve(lambda: engine)
    with connect(server) as c:
        c.wait_ready(5)
        with pytest.raises(RequestError) as err:
            c.generate("one two three")
        assert err.value.code == P.INVALID_REQUEST
        engine.fail_next_step = True
        with pytest.raises(RequestError) as err:
            c.generate("step fails", max_tokens=5)
        assert err.value.code == P.INTERNAL
        assert c.generate("still serving", max_tokens=2).text == "<0><1>"
        assert c.health()["ready"]


class PickyTokenizer(FakeEngine):
    """Its tokenizer fails on two prompts (a TypeError, as the tokenizers library raises for text it cannot take,
    and a bug), and waits for `gate` on the prompt "gate" (its lane held busy); it counts its calls."""

    def __init__(self):
        super().__init__()
        self.gate, self.prompts = threading.Event(), []

    @property
    def calls(self) -> int:
        return len(self.prompts)

    def encode(self, prompt=None, messages=None):
        self.prompts.append(prompt)
        if prompt == "untokenizable":
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")
        if prompt == "broken":
            raise RuntimeError("a bug")
        if prompt == "gate":
            self.gate.wait(10)
        return super().encode(prompt, messages)


def test_a_prompt_the_tokenizer_fails_on_is_answered_with_a_code(serve):
    """Whatever the tokenizer raises, the request gets a coded error and leaves the flight: input it cannot take is
    invalid_request, anything else internal (a TypeError used to leave the request unanswered and in flight)."""
    engine = PickyTokenizer()
    server = serve(lambda: engine)
    with connect(server) as c:
        c.wait_ready(5)
        for prompt, code in (("untokenizable", P.INVALID_REQUEST), ("broken", P.INTERNAL)):
            with pytest.raises(RequestError) as err:
                c.generate(prompt, max_tokens=2)
            assert err.value.code == code
        assert c.stats()["requests_in_flight"] == 0
        assert c.generate("still serving", max_tokens=2).text == "<0><1>"


def test_a_cancelled_prompt_leaves_the_tokenizer_queue_at_once(serve):
    """Cancelling a request whose prompt waits to be tokenized takes the prompt out of its lane: one connection's
    generate-then-cancel pairs no longer pile prompts up in memory, to be tokenized for nothing later."""
    import msgpack

    engine = PickyTokenizer()
    server = serve(lambda: engine)
    ctx = zmq.Context()
    try:
        with connect(server) as c:
            c.wait_ready(5)
            before = engine.calls  # (a warm-up's, at load)
            gate = c.stream("gate", max_tokens=2)  # holds the short prompts' lane in the tokenizer
            assert wait_for(lambda: engine.calls == before + 1)
            s = ctx.socket(zmq.DEALER)
            s.connect(server.settings.endpoint)
            for i in range(50):
                s.send(msgpack.packb({"v": 1, "op": "generate", "id": f"g{i}", "prompt": "queued " * 200,
                                      "max_tokens": 2}))
                s.send(msgpack.packb({"v": 1, "op": "cancel", "id": f"c{i}", "target": f"g{i}"}))
            replies = []
            while len(replies) < 100 and s.poll(5000):
                replies.append(msgpack.unpackb(s.recv()))
            assert sum(r.get("found") is True for r in replies) == 50
            assert sum(r.get("code") == P.CANCELLED for r in replies) == 50
            assert sum(map(len, server._lanes)) == 0
            engine.gate.set()
            assert list(gate)[-1].finish_reason in ("length", "stop")
            assert c.stats()["requests_in_flight"] == 0 and engine.prompts[before:] == ["gate"]
    finally:
        ctx.destroy(linger=0)


def test_hooks_see_every_loop_step_and_finish(serve):
    seen = {"loop": 0, "step": 0, "finish": []}
    hooks = Hooks(on_loop=lambda: seen.__setitem__("loop", seen["loop"] + 1),
                  on_step=lambda report: seen.__setitem__("step", seen["step"] + 1),
                  on_finish=lambda rid, outcome: seen["finish"].append(outcome) or {"joules": 1.5,
                                                                                    "tokens_per_joule": 2.0},
                  stats=lambda: {"energy": {"joules": 3.0}})
    server = serve(hooks=hooks)
    with connect(server) as c:
        c.wait_ready(5)
        done = c.generate("hello", max_tokens=4)
        assert done.energy == {"joules": 1.5, "tokens_per_joule": 2.0} and done.tokens_per_joule == 2.0
        assert c.stats()["energy"] == {"joules": 3.0}
    assert seen["step"] >= 4 and seen["loop"] >= 4 and seen["finish"] == ["length"]


def test_loopback_tcp_endpoint_serves_too(serve):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve(tcp_endpoint=f"tcp://127.0.0.1:{port}")
    with O3Client(f"tcp://127.0.0.1:{port}", timeout=5) as c:
        assert c.wait_ready(5)["ready"]
        assert c.generate("over tcp", max_tokens=2).text == "<0><1>"


def test_reloaded_limits_apply_at_once(serve):
    server = serve(lambda: FakeEngine(step_s=0.01), max_inflight_per_client=1)
    with connect(server) as c:
        c.wait_ready(5)
        first = iter(c.stream("x", max_tokens=10000))
        next(first)
        with pytest.raises(RequestError, match="at most 1 requests"):
            c.generate("second")
        server.update_limits(ServerSettings(endpoint="ipc:///elsewhere.sock", max_inflight_per_client=2))
        assert c.generate("second", max_tokens=1).completion_tokens == 1
        assert server.settings.endpoint != "ipc:///elsewhere.sock"
        first.close()


def test_requests_are_answered_promptly_while_the_engine_streams(serve):
    # The engine thread sends under the socket lock; a wake-up lost to ZMQ_FD's edge triggering
    # would show as ~POLL_MS (100 ms) latencies here.
    server = serve(lambda: FakeEngine(step_s=0.0005))
    stop = threading.Event()

    def stream():
        with connect(server) as c:
            while not stop.is_set():
                c.generate("x", max_tokens=100)

    workers = [threading.Thread(target=stream) for _ in range(3)]
    with connect(server) as c:
        c.wait_ready(5)
        for w in workers:
            w.start()
        latencies = []
        for _ in range(200):
            t0 = time.perf_counter()
            c.health()
            latencies.append(time.perf_counter() - t0)
    stop.set()
    for w in workers:
        w.join(10)
    assert sum(t > 0.09 for t in latencies) < 10, sorted(latencies)[-10:]


class OwnedEngine(FakeEngine):
    """Records every use of the engine from a thread other than the engine loop's."""

    def __getattribute__(self, name):
        if threading.current_thread().name != "o3edge-engine":
            object.__getattribute__(self, "foreign").append((threading.current_thread().name, name))
        return object.__getattribute__(self, name)

    def __init__(self):
        object.__setattr__(self, "foreign", [])
        super().__init__()


def test_only_the_engine_thread_touches_the_engine(serve):
    engines = []

    def load():
        engines.append(OwnedEngine())
        return engines[0]

    server = serve(load)
    with connect(server) as c:
        assert c.wait_ready(5)["ready"]
        assert c.generate("four words in here", max_tokens=3).text == "<0><1><2>"
        stream = c.stream(messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert [e for e in stream][-1].finish_reason == "length"
        info, stats = c.info(), c.stats()
        assert info["model"] == "model" and info["max_context"] == 64 and stats["finished"] == 2
    assert object.__getattribute__(engines[0], "foreign") == []
