"""The server over real sockets with the real engine: a request failing in a step gets `internal`, the
requests sharing its steps get `done`, and the daemon stays ready."""

import threading

from o3edge.config import O3Config
from o3edge.ipc import protocol as P
from o3edge.ipc.client import O3Client, RequestError
from o3edge.ipc.server import IPCServer
from o3edge.settings import ServerSettings

FAILING_MAX_TOKENS = 7  # the request asking for this many tokens fails at its third


def load(model_dir):
    from o3edge.engine.engine import LLMEngine

    engine = LLMEngine(O3Config(model_path=model_dir, device="cpu", num_kv_blocks=256), model_dir)

    def fault(seq):
        if seq.params.max_new_tokens == FAILING_MAX_TOKENS and seq.num_output_tokens == 2:
            raise ValueError("injected failure of one request")

    engine.fault_hook = fault
    return engine


def test_failing_request_gets_internal_and_the_others_finish(tmp_path, tiny_dir):
    server = IPCServer(ServerSettings(endpoint=f"ipc://{tmp_path}/s.sock"), lambda: load(tiny_dir), idle_wake_s=0.05)
    server.start()
    results, start = {}, threading.Barrier(4)

    def ask(name, max_tokens):
        with O3Client(server.settings.endpoint, timeout=60.0) as c:
            start.wait()
            try:
                results[name] = c.generate("def f(x):", max_tokens=max_tokens, ignore_eos=True)
            except RequestError as exc:
                results[name] = exc

    try:
        with O3Client(server.settings.endpoint, timeout=60.0) as c:
            assert c.wait_ready(120)["ready"]
        threads = [threading.Thread(target=ask, args=(f"ok{i}", 24)) for i in range(3)]
        threads.append(threading.Thread(target=ask, args=("bad", FAILING_MAX_TOKENS)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert isinstance(results["bad"], RequestError) and results["bad"].code == P.INTERNAL
        for i in range(3):
            assert results[f"ok{i}"].finish_reason == "length" and results[f"ok{i}"].completion_tokens == 24
        with O3Client(server.settings.endpoint, timeout=60.0) as c:
            assert c.health()["status"] == "ready"
            assert c.generate("import os", max_tokens=3, ignore_eos=True).completion_tokens == 3
            assert c.stats()["failed"] == 1
    finally:
        server.close()


