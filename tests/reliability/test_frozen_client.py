"""A streaming client frozen with SIGSTOP: the daemon stops generating for it and frees its KV
blocks once its send queue fills, and when it resumes it gets exactly one final reply, or (when a
heartbeat sent before its queue filled went unanswered and the daemon closed the connection) sees
the closed connection at once. Before, no final reply came and the client waited out its timeout."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from o3edge.ipc.client import O3Client
from tests.helpers import wait_for

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("helper", ["stream_client.py", "aio_stream_client.py"])  # blocking and asyncio clients
def test_frozen_streaming_client_gets_exactly_one_final_reply(rel_daemon, figures, helper):
    with O3Client(rel_daemon.endpoint, timeout=10.0) as c:
        dropped_before = c.stats()["dropped_peers"]
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, helper), rel_daemon.endpoint, "2000"],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        try:
            assert proc.stdout.readline().strip() == "started"
            proc.send_signal(signal.SIGSTOP)
            assert wait_for(lambda: c.stats()["dropped_peers"] > dropped_before, 60.0, 0.2), \
                "the daemon never noticed the frozen client"
            assert wait_for(lambda: c.stats()["kv_blocks_used"] == 0, 5.0)  # its generation stopped, blocks freed
            time.sleep(0.5)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGCONT)
            result = json.loads(proc.communicate(timeout=30)[0].strip().splitlines()[-1])
            resumed_s = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
        figures("frozen_client" + ("_asyncio" if helper.startswith("aio") else ""), **result, final_reply_within_s_of_resume=round(resumed_s, 2))
        if result["final"] == "unavailable":  # the connection was closed: the client says so
            assert "closed the connection" in result["message"] and result["finals"] == 0
        else:
            assert result["final"] == "error:cancelled" and "stopped reading" in result["message"]
            assert result["finals"] == 1
        assert 0 < result["tokens"] < 2000
        assert resumed_s < 5.0  # plus the helper's one-second look for a second final reply
        assert c.generate("The os module", max_tokens=4).completion_tokens == 4
