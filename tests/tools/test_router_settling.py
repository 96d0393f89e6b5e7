"""tools/router_settling.py: the router's compressed share as its routing settles over a decode."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_compressed_share_grows_refresh_by_refresh_and_less_without_the_pinned_tokens(tmp_path):
    """The built-in long model compresses part of each prompt at its end and more at decode refreshes; covering
    the threshold without the sinks' and recent window's saliency compresses less."""
    shares = {}
    for flag in ("", "--pinned-out"):
        out_json = tmp_path / f"settling{flag}.json"
        cmd = [sys.executable, os.path.join(REPO, "tools", "router_settling.py"), "--batch", "2", "--context", "1024",
               "--steps", "70", "--json", str(out_json)] + ([flag] if flag else [])
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        points = json.loads(out_json.read_text())["points"]
        assert all(b["compressed_share"] >= a["compressed_share"] for a, b in zip(points, points[1:]))
        assert all(p["step"] % 32 in (0, 29, 30, 31) for p in points)  # demotions come with the refreshes
        shares[flag] = points[-1]["compressed_share"]
    assert shares[""] > 0.1 and shares["--pinned-out"] < shares[""]
