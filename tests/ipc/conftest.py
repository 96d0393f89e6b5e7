"""Real o3edged processes on temporary ipc endpoints, and a fake engine for in-process server tests."""

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from o3edge.engine.engine import RequestOutput, StepReport
from o3edge.ipc.client import DaemonUnavailable, O3Client
from tests.helpers import wait_for  # noqa: F401 (re-exported to the tests here)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_KV_BLOCKS = 256


def clean_env(**extra) -> dict:
    """This environment without O3EDGE_* settings, with the repository importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("O3EDGE_")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class DaemonProcess:
    """An o3edged subprocess with its endpoint and log file."""

    def __init__(self, directory, model_dir, name="o3.sock", server_extra="", engine_extra=""):
        self.socket_path = os.path.join(directory, name)
        self.endpoint = "ipc://" + self.socket_path
        self.config = os.path.join(directory, name + ".toml")
        with open(self.config, "w") as fh:
            fh.write(f'[engine]\nmodel_path = "{model_dir}"\ndevice = "cpu"\nnum_kv_blocks = {NUM_KV_BLOCKS}\n'
                     f'{engine_extra}\n[server]\nendpoint = "{self.endpoint}"\ndrain_timeout_s = 5.0\n{server_extra}\n')
        self.log_path = os.path.join(directory, name + ".log")
        self.proc = None

    def start(self) -> "DaemonProcess":
        self._log = open(self.log_path, "ab")
        # XDG_STATE_HOME: a daemon started by hand writes its energy log there, not in the user's home
        self.proc = subprocess.Popen([sys.executable, "-m", "o3edge.daemon", "--config", self.config], cwd=REPO,
                                     env=clean_env(XDG_STATE_HOME=os.path.dirname(self.config)),
                                     stdout=self._log, stderr=subprocess.STDOUT)
        return self

    def wait_ready(self, timeout=60.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"o3edged exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with O3Client(self.endpoint, timeout=2.0) as c:
                    if c.health()["ready"]:
                        return
            except DaemonUnavailable:
                pass
            time.sleep(0.05)
        raise AssertionError(f"o3edged not ready after {timeout} s:\n{self.log()}")

    def stop(self, sig=signal.SIGTERM, timeout=20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def log(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()


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
        self.info = SimpleNamespace(model_dir="/fake/model", device="cpu", dtype="float32", args=args,
                                    fingerprint="fake", num_kv_blocks=64, kv_block_size=16, kv_cache_bytes=0,
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
