"""tools/bench_ipc.py's null-engine server, which its streamed-token figures are measured against."""

import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_null_engine_server_starts_and_streams_every_token():
    """The null engine stands in for a model in a real IPCServer (a child process, a real ipc:// socket): it
    must satisfy what the server reads of an engine, or the tool cannot run (it died at start once its info
    lacked a field the server's model view came to read)."""
    sys.path.insert(0, REPO)
    import tools.bench_ipc as bench
    from o3edge.ipc.client import O3Client, TokenEvent

    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o700)
        endpoint = f"ipc://{d}/s"
        proc = bench.start_null_server(endpoint, bench.free_port())
        try:
            with O3Client(endpoint, timeout=30) as client:
                tokens = [e for e in client.stream(bench.PROMPT, max_tokens=25) if isinstance(e, TokenEvent)]
            assert len(tokens) == 25 and all(int(t.text) > 0 for t in tokens)  # each stamped with its emit time
        finally:
            proc.terminate()
            proc.wait(timeout=30)
