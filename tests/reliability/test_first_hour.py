"""The first hour: the quick start is idempotent, health --wait waits, the CLI survives a closed
pipe, a deadline that passes mid-stream is not called a refusal, estimates are labelled."""

import os
import subprocess
import sys

import pytest

from o3edge import cli
from o3edge.detach import holder_of
from o3edge.ipc import protocol as P
from tests.helpers import wait_for
from tests.reliability.conftest import clean_env, open_dir


def run(args, env, **kw):
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=120, **kw)


@pytest.fixture
def quick_start(tiny_dir):
    """The README's first command's environment: an endpoint, a user state directory."""
    home = open_dir()
    env = clean_env(O3EDGE_SERVER_ENDPOINT=f"ipc://{home}/sock/o3edge.sock", XDG_STATE_HOME=f"{home}/state",
                    O3EDGE_ENGINE_MODEL_PATH=tiny_dir, O3EDGE_ENGINE_DEVICE="cpu", O3EDGE_ENGINE_NUM_KV_BLOCKS="256")
    yield env, f"{home}/state/o3edge"
    pid = holder_of(f"{home}/sock/o3edge.sock")
    if pid and pid.isdigit():
        os.kill(int(pid), 15)
        wait_for(lambda: holder_of(f"{home}/sock/o3edge.sock") is None, 20.0, 0.1)


def test_quick_start_twice_leaves_the_first_daemon_and_its_log_alone(quick_start):
    env, state = quick_start
    first = run(["-m", "o3edge.daemon", "--detach"], env)
    assert first.returncode == 0 and "started in the background" in first.stderr, first.stderr
    health = run(["-m", "o3edge.cli", "health", "--wait", "60"], env)  # right away: the engine is loading
    assert health.returncode == 0 and "ready" in health.stdout.splitlines()[0], health.stdout + health.stderr
    log = open(f"{state}/o3edged.log", "rb").read()
    pid = open(f"{state}/o3edged.pid").read().strip()
    second = run(["-m", "o3edge.daemon", "--detach"], env)
    assert second.returncode == 0 and f"already running (pid {pid})" in second.stderr
    assert open(f"{state}/o3edged.log", "rb").read() == log and b"\0" not in log
    prompt = run(["-m", "o3edge.cli", "prompt", "--raw", "The json module", "--max-tokens", "8", "--wait", "60"], env)
    assert prompt.returncode == 0, prompt.stderr
    stats = run(["-m", "o3edge.cli", "stats", "--json"], env)
    is_estimate = '"is_estimate": true' in stats.stdout
    if "tokens/J" in prompt.stderr:  # a request too short to measure gets no figure at all on a busy machine
        assert ("tokens/J (estimated" in prompt.stderr) == is_estimate, prompt.stderr  # an estimate says so
    info = run(["-m", "o3edge.cli", "info", "--json"], env)
    assert f'"energy_log": "{state}/energy.jsonl"' in info.stdout
    assert wait_for(lambda: os.path.exists(f"{state}/energy.jsonl"), 5.0)  # `o3edge-cli energy` works next
    energy = run(["-m", "o3edge.cli", "energy"], env)
    assert energy.returncode == 0 and "total: 1 requests" in energy.stdout, energy.stdout + energy.stderr
    os.kill(int(pid), 15)
    assert wait_for(lambda: not os.path.exists(f"{state}/o3edged.pid"), 20.0, 0.1)  # removed at exit


def test_cli_output_into_a_closed_pipe_ends_quietly(rel_daemon):
    env = clean_env(O3EDGE_ENDPOINT=rel_daemon.endpoint)
    proc = subprocess.Popen([sys.executable, "-m", "o3edge.cli", "stats"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    err = proc.stderr.read()
    assert proc.wait(30) == 0 and "Traceback" not in err, err


def test_a_deadline_passing_mid_stream_is_reported_as_a_stop_not_a_refusal(rel_daemon):
    env = clean_env(O3EDGE_ENDPOINT=rel_daemon.endpoint)
    out = run(["-m", "o3edge.cli", "prompt", "--raw", "The json module", "--max-tokens", "1900", "--ignore-eos",
               "--deadline-ms", "1500"], env)
    assert out.returncode == 1
    assert "stopped after" in out.stderr and "deadline_exceeded" in out.stderr and "refused" not in out.stderr


def test_cli_defaults_to_the_protocols_max_tokens():
    assert cli.parse_args(["prompt", "hi"]).max_tokens is None  # not sent: the daemon's default applies
    assert P.GenerateRequest(id="x").max_tokens == 128


def test_tokens_per_joule_is_labelled_as_estimate_and_rough_when_short():
    measured = {"tokens_per_joule": 12.3456, "is_estimate": False, "low_confidence": False}
    assert cli.tokens_per_joule_text(measured) == "12.35 tokens/J"
    estimate = {**measured, "is_estimate": True}
    assert cli.tokens_per_joule_text(estimate) == "12.35 tokens/J (estimated)"
    short = {**measured, "tokens_per_joule": 121.5, "low_confidence": True}
    assert cli.tokens_per_joule_text(short) == "~100 tokens/J (low confidence: too short to measure)"


def test_no_numpy_warning_on_import_without_numpy():
    code = "import sys; sys.modules['numpy'] = None; import o3edge.engine.engine, torch; torch.zeros(1)"
    out = run(["-W", "default", "-c", code], clean_env())
    assert out.returncode == 0 and "NumPy" not in out.stderr, out.stderr
