"""o3edge-cli end to end: a streamed prompt with its summary, JSON, health/stats, and clear failures."""

import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import REPO, clean_env
from o3edge import cli


def run_cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "o3edge.cli", *args], cwd=REPO, env=clean_env(),
                          capture_output=True, text=True, timeout=timeout)


def test_prompt_streams_the_answer_then_a_summary_line(daemon, client):
    expected = client.generate(messages=[{"role": "system", "content": "Be terse."},
                                         {"role": "user", "content": "List three modules."}], max_tokens=12)
    r = run_cli("prompt", "List three modules.", "--system", "Be terse.", "--max-tokens", "12",
                "--endpoint", daemon.endpoint)
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected.text + "\n"
    summary = r.stderr.strip().splitlines()
    assert len(summary) == 1
    assert f"{expected.prompt_tokens} prompt + 12 completion tokens" in summary[0]
    assert "TTFT" in summary[0] and "tokens/s" in summary[0]


def test_prompt_json_and_raw(daemon, client):
    expected = client.generate("import json\n", max_tokens=6, temperature=0.8, seed=3)
    r = run_cli("prompt", "import json\n", "--raw", "--json", "--max-tokens", "6", "--temperature", "0.8",
                "--seed", "3", "--priority", "high", "--endpoint", daemon.endpoint)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["text"] == expected.text and out["usage"]["completion_tokens"] == 6 and "energy" in out


def test_health_stats_info_commands(daemon):
    r = run_cli("health", "--endpoint", daemon.endpoint)
    assert r.returncode == 0 and "ready" in r.stdout
    r = run_cli("stats", "--json", "--endpoint", daemon.endpoint)
    assert r.returncode == 0 and "kv_blocks_used" in json.loads(r.stdout)
    r = run_cli("info", "--endpoint", daemon.endpoint)
    assert r.returncode == 0 and "max_context" in r.stdout


def test_request_error_is_one_clear_line(daemon):
    r = run_cli("prompt", "x", "--max-tokens", "0", "--endpoint", daemon.endpoint)
    assert r.returncode == 1
    assert r.stderr.strip() == ("o3edge-cli: the daemon refused the request: invalid_request: "
                                "'max_tokens' must be an integer in [1, 1048576], got 0")


def test_no_daemon_gives_one_clear_line(tmp_path):
    missing = f"ipc://{tmp_path}/nobody.sock"
    r = run_cli("prompt", "hello", "--endpoint", missing)
    assert r.returncode == 3
    assert r.stderr == f"o3edge-cli: o3edged is not running: no socket at {tmp_path}/nobody.sock " \
                       f"(endpoint {missing})\n"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "stale.sock"))  # a socket file with nobody listening (a crashed daemon)
    r = run_cli("health", "--endpoint", f"ipc://{tmp_path}/stale.sock")
    stale.close()
    assert r.returncode == 3 and "exists but nothing listens" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_user_outside_the_group_gets_permission_denied(daemon, capfd):
    pid = os.fork()
    if pid == 0:  # child: become nobody, then run the CLI's main (already imported)
        code = 99
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            code = cli.main(["health", "--endpoint", daemon.endpoint])
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 4
    err = capfd.readouterr().err
    assert err.startswith("o3edge-cli: permission denied") and "o3edge" in err and "Traceback" not in err


@pytest.mark.parametrize("args", [["prompt", "hi", "--max-tokens", "99999999999999999999999"],
                                  ["prompt", "hi", "--timeout", "-1"], ["prompt", "hi", "--timeout", "nan"],
                                  ["health", "--wait", "inf"], ["prompt", "hi", "--seed", "1e3"],
                                  ["prompt", b"caf\xe9".decode("utf-8", "surrogateescape")],
                                  ["prompt", "hi", "--stop", b"\xff".decode("utf-8", "surrogateescape")]])
def test_arguments_no_message_can_carry_are_usage_errors(args, tmp_path):
    """Out of range integers, negative or non-finite seconds and arguments that are not UTF-8 (a terminal in
    another encoding) are usage errors (exit 2, one line naming the argument), not tracebacks; no daemon needed."""
    r = subprocess.run([sys.executable, "-m", "o3edge.cli", *args, "--endpoint", f"ipc://{tmp_path}/none.sock"],
                       cwd=REPO, env=clean_env(), capture_output=True, timeout=60)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 2, err
    assert "Traceback" not in err and "error: argument" in err
