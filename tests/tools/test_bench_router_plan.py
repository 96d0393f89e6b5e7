"""tools/bench_router_plan.py: the router's refresh bookkeeping, each part timed alone."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_part_of_a_refresh_is_timed():
    """The tool drives the router's own refresh parts (which change as the router does): each gets a time,
    the parts a graph refresh runs together included."""
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_router_plan.py"), "--number", "20",
                          "--repeat", "1"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    times = json.loads(out.stdout)["min us"]
    names = " | ".join(times)
    for part in ("entry_rows", "_plan from the observing rows", "a refresh's rows made, observed and planned",
                 "make_due", "end_step of a graph refresh step", "_moves_array"):
        assert part in names
    assert all(t > 0 for t in times.values())
