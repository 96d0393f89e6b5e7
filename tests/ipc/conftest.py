"""Real o3edged processes on temporary ipc endpoints, and a fake engine for in-process server tests."""

import time
from types import SimpleNamespace

import pytest

from o3edge.engine.engine import RequestOutput, StepReport
from o3edge.ipc.client import O3Client
from tests.helpers import wait_for  # noqa: F401 (re-exported to the tests here)
from tools import daemon_process
from tools.daemon_process import REPO, clean_env  # noqa: F401 (re-exported to the tests here)

NUM_KV_BLOCKS = 256


class DaemonProcess(daemon_process.DaemonProcess):
    """The shared spawner (tools/daemon_process.py) with the tests' engine: on CPU, NUM_KV_BLOCKS blocks."""

    def __init__(self, directory, model_dir, name="o3.sock", tables=None, **kwargs):
        super().__init__(directory, model_dir, name,
                         daemon_process.merge({"engine": {"num_kv_blocks": NUM_KV_BLOCKS}}, tables or {}), **kwargs)


@pytest.fixture(scope="session")
def daemon(tmp_path_factory, tiny_dir):
    """One o3edged serving the tiny model for the whole session (stopped with SIGTERM at the end)."""
    d = DaemonProcess(str(tmp_path_factory.mktemp("ipc")), tiny_dir).start()
    d.wait_ready()
    yield d
    d.stop()


@pytest.fixture
def client(daemon):
    with O3Client(daemon.endpoint, timeout=20.0) as c:
        yield c


class FakeEngine:
    """Stands in for LLMEngine in server tests: one token per request per step, no model, instant.

    Token i of a request is `i % 100`; its text is f"<i>". One KV "block" per running request.
    """

    def __init__(self, step_s: float = 0.0):
        self.step_s = step_s
        self.reqs: dict[str, list] = {}  # rid -> [prompt_len, max_new_tokens, produced]
        self.num_generated_tokens = 0
        args = SimpleNamespace(family="fake", vocab_size=100)
        self.info = SimpleNamespace(model_dir="/fake/model", device="cpu", dtype="float32", backend="torch",
                                    args=args, fingerprint="fake", num_kv_blocks=64, kv_block_size=16, kv_cache_bytes=0,
                                    max_model_len=64, load_seconds=0.0, cache_identity="0" * 32)
        self.tokenizer = SimpleNamespace(chat_template=None, encode_request=self.encode)

    def encode(self, prompt=None, messages=None):
        return list(range(len(prompt.split()))) if prompt else [0]

    def add_request(self, rid, ids, params, priority=None, deadline=None):
        self.reqs[rid] = [len(ids), params.max_new_tokens, 0, deadline]

    def abort(self, rid, reason="abort"):
        return self.reqs.pop(rid, None) is not None

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        if self.step_s:
            time.sleep(self.step_s)
        t0 = time.monotonic_ns()
        outputs, report = [], StepReport(t0, t0 + 1)
        for rid, r in list(self.reqs.items()):
            if r[3] is not None and time.monotonic() > r[3]:  # as the real scheduler: cut, no token
                del self.reqs[rid]
                outputs.append(RequestOutput(rid, [], "", True, "deadline_exceeded", r[0], r[2], 0, 0.0, 0.0))
                continue
            i = r[2]
            r[2] += 1
            self.num_generated_tokens += 1
            finished = r[2] >= r[1]
            if finished:
                del self.reqs[rid]
            report.tokens[rid] = (0, 1)
            outputs.append(RequestOutput(rid, [i % 100], f"<{i}>", finished, "length" if finished else None,
                                         r[0], r[2], 0, 0.0, 0.0))
        return outputs, report

    def stats(self):
        used = len(self.reqs)
        return {"waiting": 0, "running": used, "preemptions": 0, "generated_tokens": self.num_generated_tokens,
                "kv_blocks_total": 64, "kv_blocks_free": 64 - used, "kv_blocks_used": used, "kv_blocks_cached": 0,
                "kv_block_size": 16, "prefix_hit_rate": 0.0, "prefix_hit_tokens": 0}
